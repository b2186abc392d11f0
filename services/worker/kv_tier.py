"""The worker half of the KV tier on disk (``--kv-offload-dir``): moves blocks' bytes between
this rank's KV cache tensors and block files, on threads that never block the forward.

The scheduler owns the tier's index and decides, with each step, which blocks to store
(``StepInput.kv_stores``, after the forward) and to load (``StepInput.kv_loads``, reported in
a later ``StepOutput.kv_loads_done`` / ``kv_loads_failed``). Files are named by
``services/common/kv_tier_files.py``; the folder of a rank is
``<dir>/<namespace>/tp<rank>of<size>``, the namespace digesting everything that changes a
block's bytes (``kv_tier_namespace``).

A block file::

    offset  size  field
    0       4     MAGIC b"PSKV"
    4       2     FORMAT_VERSION (u16, little-endian)
    6       2     reserved (0)
    8       16    namespace digest (the 32 hex characters as 16 bytes)
    24      16    prefix key
    40      4     KV cache group (u32)
    44      8     payload bytes (u64)
    52      4     zlib.crc32 of the payload (u32)
    56      ...   payload: for each unique cache tensor, in order, tensor[block] as bytes

A block's bytes on a rank are ``tensor[block]`` of every unique K/V tensor (all KV cache
groups share the pool of block ids and the pair tensors; the group is only part of the key).
An int8 / fp8 cache keeps its scales inside the row (``kernels/kv_quant.py``), so they travel.

NOTE: the I/O threads do no torch compute (``server.forward_thread``: each thread that starts
an OpenMP region gets its own libgomp pool); they see numpy arrays and memoryviews only. The
gathers and scatters (``index_select`` / ``index_copy_``) run on the forward thread.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from services.common.kv_tier_files import TMP_SUFFIX, block_path
from services.common.step import KVTransfer

log = logging.getLogger(__name__)

MAGIC = b"PSKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHH16s16sIQI")  # see the module docstring
MAX_PENDING_BYTES = 256 << 20  # stores queued for the writer beyond which a step's are dropped
_DIGEST_SPAN = 1 << 20  # bytes hashed at each end of a model file (kv_tier_namespace)

LOAD_FAILURES = ("missing", "truncated", "corrupt", "foreign", "error")


class KVTierMetrics(Protocol):
    """What the tier reports (``services/worker/metrics.py``'s ``KVTierMetrics``)."""

    def observe_store(self, seconds: float) -> None: ...
    def observe_load(self, seconds: float) -> None: ...
    def store_failed(self, reason: str) -> None: ...
    def load_failed(self, reason: str) -> None: ...
    def stores_dropped(self, n: int) -> None: ...
    def set_writes_enabled(self, enabled: bool) -> None: ...


@dataclass(slots=True)
class _Stores:
    """One step's stores for the writer: per transfer, per tensor, its block's bytes."""

    transfers: list[KVTransfer]
    parts: list[np.ndarray]  # per unique tensor: [n, bytes per block] uint8
    nbytes: int


class KVTier:
    """Stores and loads this rank's KV blocks as files under ``rank_dir``.

    Args:
        rank_dir: this rank's folder (``<--kv-offload-dir>/<namespace>/tp<rank>of<size>``),
            made here if missing.
        namespace: ``kv_tier_namespace``'s 32 hex characters, written in every header.
        tensors: the unique KV cache tensors, in a fixed order, each
            ``[num_blocks, block_size, num_kv_heads, kv_row]`` (any dtype, contiguous).
        max_pending_bytes: stores waiting for the writer beyond which a step's are dropped.
        metrics: where to count (None: nowhere); may be set later (``metrics`` attribute).

    Raises:
        OSError: ``rank_dir`` cannot be made.
    """

    def __init__(self, rank_dir: str, namespace: str, tensors: Sequence[torch.Tensor], *,
                 max_pending_bytes: int = MAX_PENDING_BYTES,
                 metrics: KVTierMetrics | None = None) -> None:
        os.makedirs(rank_dir, exist_ok=True)
        self.rank_dir = rank_dir
        self.namespace = bytes.fromhex(namespace)
        assert len(self.namespace) == 16, "the namespace is 32 hex characters"
        self.tensors = list(tensors)
        assert all(t.is_contiguous() for t in self.tensors)
        self._part_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.payload_bytes = sum(self._part_bytes)
        self.block_bytes = HEADER.size + self.payload_bytes  # one file's size
        self.metrics = metrics
        self.writes_enabled = True
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0  # (guarded by _lock)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._staged: list[tuple[int, np.ndarray]] = []  # loaded (block id, payload)
        self._failed: list[int] = []  # block ids of failed loads
        self._loading = 0  # loads started and not yet staged or failed
        self._logged_reasons: set[str] = set()
        self._unique = 0  # for temporary names
        self._writes: queue.Queue[_Stores | None] = queue.Queue()
        self._reads: queue.Queue[list[KVTransfer] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer",
                                        daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="kv-tier-reader",
                                        daemon=True)
        self._writer.start()
        self._reader.start()

    # ---- the forward thread ----------------------------------------------------------------

    def store(self, transfers: Sequence[KVTransfer], skip_block_ids: Iterable[int] = ()) -> int:
        """Queue ``transfers``' blocks for writing, after the step's forward wrote them.

        The blocks' bytes are gathered now (one ``index_select`` per tensor), so the cache may
        change afterwards. Nothing is queued while writing is off; a step's stores that would
        take the queue past ``max_pending_bytes`` are dropped and counted (never blocking).

        Returns:
            How many blocks were queued.
        """
        skip = set(skip_block_ids)
        todo = [t for t in transfers if t.block_id not in skip]
        if not todo or not self.writes_enabled:
            return 0
        nbytes = len(todo) * self.payload_bytes
        with self._lock:
            fits = self._pending_bytes + nbytes <= self.max_pending_bytes
            if fits:
                self._pending_bytes += nbytes
        if not fits:
            if self.metrics is not None:
                self.metrics.stores_dropped(len(todo))
            return 0
        index = torch.tensor([t.block_id for t in todo], dtype=torch.int64,
                             device=self.tensors[0].device)
        # [n, block_size, heads, row] -> [n, bytes] uint8 on the CPU (a copy: the cache may
        # change once the forward thread moves on)
        parts = [t.index_select(0, index).cpu().view(torch.uint8).reshape(len(todo), -1).numpy()
                 for t in self.tensors]
        self._writes.put(_Stores(todo, parts, nbytes))
        return len(todo)

    def start_loads(self, transfers: Sequence[KVTransfer]) -> None:
        """Start reading ``transfers``' files (their blocks are applied by ``apply_ready``)."""
        if not transfers:
            return
        with self._lock:
            self._loading += len(transfers)
        self._reads.put(list(transfers))

    def apply_ready(self, wait_s: float = 0.0) -> tuple[list[int], list[int]]:
        """Copy every staged block into the cache tensors (one ``index_copy_`` per tensor);
        call before the step's forward.

        Args:
            wait_s: with loads pending and none finished, wait up to this long (seconds) for
                one (an otherwise empty step polls without spinning); 0 = never wait.

        Returns:
            ``(done, failed)`` block ids: the loads now in the cache, and those that failed
            (their blocks' contents undefined).
        """
        with self._ready:
            if wait_s > 0 and self._loading and not self._staged and not self._failed:
                self._ready.wait(wait_s)
            staged, self._staged = self._staged, []
            failed, self._failed = self._failed, []
        if staged:
            self._scatter(staged)
        return [b for b, _ in staged], failed

    def _scatter(self, staged: list[tuple[int, np.ndarray]]) -> None:
        """Copy the staged payloads (``[payload_bytes]`` uint8 each) into their blocks."""
        device = self.tensors[0].device
        payloads = np.stack([p for _, p in staged])  # [n, payload_bytes] uint8
        index = torch.tensor([b for b, _ in staged], dtype=torch.int64, device=device)
        offset = 0
        for t, size in zip(self.tensors, self._part_bytes, strict=True):
            part = torch.from_numpy(np.ascontiguousarray(payloads[:, offset:offset + size]))
            # [n, size] uint8 -> [n, block_size, heads, row] in the cache's dtype
            t.index_copy_(0, index, part.to(device).view(t.dtype).view(-1, *t.shape[1:]))
            offset += size

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` seconds for the queued writes; True when none is left."""
        with self._ready:
            return self._ready.wait_for(lambda: self._pending_bytes == 0, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the threads: finish the queued writes (up to ``timeout`` seconds), drop the
        loads not started."""
        self._writes.put(None)
        self._reads.put(None)
        self._writer.join(timeout)
        self._reader.join(timeout)

    # ---- the writer thread ------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            try:
                if self.writes_enabled:
                    for i, tr in enumerate(item.transfers):
                        if not self._write_block(tr, [p[i] for p in item.parts]):
                            break
            finally:
                with self._ready:
                    self._pending_bytes -= item.nbytes
                    self._ready.notify_all()

    def _write_block(self, tr: KVTransfer, parts: list[np.ndarray]) -> bool:
        """Write one block's file unless it exists; False once writing is turned off.

        NOTE: a temporary name, then ``os.replace``: concurrent writers of one block (another
        rank's restart, another worker on the same folder) never expose a half-written file.
        No fsync: a file torn by a crash fails its checksum and is deleted by its reader.
        """
        path = block_path(self.rank_dir, tr.group, tr.key)
        if os.path.exists(path):
            return True
        t0 = time.perf_counter()
        crc = 0
        for p in parts:
            crc = zlib.crc32(p.data, crc)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, self.namespace, tr.key, tr.group,
                             self.payload_bytes, crc)
        self._unique += 1
        tmp = f"{path}.{os.getpid()}-{threading.get_ident()}-{self._unique}{TMP_SUFFIX}"
        try:
            folder = os.path.dirname(path)
            if not os.path.isdir(folder):
                # NOTE: mkdir, not makedirs: a vanished rank folder turns writing off
                # instead of being made again under whatever removed it
                try:
                    os.mkdir(folder)
                except FileExistsError:
                    pass
            with open(tmp, "wb") as f:
                f.write(header)
                for p in parts:
                    f.write(p.data)
            os.replace(tmp, path)
        except OSError as e:
            self._writes_off(e, tmp)
            return False
        if self.metrics is not None:
            self.metrics.observe_store(time.perf_counter() - t0)
        return True

    def _writes_off(self, e: OSError, tmp: str) -> None:
        """Turn writing off after ``e`` (disk full, read-only, no permission, the folder
        gone...), with one warning; serving goes on, loads too."""
        self.writes_enabled = False
        reason = errno.errorcode.get(e.errno or 0, "error")
        log.warning("KV tier: writing to %s turned off: %s (blocks are no longer stored on "
                    "disk; loads go on)", self.rank_dir, e)
        if self.metrics is not None:
            self.metrics.store_failed(reason)
            self.metrics.set_writes_enabled(False)
        try:
            os.remove(tmp)
        except OSError:
            pass

    # ---- the reader thread ------------------------------------------------------------------

    def _read_loop(self) -> None:
        while (transfers := self._reads.get()) is not None:
            for tr in transfers:
                t0 = time.perf_counter()
                payload, reason, read = self._read_block(tr)
                # (counted, and a bad file deleted, before the outcome is reported: the
                # scheduler may store the block again at once)
                if payload is None:
                    self._load_failed(tr, reason, read)
                elif self.metrics is not None:
                    self.metrics.observe_load(time.perf_counter() - t0)
                with self._ready:
                    self._loading -= 1
                    if payload is not None:
                        self._staged.append((tr.block_id, payload))
                    else:
                        self._failed.append(tr.block_id)
                    self._ready.notify_all()

    def _read_block(self, tr: KVTransfer
                    ) -> tuple[np.ndarray | None, str, tuple[int, int] | None]:
        """Read and check one block's file: ``(payload, "", file)``, or ``(None, reason,
        file)``, the reason one of ``LOAD_FAILURES``; ``file`` is the (device, inode) of the
        file read (None: none opened)."""
        path = block_path(self.rank_dir, tr.group, tr.key)
        read = None
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                read = (st.st_dev, st.st_ino)
                head = f.read(HEADER.size)
                if len(head) < HEADER.size:
                    return None, "truncated", read
                magic, version, _, namespace, key, group, length, crc = HEADER.unpack(head)
                if magic != MAGIC:
                    return None, "corrupt", read
                if (version != FORMAT_VERSION or namespace != self.namespace or key != tr.key
                        or group != tr.group or length != self.payload_bytes):
                    return None, "foreign", read
                payload = np.empty(length, dtype=np.uint8)
                n = f.readinto(payload.data)
                if n < length:
                    return None, "truncated", read
                if f.read(1):
                    return None, "corrupt", read
        except FileNotFoundError:
            return None, "missing", read
        except OSError as e:
            log.debug("KV tier: reading %s: %s", path, e)
            return None, "error", read
        if zlib.crc32(payload.data) != crc:
            return None, "corrupt", read
        return payload, "", read

    def _load_failed(self, tr: KVTransfer, reason: str, read: tuple[int, int] | None) -> None:
        """Count a failed load, log its reason once, and delete the bad file read (``read``:
        its device and inode; best effort), not one renamed into its place since (the
        scheduler may store the block again while its load is in flight)."""
        path = block_path(self.rank_dir, tr.group, tr.key)
        if self.metrics is not None:
            self.metrics.load_failed(reason)
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            log.warning("KV tier: a block file failed to load (%s): %s; further %s files are "
                        "counted, not logged (pagedserve:kv_offload_load_failures_total)",
                        reason, path, reason)
        if reason in ("truncated", "corrupt", "foreign"):
            try:
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == read:
                    os.remove(path)
            except OSError:
                pass


def rank_dir(offload_dir: str, namespace: str, rank: int, size: int) -> str:
    """This rank's folder of the tier: ``<offload_dir>/<namespace>/tp<rank>of<size>``."""
    return os.path.join(offload_dir, namespace, f"tp{rank}of{size}")


def model_files_digest(path: str) -> list[dict[str, Any]]:
    """Per file of a model (``path``: a ``.gguf`` file, or a folder's regular files, sorted by
    name, hidden ones left out): name, size and the sha256 of its first and last MiB (the
    whole file when under 2 MiB).

    NOTE: cheap for a 270 MB checkpoint (2 MiB read per file) and it catches a re-export, a
    re-quantisation or an edited config; a change confined to a large file's middle, keeping
    its size, is not seen (the file's size and both ends would have to survive it).
    """
    files = ([path] if os.path.isfile(path) else
             [os.path.join(path, n) for n in sorted(os.listdir(path))
              if not n.startswith(".") and os.path.isfile(os.path.join(path, n))])
    out = []
    for name in files:
        size = os.path.getsize(name)
        h = hashlib.sha256()
        with open(name, "rb") as f:
            h.update(f.read(_DIGEST_SPAN))
            if size > 2 * _DIGEST_SPAN:
                f.seek(size - _DIGEST_SPAN)
            h.update(f.read())
        out.append({"name": os.path.basename(name), "size": size, "sha256": h.hexdigest()})
    return out


def kv_tier_namespace(description: dict[str, Any]) -> str:
    """32 hex characters digesting ``description`` (JSON-able: everything that changes a
    block's bytes; ``kv_tier_step.kv_tier_description``) with ``FORMAT_VERSION``: the sha256
    of its canonical JSON (sorted keys, no spaces), truncated."""
    text = json.dumps({"format_version": FORMAT_VERSION, **description}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]
