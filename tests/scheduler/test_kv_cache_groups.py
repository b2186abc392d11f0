"""KV cache groups (vLLM's hybrid KV cache manager, simplified): one block table per group from
one shared pool; a sliding-window group releases the blocks wholly before its window, so a
request holds at most ceil(W / bs) + 1 of them; prefix hits need only the window's blocks.

Block size 4 throughout, windows below (3), equal to (4) and above (9) a block. Scheduler runs go
through FakeWorker, which splits the flat block ids group by group, checks -1 entries lie out of
the window and that every slot a step reads (within the window) holds its group's K/V.
"""

import pytest

from services.common.pb.pagedserve.v1 import worker_pb2
from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request
from services.scheduler.worker_client import WorkerError, check_kv_cache_groups
from tests.scheduler.factories import (
    FakeWorker,
    expected_output,
    make_request,
    make_scheduler,
    run_to_completion,
    step_output,
)

BS = 4
WINDOWS = [3, 4, 9]  # < block, = block, > block


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def bound(w: int, chunk: int = 1) -> int:
    """Most blocks of a window-w group one request holds when a step computes <= chunk tokens
    (ceil(W / bs) + 1 while decoding)."""
    return ceil_div(chunk + w - 1, BS) + 1


# --- the groups the workers report ------------------------------------------------------------

def info(*groups: tuple[int, list[int]]) -> worker_pb2.GetWorkerInfoResponse:
    return worker_pb2.GetWorkerInfoResponse(kv_cache_groups=[
        worker_pb2.KVCacheGroup(sliding_window=w, layer_ids=ids) for w, ids in groups])


def test_no_groups_reported_means_one_full_group():
    assert check_kv_cache_groups([info(), info()], ["a:1", "b:1"]) == [(0, ())]


def test_ranks_must_report_the_same_groups():
    gemma = info((512, [0, 1, 2]), (0, [3, 4, 5]))
    assert check_kv_cache_groups([gemma, gemma], ["a:1", "b:1"]) == [
        (512, (0, 1, 2)), (0, (3, 4, 5))]
    with pytest.raises(WorkerError, match=(
            r"worker a:1 reports KV cache groups \[window 512: layers 0,1,2; full: layers "
            r"3,4,5\] but worker b:1 reports \[full: layers all\]")):
        check_kv_cache_groups([gemma, info()], ["a:1", "b:1"])


# --- the block manager ------------------------------------------------------------------------

def run_chunks(bm: BlockManager, r: Request, chunk: int, held: list[tuple[int, int]]) -> None:
    """Compute ``r``'s tokens ``chunk`` at a time as the scheduler does, recording the blocks
    each group holds after every allocation."""
    while r.num_computed_tokens < r.num_tokens:
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert bm.can_allocate(r, n)
        bm.allocate(r, n)
        r.num_computed_tokens += n
        held.append((bm.num_blocks_held(r, 0), bm.num_blocks_held(r, 1)))
        bm.check_invariants([r])


@pytest.mark.parametrize("w", WINDOWS)
@pytest.mark.parametrize("chunk", [1, BS, 2 * BS, 5])
def test_sliding_group_holds_at_most_its_window(w, chunk):
    bm = BlockManager(64, BS, sliding_windows=[0, w])
    r = Request("r", list(range(100)))
    held: list[tuple[int, int]] = []
    run_chunks(bm, r, chunk, held)
    assert max(s for _, s in held) <= min(bound(w, chunk), bm.blocks_for_one_request(100, chunk))
    if chunk in (1, BS):  # decoding, or block-aligned chunks of one block
        assert max(s for _, s in held) <= ceil_div(w, BS) + 1
    assert [f for f, _ in held] == [ceil_div(min(100, chunk * (i + 1)), BS)
                                    for i in range(len(held))]  # the full group keeps all
    full, sliding = r.block_ids
    assert len(full) == len(sliding) == 25
    last = (99 // chunk) * chunk  # the last step's first query: it reads keys from last - w + 1
    first = max(0, last - w + 1) // BS
    assert sliding[:first] == [-1] * first and min(sliding[first:]) >= 0
    assert bm.num_free_blocks + bm.num_used_blocks == 64
    assert bm.num_used_blocks == 25 + len(sliding) - first
    bm.free(r)
    assert bm.num_free_blocks == 64 and r.block_ids == []
    bm.check_invariants([r])


def test_released_blocks_are_reused():
    # 25 blocks for the full group + 2 for the sliding one: a 100-token decode fits only if
    # the sliding group's released blocks come back.
    bm = BlockManager(27, BS, sliding_windows=[0, 5])
    r = Request("r", list(range(100)))
    seen = set()
    while r.num_computed_tokens < r.num_tokens:
        bm.allocate(r, 1)
        r.num_computed_tokens += 1
        seen.update(b for b in r.block_ids[1] if b >= 0)
        bm.check_invariants([r])
    assert len(seen) < 25 and bm.num_free_blocks == 0  # 25 logical blocks, fewer ids


def test_allocate_adds_as_many_blocks_to_every_group_and_counts_them_all():
    bm = BlockManager(5, BS, sliding_windows=[0, 9, 9])
    r = Request("r", list(range(8)))
    assert bm.can_allocate(r, 4) and not bm.can_allocate(r, 5)  # 2 blocks x 3 groups > 5
    assert bm.allocate(r, 4) == [0, 1, 2]  # group by group
    assert r.block_ids == [[0], [1], [2]]
    r.num_computed_tokens = 4
    assert not bm.can_allocate(r, 1)  # 3 more blocks, 2 free
    with pytest.raises(RuntimeError, match="needs 3 more KV blocks but only 2 are free"):
        bm.allocate(r, 1)
    assert r.block_ids == [[0], [1], [2]]
    bm.check_invariants([r])


def test_can_allocate_counts_the_blocks_the_window_releases_first():
    bm = BlockManager(4, BS, sliding_windows=[3])  # a sliding group alone
    r = Request("r", list(range(20)))
    bm.allocate(r, 16)  # 4 blocks: the whole cache
    r.num_computed_tokens = 16
    assert bm.num_free_blocks == 0
    assert bm.can_allocate(r, 1)  # blocks 0..2 end before key 14: released, one reused
    assert bm.allocate(r, 1) == [2]  # the newest released block: vLLM's order
    assert r.block_ids == [[-1, -1, -1, 3, 2]] and bm.num_free_blocks == 2
    bm.check_invariants([r])


def test_check_invariants_catches_a_missing_block_in_the_window():
    bm = BlockManager(8, BS, sliding_windows=[0, 4])
    r = Request("r", list(range(10)))
    bm.allocate(r, 10)
    r.num_computed_tokens = 10
    bm.check_invariants([r])
    r.block_ids[1][2] = -1  # forged: block 2 holds keys the window reads
    with pytest.raises(AssertionError, match="group 1 has no block where its window reads"):
        bm.check_invariants([r])


def test_blocks_for_one_request():
    bm = BlockManager(1, 16, sliding_windows=[512, 0, 512, 512, 512, 512])
    # Gemma 3 270M, one 4096-token request decoding: 256 full blocks + 5 x (32 + 1).
    assert bm.blocks_for_one_request(4096, 1) == 256 + 5 * 33
    assert bm.blocks_for_one_request(4096, 2048) == 256 + 5 * (ceil_div(2048 + 511, 16) + 1)
    assert bm.blocks_for_one_request(100, 1) == 6 * 7  # a short request: ceil(100 / 16) each


# --- prefix caching with a sliding group ------------------------------------------------------

W = 6  # with BS = 4: a hit of n blocks needs sliding blocks (4n - 5) // 4 .. n - 1


def prefilled() -> tuple[BlockManager, Request, list[int]]:
    """A manager whose request ``a`` computed its 41-token prompt 4 tokens a step: its
    sliding group released blocks 0..7 (keys 0..31 lie before its last step's window), which
    stay cached. Also returns the ids of the sliding group's blocks 0..9 (as registered)."""
    bm = BlockManager(40, BS, sliding_windows=[0, W])
    a = Request("a", list(range(41)))
    run_chunks(bm, a, BS, [])
    assert a.block_ids[1][:8] == [-1] * 8 and min(a.block_ids[1][8:]) >= 0
    sliding = [bm.cached_blocks[1, key].block_id for key in a.block_hashes[:10]]
    assert sliding[8:] == a.block_ids[1][8:10]
    return bm, a, sliding


def admit(bm: BlockManager, r: Request) -> int:
    hits, num_hit = bm.get_computed_blocks(r)
    assert bm.can_allocate(r, r.num_tokens - num_hit, hits)
    bm.allocate(r, r.num_tokens - num_hit, hits)
    r.num_computed_tokens = num_hit
    return num_hit


def test_hit_after_a_long_prompt_needs_only_the_window():
    bm, a, _ = prefilled()
    b = Request("b", list(range(41)))
    hits, num_hit = bm.get_computed_blocks(b)
    assert num_hit == 40
    full, sliding = a.block_ids
    assert hits == [full[:10], [-1] * 8 + sliding[8:10]]  # keys 35.. : blocks 8, 9
    admit(bm, b)
    assert bm.num_blocks_held(b, 1) == 3  # blocks 8, 9 shared, 10 its own
    bm.check_invariants([a, b])


def test_hit_survives_the_eviction_of_the_sliding_groups_early_blocks():
    bm, a, _ = prefilled()
    held = {block_id for table in a.block_ids for block_id in table}
    released = [block for block in bm.blocks
                if block.block_id not in held and block.block_hash is not None]
    assert len(released) == 8  # the sliding group's blocks 0..7, on the free list
    # a filler takes every free block: the released early blocks lose their keys
    filler = Request("filler", [9000 + i for i in range(2 * bm.num_free_blocks)])
    admit(bm, filler)
    assert bm.num_free_blocks == 0
    assert all(block.block_hash is None or block.block_hash[1] in filler.block_hashes
               for block in released)
    hits, num_hit = bm.get_computed_blocks(Request("b", list(range(41))))
    assert num_hit == 40 and hits[1] == [-1] * 8 + a.block_ids[1][8:10]


def test_evicting_a_block_in_the_window_shrinks_the_hit():
    bm, a, sliding = prefilled()
    a_full = list(a.block_ids[0])
    bm.free(a)  # everything on the free list, keys kept
    bm._evict(bm.blocks[sliding[9]])  # as if allocation had evicted it
    b = Request("b", list(range(41)))
    hits, num_hit = bm.get_computed_blocks(b)
    # no hit of 10 blocks (needs block 9); 9 blocks need sliding blocks 7, 8, released but cached
    assert num_hit == 36 and hits[1] == [-1] * 7 + sliding[7:9]
    bm._evict(bm.blocks[sliding[7]])
    # hits of 9 and 8 blocks need block 7; 7 blocks need blocks 5, 6
    assert bm.get_computed_blocks(b) == ([a_full[:7], [-1] * 5 + sliding[5:7]], 28)
    bm.check_invariants([])


def test_a_full_group_miss_bounds_the_hit():
    bm, a, sliding = prefilled()
    full = list(a.block_ids[0])
    bm.free(a)
    bm._evict(bm.blocks[full[3]])
    # 3 blocks: blocks 1, 2 of the sliding group (released early, still cached)
    assert bm.get_computed_blocks(Request("b", list(range(41)))) == (
        [full[:3], [-1, *sliding[1:3]]], 12)


def test_without_prefix_caching_released_blocks_lose_their_keys_but_choices_still_share():
    bm = BlockManager(40, BS, enable_prefix_caching=False, sliding_windows=[0, W])
    a = Request("0_p", list(range(41)), parent_request_id="p")
    run_chunks(bm, a, BS, [])
    assert bm.num_cached_blocks == 10 + 2  # the sliding group's released blocks 0..7 forgot
    b = Request("1_p", list(range(41)), parent_request_id="p")  # a choice of the same request
    assert admit(bm, b) == 40
    (full, sliding), (b_full, b_sliding) = a.block_ids, b.block_ids
    assert b_full[:10] == full[:10] and b_sliding[:10] == [-1] * 8 + sliding[8:10]
    stranger = Request("stranger", list(range(41)))
    assert admit(bm, stranger) == 0
    bm.check_invariants([a, b, stranger])


# --- through the scheduler ----------------------------------------------------------------------

@pytest.mark.parametrize("w", WINDOWS)
@pytest.mark.parametrize("threshold", [0, BS])
def test_long_request_through_the_scheduler(w, threshold):
    s = make_scheduler(40, block_size=BS, max_num_batched_tokens=16, max_model_len=128,
                       sliding_windows=(0, w), long_prefill_token_threshold=threshold)
    r = make_request(0, 50, max_tokens=60, ignore_eos=True)
    s.add_request(r)
    w_ = FakeWorker(s)
    chunk = threshold or 16
    while s.has_unfinished_requests():
        w_.step()
        s.block_manager.check_invariants(s.requests.values())
        if r.block_ids:
            assert s.block_manager.num_blocks_held(r, 1) <= bound(w, chunk)
            if threshold or r.num_output_tokens:  # block-aligned chunks, or decoding
                assert s.block_manager.num_blocks_held(r, 1) <= ceil_div(w, BS) + 1
    assert (r.output_token_ids, r.finish_reason) == expected_output(r, 128)
    assert r.num_preemptions == 0
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_scheduler_refuses_a_cache_too_small_for_one_request():
    with pytest.raises(ValueError, match="max_model_len=32 needs 13 blocks in 2 KV cache groups"):
        make_scheduler(12, block_size=BS, max_num_batched_tokens=8, max_model_len=32,
                       sliding_windows=(0, 9))  # 8 full + ceil(16 / 4) + 1 sliding
    make_scheduler(13, block_size=BS, max_num_batched_tokens=8, max_model_len=32,
                   sliding_windows=(0, 9))


SYSTEM = [7000 + i for i in range(30)]


@pytest.mark.parametrize("w", WINDOWS)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefixes_n_choices_and_preemption(w, prefix_caching):
    """Choices of one parent share blocks even without prefix caching; a small cache forces
    preemptions and resumes; outputs are the fake model's; nothing leaks."""
    s = make_scheduler(30, block_size=BS, max_num_batched_tokens=16, max_num_seqs=4,
                       max_model_len=64, enable_prefix_caching=prefix_caching,
                       sliding_windows=(w, 0, w))
    reqs = []
    for i in range(6):
        r = make_request(i, 1, max_tokens=20, ignore_eos=True)
        r.prompt_token_ids = [*SYSTEM, 100 * i]
        r.parent_request_id = "p" if i < 3 else ""  # req-0..2: choices of one request
        reqs.append(r)
        s.add_request(r)
    run_to_completion(s, FakeWorker(s))  # checks the invariants after every step
    for r in reqs:
        assert (r.output_token_ids, r.finish_reason) == expected_output(r, 64)
    assert s.num_preemptions_total > 0
    assert reqs[1].num_cached_tokens == reqs[2].num_cached_tokens == 28  # the shared prefix
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_fake_worker_verifies_the_group_layout():
    for layout in ([0], [0, 0]):  # one group too few; a full group where the scheduler slides
        s = make_scheduler(40, block_size=BS, max_model_len=64, sliding_windows=(0, 3))
        s.add_request(make_request(0, 30, max_tokens=10))
        w = FakeWorker(s, sliding_windows=layout)
        with pytest.raises(AssertionError, match=r"group layout|differs from the scheduler"):
            run_to_completion(s, w)


def test_gemma3_270m_shape_one_4096_token_request():
    """The issue's measurement at the scheduler: Gemma 3 270M's groups (18 layers, 3 full and 15
    sliding with W = 512 -> 6 groups of 3 layers), block size 16. Decoding to 4096 tokens a
    request holds 256 full blocks + 5 x (ceil(512 / 16) + 1) at most, where a full-attention
    cache would hold 6 x 256."""
    windows = (512, 512, 0, 512, 512, 512)  # the groups in order of their first layer
    s = make_scheduler(1100, block_size=16, max_num_batched_tokens=2048, max_model_len=4096,
                       sliding_windows=windows)
    r = make_request(0, 4000, ignore_eos=True)
    s.add_request(r)
    w = FakeWorker(s)
    held = []
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, step_output(out, w.execute(out)))
        if out.num_scheduled_tokens.get("req-0") == 1 and r.block_ids:  # a decode step
            held.append(s.block_manager.num_blocks_held(r))
            assert s.block_manager.num_blocks_held(r, 2) == ceil_div(r.num_computed_tokens, 16)
    assert r.num_tokens == 4096 and r.num_output_tokens == 96
    assert max(held) <= 256 + 5 * 33 < 6 * 256
    # the last new block (token 4080, keys from 3570 = block 223 on): blocks 223 .. 255
    assert held[-1] == 256 + 5 * 33
