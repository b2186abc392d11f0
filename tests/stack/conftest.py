"""Fixtures: the in-process stack on a tiny random Llama (float32) and on SmolLM2."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve_client import AsyncClient

from tests.helpers import make_servable_tiny_llama
from tests.stack_harness import InProcessStack


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, gguf_file=None,
              ignore_eos: bool = True, model=None):
    """transformers' greedy ``generate`` token ids for each prompt, one at a time, float32.

    With ``ignore_eos`` generation runs to max_new_tokens; otherwise it ends with the model's
    EOS token included, as the engine's output does. ``model``: the transformers model of
    ``model_dir`` already loaded (float32), or None to load it here."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file,
                                                     dtype=torch.float32).eval()
    model_eos = model.generation_config.eos_token_id
    eos = None if ignore_eos else model_eos
    if ignore_eos:
        model.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                           pad_token_id=0)
    outs = []
    try:
        with torch.inference_mode():
            for ids in prompts:
                out = model.generate(torch.tensor([ids]), generation_config=cfg,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
                outs.append(out[0, len(ids):].tolist())
    finally:
        model.generation_config.eos_token_id = model_eos  # (the caller's model is left as it was)
    return outs


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random-weight Llama (safetensors) with SmolLM2's tokenizer files beside it."""
    return make_servable_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def generate_at_once(address: str, requests: list[dict], return_exceptions: bool = False
                     ) -> list:
    """Send every request (``Client.generate`` keyword arguments) on one channel in one
    event-loop turn and return the ``GenerationResult`` of each, in order (with
    ``return_exceptions``, a failed request's ``grpc.RpcError`` in its place; else the first
    error is raised).

    The tests that need requests to overlap (to force preemption) use this: one thread per
    request, each connecting on its own, could reach the router tens of milliseconds apart on
    a loaded machine, which is more than a tiny model's whole request."""
    async def main():
        async with AsyncClient(address) as c:
            await c.list_models()  # the channel is connected before the first request
            return await asyncio.gather(*(c.generate(**kw) for kw in requests),
                                        return_exceptions=return_exceptions)
    return asyncio.run(main())


def _leak_check(stack: InProcessStack) -> None:
    s = stack.wait_idle()
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.num_free_blocks + s.num_used_blocks == s.num_total_blocks
    assert s.num_free_blocks == s.num_total_blocks, "KV blocks leaked"


@pytest.fixture(scope="module")
def tiny_stack(tiny_model_dir):
    stack = InProcessStack(tiny_model_dir,
                           worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB"],
                           scheduler_argv=["--max-num-batched-tokens", "256"]).start()
    yield stack
    stack.stop()


@pytest.fixture
def tiny(tiny_stack):
    """The tiny stack, with a KV-block leak check after the test."""
    yield tiny_stack
    _leak_check(tiny_stack)


@pytest.fixture
def oai(tiny):
    """The official ``openai`` client, unchanged, on the tiny stack's HTTP port."""
    import openai

    client = openai.OpenAI(base_url=f"{tiny.http_url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    yield client
    client.close()
