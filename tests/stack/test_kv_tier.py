"""The KV tier on disk (``--kv-offload-dir``) through the whole stack.

Every test forces real tier hits: a RAM pool of a few blocks, a prompt of 6 full blocks + 3
tokens served once, then other prompts that evict its blocks from RAM, then the prompt again:
its prefix can only come back from the block files, so ``prefix_cache_tier_hits_total`` must
grow. Greedy tokens of the tier hit equal transformers' at float32 (tiny Llama, a tiny
sliding-window Gemma 3, TP=2, a LoRA adapter through transformers + PEFT) or, for an int8 KV
cache, those of the same workload with the tier off.

- restart: a new stack on the same folder serves the prefix from the files;
- two replicas on one folder: a prefix computed by one is a tier hit on the other; both
  computing the same prefix at once leave valid files;
- faults (each: every request ends normally with the same tokens, and the counters say what
  happened): block files corrupt, truncated, from another namespace, swapped between keys;
  a disk that fills (a tiny tmpfs); the folder removed while requests run;
- ``--kv-offload-dir`` with ``--no-enable-prefix-caching`` is refused at start.

No KV block leaks after any of them (``_leak_check``).
"""

from __future__ import annotations

import glob
import logging
import os
import random
import shutil
import subprocess
import threading
import time
import zlib

import grpc
import pytest

from pagedserve_client import Client
from services.worker.kv_tier import HEADER, MAGIC
from tests import helpers
from tests.stack.conftest import _leak_check, generate_at_once, hf_greedy
from tests.stack.test_equivalence import kv_bytes_per_block
from tests.stack.test_metrics import scrape
from tests.stack_harness import InProcessStack, MultiReplicaStack

BLOCK = 16
MAX_NEW = 6
RAM_BLOCKS = 14  # too few for a prompt and the churn after it: the prompt's blocks go
TIMEOUT = 60  # seconds for any one request: a hung load fails the test instead of the run


def _prompt(seed: int, full_blocks: int = 6, extra: int = 3, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(full_blocks * BLOCK + extra)]


def request(prompt: list[int], model: str = "") -> dict:
    """``Client.generate`` keywords of a greedy request (for ``generate_at_once``)."""
    return {"prompt_token_ids": prompt, "temperature": 0, "max_tokens": MAX_NEW,
            "ignore_eos": True, "timeout": TIMEOUT, **({"model": model} if model else {})}


def gen(address: str, prompt: list[int], model: str = "", max_tokens: int = MAX_NEW):
    with Client(address, timeout=TIMEOUT, max_retries=0) as c:
        kw = {"model": model} if model else {}
        r = c.generate(prompt_token_ids=prompt, temperature=0, max_tokens=max_tokens,
                       ignore_eos=True, **kw)
    assert r.finish_reason == "length" and r.usage.completion_tokens == max_tokens
    return r


_churn_seed = iter(range(10_000, 1_000_000))


def churn(address: str, n: int = 3, length: int = 120) -> None:
    """``n`` prompts of ``length`` fresh random tokens, one at a time: together more blocks
    than the RAM pool holds, so every earlier prompt's blocks leave RAM."""
    for _ in range(n):
        rng = random.Random(next(_churn_seed))
        gen(address, [rng.randrange(3, 500) for _ in range(length)], max_tokens=2)


def block_files(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "**", "*.kv"), recursive=True))


def wait_files(folder: str, before: set[str], n: int, timeout: float = 20.0) -> list[str]:
    """The block files written since ``before`` once there are at least ``n`` of them (the
    worker writes off the forward's thread, after the step)."""
    deadline = time.monotonic() + timeout
    while True:
        new = [f for f in block_files(folder) if f not in before]
        if len(new) >= n:
            return new
        assert time.monotonic() < deadline, f"{len(new)} of {n} block files written"
        time.sleep(0.05)


def file_ok(path: str) -> bool:
    """A complete block file: its header's magic, payload length and checksum hold."""
    with open(path, "rb") as f:
        data = f.read()
    magic, _, _, _, _, _, length, crc = HEADER.unpack(data[:HEADER.size])
    payload = data[HEADER.size:]
    return magic == MAGIC and len(payload) == length and zlib.crc32(payload) == crc


def worker_counter(port: int, name: str, **labels) -> float:
    """A worker metric summed over the labels not given (``rank``)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in scrape(port).items() if n == name and want <= set(ls))


def tier_loads(stack) -> float:
    """Blocks the scheduler has had loaded from the tier (``kv_offload_loads_total``)."""
    return sum(v for (n, _), v in scrape(stack.scheduler_args.metrics_port).items()
               if n == "pagedserve:kv_offload_loads_total")


def tiny_tier_stack(model: str, folder: str, blocks: int = RAM_BLOCKS, worker=(),
                    scheduler=(), router=()) -> InProcessStack:
    return InProcessStack(model, worker_argv=[
        "--dtype", "float32", "--enforce-eager",
        "--kv-cache-memory", str(kv_bytes_per_block(model) * blocks),
        *(["--kv-offload-dir", folder] if folder else []), *worker],
        scheduler_argv=["--max-num-batched-tokens", "256", "--max-model-len", "200",
                        *scheduler], router_argv=list(router)).start()


def prompt_then_tier_hit(stack, prompts: list[list[int]], model: str = ""):
    """Serve ``prompts`` one at a time, churn, serve them again: (first results, second
    results, tier hits counted over the second round)."""
    first = [gen(stack.address, p, model) for p in prompts]
    churn(stack.address)
    hits = stack.stats().prefix_cache_tier_hits_total
    second = [gen(stack.address, p, model) for p in prompts]
    return first, second, stack.stats().prefix_cache_tier_hits_total - hits


# ---- 1. the tier changes no token ---------------------------------------------------------

SYSTEM = _prompt(1)
PROMPTS = [[*SYSTEM, 7, 8], [*SYSTEM, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    return hf_greedy(tiny_model_dir, PROMPTS, MAX_NEW)


def _stack_on_a_new_folder(tiny_model_dir, tmp_path_factory, name: str):
    """(stack, its tier folder) for a module-scoped fixture: a fresh folder per module."""
    folder = str(tmp_path_factory.mktemp(name))
    stack = tiny_tier_stack(tiny_model_dir, folder)
    yield stack, folder
    stack.stop()


@pytest.fixture(scope="module")
def f32_tier(tiny_model_dir, tmp_path_factory):
    yield from _stack_on_a_new_folder(tiny_model_dir, tmp_path_factory, "tier-f32")


def test_float32_tier_hits_equal_transformers(f32_tier, expected):
    stack, folder = f32_tier
    assert stack.info().num_kv_blocks == RAM_BLOCKS
    first, second, tier_hits = prompt_then_tier_hit(stack, PROMPTS)
    assert [r.token_ids for r in first] == expected
    assert [r.token_ids for r in second] == expected
    assert first[0].usage.num_cached_tokens == 0
    # the 6 full blocks come back from the files, for the first; the second prompt shares
    # them with it, in RAM again or from the files
    assert second[0].usage.num_cached_tokens == 6 * BLOCK
    assert second[1].usage.num_cached_tokens == 6 * BLOCK
    assert tier_hits >= 6 * BLOCK
    assert stack.stats().kv_offload_loads_failed_total == 0
    assert stack.stats().kv_offload_blocks >= 6
    assert all(file_ok(f) for f in block_files(folder))
    _leak_check(stack)


def test_float32_tier_hits_sent_together_equal_transformers(f32_tier, expected):
    """Both prompts at once after churn: two requests wait on the same prefix's loads."""
    stack, _ = f32_tier
    churn(stack.address)
    hits = stack.stats().prefix_cache_tier_hits_total
    results = generate_at_once(stack.address, [request(p) for p in PROMPTS])
    assert [r.token_ids for r in results] == expected
    assert stack.stats().prefix_cache_tier_hits_total - hits >= 6 * BLOCK
    assert stack.stats().kv_offload_loads_failed_total == 0
    _leak_check(stack)


def test_int8_cache_tier_on_equals_tier_off(tiny_model_dir, tmp_path):
    """An int8 cache keeps its scales in the row: loaded blocks give the tokens the same
    workload gives with the tier off."""
    from tests.stack.test_kv_cache_dtype import int8_bytes_per_block

    memory = str(int8_bytes_per_block(tiny_model_dir) * RAM_BLOCKS)
    runs = {}
    for name, folder in (("off", ""), ("on", str(tmp_path))):
        stack = tiny_tier_stack(tiny_model_dir, folder,
                                worker=["--kv-cache-dtype", "int8", "--kv-cache-memory", memory])
        try:
            assert stack.info().num_kv_blocks == RAM_BLOCKS
            first, second, tier_hits = prompt_then_tier_hit(stack, PROMPTS)
            runs[name] = [r.token_ids for r in first + second]
            assert (tier_hits >= 6 * BLOCK) if folder else (tier_hits == 0), name
            assert second[0].usage.num_cached_tokens == (6 * BLOCK if folder else 0)
            _leak_check(stack)
        finally:
            stack.stop()
    assert runs["on"] == runs["off"]


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory) -> str:
    return helpers.make_peft_lora(tiny_model_dir, tmp_path_factory.mktemp("lora") / "a1", r=8,
                                  lora_alpha=16)


def test_lora_and_base_tier_hits_equal_transformers_and_share_no_block(
        tiny_model_dir, adapter, tmp_path):
    """The same prompt with and without the adapter: each's blocks come back from the tier
    as its own (the adapter changes every layer's K/V), never the other's."""
    from tests.worker.lora_driver import reference_greedy

    prompt = PROMPTS[0]
    want_base = reference_greedy(tiny_model_dir, None, [prompt], MAX_NEW)[0]
    want_lora = reference_greedy(tiny_model_dir, adapter, [prompt], MAX_NEW)[0]
    assert want_base != want_lora
    stack = tiny_tier_stack(
        tiny_model_dir, str(tmp_path), worker=["--enable-lora", "--max-loras", "1",
                                               "--max-lora-rank", "8"],
        scheduler=["--max-loras", "1"],
        router=["--enable-lora", "--lora-modules", f"a1={adapter}"])
    try:
        base = gen(stack.address, prompt)
        assert base.token_ids == want_base
        churn(stack.address)  # the base blocks are in the files only
        hits = stack.stats().prefix_cache_tier_hits_total
        lora = gen(stack.address, prompt, "a1")
        assert lora.token_ids == want_lora
        assert lora.usage.num_cached_tokens == 0, "the adapter got the base model's blocks"
        assert stack.stats().prefix_cache_tier_hits_total == hits
        churn(stack.address)
        hits = stack.stats().prefix_cache_tier_hits_total
        again = generate_at_once(stack.address, [request(prompt, m) for m in ("", "a1")])
        assert [r.token_ids for r in again] == [want_base, want_lora]
        assert [r.usage.num_cached_tokens for r in again] == [6 * BLOCK, 6 * BLOCK]
        assert stack.stats().prefix_cache_tier_hits_total - hits == 2 * 6 * BLOCK
        assert stack.stats().kv_offload_loads_failed_total == 0
        _leak_check(stack)
    finally:
        stack.stop()


def test_sliding_window_gemma3_tier_hits_equal_transformers(tmp_path):
    """Sliding (window 16) and full layers in two KV cache groups; their blocks are stored
    and loaded per group."""
    from services.router.tokenizer import load_tokenizer
    from tests.stack.test_model_families import _bytes_per_block

    model = str(helpers.make_tiny_gemma3(tmp_path / "g3"))
    load_tokenizer(None).save_pretrained(model)
    want = hf_greedy(model, PROMPTS, MAX_NEW)
    stack = InProcessStack(model, worker_argv=[
        "--dtype", "float32", "--enforce-eager",
        "--kv-cache-memory", str(24 * _bytes_per_block(model)),
        "--kv-offload-dir", str(tmp_path / "tier")],
        scheduler_argv=["--max-num-batched-tokens", "256", "--max-model-len", "200",
                        "--block-size", str(BLOCK)]).start()
    try:
        loads = tier_loads(stack)
        first, second, tier_hits = prompt_then_tier_hit(stack, PROMPTS)
        assert tier_loads(stack) - loads >= 6  # (and the sliding group's last blocks)
        assert [r.token_ids for r in first] == want
        assert [r.token_ids for r in second] == want
        # the full-attention group's 6 blocks (and the sliding group's last) came from the
        # files: 96 tokens, counted once (as a RAM hit of several groups is)
        assert second[0].usage.num_cached_tokens == 6 * BLOCK
        assert tier_hits == 6 * BLOCK
        assert stack.stats().kv_offload_loads_failed_total == 0
        _leak_check(stack)
    finally:
        stack.stop()


def test_tp2_tier_hits_equal_transformers(tiny_model_dir, tmp_path, expected):
    """Two worker ranks (processes), each with its own folder of its half of the heads; a
    block is loaded when both ranks have read theirs."""
    from benchmarks.stack_harness import _stats, _wait_idle
    from tests.parallel.conftest import ParallelStack

    class TPStack(ParallelStack):
        def stats(self):
            return _stats(self.scheduler_address)

        def wait_idle(self, timeout: float = 30.0):
            return _wait_idle(self.scheduler_address, timeout)

    per_rank = kv_bytes_per_block(tiny_model_dir) // 2  # (2 KV heads: one per rank)
    folder = str(tmp_path)
    stack = TPStack(tiny_model_dir, tp=2, worker_argv=[
        "--kv-cache-memory", str(per_rank * RAM_BLOCKS), "--enforce-eager",
        "--kv-offload-dir", folder],
        scheduler_argv=["--max-num-batched-tokens", "256", "--max-model-len", "200"]).start()
    try:
        first, second, tier_hits = prompt_then_tier_hit(stack, PROMPTS)
        assert [r.token_ids for r in first] == expected
        assert [r.token_ids for r in second] == expected
        assert second[0].usage.num_cached_tokens == 6 * BLOCK
        assert tier_hits >= 6 * BLOCK
        ranks = sorted({os.path.basename(os.path.dirname(os.path.dirname(f)))
                        for f in block_files(folder)})
        assert ranks == ["tp0of2", "tp1of2"]
        _leak_check(stack)
        # rank 1's files of the prefix truncated, rank 0's whole: the load fails as a whole
        # (rank 0's bytes alone are half the heads) and the prefix is recomputed
        for f in block_files(folder):
            if f"{os.sep}tp1of2{os.sep}" in f:
                os.truncate(f, 100)
        churn(stack.address)
        failed = stack.stats().kv_offload_loads_failed_total
        r = gen(stack.address, PROMPTS[0])
        assert r.token_ids == expected[0]
        assert stack.stats().kv_offload_loads_failed_total > failed
        _leak_check(stack)
    finally:
        stack.stop()


def test_tier_size_bounds_the_files_least_recently_used_go(tiny_model_dir, tmp_path):
    """--kv-offload-size of 8 blocks: the churn's blocks push the prompt's out of the tier
    (their files deleted), and the prompt is then computed again, exactly."""
    folder = str(tmp_path)
    per_block = kv_bytes_per_block(tiny_model_dir) + HEADER.size
    stack = tiny_tier_stack(tiny_model_dir, folder,
                            scheduler=["--kv-offload-size", str(8 * per_block)])
    try:
        first = gen(stack.address, PROMPTS[0])
        churn(stack.address)
        stack.wait_idle()
        time.sleep(0.5)  # (the last writes land)
        assert stack.stats().kv_offload_blocks == 8
        assert len(block_files(folder)) <= 8
        hits = stack.stats().prefix_cache_tier_hits_total
        again = gen(stack.address, PROMPTS[0])
        assert again.token_ids == first.token_ids
        assert again.usage.num_cached_tokens == 0
        assert stack.stats().prefix_cache_tier_hits_total == hits
        assert stack.stats().kv_offload_loads_failed_total == 0
        _leak_check(stack)
    finally:
        stack.stop()


def test_tier_size_bounds_the_files_when_a_step_stores_more_than_it_holds(tiny_model_dir,
                                                                          tmp_path):
    """--kv-offload-size of 4 blocks and prompts of 6: each prompt's step stores 6 blocks,
    so the index evicts blocks whose files are still being written. The folder must still
    hold at most 4 block files once the writes have landed."""
    folder = str(tmp_path)
    per_block = kv_bytes_per_block(tiny_model_dir) + HEADER.size
    stack = tiny_tier_stack(tiny_model_dir, folder,
                            scheduler=["--kv-offload-size", str(4 * per_block)])
    try:
        counts = []
        for i in range(3):
            gen(stack.address, [*_prompt(45 + i), 1])
            stack.wait_idle()
            time.sleep(0.3)  # (the writes land)
            counts.append((stack.stats().kv_offload_blocks, len(block_files(folder))))
        assert counts == [(4, 4)] * 3, "(index, files on disk) after each prompt"
        _leak_check(stack)
    finally:
        stack.stop()


def test_a_prefix_is_loaded_once_for_every_request_and_choice_that_shares_it(
        tiny_model_dir, tmp_path, expected):
    """n = 4 over a prompt whose 6 full blocks are in the tier only, then two prompts sharing
    them sent at once: the choices and the requests share the loaded blocks, as they share
    RAM hits (tests/stack/test_prefix_caching.py), so each block is read once."""
    stack = tiny_tier_stack(tiny_model_dir, str(tmp_path), blocks=40)

    def loads() -> float:
        return tier_loads(stack)

    try:
        gen(stack.address, PROMPTS[0])
        churn(stack.address, n=5)
        before = loads()
        with Client(stack.address, timeout=TIMEOUT, max_retries=0) as c:
            r = c.generate(prompt_token_ids=PROMPTS[0], n=4, temperature=0, max_tokens=MAX_NEW,
                           ignore_eos=True)
        assert [ch.token_ids for ch in r.choices] == [expected[0]] * 4
        n4_loads = loads() - before
        _leak_check(stack)
        churn(stack.address, n=5)
        before = loads()
        results = generate_at_once(stack.address, [request(p) for p in PROMPTS])
        assert [x.token_ids for x in results] == expected
        assert (n4_loads, loads() - before) == (6, 6), "blocks read for n=4, for 2 requests"
        _leak_check(stack)
    finally:
        stack.stop()


def test_tier_hits_under_chunked_prefill_and_preemption(tiny_model_dir, tmp_path):
    """Prefill in chunks of 32 tokens; three tier-hit prompts at once, each 7 blocks + its
    outputs, in a pool of 14: they preempt one another while their loads come back. A
    prompt of exactly 6 full blocks: its last block is computed, not loaded (one token must
    be)."""
    prompts = [[*_prompt(40 + i), i] for i in range(3)]
    exact = _prompt(43, extra=0)
    want = hf_greedy(tiny_model_dir, [*prompts, exact], 20)
    stack = tiny_tier_stack(tiny_model_dir, str(tmp_path),
                            scheduler=["--max-num-batched-tokens", "32"])
    try:
        for p in [*prompts, exact]:
            gen(stack.address, p, max_tokens=20)
        churn(stack.address)
        before = stack.stats()
        results = generate_at_once(stack.address, [{**request(p), "max_tokens": 20}
                                                   for p in prompts])
        after = stack.stats()
        assert [r.token_ids for r in results] == want[:3]
        assert after.num_preemptions_total > before.num_preemptions_total
        assert after.prefix_cache_tier_hits_total - before.prefix_cache_tier_hits_total >= (
            3 * 6 * BLOCK)
        churn(stack.address)
        r = gen(stack.address, exact, max_tokens=20)
        assert r.token_ids == want[3]
        assert r.usage.num_cached_tokens == 5 * BLOCK
        assert stack.stats().kv_offload_loads_failed_total == 0
        _leak_check(stack)
    finally:
        stack.stop()


def _blocks_back(stack, timeout: float = 5.0) -> None:
    """Wait until no KV block is in use (a tier load's block is held until the workers have
    answered it), then check for leaks."""
    deadline = time.monotonic() + timeout
    while (used := stack.stats().num_used_blocks) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert used == 0, f"{used} KV blocks still held {timeout:.0f} s after the last request"
    _leak_check(stack)


def test_requests_aborted_while_their_prefix_loads_leave_no_block_held(tiny_model_dir,
                                                                       tmp_path):
    """Three tier-hit prompts sent at once with deadlines of 1 to 20 ms: the router aborts
    them while their loads are in flight (or before, or after). With nothing else to run, the
    loads' blocks must still come back, and the prompts then load exactly."""
    prompts = [[*_prompt(60 + i), 3] for i in range(3)]
    want = hf_greedy(tiny_model_dir, prompts, MAX_NEW)
    stack = tiny_tier_stack(tiny_model_dir, str(tmp_path),
                            scheduler=["--max-num-batched-tokens", "32"])
    try:
        for p in prompts:
            gen(stack.address, p)
        for deadline in (0.001, 0.003, 0.01, 0.02) * 2:
            churn(stack.address)
            out = generate_at_once(stack.address, [{**request(p), "timeout": deadline}
                                                   for p in prompts], return_exceptions=True)
            assert all((isinstance(r, grpc.RpcError) and
                       r.code() == grpc.StatusCode.DEADLINE_EXCEEDED) or r.token_ids == w
                       for r, w in zip(out, want, strict=True))
            _blocks_back(stack)
        churn(stack.address)
        results = [gen(stack.address, p) for p in prompts]
        assert [r.token_ids for r in results] == want
        assert [r.usage.num_cached_tokens for r in results] == [6 * BLOCK] * 3
        _blocks_back(stack)
    finally:
        stack.stop()


# ---- 2. a restart finds the blocks ---------------------------------------------------------

def test_restart_serves_the_prefix_from_the_files(tiny_model_dir, tmp_path, expected):
    folder = str(tmp_path)
    stack = tiny_tier_stack(tiny_model_dir, folder)
    try:
        first = gen(stack.address, PROMPTS[0])
        assert first.token_ids == expected[0]
    finally:
        stack.stop()  # (the worker finishes its queued writes as it stops)
    assert len(block_files(folder)) >= 6
    stack = tiny_tier_stack(tiny_model_dir, folder)
    try:
        assert stack.stats().kv_offload_blocks >= 6  # indexed from the folder at start
        r = gen(stack.address, PROMPTS[0])
        assert r.token_ids == expected[0]
        assert r.usage.num_cached_tokens == 6 * BLOCK
        assert stack.stats().prefix_cache_tier_hits_total == 6 * BLOCK
        _leak_check(stack)
    finally:
        stack.stop()


def test_another_model_on_the_same_folder_loads_none_of_its_blocks(tiny_model_dir, tmp_path,
                                                                   expected):
    """The same architecture with other weights, started on a folder the first model filled:
    its blocks live under another namespace, so the same prompt is computed, exactly."""
    folder = str(tmp_path / "tier")
    other = helpers.make_servable_tiny_llama(tmp_path / "other", seed=1)
    want = hf_greedy(other, [PROMPTS[0]], MAX_NEW)[0]
    assert want != expected[0]
    stack = tiny_tier_stack(tiny_model_dir, folder)
    try:
        assert gen(stack.address, PROMPTS[0]).token_ids == expected[0]
    finally:
        stack.stop()
    stack = tiny_tier_stack(other, folder)
    try:
        assert stack.stats().kv_offload_blocks == 0
        r = gen(stack.address, PROMPTS[0])
        assert r.token_ids == want
        assert r.usage.num_cached_tokens == 0
        assert stack.stats().kv_offload_loads_failed_total == 0
        assert len(os.listdir(folder)) == 2  # a namespace per model
        _leak_check(stack)
    finally:
        stack.stop()


# ---- 3. two replicas on one folder ---------------------------------------------------------

@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tier-shared"))
    stack = MultiReplicaStack(tiny_model_dir, replicas=2, worker_argv=[
        "--dtype", "float32", "--enforce-eager",
        "--kv-cache-memory", str(kv_bytes_per_block(tiny_model_dir) * RAM_BLOCKS),
        "--kv-offload-dir", folder],
        scheduler_argv=["--max-num-batched-tokens", "256", "--max-model-len", "200"],
        router_argv=["--routing-policy", "round_robin"]).start()
    yield stack, folder
    stack.stop()


def _queries(stack: MultiReplicaStack) -> list[int]:
    return [stack.stats(i).prefix_cache_queries_total for i in range(2)]


def test_prefix_of_one_replica_is_a_tier_hit_on_the_other(replicas, tiny_model_dir):
    stack, folder = replicas
    prompt = [*_prompt(2), 5]
    want = hf_greedy(tiny_model_dir, [prompt], MAX_NEW)[0]
    before_files = set(block_files(folder))
    q0 = _queries(stack)
    first = gen(stack.address, prompt)
    a = [i for i, (x, y) in enumerate(zip(q0, _queries(stack), strict=True)) if y > x]
    assert len(a) == 1, "one replica served the first request"
    a = a[0]
    b = 1 - a
    wait_files(folder, before_files, 6)
    hits_b = stack.stats(b).prefix_cache_tier_hits_total
    for _ in range(3):  # round robin: the next request goes to b (or a, then b)
        q = stack.stats(b).prefix_cache_queries_total
        r = gen(stack.address, prompt)
        if stack.stats(b).prefix_cache_queries_total > q:
            break
    else:
        pytest.fail("the router never sent the prompt to the other replica")
    assert first.token_ids == want and r.token_ids == want
    assert r.usage.num_cached_tokens == 6 * BLOCK
    assert stack.stats(b).prefix_cache_tier_hits_total - hits_b == 6 * BLOCK
    assert stack.stats(b).kv_offload_loads_failed_total == 0
    for i in range(2):
        _leak_check_replica(stack, i)


def _leak_check_replica(stack: MultiReplicaStack, i: int) -> None:
    s = stack.wait_idle(i)
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.num_free_blocks == s.num_total_blocks, f"KV blocks leaked on replica {i}"


def test_two_replicas_writing_the_same_blocks_at_once(replicas, tiny_model_dir):
    """Both replicas compute one prefix in the same steps and write its files together;
    every file is whole afterwards, and a third request loads them."""
    stack, folder = replicas
    prompt = [*_prompt(3), 6, 7]
    want = hf_greedy(tiny_model_dir, [prompt], MAX_NEW)[0]
    q0 = _queries(stack)
    results = generate_at_once(stack.address, [request(prompt)] * 2)
    assert [r.token_ids for r in results] == [want, want]
    assert all(y > x for x, y in zip(q0, _queries(stack), strict=True)), "both replicas served it"
    time.sleep(0.5)  # (the writers finish)
    files = block_files(folder)
    assert not glob.glob(os.path.join(folder, "**", "*.tmp"), recursive=True)
    assert files and all(file_ok(f) for f in files)
    churn(stack.address, n=6)  # (round robin: 3 on each replica)
    hits = [stack.stats(i).prefix_cache_tier_hits_total for i in range(2)]
    again = [gen(stack.address, prompt) for _ in range(2)]  # one on each replica
    assert [r.token_ids for r in again] == [want, want]
    assert [stack.stats(i).prefix_cache_tier_hits_total - hits[i] for i in range(2)] == [
        6 * BLOCK, 6 * BLOCK]
    assert sum(stack.stats(i).kv_offload_loads_failed_total for i in range(2)) == 0
    for i in range(2):
        _leak_check_replica(stack, i)


# ---- 4. faults -----------------------------------------------------------------------------

def _corrupt(path: str) -> None:
    """Flip the sign and exponent byte of every 256th float32 of the payload: the file's
    size and header stay, and loaded as is it would change the tokens."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for i in range(HEADER.size + 3, len(data), 1024):
            data[i] ^= 0xFF
        f.seek(0)
        f.write(data)


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _foreign_namespace(path: str) -> None:
    """The header of another model's tier (another namespace digest); payload and checksum
    intact."""
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(bytes.fromhex("0123456789abcdef" * 2))


def _swap_keys(paths: list[str]) -> None:
    """Each block file moved to the next block's name: whole, valid files under the wrong
    key (only the header's key tells)."""
    data = []
    for f in paths:
        with open(f, "rb") as src:
            data.append(src.read())
    for f, d in zip(paths, data[1:] + data[:1], strict=True):
        with open(f, "wb") as out:
            out.write(d)


def _each(damage):
    return lambda paths: [damage(p) for p in paths]


# damage -> (what it does to the files a prompt wrote, the worker's failure reason)
DAMAGE = {"corrupt": (_each(_corrupt), "corrupt"), "truncated": (_each(_truncate), "truncated"),
          "foreign-namespace": (_each(_foreign_namespace), "foreign"),
          "swapped-keys": (_swap_keys, "foreign")}


@pytest.fixture(scope="module")
def fault_stack(tiny_model_dir, tmp_path_factory):
    yield from _stack_on_a_new_folder(tiny_model_dir, tmp_path_factory, "tier-faults")


def _damage_then_serve(stack, folder: str, prompts: list[list[int]], want: list[list[int]],
                       damage) -> int:
    """Serve ``prompts[0]``, damage every block file it wrote, churn, serve all ``prompts``
    (which share its full blocks) at once: the same tokens, through failed loads. Returns the
    loads the scheduler counted failed.

    NOTE: each request admitted reads the shared blocks itself (see
    test_a_prefix_is_loaded_once_...): the first read of a damaged file deletes it, a later
    read of the same block fails as missing."""
    before = set(block_files(folder))
    assert gen(stack.address, prompts[0]).token_ids == want[0]
    new = wait_files(folder, before, 6)
    churn(stack.address)
    damage(new)
    failed = stack.stats().kv_offload_loads_failed_total
    results = generate_at_once(stack.address, [request(p) for p in prompts])
    assert [r.token_ids for r in results] == want
    return stack.stats().kv_offload_loads_failed_total - failed


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_bad_block_files_are_recomputed_counted_and_stored_again(
        fault_stack, tiny_model_dir, kind):
    stack, folder = fault_stack
    damage, reason = DAMAGE[kind]
    port = stack.worker_args.metrics_port
    shared = _prompt(10 + list(DAMAGE).index(kind))
    prompt, sibling = [*shared, 4], [*shared, 5, 6]
    want, want_sibling = hf_greedy(tiny_model_dir, [prompt, sibling], MAX_NEW)
    name = "pagedserve:kv_offload_load_failures_total"
    before = {r: worker_counter(port, name, reason=r) for r in (reason, "missing")}
    failed = _damage_then_serve(stack, folder, [prompt, sibling], [want, want_sibling], damage)
    after = {r: worker_counter(port, name, reason=r) - before[r] for r in before}
    # the worker says why: the damage, for the first read of each file (which deletes it);
    # missing, for a second read of the same block (_damage_then_serve's NOTE)
    assert after[reason] == 6, after
    assert after[reason] + after["missing"] == failed, (after, failed)
    _leak_check(stack)
    # the bad files were deleted and the recomputed blocks stored again: the next time the
    # prefix leaves RAM it comes back from the files
    churn(stack.address)
    hits = stack.stats().prefix_cache_tier_hits_total
    failed = stack.stats().kv_offload_loads_failed_total
    r = gen(stack.address, prompt)
    assert r.token_ids == want
    assert r.usage.num_cached_tokens == 6 * BLOCK
    assert stack.stats().prefix_cache_tier_hits_total - hits == 6 * BLOCK
    assert stack.stats().kv_offload_loads_failed_total == failed
    _leak_check(stack)


def _num_requests(stack) -> int:
    s = stack.stats()
    return s.num_running + s.num_waiting


def test_folder_removed_under_load(tiny_model_dir, tmp_path, caplog):
    """``rmtree`` of the whole tier while requests run: they and the later ones end with
    transformers' tokens; loads of the vanished files fail as missing; writing turns off with
    one warning."""
    folder = str(tmp_path / "tier")
    prompts = [[*_prompt(30 + i), i] for i in range(3)]
    long = 60  # output tokens of the requests that run while the folder goes
    want_long = hf_greedy(tiny_model_dir, prompts, long)
    want = [w[:MAX_NEW] for w in want_long]
    stack = tiny_tier_stack(tiny_model_dir, folder)
    try:
        port = stack.worker_args.metrics_port
        for p, w in zip(prompts[:2], want[:2], strict=True):
            assert gen(stack.address, p).token_ids == w
        wait_files(folder, set(), 12)
        churn(stack.address)
        caplog.set_level(logging.WARNING, logger="services.worker.kv_tier")
        out: list = []
        runner = threading.Thread(target=lambda: out.extend(generate_at_once(
            stack.address, [{**request(p), "max_tokens": long} for p in prompts])))
        runner.start()
        deadline = time.monotonic() + TIMEOUT
        while _num_requests(stack) < 3:  # all three admitted (running, or waiting)
            assert runner.is_alive() and time.monotonic() < deadline, "never ran together"
            time.sleep(0.002)
        while os.path.exists(folder):  # (a writer may add a file while rmtree walks)
            shutil.rmtree(folder, ignore_errors=True)
        assert runner.is_alive(), "the requests ended before the folder went"
        runner.join(2 * TIMEOUT)
        assert not runner.is_alive(), "requests hung"
        assert [r.token_ids for r in out] == want_long
        # later requests: a new prefix (writing fails: off) and the old ones again
        churn(stack.address)
        for p, w in zip(prompts, want, strict=True):
            assert gen(stack.address, p).token_ids == w
        assert not os.path.exists(folder), "the tier made its folder again"
        # the index still listed the old prefixes: their loads failed, as missing
        assert stack.stats().kv_offload_loads_failed_total > 0
        assert worker_counter(port, "pagedserve:kv_offload_load_failures_total",
                              reason="missing") == stack.stats().kv_offload_loads_failed_total
        assert worker_counter(port, "pagedserve:kv_offload_writes_enabled") == 0
        assert worker_counter(port, "pagedserve:kv_offload_store_failures_total",
                              reason="ENOENT") == 1
        assert sum("writing to" in r.getMessage() and "turned off" in r.getMessage()
                   for r in caplog.records) == 1
        _leak_check(stack)
    finally:
        stack.stop()


def _tmpfs(path: str, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True).returncode == 0


def test_disk_full_turns_writing_off_and_serving_goes_on(tiny_model_dir, tmp_path, caplog):
    """A tier folder on a 64 KiB tmpfs: four of the prompt's six block files fit (12 KiB
    each); the fifth fails with ENOSPC and writing turns off; every answer stays exact, and
    the blocks that were written still load."""
    folder = str(tmp_path / "tiny-disk")
    if not _tmpfs(folder, "64k"):
        pytest.skip("needs root and `mount -t tmpfs` for a disk that fills (the worker's "
                    "unit tests simulate ENOSPC)")
    caplog.set_level(logging.WARNING, logger="services.worker.kv_tier")
    try:
        stack = tiny_tier_stack(tiny_model_dir, folder)
        try:
            port = stack.worker_args.metrics_port
            prompt = PROMPTS[0]
            want = hf_greedy(tiny_model_dir, [prompt], MAX_NEW)[0]
            assert gen(stack.address, prompt).token_ids == want
            deadline = time.monotonic() + 20
            while worker_counter(port, "pagedserve:kv_offload_writes_enabled") != 0:
                assert time.monotonic() < deadline, "writing never turned off"
                time.sleep(0.05)
            assert worker_counter(port, "pagedserve:kv_offload_store_failures_total",
                                  reason="ENOSPC") == 1
            assert any("turned off" in r.getMessage() for r in caplog.records)
            files = block_files(folder)
            assert 0 < len(files) < 6 and all(file_ok(f) for f in files)
            assert not glob.glob(os.path.join(folder, "**", "*.tmp"), recursive=True)
            churn(stack.address)
            hits = stack.stats().prefix_cache_tier_hits_total
            r = gen(stack.address, prompt)
            assert r.token_ids == want
            # the blocks on disk load; the rest (the index listed them) fail as missing
            assert stack.stats().prefix_cache_tier_hits_total > hits
            _leak_check(stack)
        finally:
            stack.stop()
    finally:
        subprocess.run(["umount", folder], check=False)


# ---- 5. the flags ---------------------------------------------------------------------------

def test_tier_without_prefix_caching_is_refused_naming_both_flags(tiny_model_dir, tmp_path):
    # NOTE: the refused scheduler lets the workers go (build_engine closes the connection it
    # opened), so the worker stops at once instead of waiting its drain timeout (30 s)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as err:
        tiny_tier_stack(tiny_model_dir, str(tmp_path),
                        scheduler=["--no-enable-prefix-caching"])
    assert time.monotonic() - t0 < 25
    assert "--kv-offload-dir" in str(err.value)
    assert "--no-enable-prefix-caching" in str(err.value)
