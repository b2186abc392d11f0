"""The KV events on ZMQ, as vLLM's ``ZmqEventPublisher`` sends them
(``vllm/distributed/kv_events.py``), so a subscriber written for vLLM
(``examples/online_serving/kv_events_subscriber.py``) reads ours unchanged.

Wire format (``--kv-events-config`` ``endpoint`` / ``replay_endpoint`` / ``topic``):

- PUB: one multipart message per batch, ``[topic, seq, payload]``: ``seq`` 8 bytes big-endian
  (the batch's ``sequence_number``: the same numbers as the gRPC stream), ``payload`` msgpack of
  vLLM's msgspec structs in their array layout (``array_like=True, omit_defaults=True,
  tag=True``)::

      batch   = [ts, [event, ...], data_parallel_rank (0)]
      event   = ["BlockStored", block_hashes, parent_block_hash | None, token_ids, block_size,
                 lora_id (None), medium, lora_name | None, extra_keys (None), group_idx]
              | ["BlockRemoved", block_hashes, medium, group_idx]
              | ["AllBlocksCleared"]

  A decoder of vLLM's older structs (up to ``medium``) ignores the trailing elements (msgspec
  reads an array-like struct's known prefix).
- ROUTER (replay): a REQ or DEALER client sends the first sequence number it wants (8 bytes
  big-endian); it gets one ``[seq, payload]`` message per buffered batch from there on, then
  ``[-1 (8 bytes, signed), b""]``. (As vLLM's: a REQ socket takes only the first of them per
  request; a DEALER takes all.)

The sockets live on a thread of their own (vLLM's design): ``publish`` only queues the batch.
A full queue (``max_queue_size``: the thread is stuck) drops the batch with a warning rather
than block the engine loop (vLLM's blocks); a subscriber sees the gap in ``seq``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgpack  # type: ignore[import-untyped]
import zmq

from services.common.pb.pagedserve.v1 import engine_pb2
from services.scheduler.kv_events_config import KVEventsConfig

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _event_array(event: engine_pb2.KvEvent) -> list:
    kind = event.WhichOneof("event")
    if kind == "block_stored":
        s = event.block_stored
        parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
        return ["BlockStored", list(s.block_hashes), parent, list(s.token_ids), s.block_size,
                None, s.medium, s.lora_name or None, None, s.group_idx]
    if kind == "block_removed":
        r = event.block_removed
        return ["BlockRemoved", list(r.block_hashes), r.medium, r.group_idx]
    return ["AllBlocksCleared"]


def encode_batch(batch: engine_pb2.KvEventBatch) -> bytes:
    """``batch`` as vLLM's msgpack payload (the module docstring's layout)."""
    return msgpack.packb([batch.ts, [_event_array(e) for e in batch.events], 0])


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPC or in-process address, connect to any other."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")
            or endpoint.startswith("inproc://"))


class ZmqEventPublisher:
    """PUB socket + replay ROUTER socket on a thread (see the module docstring).

    Args:
        config: endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic.

    Raises:
        ValueError: an endpoint cannot be bound or connected (naming the flag).
    """

    SHUTDOWN_TIMEOUT = 1.0  # seconds close() waits for the queued batches to go out

    def __init__(self, config: KVEventsConfig) -> None:
        self._queue: queue.Queue[engine_pb2.KvEventBatch] = queue.Queue(
            config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        ctx: zmq.Context = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open the ZMQ endpoints "
                             f"{config.endpoint!r} / {config.replay_endpoint!r}: {e}") from e
        # the addresses as bound (a wildcard port resolved), e.g. for tests
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                if self._replay is not None else None)
        self.num_dropped_total = 0  # batches dropped on a full queue
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-zmq")
        self._thread.start()
        log.info("KV events on ZMQ: PUB %s%s", self.endpoint,
                 f", replay {self.replay_endpoint}" if self._replay is not None else "")

    def publish(self, batch: engine_pb2.KvEventBatch) -> None:
        """Queue ``batch`` for the thread (never blocks; see the module docstring)."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped_total += 1
            log.warning("KV events on ZMQ: queue full, batch %d dropped", batch.sequence_number)

    def close(self) -> None:
        """Send what is queued (``SHUTDOWN_TIMEOUT`` at most), stop the thread, close the
        sockets."""
        self._running = False
        deadline = time.monotonic() + self.SHUTDOWN_TIMEOUT
        while not self._queue.empty() and time.monotonic() < deadline and (
                self._thread.is_alive()):
            time.sleep(0.01)
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        """The thread: answer replay requests, send queued batches, until closed."""
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    log.exception("KV events on ZMQ: replay failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            seq = batch.sequence_number
            payload = encode_batch(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                log.exception("KV events on ZMQ: send of batch %d failed", seq)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """One replay request: [client id, b"", start seq] -> the buffered batches from start
        seq on, then END_SEQ (vLLM's ``_service_replay``)."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events on ZMQ: malformed replay request of %d frames", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
