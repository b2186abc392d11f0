"""Prefix caching through the whole stack: greedy tokens equal transformers' (float32) with
caching on and with caching off, usage reports the cached tokens, and a cache too small to keep
everything evicts and recomputes without changing any output.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from pagedserve_client import Client

from tests.stack.conftest import _leak_check, hf_greedy
from tests.stack.test_equivalence import kv_bytes_per_block
from tests.stack_harness import InProcessStack

MAX_NEW = 12
BLOCK = 16
rng = random.Random(7)
SYSTEM = [rng.randrange(3, 500) for _ in range(3 * BLOCK + 5)]  # 3 full blocks + 5 tokens
HITS = [SYSTEM + [rng.randrange(3, 500) for _ in range(n)] for n in (4, 11, 20)]
MISSES = [[rng.randrange(3, 500) for _ in range(n)] for n in (37, 70)]
REPEATED = [rng.randrange(3, 500) for _ in range(2 * BLOCK + 9)]
PROMPTS = [SYSTEM, *HITS, *MISSES, REPEATED]


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    return dict(zip(map(tuple, PROMPTS), hf_greedy(tiny_model_dir, PROMPTS, MAX_NEW)))


def generate(address: str, prompt: list[int]):
    with Client(address) as c:
        r = c.generate(prompt_token_ids=prompt, temperature=0, max_tokens=MAX_NEW,
                       ignore_eos=True)
    assert r.finish_reason == "length" and r.usage.completion_tokens == MAX_NEW
    return r


def generate_all(address: str, prompts: list[list[int]]):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: generate(address, p), prompts))


@pytest.fixture(scope="module", params=["caching-on", "caching-off"])
def stack(request, tiny_model_dir):
    flags = [] if request.param == "caching-on" else ["--no-enable-prefix-caching"]
    s = InProcessStack(tiny_model_dir, worker_argv=["--dtype", "float32", "--kv-cache-memory",
                                                    "64MiB"],
                       scheduler_argv=["--max-num-batched-tokens", "256", *flags]).start()
    assert s.info().enable_prefix_caching == (request.param == "caching-on")
    yield s
    s.stop()


def test_mixed_hits_and_misses_match_transformers(stack, expected):
    caching = stack.info().enable_prefix_caching
    first = generate(stack.address, SYSTEM)  # puts the 3 shared blocks in the cache
    assert first.token_ids == expected[tuple(SYSTEM)]
    assert first.usage.num_cached_tokens == 0
    results = generate_all(stack.address, HITS + MISSES)
    for prompt, r in zip(HITS + MISSES, results, strict=True):
        assert r.token_ids == expected[tuple(prompt)], f"prompt of {len(prompt)} tokens diverged"
    for r in results[:len(HITS)]:
        assert r.usage.num_cached_tokens == (3 * BLOCK if caching else 0)
    for r in results[len(HITS):]:
        assert r.usage.num_cached_tokens == 0
    _leak_check(stack)


def test_one_prompt_repeated_matches_transformers(stack, expected):
    caching = stack.info().enable_prefix_caching
    want = expected[tuple(REPEATED)]
    alone = [generate(stack.address, REPEATED) for _ in range(3)]
    together = generate_all(stack.address, [REPEATED] * 4)
    assert all(r.token_ids == want for r in alone + together)
    # The prompt's 2 full blocks come from the cache from the second request on (and the
    # prompt + output blocks of earlier runs too, when they are a prefix of the new prompt).
    assert [r.usage.num_cached_tokens for r in alone[1:]] == ([2 * BLOCK] * 2 if caching
                                                             else [0, 0])
    _leak_check(stack)


def test_eviction_under_a_small_cache_recomputes_correctly(tiny_model_dir, expected):
    """A cache of 12 blocks cannot keep every prompt's blocks: later requests evict cached
    blocks, and a repeated prompt then recomputes what was evicted."""
    stack = InProcessStack(tiny_model_dir, worker_argv=[
        "--dtype", "float32", "--kv-cache-memory", str(12 * kv_bytes_per_block(tiny_model_dir))],
        scheduler_argv=["--max-num-batched-tokens", "256", "--max-model-len", "192"]).start()
    try:
        assert stack.info().num_kv_blocks == 12
        order = [SYSTEM, HITS[0], MISSES[1], REPEATED, MISSES[0], SYSTEM, HITS[2], HITS[1]]
        cached = []
        for prompt in order:
            r = generate(stack.address, prompt)
            assert r.token_ids == expected[tuple(prompt)], f"{len(prompt)}-token prompt diverged"
            cached.append(r.usage.num_cached_tokens)
        stats = stack.stats()
        assert stats.num_cached_blocks <= 12
        assert cached[1] == 3 * BLOCK  # HITS[0] right after SYSTEM: a hit
        # SYSTEM again after three other prompts that took 6 + 4 + 4 blocks of the 12: its
        # blocks were evicted, so it recomputed them ...
        assert cached[5] < 3 * BLOCK
        # ... and put them back in the cache for the next prompt that shares them.
        assert cached[6] == 3 * BLOCK
        assert stats.prefix_cache_hits_total > 0
        _leak_check(stack)
    finally:
        stack.stop()


def test_choices_share_the_prompts_kv_blocks(stack):
    """n = 4 over a 60-token prompt (3 full blocks of 16 + 12 tokens): the choices hold the 3
    full prompt blocks once, through ref counts, and one or two private blocks each (the
    partial prompt block and their own outputs); without sharing they would hold 4 x 4. With
    prefix caching off too: the choices of one request always share."""
    bs = stack.info().block_size
    prompt = [(13 * i) % 480 + 11 for i in range(3 * bs + 12)]
    with Client(stack.address) as c:
        stream = c.stream(prompt_token_ids=prompt, n=4, max_tokens=20, ignore_eos=True,
                          temperature=0)
        started, used, cached = set(), None, {}
        for d in stream:
            started.add(d.index)
            if used is None and len(started) == 4:
                used = stack.stats().num_used_blocks  # every choice has its first token
            if d.usage is not None:
                cached[d.index] = d.usage.num_cached_tokens
    # 60 prompt + at most 20 output tokens = at most 5 blocks per choice, 3 of them shared
    assert used is not None and used <= 3 + 4 * 2 < 4 * 4, used
    assert sorted(cached.values()) == [0, 3 * bs, 3 * bs, 3 * bs], cached
    _leak_check(stack)
    if not stack.info().enable_prefix_caching:  # the shared blocks went with their users
        assert stack.stats().num_cached_blocks == 0
