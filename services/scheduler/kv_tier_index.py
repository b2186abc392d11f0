"""Which blocks the KV tier on disk holds: the scheduler's index over the workers' folders.

The worker ranks write and read the files (``worker/kv_tier.py``); the scheduler decides what
is loaded and stored, so it keeps the index: one entry per (KV cache group, prefix key), in LRU
order, with the bytes it costs on every rank. It is rebuilt from the folders at start (bounded
in time), grows when the scheduler stores a block, learns of blocks other processes wrote (a
replica on the same folder, the worker before a restart) by looking at the folder on a miss,
and evicts least recently used blocks, deleting their files, to stay under ``max_bytes``.

    rank_dirs: [<dir>/<namespace>/tp0of2, <dir>/<namespace>/tp1of2]   (kv_tier_files.py)
    a block is held when every rank's file of it exists

NOTE: the index may be wrong in both directions (a replica evicted a file, a write failed or
is still queued, a disk was cleaned by hand): a load of a block that is not there fails on the
worker and the request computes it instead (``kv_tier.py``), so it is a hint, never trusted
for the bytes. Torch-free; filesystem calls are ``stat``, ``scandir`` and ``unlink`` only.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable

from services.common.kv_tier_files import block_path, parse_block_name

log = logging.getLogger(__name__)

TierKey = tuple[int, bytes]  # (KV cache group, prefix key)
REAP_SECONDS = 60.0  # how long an evicted block's file is waited for (``KVTierIndex.reap``)


class KVTierIndex:
    """The tier's blocks in LRU order (left = least recently used = evicted first).

    Args:
        rank_dirs: every worker rank's folder (``GetWorkerInfoResponse.kv_offload_path``).
        block_bytes: bytes of one block's file on each rank (their sum is what a block costs).
        max_bytes: the tier's size (``--kv-offload-size``), over every rank's files.
        scan_seconds: the most time the start-up scan may take (the rest is found on misses).
        clock: ``time.monotonic`` (tests pass a fake one).

    Raises:
        ValueError: no rank folder, a block size < 1 or a size smaller than one block.
    """

    def __init__(self, rank_dirs: list[str], block_bytes: int, max_bytes: int,
                 scan_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not rank_dirs or block_bytes < 1:
            raise ValueError(f"the KV tier needs rank folders and a block size, got "
                             f"{rank_dirs} and {block_bytes} bytes")
        if max_bytes < block_bytes * len(rank_dirs):
            raise ValueError(f"--kv-offload-size {max_bytes} is smaller than one block "
                             f"({block_bytes * len(rank_dirs)} bytes over {len(rank_dirs)} "
                             f"ranks)")
        self.rank_dirs = rank_dirs
        self.bytes_per_block = block_bytes * len(rank_dirs)
        self.max_blocks = max_bytes // self.bytes_per_block
        self._lru: OrderedDict[TierKey, None] = OrderedDict()
        # blocks whose load failed: not taken from the disk again (a bad file the worker could
        # not delete would fail every time), until this scheduler stores them itself
        self._bad: set[TierKey] = set()
        # evicted blocks whose files were not there yet (a store still queued on a worker):
        # deleted once they are (``reap``), for up to REAP_SECONDS
        self._doomed: OrderedDict[TierKey, float] = OrderedDict()
        self._clock = clock
        self.num_evictions_total = 0
        self.num_found_total = 0  # blocks found on disk after a miss (another process wrote)
        self.scan_complete = True
        self._scan(scan_seconds, clock)

    def __contains__(self, key: TierKey) -> bool:
        """Whether the index lists (group, key) (no look at the disk)."""
        return key in self._lru

    @property
    def num_blocks(self) -> int:
        return len(self._lru)

    @property
    def num_bytes(self) -> int:
        """Bytes the tier's blocks take on disk, every rank's files."""
        return len(self._lru) * self.bytes_per_block

    def _scan(self, seconds: float, clock: Callable[[], float]) -> None:
        """Index the blocks rank 0's folder holds, oldest first (by file time), for at most
        ``seconds``; over the size the oldest are evicted."""
        deadline = clock() + seconds
        found: list[tuple[float, TierKey]] = []
        try:
            fans = [e for e in os.scandir(self.rank_dirs[0]) if e.is_dir()]
        except OSError:
            fans = []  # (no folder yet: an empty tier)
        for fan in fans:
            try:
                entries = list(os.scandir(fan.path))
            except OSError:
                continue
            for e in entries:
                key = parse_block_name(e.name)
                if key is not None:
                    try:
                        found.append((e.stat().st_mtime, key))
                    except OSError:
                        pass
            if clock() > deadline:
                self.scan_complete = False
                log.warning("KV tier: indexing %s took more than %.1f s; %d blocks indexed, "
                            "the rest are found when looked up", self.rank_dirs[0], seconds,
                            len(found))
                break
        found.sort()
        others = self.rank_dirs[1:]
        for _, key in found:
            if all(os.path.exists(block_path(d, *key)) for d in others):
                self._lru[key] = None
        self._evict_over()

    def holds(self, group: int, key: bytes) -> bool:
        """Whether the tier holds block (``group``, ``key``): in the index, or else on disk on
        every rank (another process wrote it: it joins the index)."""
        k = (group, key)
        if k in self._lru:
            return True
        if k in self._bad or k in self._doomed or not all(os.path.exists(block_path(d, group, key))
                                     for d in self.rank_dirs):
            return False
        self.num_found_total += 1
        self.add(group, key)
        return True

    def touch(self, group: int, key: bytes) -> None:
        """A use of the block (a load): it becomes the most recently used."""
        if (group, key) in self._lru:
            self._lru.move_to_end((group, key))

    def add(self, group: int, key: bytes) -> None:
        """The block is (about to be) written: most recently used; evicts the least recently
        used blocks over the size."""
        self._lru[(group, key)] = None
        self._lru.move_to_end((group, key))
        self._bad.discard((group, key))
        self._doomed.pop((group, key), None)
        self._evict_over()

    def discard(self, group: int, key: bytes) -> None:
        """Forget the block (a load of it failed: gone, torn or foreign) and do not take it
        from the disk again until ``add``; its files stay to whoever wrote them (the worker
        deletes a file it found corrupt)."""
        self._lru.pop((group, key), None)
        if len(self._bad) >= 1 << 16:  # (bounded: forget the oldest reasons to doubt)
            self._bad.clear()
        self._bad.add((group, key))

    def _evict_over(self) -> None:
        while len(self._lru) > self.max_blocks:
            key, _ = self._lru.popitem(last=False)
            self.num_evictions_total += 1
            if not self._unlink(key):
                self._doomed[key] = self._clock()

    def _unlink(self, key: TierKey) -> bool:
        """Delete the block's file on every rank; False when some rank's is not there (not
        written yet, or another replica evicted it)."""
        found = True
        for d in self.rank_dirs:
            try:
                os.unlink(block_path(d, *key))
            except OSError:
                found = False
        return found

    def reap(self) -> None:
        """Delete the files of evicted blocks that have been written since (a store that was
        still queued on a worker when its block was evicted), so the folder stays within the
        size; give up on one after ``REAP_SECONDS`` (another replica deleted it, or the write
        failed). Once a step (``KVTier.take_transfers``)."""
        now = self._clock()
        for key, evicted in list(self._doomed.items()):
            if self._unlink(key) or now - evicted > REAP_SECONDS:
                del self._doomed[key]
