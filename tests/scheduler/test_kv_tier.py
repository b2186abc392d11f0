"""The scheduler's half of the KV tier on disk: the index over the folders, what steps load
and store, requests that wait for their loads, failed loads, aborts during a load, restarts.

A fake worker (``tier_worker``) keeps the fake K/V of every slot (``FakeWorker``: each read is
checked against the tokens it must hold) and a fake disk: a store copies a block's slots into
it and creates its file under the rank's folder (what the index looks at), a load copies them
back into the target block at the start of the worker's next step, or fails when the file is
gone.
"""

from __future__ import annotations

import os

import pytest

from services.common.kv_tier_files import block_path
from services.scheduler.kv_tier import TIER
from services.scheduler.kv_tier import KVTier, RankLoadReports
from services.scheduler.kv_tier_index import KVTierIndex
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from tests.scheduler.factories import (
    TIER_BLOCK_BYTES as BLOCK_BYTES,
    FakeWorker,
    make_request,
    make_scheduler,
    run_to_completion,
)

BS = 4


def tier_worker(scheduler: Scheduler, rank_dir: str, disk: dict | None = None) -> FakeWorker:
    return FakeWorker(scheduler, tier_dir=rank_dir, disk={} if disk is None else disk)


def tier_scheduler(tmp_path, num_kv_blocks: int = 12, max_blocks: int = 64,
                   **kwargs) -> Scheduler:
    index = KVTierIndex([str(tmp_path)], BLOCK_BYTES, max_blocks * BLOCK_BYTES)
    return make_scheduler(num_kv_blocks, block_size=BS, max_model_len=32, kv_tier=KVTier(index),
                          **kwargs)


def run(scheduler: Scheduler, worker: FakeWorker) -> None:
    run_to_completion(scheduler, worker)


def prompt(n_tokens: int, base: int = 7) -> list[int]:
    return [base * 1000 + j for j in range(n_tokens)]


def request(index: int, tokens: list[int], max_tokens: int = 2):
    r = make_request(index, 1, max_tokens=max_tokens, ignore_eos=True)
    r.prompt_token_ids = list(tokens)
    return r


def churn(scheduler, worker, start: int, n: int = 3) -> None:
    """Run ``n`` unrelated 12-token requests: they evict the RAM pool's cached blocks."""
    for i in range(n):
        scheduler.add_request(request(start + i, prompt(12, base=50 + start + i)))
        run(scheduler, worker)


def evicted_prefix(tmp_path):
    """A scheduler whose tier holds the two full blocks of ``shared`` (10 tokens) and whose RAM
    pool has evicted them: (scheduler, worker, shared)."""
    scheduler = tier_scheduler(tmp_path)
    worker = tier_worker(scheduler, str(tmp_path))
    shared = prompt(10)
    scheduler.add_request(request(0, shared))
    run(scheduler, worker)
    churn(scheduler, worker, 10)
    return scheduler, worker, shared


def test_computed_blocks_are_stored_and_a_prefix_the_pool_lost_is_loaded(tmp_path):
    scheduler = tier_scheduler(tmp_path)
    worker = tier_worker(scheduler, str(tmp_path))
    shared = prompt(10)  # two full blocks (8 tokens) and a partial one
    first = request(0, shared)
    scheduler.add_request(first)
    out = scheduler.schedule()
    assert [t.block_id for t in out.kv_stores] == first.block_ids[0][:2]  # the full blocks
    scheduler.update_from_output(out, worker.output(out, worker.execute(out)))
    run(scheduler, worker)
    tier = scheduler.block_manager.tier
    assert tier.index.num_blocks >= 2 and len(worker.disk) == tier.index.num_blocks
    churn(scheduler, worker, 10)
    assert scheduler.block_manager.num_cached_blocks == 0 or all(
        b.token_ids[:1] != (shared[0],) for b in scheduler.block_manager.cached_blocks.values())

    second = request(1, shared + [1, 2, 3])
    scheduler.add_request(second)
    out = scheduler.schedule()  # admitted with a tier hit: loads, nothing computed yet
    assert out.num_scheduled_tokens == {}
    assert [t.block_id for t in out.kv_loads] == second.block_ids[0][:2]
    assert second.status is RequestStatus.RUNNING and second.kv_loads_pending == 2
    assert second.num_cached_tokens == 8 and scheduler.prefix_cache_tier_hits_total == 0
    scheduler.update_from_output(out, worker.output(out, worker.execute(out)))
    run(scheduler, worker)  # the poll step brings the loads back, then it runs from 8
    assert second.status is RequestStatus.FINISHED
    assert scheduler.prefix_cache_tier_hits_total == 8  # (counted as the loads came back)
    new = [r for o in worker.outputs for r in o.new_requests if r.request_id == "req-1"]
    assert new[0].num_computed_tokens == 8  # the fake worker checked every K/V it read
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert not tier.in_flight


def test_a_failed_load_sends_the_request_back_to_compute_its_prefix(tmp_path):
    scheduler, worker, shared = evicted_prefix(tmp_path)
    tier = scheduler.block_manager.tier
    r = request(1, shared)
    scheduler.add_request(r)
    out = scheduler.schedule()
    victim = out.kv_loads[1]
    os.unlink(block_path(str(tmp_path), victim.group, victim.key))  # gone under the worker
    scheduler.update_from_output(out, worker.output(out, worker.execute(out)))
    run(scheduler, worker)
    assert r.status is RequestStatus.FINISHED and tier.num_load_failures_total == 1
    # the recomputed block was written again
    assert (victim.group, victim.key) in tier.index
    assert os.path.exists(block_path(str(tmp_path), victim.group, victim.key))
    new = [m for o in worker.outputs for m in o.new_requests if m.request_id == "req-1"]
    assert [m.num_computed_tokens for m in new] == [4]  # the first block loaded, then cached
    assert r.num_cached_tokens == 4
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not tier.in_flight


def test_an_aborted_request_keeps_its_loading_blocks_held_until_every_load_is_back(tmp_path):
    scheduler, worker, shared = evicted_prefix(tmp_path)
    r = request(1, shared)
    scheduler.add_request(r)
    out = scheduler.schedule()
    loading = [t.block_id for t in out.kv_loads]
    scheduler.update_from_output(out, worker.output(out, worker.execute(out)))
    scheduler.abort_request("req-1")
    bm = scheduler.block_manager
    assert all(bm.blocks[b].ref_count == 1 for b in loading)  # the loads' own references
    assert not set(loading) & set(bm.free_block_ids)
    bm.check_invariants(scheduler.requests.values())
    assert not scheduler.has_unfinished_requests() and scheduler.has_work()
    out = scheduler.schedule()  # nothing to compute: the engine's poll step
    result = worker.output(out, worker.execute(out))
    assert sorted(result.kv_loads_done) == sorted(loading) and not result.kv_loads_failed
    scheduler.update_from_output(out, result)
    assert bm.num_free_blocks == bm.num_blocks and not scheduler.has_work()
    assert all(bm.blocks[b].block_hash is not None for b in loading)  # cached all the same


def test_a_new_scheduler_on_the_same_folder_finds_the_blocks(tmp_path):
    """A restart, or a second replica on the folder: the index is rebuilt from disk at start
    and grows from disk on a miss."""
    first = tier_scheduler(tmp_path)
    disk: dict = {}
    worker = tier_worker(first, str(tmp_path), disk)
    shared = prompt(10)
    first.add_request(request(0, shared))
    run(first, worker)
    restarted = tier_scheduler(tmp_path)
    assert restarted.block_manager.tier.index.num_blocks == 2
    replica = tier_scheduler(tmp_path)
    for scheduler in (restarted, replica):
        scheduler.block_manager.tier.index._lru.clear()  # (as if started before the write)
        w = tier_worker(scheduler, str(tmp_path), disk)
        r = request(1, shared)
        scheduler.add_request(r)
        run(scheduler, w)
        assert r.num_cached_tokens == 8 and scheduler.prefix_cache_tier_hits_total == 8
        assert scheduler.block_manager.tier.index.num_found_total == 2


def test_the_index_evicts_the_least_recently_used_blocks_and_their_files(tmp_path):
    scheduler = tier_scheduler(tmp_path, max_blocks=3)
    worker = tier_worker(scheduler, str(tmp_path))
    for i in range(3):
        scheduler.add_request(request(i, prompt(9, base=i + 1)))  # 2 full blocks each
        run(scheduler, worker)
    index = scheduler.block_manager.tier.index
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert index.num_blocks == 3 == len(files) and index.num_evictions_total == 3
    assert index.num_bytes == 3 * BLOCK_BYTES
    # the first two requests' blocks and one of the third's are gone; asking for the first
    # prompt again computes it
    r = request(9, prompt(9, base=1))
    scheduler.add_request(r)
    run(scheduler, worker)
    assert r.num_cached_tokens == 0 or scheduler.prefix_cache_tier_hits_total == 0


def test_a_sliding_window_group_loads_only_the_blocks_its_window_reads(tmp_path):
    index = KVTierIndex([str(tmp_path)], BLOCK_BYTES, 64 * BLOCK_BYTES)
    scheduler = make_scheduler(24, block_size=BS, sliding_windows=(0, 6), max_model_len=32,
                               kv_tier=KVTier(index))
    worker = tier_worker(scheduler, str(tmp_path))
    shared = prompt(17)  # 4 full blocks
    scheduler.add_request(request(0, shared))
    run(scheduler, worker)
    for i in range(4):
        scheduler.add_request(request(10 + i, prompt(16, base=60 + i)))
        run(scheduler, worker)
    r = request(1, shared)
    scheduler.add_request(r)
    hit, n = scheduler.block_manager.get_computed_blocks(r)
    assert n == 16 and hit[0] == [TIER] * 4
    assert hit[1][:2] == [-1, -1] and hit[1][2:] == [TIER, TIER]  # window 6 reads 10 .. 15
    run(scheduler, worker)
    assert r.status is RequestStatus.FINISHED and r.num_cached_tokens == 16
    # tokens, not blocks: 4 positions loaded (in one group or both)
    assert scheduler.prefix_cache_tier_hits_total == 16


def test_rank_reports_are_combined_once_every_rank_answered():
    reports = RankLoadReports(2)
    reports.add([1, 2], [])
    assert reports.take() == ([], [])
    reports.add([1], [2])
    assert reports.take() == ([1], [2])
    reports.add([], [3])
    reports.add([3], [])
    assert reports.take() == ([], [3])


def test_the_tier_needs_prefix_caching_and_room_for_a_block(tmp_path):
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.kv_tier import build_kv_tier
    with pytest.raises(ValueError, match="prefix caching"):
        build_kv_tier([str(tmp_path)], 100, SchedulerConfig(enable_prefix_caching=False))
    with pytest.raises(ValueError, match="kv-offload-size"):
        build_kv_tier([str(tmp_path)], 100, SchedulerConfig(kv_offload_size=99))
    assert build_kv_tier([], 0, SchedulerConfig()) is None


def test_a_block_whose_load_failed_is_not_taken_from_the_disk_again_until_stored(tmp_path):
    """A bad file the worker could not delete must not fail every later lookup."""
    index = KVTierIndex([str(tmp_path)], BLOCK_BYTES, 10 * BLOCK_BYTES)
    key = bytes(range(16))
    path = block_path(str(tmp_path), 0, key)
    os.makedirs(os.path.dirname(path))
    open(path, "wb").close()
    assert index.holds(0, key) and index.num_found_total == 1
    index.discard(0, key)  # its load failed; the file stays
    assert not index.holds(0, key)
    index.add(0, key)  # stored again by this scheduler
    assert index.holds(0, key)


def test_a_block_stored_again_while_its_load_is_in_flight_stays_in_the_index(tmp_path):
    """A request whose first load failed computes its prefix again while the loads of the
    blocks after it are still in flight: those blocks are written again, and their loads
    failing afterwards (the files were as bad) must not drop the new files from the index."""
    index = KVTierIndex([str(tmp_path)], BLOCK_BYTES, 10 * BLOCK_BYTES)
    tier = KVTier(index)
    key = bytes(range(16))
    index.add(0, key)
    waiter = make_request(1, 8)
    tier.start_load(3, 0, key, waiter, (1, 2, 3, 4), b"")
    tier.registered(5, 0, key)  # recomputed in RAM meanwhile
    assert [(t.block_id, t.key) for t in tier.take_transfers()[0]] == [(5, key)]
    assert tier.finished(3, ok=False) is not None
    assert (0, key) in index  # the file being written again is still the tier's
    # without a load in flight, a block the index has is not written twice
    tier.registered(6, 0, key)
    assert tier.take_transfers()[0] == []
    # and a load that fails with no new store still drops the block
    tier.start_load(7, 0, key, waiter, (1, 2, 3, 4), b"")
    tier.finished(7, ok=False)
    assert (0, key) not in index


def test_requests_that_hit_a_prefix_being_loaded_wait_for_that_load(tmp_path):
    """n choices, or two requests admitted together, read the tier's blocks once."""
    scheduler, worker, shared = evicted_prefix(tmp_path)
    a, b = request(1, shared + [1]), request(2, shared + [2])
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert len(out.kv_loads) == 2  # a's two blocks; b waits for the same loads
    assert a.block_ids[0][:2] == b.block_ids[0][:2] and b.kv_loads_pending == 2
    scheduler.update_from_output(out, worker.output(out, worker.execute(out)))
    run(scheduler, worker)
    assert a.num_cached_tokens == b.num_cached_tokens == 8
    assert scheduler.prefix_cache_tier_hits_total == 16  # (8 tokens for each)
    assert scheduler.block_manager.tier.num_loads_total == 2


def test_an_evicted_block_whose_store_was_still_queued_is_deleted_once_written(tmp_path):
    clock = [0.0]
    index = KVTierIndex([str(tmp_path)], BLOCK_BYTES, BLOCK_BYTES, clock=lambda: clock[0])
    old, new = bytes(16), bytes(range(16))
    index.add(0, old)  # its store is queued on the worker: no file yet
    index.add(0, new)  # evicts it before the write lands
    path = block_path(str(tmp_path), 0, old)
    os.makedirs(os.path.dirname(path))
    open(path, "wb").close()  # the write lands
    assert not index.holds(0, old)  # (not taken from the disk: it is evicted)
    index.reap()
    assert not os.path.exists(path) and index.num_blocks == 1
    index.add(0, old)  # (evicts ``new``, whose file never comes)
    clock[0] = 61.0
    index.reap()  # gives up on it
    assert not index._doomed
