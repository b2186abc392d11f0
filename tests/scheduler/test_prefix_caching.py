"""Automatic prefix caching: chained block keys, verified hits, LRU eviction, exact ref counts.

Scheduler-level runs go through FakeWorker, whose fake K/V of a slot is (position, the tokens up
to it): a hit on a block with different content, or on an evicted block, fails its check.
"""

import pytest

from services.common.block_hash import hash_block
from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request
from tests.scheduler.factories import (
    FakeWorker,
    expected_output,
    make_scheduler,
    run_to_completion,
    step_output,
)


def request(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, tokens, **kw)


def allocate_all(bm: BlockManager, r: Request) -> int:
    """Admit ``r`` the way the scheduler does: hit, then allocate the rest. Returns the hit."""
    hits, num_hit = bm.get_computed_blocks(r)
    bm.allocate(r, r.num_tokens - num_hit, hits)
    r.num_computed_tokens = num_hit
    return num_hit


def test_block_key_chains_parent_and_tokens():
    a = hash_block(b"", [1, 2, 3, 4])
    assert a == hash_block(b"", [1, 2, 3, 4]) and len(a) == 16
    assert a != hash_block(b"", [1, 2, 3, 5])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(b"", [5, 6, 7, 8])  # parent matters
    assert hash_block(b"", [1, 2, 3, 4], b"salt") != a  # extra keys matter


def test_hit_shares_full_blocks_and_counts_refs():
    bm = BlockManager(16, 4)
    a = request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert allocate_all(bm, a) == 0
    assert bm.num_cached_blocks == 2
    b = request("b", [*range(8), 99, 98, 97])
    assert allocate_all(bm, b) == 8
    (ta,), (tb,) = a.block_ids, b.block_ids
    assert tb[:2] == ta[:2] and tb[2] != ta[2]
    assert [bm.blocks[i].ref_count for i in ta[:2]] == [2, 2]
    bm.check_invariants([a, b])
    assert bm.num_used_blocks == 3 + 1  # a: 3 blocks, b: 1 private block


def test_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(16, 4)
    a = request("a", list(range(8)))
    allocate_all(bm, a)
    same = request("same", list(range(8)))  # exactly 2 full blocks: only the first may hit
    assert bm.get_computed_blocks(same) == ([a.block_ids[0][:1]], 4)


def test_miss_on_different_first_block_even_with_same_later_tokens():
    bm = BlockManager(16, 4)
    a = request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    allocate_all(bm, a)
    b = request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.get_computed_blocks(b) == ([], 0)


def test_freed_blocks_stay_cached_until_evicted_in_lru_order():
    bm = BlockManager(6, 4)
    a = request("a", list(range(13)))  # 4 blocks, 3 full
    allocate_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    again = request("again", list(range(13)))
    assert allocate_all(bm, again) == 12  # all 3 full blocks reused although nobody held them
    bm.free(again)
    # A request that needs 4 fresh blocks takes the 3 never-cached ones first, then evicts the
    # cached tail block of `again` (freed before its head), keeping the first two blocks.
    filler = request("filler", [50 + i for i in range(16)])
    allocate_all(bm, filler)
    assert bm.num_cached_blocks == 2 + 4  # the two survivors + filler's own 4 full blocks
    bm.free(filler)
    bm.check_invariants([])
    third = request("third", list(range(13)))
    _, num_hit = bm.get_computed_blocks(third)
    assert num_hit == 8  # block 2 of the prefix was evicted, blocks 0-1 survive
    bm.check_invariants([])


def test_hit_rechecks_stored_tokens():
    bm = BlockManager(8, 4)
    a = request("a", list(range(9)))
    allocate_all(bm, a)
    # Forge a collision: make the cached first block claim other tokens under the same key.
    first = bm.blocks[a.block_ids[0][0]]
    first.token_ids = (9, 9, 9, 9)
    assert bm.get_computed_blocks(request("b", list(range(9)))) == ([], 0)


def test_reset_prefix_cache_forgets_keys_but_not_owners():
    bm = BlockManager(8, 4)
    a = request("a", list(range(9)))
    allocate_all(bm, a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and a.block_ids == [[0, 1, 2]]
    assert bm.get_computed_blocks(request("b", list(range(9)))) == ([], 0)
    bm.check_invariants([a])


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = request("a", list(range(9)))
    allocate_all(bm, a)
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(request("b", list(range(9)))) == ([], 0)


def test_without_prefix_caching_only_choices_of_one_request_share():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    tokens = list(range(9))
    first = request("0_r", tokens, parent_request_id="r")
    assert allocate_all(bm, first) == 0 and bm.num_cached_blocks == 2
    assert allocate_all(bm, request("1_r", tokens, parent_request_id="r")) == 8
    assert allocate_all(bm, request("stranger", tokens)) == 0  # not a choice of "r"
    assert allocate_all(bm, request("0_q", tokens, parent_request_id="q")) == 0  # other parent
    for r in [first]:
        bm.free(r)
    assert bm.num_cached_blocks == 2 + 2  # "1_r" still holds the shared blocks; "0_q" its own
    bm.check_invariants()


def test_without_prefix_caching_a_block_loses_its_key_with_its_last_user():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a = request("0_r", list(range(9)), parent_request_id="r")
    b = request("1_r", list(range(9)), parent_request_id="r")
    allocate_all(bm, a)
    allocate_all(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 0
    assert allocate_all(bm, request("2_r", list(range(9)), parent_request_id="r")) == 0
    bm.check_invariants()


def test_hit_on_free_cached_blocks_needs_room_for_them():
    bm = BlockManager(3, 4)
    a = request("a", list(range(9)))  # 3 blocks, 2 full
    allocate_all(bm, a)
    bm.free(a)
    b = request("b", list(range(8)) + list(range(100, 105)))  # 2 hits + 2 new blocks = 4 > 3
    hits, num_hit = bm.get_computed_blocks(b)
    assert num_hit == 8 and not bm.can_allocate(b, b.num_tokens - num_hit, hits)
    with pytest.raises(RuntimeError):
        bm.allocate(b, b.num_tokens - num_hit, hits)
    bm.check_invariants([a, b])


# --- through the scheduler -------------------------------------------------------------------

SYSTEM = [7000 + i for i in range(12)]  # a 3-block shared prefix at block_size 4


def shared_prefix_requests(n: int, tail: int = 3, start: int = 0, **sampling) -> list[Request]:
    from services.scheduler.request import EngineSamplingParams

    return [Request(f"req-{start + i}", SYSTEM + [100 * (start + i) + j for j in range(tail)],
                    EngineSamplingParams(**sampling)) for i in range(n)]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_outputs_do_not_depend_on_prefix_caching(prefix_caching):
    s = make_scheduler(24, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                       max_model_len=64, enable_prefix_caching=prefix_caching)
    reqs = shared_prefix_requests(6, max_tokens=9)
    for r in reqs:
        s.add_request(r)
    run_to_completion(s)
    for r in reqs:
        assert (r.output_token_ids, r.finish_reason) == expected_output(r, 64)
    if prefix_caching:
        assert reqs[0].num_cached_tokens == 0
        assert all(r.num_cached_tokens == 12 for r in reqs[1:])
        assert s.prefix_cache_hits_total == 12 * 5
    else:
        assert all(r.num_cached_tokens == 0 for r in reqs)


def test_requests_admitted_in_one_step_share_the_prefix():
    s = make_scheduler(64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    reqs = shared_prefix_requests(4, max_tokens=2)
    for r in reqs:
        s.add_request(r)
    w = FakeWorker(s)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"req-0": 15, "req-1": 3, "req-2": 3, "req-3": 3}
    shared = reqs[0].block_ids[0][:3]
    assert all(r.block_ids[0][:3] == shared for r in reqs)
    assert s.block_manager.num_used_blocks == 3 + 4  # the prefix once, one tail block each
    # FakeWorker checks every slot it reads
    s.update_from_output(out, step_output(out, w.execute(out)))
    run_to_completion(s, w)


def test_preempted_request_resumes_from_its_cached_blocks():
    s = make_scheduler(8, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                       max_model_len=32)
    a, b = shared_prefix_requests(2, tail=6, max_tokens=12, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    w = FakeWorker(s)
    updates = run_to_completion(s, w)
    assert s.num_preemptions_total > 0
    assert b.num_preemptions > 0
    assert s.prefix_cache_hits_total > 12  # the resume hit, on top of b's first admission
    for r in (a, b):
        assert (r.output_token_ids, r.finish_reason) == expected_output(r, 32)
    assert updates


def test_small_cache_evicts_and_recomputes_correctly():
    s = make_scheduler(10, block_size=4, max_num_batched_tokens=8, max_num_seqs=2,
                       max_model_len=40)
    reqs = shared_prefix_requests(3, tail=5, max_tokens=6)
    reqs += [Request(f"req-{10 + i}", [900 + 10 * i + j for j in range(20)])
             for i in range(3)]
    reqs += shared_prefix_requests(2, tail=5, start=20, max_tokens=6)
    for r in reqs:
        s.add_request(r)
    run_to_completion(s)
    for r in reqs:
        assert (r.output_token_ids, r.finish_reason) == expected_output(r, 40)
    assert s.block_manager.num_cached_blocks <= 10
