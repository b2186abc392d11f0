"""The same request gives the same answer, at bfloat16 (the default dtype of a CPU with native
bf16; forced here so that every CPU runs it) and compiled, as ``serve`` runs by default:

- a greedy request sent twice, the second time with more of its prompt from the prefix cache;
- streamed and not (OpenAI HTTP);
- ``top_k=1`` at any temperature and greedy;
- a seeded sampled request streamed and not;

on a tiny random-weight Llama and on SmolLM2 with several chats. On SmolLM2 the first step's
top-5 logprobs of 16 chats are float32 values: no two tied where float32 does not tie them,
closer to a float32 run than transformers' bf16 (which rounds its logits), and within the
noise of the bf16 eager path's distance (at most 1.5x: the two round at different places).
"""

from __future__ import annotations

import math

import openai
import pytest

from benchmarks.probes import (
    PROBE_CHATS,
    TOP,
    chat_prompts,
    hf_first_logprobs,
    mean_distance,
    our_first_logprobs,
)
from pagedserve_client import Client
from tests.stack.conftest import _leak_check
from tests.stack_harness import InProcessStack

CHATS = ["What is the capital of France?", "List three fruits.",
         "Write a haiku about autumn.", "Explain gravity to a child."]
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def stack(request, tiny_model_dir):
    model = tiny_model_dir if request.param == "tiny" else None
    s = InProcessStack(model, worker_argv=["--dtype", "bfloat16",
                                           "--kv-cache-memory", "256MiB"]).start()
    yield s
    _leak_check(s)
    s.stop()


@pytest.fixture
def http(stack):
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    yield client, stack.info().model
    client.close()


def _messages(chat: str) -> list[dict]:
    return [{"role": "user", "content": chat}]


def test_a_prefix_hit_gives_the_same_tokens_and_logprobs(stack):
    with Client(stack.address) as c:
        for chat in CHATS:
            kw = dict(messages=_messages(chat), temperature=0, max_tokens=MAX_TOKENS, logprobs=3)
            first = c.generate(**kw)
            again = c.generate(**kw)
            # the whole prompt's full blocks now, where the first had at most the shared
            # system prompt's
            assert again.usage.num_cached_tokens > first.usage.num_cached_tokens, chat
            assert again.token_ids == first.token_ids, chat
            assert again.logprobs == first.logprobs, chat


def _stream_text(client: openai.OpenAI, **kw) -> str:
    return "".join(chunk.choices[0].delta.content or ""
                   for chunk in client.chat.completions.create(**kw, stream=True)
                   if chunk.choices)


@pytest.mark.parametrize("sampling", [dict(temperature=0),
                                      dict(temperature=0.8, top_p=0.95, seed=1234)],
                         ids=["greedy", "seeded"])
def test_streamed_and_not_give_the_same_text(http, sampling):
    client, model = http
    for chat in CHATS:
        kw = dict(model=model, messages=_messages(chat), max_tokens=MAX_TOKENS, **sampling)
        whole = client.chat.completions.create(**kw).choices[0].message.content
        assert _stream_text(client, **kw) == whole, chat
        assert client.chat.completions.create(**kw).choices[0].message.content == whole, chat


def test_top_k_1_is_greedy_at_any_temperature(stack):
    with Client(stack.address) as c:
        for chat in CHATS:
            greedy = c.generate(messages=_messages(chat), temperature=0, max_tokens=MAX_TOKENS)
            for temperature in (0.7, 1.5):
                top1 = c.generate(messages=_messages(chat), temperature=temperature, top_k=1,
                                  max_tokens=MAX_TOKENS)
                assert top1.token_ids == greedy.token_ids, (chat, temperature)


@pytest.mark.parametrize("stack", ["smollm2"], indirect=True)
def test_first_step_logprobs_are_float32_values(stack):
    import torch
    from transformers import AutoModelForCausalLM

    from services.common.model_files import resolve_model
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner
    from tests.worker.invariance_driver import generate

    prompts = chat_prompts(PROBE_CHATS)
    src = resolve_model(None)
    hf = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file,
                                              dtype=torch.float32).eval()
    fp32 = hf_first_logprobs(hf, prompts)
    hf_bf16 = hf_first_logprobs(hf.to(torch.bfloat16), prompts)
    del hf
    ours = our_first_logprobs(stack.address, prompts)
    eager = ModelRunner(WorkerConfig(model=None, dtype="bfloat16", enforce_eager=True,
                                     kv_cache_memory=64 << 20))
    ours_eager = [[(t, lp) for t, lp in zip(*generate(eager, p, 1)[1][0][1:], strict=True)]
                  for p in prompts]
    del eager
    for top, ref in zip(ours, fp32, strict=True):
        values = [lp for _, lp in top]
        assert all(math.isfinite(v) for v in values)
        ref_values = [ref[t].item() for t, _ in top]
        ties = len(values) - len(set(values))
        assert ties == len(ref_values) - len(set(ref_values)), top  # no tie float32 lacks
    ours_d = mean_distance(ours, fp32)
    eager_d = mean_distance(ours_eager, fp32)
    hf_bf16_d = mean_distance([[(t, ref[t].item()) for t in ref.topk(TOP).indices.tolist()]
                                for ref in hf_bf16], fp32)
    # The compiled forward rounds at other places than the eager one (Inductor's fused norm
    # rounds once where the eager op rounds twice, and keeps fused sums in float32), so the
    # two are equally good roundings whose distances differ by chance, by ISA: compiled /
    # eager was 0.87 on an AMX Xeon, 1.28 on an AVX2-only EPYC, and the eager path with a
    # once-rounding norm moved 13 % (docs/benchmarks.md, issue 31, seventh session). The
    # bound keeps gross losses out (logits rounded to bf16: ~2x); a bf16 residual stream was
    # 1.37x farther compiled on the Xeon, which this bound no longer catches there.
    assert ours_d <= 1.5 * eager_d, (ours_d, eager_d)
    assert ours_d < hf_bf16_d, (ours_d, hf_bf16_d)  # transformers' bf16 rounds its logits
