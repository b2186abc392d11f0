"""A LoRA adapter the workers cannot load at step time (its folder deleted after the router
checked it; issue 35) fails only its own requests, through the whole tiny stack: each ends with
INVALID_ARGUMENT (gRPC) / 400 (HTTP) naming the adapter and the problem, while the requests of
another adapter and of the base model sent at the same moment finish with transformers + PEFT's
tokens; no KV block leaks and the server keeps serving. Once the folder is back, a new request
of that adapter runs with its own tokens (the engine retired the failed adapter id, so the
workers load it again). With async scheduling on and off.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import grpc
import openai
import pytest

from tests.helpers import make_peft_lora
from tests.stack.conftest import _leak_check, generate_at_once
from tests.stack_harness import InProcessStack
from tests.worker.lora_driver import reference_greedy

MAX_NEW = 8
MODELS = ("doomed", "good", "")  # "" = the base model


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"good": make_peft_lora(tiny_model_dir, root / "good", r=8, seed=4, lora_alpha=16),
            "doomed": make_peft_lora(tiny_model_dir, root / "doomed", r=4, seed=5,
                                     lora_alpha=8)}


@pytest.fixture(scope="module")
def prompts_and_expected(tiny_model_dir, adapters):
    """(prompts, model name -> transformers (+ PEFT) greedy tokens of each prompt)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 49152) for _ in range(n)] for n in (9, 33)]
    return prompts, {model: reference_greedy(tiny_model_dir, adapters.get(model), prompts,
                                             MAX_NEW) for model in MODELS}


@pytest.fixture(scope="module", params=["async", "no-async"])
def stack(request, tiny_model_dir, adapters):
    stack = InProcessStack(
        tiny_model_dir,
        worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB", "--enforce-eager",
                     "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"],
        scheduler_argv=["--max-num-batched-tokens", "256", "--max-loras", "2",
                        f"--{request.param}-scheduling"],
        router_argv=["--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                     *(f"{name}={path}" for name, path in adapters.items())]).start()
    yield stack
    stack.stop()


def _greedy(ids: list[int], model: str) -> dict:
    return {"prompt_token_ids": ids, "temperature": 0, "max_tokens": MAX_NEW,
            "ignore_eos": True, "model": model}


def test_an_adapter_that_vanished_fails_only_its_own_requests(stack, adapters,
                                                              prompts_and_expected, tmp_path):
    prompts, want = prompts_and_expected
    cases = [(model, i) for i in range(len(prompts)) for model in MODELS]
    doomed = Path(adapters["doomed"])
    saved = shutil.copytree(doomed, tmp_path / "saved")
    shutil.rmtree(doomed)
    try:
        got = generate_at_once(stack.address, [_greedy(prompts[i], model) for model, i in cases],
                               return_exceptions=True)
        for (model, i), r in zip(cases, got, strict=True):
            if model == "doomed":
                assert isinstance(r, grpc.RpcError), r
                assert r.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"LoRA adapter 'doomed': {doomed}: no such adapter folder" in r.details()
            else:
                assert not isinstance(r, BaseException), (model, r)
                assert r.token_ids == want[model][i], (model, i)
        _leak_check(stack)
        # alone (so it surely got blocks, whose prefix keys it registered before the workers
        # left it out), over HTTP: a 400 naming the adapter
        oai = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                            timeout=60)
        with pytest.raises(openai.BadRequestError,
                           match=r"LoRA adapter 'doomed': .* no such adapter folder"):
            oai.completions.create(model="doomed", prompt=prompts[1], max_tokens=MAX_NEW)
        _leak_check(stack)
    finally:
        shutil.copytree(saved, doomed)
    # back: its tokens are right (never computed from those blocks, which were not written)
    got = generate_at_once(stack.address, [_greedy(prompts[i], model) for model, i in cases])
    assert [r.token_ids for r in got] == [want[model][i] for model, i in cases]
    _leak_check(stack)
