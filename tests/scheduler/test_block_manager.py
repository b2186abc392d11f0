"""BlockManager: allocation, freeing, exact accounting."""

import pytest

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request


def req(rid: str = "req-0", num_computed_tokens: int = 0) -> Request:
    request = Request(rid, [1, 2, 3])
    request.num_computed_tokens = num_computed_tokens
    return request


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


@pytest.mark.parametrize(
    ("num_tokens", "blocks"), [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)]
)
def test_num_blocks_needed_is_ceil(num_tokens, blocks):
    assert BlockManager(16, 4).num_blocks_needed(num_tokens) == blocks


def test_allocate_appends_and_returns_new_ids():
    bm = BlockManager(8, 4)
    r = req()
    assert bm.allocate(r, 5) == [0, 1]
    assert r.block_ids == [[0, 1]] and bm.num_free_blocks == 6
    r.num_computed_tokens = 5
    assert bm.allocate(r, 3) == []  # slots 5..7 are in block 1 already
    assert bm.allocate(r, 4) == [2]  # slot 8 needs a third block
    assert r.block_ids == [[0, 1, 2]]
    assert bm.usage == pytest.approx(3 / 8)
    bm.check_invariants([r])


def test_can_allocate_boundaries():
    bm = BlockManager(4, 4)  # 16 slots
    r = req()
    assert bm.can_allocate(r, 16)
    assert not bm.can_allocate(r, 17)
    bm.allocate(r, 6)  # 2 blocks
    r.num_computed_tokens = 6
    assert bm.can_allocate(r, 10)  # up to slot 15: 4 blocks, 2 missing, 2 free
    assert not bm.can_allocate(r, 11)
    other = req("req-1")
    assert bm.can_allocate(other, 8) and not bm.can_allocate(other, 9)
    with pytest.raises(ValueError):
        bm.can_allocate(r, -1)


def test_allocate_without_room_raises_and_changes_nothing():
    bm = BlockManager(2, 4)
    r = req()
    with pytest.raises(RuntimeError, match="needs 3 more KV blocks but only 2"):
        bm.allocate(r, 9)
    assert r.block_ids == [] and bm.num_free_blocks == 2
    bm.check_invariants([r])


def test_free_returns_blocks_and_clears_table():
    bm = BlockManager(6, 2)
    a, b = req("req-0"), req("req-1")
    bm.allocate(a, 5)
    bm.allocate(b, 2)
    table = a.block_ids
    bm.free(a)
    assert a.block_ids == [] and table == [[0, 1, 2]]  # the old list object is left intact
    assert bm.num_free_blocks == 5
    bm.check_invariants([a, b])
    # Freed blocks go to the back of the free list, tail block first.
    assert list(bm.free_block_ids) == [4, 5, 2, 1, 0]
    bm.free(a)  # second free of the same request: a no-op
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.usage == 0.0
    bm.check_invariants([a, b])


def test_double_free_of_a_block_asserts():
    bm = BlockManager(4, 2)
    a = req()
    bm.allocate(a, 2)
    stale = req("req-1")
    stale.block_ids = [list(t) for t in a.block_ids]  # a forged second owner without a ref count
    bm.free(a)
    with pytest.raises(AssertionError, match="double free of block 0"):
        bm.free(stale)


def test_check_invariants_catches_leaks_and_wrong_refs():
    bm = BlockManager(4, 2)
    a = req()
    bm.allocate(a, 4)
    bm.check_invariants([a])
    with pytest.raises(AssertionError, match="ref_count 1 but 0"):
        bm.check_invariants([])
    bm.blocks[0].ref_count = 0  # leaked: not free, no refs
    with pytest.raises(AssertionError, match="leaked"):
        bm.check_invariants()


def test_full_cycle_keeps_accounting_exact():
    bm = BlockManager(10, 3)
    reqs = [req(f"req-{i}") for i in range(5)]
    for i, r in enumerate(reqs):
        bm.allocate(r, i + 1)
        assert bm.num_free_blocks + sum(bm.num_blocks_held(x) for x in reqs) == 10
    for r in reqs[::2]:
        bm.free(r)
        bm.check_invariants(reqs)
    for r in reqs:
        bm.free(r)
    assert bm.num_free_blocks == 10
    assert sorted(bm.free_block_ids) == list(range(10))
