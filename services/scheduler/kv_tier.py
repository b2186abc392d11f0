"""The scheduler's half of the KV tier on disk (``--kv-offload-dir``): what the next step loads
and stores, and the loads in flight (vLLM's offloading connector splits it the same way: the
scheduler decides, the worker moves the bytes: ``worker/kv_tier.py``).

    admission: prefix hit = RAM blocks, then blocks the tier holds (BlockManager, TIER entries)
        -> each tier block gets a fresh KV block, held twice: by the request's table and by
           the load, and a KVTransfer in the next step's ``kv_loads``
        -> the request waits (``Request.kv_loads_pending``); the step loop does not; a hit on
           a block still loading waits for that load (``join``): a prefix is read once
    StepOutput.kv_loads_done / kv_loads_failed (every rank has answered: WorkerGroup)
        -> done: the block joins the RAM prefix cache under its key; failed: the index forgets
           the key; either way the load's reference goes
        -> when a request's last load is back it runs, from its whole hit (counted as hits
           then), or (one failed) looks its prefix up again in place (``kv_tier_loads.py``)
    a block registered in the RAM prefix cache (computed by the step that registers it) and
    not in the index -> a KVTransfer in that step's ``kv_stores`` (the worker writes it after
    the forward, off the forward's thread)

NOTE: the load's reference keeps a loading block off the free list until every rank has
answered, even when its request is aborted or preempted meanwhile: a rank may still write the
file's bytes into it, so it must not be handed to anyone else before.
Torch-free.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass

from services.common.step import KVTransfer
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_tier_index import KVTierIndex
from services.scheduler.request import Request

TIER = -2  # a prefix hit's entry for a block the tier holds (``BlockManager``: to be loaded)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierLoad:
    """A block being read from the tier into a KV block: the requests whose hits wait for it
    (with the epoch of the admission each waits in) and what it will hold once read."""

    waiters: list[tuple[Request, int]]
    group: int
    key: bytes
    token_ids: tuple[int, ...]
    parent_hash: bytes
    started: float  # time.monotonic() when scheduled
    # the block was registered in RAM and stored while this load was in flight: its file is
    # being written again, so a failure of this load must not drop it from the index
    rewritten: bool = False


class KVTier:
    """The transfers of the next step and the loads in flight.

    Args:
        index: the blocks the tier holds.
        clock: ``time.monotonic`` (tests pass a fake one).
    """

    def __init__(self, index: KVTierIndex, clock=time.monotonic) -> None:
        self.index = index
        self.clock = clock
        self.stores: list[KVTransfer] = []  # for the next step
        self.loads: list[KVTransfer] = []  # for the next step
        self.in_flight: dict[int, TierLoad] = {}  # KV block id -> its load
        self.loading: dict[tuple[int, bytes], int] = {}  # (group, key) -> KV block id
        self.num_stores_total = 0
        self.num_loads_total = 0
        self.num_load_failures_total = 0
        # per load back, for the metrics (drained by them; bounded when nobody does)
        self.load_wait_seconds: deque[float] = deque(maxlen=4096)

    def holds(self, group: int, key: bytes) -> bool:
        return self.index.holds(group, key)

    def loading_block(self, group: int, key: bytes, parent_hash: bytes,
                      token_ids: tuple[int, ...]) -> int | None:
        """The KV block a load of (``group``, ``key``) is filling, when it holds exactly these
        tokens after ``parent_hash``: a hit on it waits for that load (``join``) instead of
        reading the file again. None: no such load."""
        block_id = self.loading.get((group, key))
        if block_id is None:
            return None
        load = self.in_flight[block_id]
        return (block_id if (load.parent_hash, load.token_ids) == (parent_hash, token_ids)
                else None)

    def join(self, block_id: int, request: Request) -> None:
        """``request``'s hit takes KV block ``block_id``, still loading: it waits for it too."""
        self.in_flight[block_id].waiters.append((request, request.epoch))
        request.kv_loads_pending += 1

    def start_load(self, block_id: int, group: int, key: bytes, request: Request,
                   token_ids: tuple[int, ...], parent_hash: bytes) -> None:
        """Read block (``group``, ``key``) into KV block ``block_id`` for ``request`` (the
        caller holds the block for the load)."""
        self.in_flight[block_id] = TierLoad([(request, request.epoch)], group, key, token_ids,
                                            parent_hash, self.clock())
        self.loading[(group, key)] = block_id
        self.loads.append(KVTransfer(block_id, group, key))
        self.index.touch(group, key)
        request.kv_loads_pending += 1
        self.num_loads_total += 1

    def registered(self, block_id: int, group: int, key: bytes) -> None:
        """KV block ``block_id`` joined the RAM prefix cache under (``group``, ``key``) and is
        computed by the step being scheduled: write it, unless the index has it and no load of
        it is in flight (that load may yet fail: a request that gave up waiting for it
        computed the block again, and its file must be written again)."""
        loading = self.loading.get((group, key))
        if loading is None and (group, key) in self.index:
            return
        if loading is not None:
            self.in_flight[loading].rewritten = True
        self.index.add(group, key)
        self.stores.append(KVTransfer(block_id, group, key))
        self.num_stores_total += 1

    def take_transfers(self) -> tuple[list[KVTransfer], list[KVTransfer]]:
        """The next step's (stores, loads); empties both. (Once a step: the index deletes the
        files of blocks it evicted before their writes landed, ``KVTierIndex.reap``.)"""
        self.index.reap()
        stores, loads = self.stores, self.loads
        self.stores, self.loads = [], []
        return stores, loads

    def finished(self, block_id: int, ok: bool) -> TierLoad | None:
        """The load into ``block_id`` is back from every rank (``ok``: the data is in the
        block). Returns its record (None for a block with no load: a stale report); a failed
        block's key leaves the index."""
        load = self.in_flight.pop(block_id, None)
        if load is None:
            return None
        if self.loading.get((load.group, load.key)) == block_id:
            del self.loading[(load.group, load.key)]
        if not ok:
            self.num_load_failures_total += 1
            if not load.rewritten:
                self.index.discard(load.group, load.key)
        self.load_wait_seconds.append(self.clock() - load.started)
        return load

    def abandon(self) -> list[int]:
        """Forget every load in flight and transfer not sent (the workers were lost);
        returns the KV blocks the loads held."""
        blocks = list(self.in_flight)
        self.in_flight.clear()
        self.loading.clear()
        self.stores, self.loads = [], []
        return blocks


def tier_tokens(hit: Sequence[Sequence[int]], block_size: int,
                loading: Container[int] = ()) -> int:
    """Tokens of a prefix hit (one table per KV cache group) that the tier supplies: the
    positions where some group's block is to be loaded (``TIER``) or is ``loading``."""
    return block_size * sum(1 for column in zip(*hit, strict=True)
                            if any(b == TIER or b in loading for b in column))


def build_kv_tier(rank_dirs: list[str], block_bytes: int, config: SchedulerConfig
                  ) -> KVTier | None:
    """The tier over the folders the worker ranks report (``WorkerGroup.kv_tier_folders``),
    indexed from disk, and its start-up log line; None when they run none.

    Raises:
        ValueError: prefix caching is off (the tier extends prefix hits), or the size is
            smaller than one block.
    """
    if not rank_dirs:
        return None
    if not config.enable_prefix_caching:
        raise ValueError("the workers run a KV tier (--kv-offload-dir), which needs prefix "
                         "caching: drop --no-enable-prefix-caching")
    t0 = time.monotonic()
    index = KVTierIndex(rank_dirs, block_bytes, config.kv_offload_size)
    log.info("KV tier on disk: %s (%d ranks), --kv-offload-size %.1f GiB = %d blocks of %d "
             "bytes; %d blocks (%.1f MiB) found in %.2f s%s",
             os.path.dirname(rank_dirs[0]), len(rank_dirs), config.kv_offload_size / 2**30,
             index.max_blocks, index.bytes_per_block, index.num_blocks,
             index.num_bytes / 2**20, time.monotonic() - t0,
             "" if index.scan_complete else " (stopped early: the rest is found on lookup)")
    return KVTier(index)


class RankLoadReports:
    """Every rank's load reports combined: a load is back once each of ``num_ranks`` ranks
    has reported it (they read their own files, at their own pace), failed if any failed.

    NOTE: not before: a rank still reading would write the file's bytes into a block that
    may be handed to another request once the load is reported.
    """

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._seen: dict[int, list] = {}  # block id -> [ranks reported, any failed]

    def add(self, done: list[int], failed: list[int]) -> None:
        """One rank's ``kv_loads_done`` and ``kv_loads_failed`` of one step."""
        for block_id, ok in [(b, True) for b in done] + [(b, False) for b in failed]:
            seen = self._seen.setdefault(block_id, [0, False])
            seen[0] += 1
            seen[1] |= not ok

    def take(self) -> tuple[list[int], list[int]]:
        """The loads every rank has reported since the last call: (done, failed)."""
        done: list[int] = []
        failed: list[int] = []
        for block_id, (n, bad) in list(self._seen.items()):
            if n >= self.num_ranks:
                (failed if bad else done).append(block_id)
                del self._seen[block_id]
        return done, failed
