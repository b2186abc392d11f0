"""KV events (vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``): the prefix
cache's changes, batched per engine step, for routers that route on what each replica holds.

The ``BlockManager`` reports every change of ``cached_blocks`` to its ``events`` log (None, the
default: events off, nothing is recorded):

- ``stored``: a block joined the cache (``_cache_full_blocks``: registered when allocated for a
  step; ``finish_load``: a KV tier load landed in RAM, announced like any other block: the
  tier's own files are not published, only what the RAM cache holds);
- ``removed``: a block left it (``_evict``: allocation reused a free cached block, a request
  the workers left out was forgotten, prefix caching off);
- ``cleared``: ``reset_prefix_cache`` (the workers restarted).

Consecutive ``stored`` blocks of one chain (same group and adapter, each the parent of the
next: one request's blocks) merge into one event, as vLLM's do. The engine calls ``flush``
once per step (after ``update_from_output``) and after any change outside a step (a worker
failure's reset; before it idles): the pending events become one ``KvEventBatch`` with the
next sequence number (from 0; none for a step that changed nothing), kept in a ring buffer of
``buffer_steps`` batches, put on every gRPC subscriber's queue and handed to the publishers
(ZMQ: ``kv_events_zmq.py``).

    step:    schedule() ... update_from_output()  flush -> batch seq 7 [Stored(a,b,c), Removed(x)]
    gRPC:    subscribe(start 5, same publisher_id) -> batches 5, 6 from the buffer, then live
             subscribe(no start / too old / another publisher_id) -> snapshot (seq 7), then 8..

A snapshot is ``AllBlocksCleared`` then one ``BlockStored`` per block of ``cached_blocks``
(read directly, not rebuilt from events), parents first, carrying the sequence number of the
last batch it includes: pending events are flushed first, so the next live batch is
``sequence_number + 1``. Everything here runs on the engine's event loop thread (the gRPC
servicer shares it), so a snapshot and the sequence numbers agree. ``publisher_id`` is random
per process: sequence numbers compare only within one.

Hashes are ``external_block_hash`` of the 16-byte keys (64-bit ints); a first block's parent is
unset; every KV cache group is published (``group_idx``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Protocol

from services.common.block_hash import BlockHash, external_block_hash
from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import engine_pb2
from services.scheduler.kv_events_config import KVEventsConfig
from services.scheduler.kv_events_zmq import ZmqEventPublisher

log = logging.getLogger(__name__)
CacheKey = tuple[int, BlockHash]  # (KV cache group, 16-byte prefix key)


def medium_of(device: str) -> str:
    """The ``medium`` of the blocks the workers hold: ``"GPU"`` (vLLM's name) for a CUDA KV
    cache (GetWorkerInfo's ``device``), else ``"CPU"``."""
    return "GPU" if device.startswith("cuda") else "CPU"


class CachedBlock(Protocol):
    """What a snapshot reads of a block in the prefix cache (``block_manager.Block``)."""

    token_ids: tuple[int, ...] | None
    parent_hash: BlockHash | None


class Publisher(Protocol):
    """Where flushed batches also go (``kv_events_zmq.ZmqEventPublisher``)."""

    def publish(self, batch: engine_pb2.KvEventBatch) -> None: ...

    def close(self) -> None: ...


class KVEventSubscription:
    """One gRPC subscriber's live batches: a bounded queue; ``None`` ends the stream, with
    ``cut_off`` set when the subscriber fell ``maxsize`` batches behind."""

    def __init__(self, maxsize: int) -> None:
        self.queue: asyncio.Queue[engine_pb2.KvEventBatch | None] = asyncio.Queue(maxsize)
        self.cut_off = False


class KVEventLog:
    """The prefix cache's change log (see the module docstring).

    Args:
        block_size: tokens per block (every ``BlockStored`` carries it).
        medium: ``medium_of`` the workers' device.
        buffer_steps: batches kept for replay (>= 1).
        max_queue_size: batches a gRPC subscriber may lag before it is cut off (>= 1).
        clock: the batches' ``ts`` (Unix seconds); tests pass a fake one.
    """

    def __init__(self, block_size: int, medium: str = "GPU", buffer_steps: int = 10_000,
                 max_queue_size: int = 100_000, clock=time.time) -> None:
        if buffer_steps < 1 or max_queue_size < 1:
            raise ValueError(f"buffer_steps and max_queue_size must be >= 1, got "
                             f"{buffer_steps} and {max_queue_size}")
        self.block_size = block_size
        self.medium = medium
        self.max_queue_size = max_queue_size
        self.publisher_id = secrets.token_hex(8)
        self.next_sequence_number = 0
        self.publishers: list[Publisher] = []
        self.num_cut_off_total = 0  # subscribers cut off for falling behind
        self._clock = clock
        self._pending: list[engine_pb2.KvEvent] = []
        self._buffer: deque[engine_pb2.KvEventBatch] = deque(maxlen=buffer_steps)
        self._subscribers: set[KVEventSubscription] = set()
        self._lora_names: dict[CacheKey, str] = {}  # cached blocks of an adapter (snapshots)

    # ---- changes, from the BlockManager ---------------------------------------------------
    def stored(self, key: CacheKey, parent: BlockHash | None, token_ids: Iterable[int],
               lora: LoRARequest | None) -> None:
        """Block ``key`` (holding ``token_ids``, after the block keyed ``parent``; b"" or None
        for a first block), computed with adapter ``lora``, joined the prefix cache."""
        group, h = key[0], external_block_hash(key[1])
        parent_h = external_block_hash(parent) if parent else None
        name = lora.name if lora is not None else ""
        if name:
            self._lora_names[key] = name
        last = self._pending[-1] if self._pending else None
        if last is not None and last.WhichOneof("event") == "block_stored":
            s = last.block_stored
            if (parent_h is not None and s.block_hashes[-1] == parent_h
                    and s.group_idx == group and s.lora_name == name):
                s.block_hashes.append(h)  # (the next block of the same chain)
                s.token_ids.extend(token_ids)
                return
        event = engine_pb2.KvBlockStored(
            block_hashes=[h], token_ids=token_ids, block_size=self.block_size, lora_name=name,
            medium=self.medium, group_idx=group)
        if parent_h is not None:
            event.parent_block_hash = parent_h
        self._pending.append(engine_pb2.KvEvent(block_stored=event))

    def removed(self, key: CacheKey) -> None:
        """Block ``key`` left the prefix cache."""
        self._lora_names.pop(key, None)
        h = external_block_hash(key[1])
        last = self._pending[-1] if self._pending else None
        if last is not None and last.WhichOneof("event") == "block_removed" and (
                last.block_removed.group_idx == key[0]):
            last.block_removed.block_hashes.append(h)
            return
        self._pending.append(engine_pb2.KvEvent(block_removed=engine_pb2.KvBlockRemoved(
            block_hashes=[h], medium=self.medium, group_idx=key[0])))

    def cleared(self) -> None:
        """The whole prefix cache was dropped."""
        self._lora_names.clear()
        self._pending.append(engine_pb2.KvEvent(
            all_blocks_cleared=engine_pb2.KvAllBlocksCleared()))

    # ---- batches --------------------------------------------------------------------------
    def flush(self) -> engine_pb2.KvEventBatch | None:
        """The pending events as the next batch (None: nothing changed since the last one),
        buffered and sent to every subscriber and publisher."""
        if not self._pending:
            return None
        batch = engine_pb2.KvEventBatch(
            sequence_number=self.next_sequence_number, ts=self._clock(), events=self._pending,
            publisher_id=self.publisher_id)
        self._pending = []
        self.next_sequence_number += 1
        self._buffer.append(batch)
        for sub in list(self._subscribers):
            self._offer(sub, batch)
        for publisher in self.publishers:
            publisher.publish(batch)
        return batch

    def snapshot(self, cached: Mapping[CacheKey, CachedBlock]) -> engine_pb2.KvEventBatch:
        """The prefix cache ``cached`` (the BlockManager's ``cached_blocks``) as one batch
        (``snapshot`` set): AllBlocksCleared, then one BlockStored per block, every block after
        its parent when its parent is cached too. Flushes first, so it carries the sequence
        number of the last batch (-1 before the first). O(cached blocks)."""
        self.flush()
        children: dict[CacheKey, list[CacheKey]] = {}
        order: deque[CacheKey] = deque()
        for key, block in cached.items():
            parent = (key[0], block.parent_hash or b"")
            if block.parent_hash and parent in cached:
                children.setdefault(parent, []).append(key)
            else:
                order.append(key)  # (a root: a first block, or its parent was evicted)
        events = [engine_pb2.KvEvent(all_blocks_cleared=engine_pb2.KvAllBlocksCleared())]
        while order:
            key = order.popleft()
            order.extend(children.get(key, ()))
            block = cached[key]
            stored = engine_pb2.KvBlockStored(
                block_hashes=[external_block_hash(key[1])], token_ids=block.token_ids or (),
                block_size=self.block_size, lora_name=self._lora_names.get(key, ""),
                medium=self.medium, group_idx=key[0])
            if block.parent_hash:
                stored.parent_block_hash = external_block_hash(block.parent_hash)
            events.append(engine_pb2.KvEvent(block_stored=stored))
        return engine_pb2.KvEventBatch(
            sequence_number=self.next_sequence_number - 1, ts=self._clock(), events=events,
            snapshot=True, publisher_id=self.publisher_id)

    # ---- gRPC subscribers -----------------------------------------------------------------
    def subscribe(self, start: int | None, publisher_id: str,
                  cached: Mapping[CacheKey, CachedBlock]
                  ) -> tuple[KVEventSubscription, list[engine_pb2.KvEventBatch]]:
        """A new subscriber: its live queue, and the batches to send before it: the buffered
        batches from sequence number ``start`` on when ``publisher_id`` is this log's and
        ``start`` is still buffered (or the next one), else a snapshot of ``cached``."""
        initial = None
        if start is not None and publisher_id == self.publisher_id:
            oldest = self._buffer[0].sequence_number if self._buffer else (
                self.next_sequence_number)
            if oldest <= start <= self.next_sequence_number:
                initial = list(itertools.islice(self._buffer, start - oldest, None))
        if initial is None:
            initial = [self.snapshot(cached)]
        sub = KVEventSubscription(self.max_queue_size)
        self._subscribers.add(sub)
        return sub, initial

    def unsubscribe(self, sub: KVEventSubscription) -> None:
        """The subscriber's stream ended."""
        self._subscribers.discard(sub)

    def _offer(self, sub: KVEventSubscription, batch: engine_pb2.KvEventBatch) -> None:
        try:
            sub.queue.put_nowait(batch)
        except asyncio.QueueFull:  # too far behind: cut off (it reconnects with a replay)
            self._subscribers.discard(sub)
            sub.cut_off = True
            self.num_cut_off_total += 1
            while not sub.queue.empty():
                sub.queue.get_nowait()
            sub.queue.put_nowait(None)
            log.warning("KV event subscriber cut off: %d batches behind", self.max_queue_size)

    def close(self) -> None:
        """End every subscriber's stream (normally) and close the publishers."""
        for sub in self._subscribers:
            if sub.queue.full():  # (a lagging one loses its oldest batch: it resyncs anyway)
                sub.queue.get_nowait()
            sub.queue.put_nowait(None)
        self._subscribers.clear()
        for publisher in self.publishers:
            publisher.close()


def build_kv_event_log(config: KVEventsConfig | None, block_size: int, device: str
                       ) -> KVEventLog | None:
    """The event log ``--kv-events-config`` asks for (None: events off), with a ZMQ publisher
    for ``publisher: "zmq"`` (it binds or connects its sockets now), for workers on
    ``device`` (GetWorkerInfo's: the events' ``medium``).

    Raises:
        ValueError: a ZMQ endpoint cannot be bound (e.g. the port is taken), naming the flag.
    """
    if config is None or not config.enable_kv_cache_events:
        return None
    events = KVEventLog(block_size, medium_of(device), config.buffer_steps,
                        config.max_queue_size)
    if config.publisher == "zmq":
        events.publishers.append(ZmqEventPublisher(config))
    return events
