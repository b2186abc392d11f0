"""Qwen2, Qwen3, Mistral and Gemma 3 through the whole stack: greedy token ids equal
transformers' ``generate`` exactly at float32, for prompts shorter and much longer than the
sliding window (16 tokens), sent together and alone, with chunked prefill (64 tokens per step),
a prefix-cache hit, and a KV cache small enough to force preemption. The sliding-window groups'
blocks are freed as requests advance (item 3 of issue 18): no block leaks, and a long request
holds at most ceil(W / block_size) + 1 blocks per sliding-window group."""

from __future__ import annotations

import random

import pytest

from pagedserve_client import Client
from services.worker.kv_cache_groups import kv_cache_groups
from tests import helpers
from tests.stack.conftest import _leak_check, generate_at_once, hf_greedy
from tests.stack_harness import InProcessStack

MAX_NEW = 20
LENGTHS = [5, 40, 300, 280]
WINDOW = 16
BLOCK = 16
# family -> (tiny-model writer, KV blocks: too few for all prompts at once, worker flags).
# NOTE: Gemma 3 runs the compiled forward (the CPU default); the others run eagerly to keep
# the suite short (tests/worker/test_compiled.py compiles the shared Llama forward).
FAMILIES = {
    "qwen2": (helpers.make_tiny_qwen2, 24, ["--enforce-eager"]),
    "qwen3": (helpers.make_tiny_qwen3, 24, ["--enforce-eager"]),
    "mistral": (helpers.make_tiny_mistral, 6, ["--enforce-eager"]),
    "gemma3": (helpers.make_tiny_gemma3, 32, []),
}


def _config(model_dir: str) -> dict:
    import json
    import os
    return json.load(open(os.path.join(model_dir, "config.json")))


def _windows(model_dir: str) -> list[int]:
    """Per layer the sliding window (0 = full), read from the model's own config class."""
    from services.worker.checkpoint import family_of

    cfg = _config(model_dir)
    return family_of(cfg, model_dir).config.from_hf(cfg).sliding_windows


def _bytes_per_block(model_dir: str) -> int:
    """The worker's sizing rule: one (k, v) pair per position of a KV cache group."""
    cfg = _config(model_dir)
    pairs = max(len(g.layer_ids) for g in kv_cache_groups(_windows(model_dir)))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * pairs * BLOCK * cfg["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, model dir, prompts, transformers' greedy ids, stack)."""
    from services.router.tokenizer import load_tokenizer

    make, num_blocks, flags = FAMILIES[request.param]
    model_dir = str(make(tmp_path_factory.mktemp(request.param)))
    load_tokenizer(None).save_pretrained(model_dir)  # SmolLM2's tokenizer, for the router
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    expected = hf_greedy(model_dir, prompts, MAX_NEW)
    stack = InProcessStack(model_dir, worker_argv=[
        "--dtype", "float32", "--kv-cache-memory", str(num_blocks * _bytes_per_block(model_dir)),
        *flags],
        scheduler_argv=["--max-num-batched-tokens", "64", "--long-prefill-token-threshold", "0",
                        "--max-model-len", "384",
                        "--block-size", str(BLOCK)]).start()
    try:
        assert stack.info().num_kv_blocks == num_blocks
        yield request.param, model_dir, prompts, expected, stack
    finally:
        stack.stop()


def _generate(address: str, prompts: list[list[int]]) -> list[list[int]]:
    results = generate_at_once(address, [dict(prompt_token_ids=ids, temperature=0,
                                              max_tokens=MAX_NEW, ignore_eos=True)
                                         for ids in prompts])
    assert all(r.usage.completion_tokens == MAX_NEW for r in results)
    return [r.token_ids for r in results]


def test_greedy_equals_transformers_together_with_preemption(family):
    name, _, prompts, expected, stack = family
    before = stack.stats().num_preemptions_total
    assert _generate(stack.address, prompts) == expected, name
    assert stack.stats().num_preemptions_total > before, "the small KV cache did not preempt"
    _leak_check(stack)


def test_greedy_equals_transformers_alone_and_with_a_prefix_hit(family):
    name, _, prompts, expected, stack = family
    for ids, want in zip(prompts[:3], expected, strict=False):
        assert _generate(stack.address, [ids]) == [want], (name, len(ids))
    with Client(stack.address) as c:  # the 300-token prompt again: its blocks are cached
        r = c.generate(prompt_token_ids=prompts[2], temperature=0, max_tokens=MAX_NEW,
                       ignore_eos=True)
    assert r.token_ids == expected[2]
    assert r.usage.num_cached_tokens > 0, f"{name}: no prefix-cache hit"
    _leak_check(stack)
