"""KV events on ZMQ (services/scheduler/kv_events_zmq.py) read by vLLM's published example
subscriber (examples/online_serving/kv_events_subscriber.py): its msgspec types, copied here
exactly as the example defines them, decode what our PUB socket sends; its gap handling
replays a missed batch through our ROUTER socket with a REQ socket, as the example does; a
DEALER gets every buffered batch and the end marker (vLLM's replay protocol)."""

from __future__ import annotations

import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq
from msgspec.msgpack import Decoder

from services.common.block_hash import external_block_hash
from services.common.lora import LoRARequest
from services.scheduler.kv_events import KVEventLog
from services.scheduler.kv_events_config import KVEventsConfig
from services.scheduler.kv_events_zmq import ZmqEventPublisher
from tests.scheduler.factories import FakeWorker, make_request, make_scheduler, run_to_completion


#
# Types copied from vLLM's examples/online_serving/kv_events_subscriber.py
#
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True
):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]  # noqa: UP045 (as the example writes it)
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]  # noqa: UP045
    medium: Optional[str]  # noqa: UP045


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]  # noqa: UP045


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]  # noqa: UP007


TIMEOUT_MS = 5000


@pytest.fixture
def zmq_log():
    """(scheduler, worker, log, publisher) with KV events on a ZMQ PUB + replay socket on
    ephemeral loopback ports, topic "kv-events" (the example's)."""
    config = KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                            buffer_steps=16, topic="kv-events")
    publisher = ZmqEventPublisher(config)
    s = make_scheduler(16, block_size=4, max_model_len=32)
    s.block_manager.events = events = KVEventLog(4, "GPU", config.buffer_steps)
    events.publishers.append(publisher)
    yield s, FakeWorker(s), events, publisher
    events.close()


def _run(s, worker, index: int, tokens: int = 9, lora=None) -> None:
    request = make_request(index, tokens, max_tokens=1)
    request.lora = lora
    s.add_request(request)
    run_to_completion(s, worker)


def _subscriber(ctx: zmq.Context, publisher: ZmqEventPublisher, s, worker, events):
    """A SUB socket on the example's topic, connected and past the slow-joiner window: the
    log publishes batches until one arrives (returns the socket and that batch's seq)."""
    sub = ctx.socket(zmq.SUB)
    sub.connect(publisher.endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    index = 100
    while time.monotonic() < deadline:
        _run(s, worker, index)
        index += 1
        events.flush()
        if sub.poll(100):
            _, seq_bytes, _ = sub.recv_multipart()
            return sub, int.from_bytes(seq_bytes, "big")
    raise AssertionError("the SUB socket got nothing")


def test_vllms_example_decoder_reads_our_batches_unchanged(zmq_log):
    s, worker, events, publisher = zmq_log
    ctx = zmq.Context.instance()
    sub, last = _subscriber(ctx, publisher, s, worker, events)
    try:
        _run(s, worker, 1, tokens=30)
        _run(s, worker, 2, tokens=30)  # (8 blocks each of 16: evictions)
        _run(s, worker, 3, tokens=9, lora=LoRARequest(1, "sql", "/a/sql"))
        s.reset_prefix_cache()
        batch = events.flush()
        assert sub.poll(TIMEOUT_MS)
        topic, seq_bytes, payload = sub.recv_multipart()
        assert topic == b"kv-events" and int.from_bytes(seq_bytes, "big") == last + 1
        assert batch is not None and batch.sequence_number == last + 1
        decoded = Decoder(type=KVEventBatch).decode(payload)
        assert decoded.ts == pytest.approx(batch.ts)
        kinds = [type(e).__name__ for e in decoded.events]
        assert kinds == [
            {"block_stored": "BlockStored", "block_removed": "BlockRemoved",
             "all_blocks_cleared": "AllBlocksCleared"}[e.WhichOneof("event")]
            for e in batch.events]
        assert kinds[-1] == "AllBlocksCleared" and {"BlockStored", "BlockRemoved"} <= set(kinds)
        for ours, theirs in zip(batch.events, decoded.events, strict=True):
            if isinstance(theirs, BlockStored):
                b = ours.block_stored
                parent = b.parent_block_hash if b.HasField("parent_block_hash") else None
                assert (theirs.block_hashes, theirs.parent_block_hash, theirs.token_ids,
                        theirs.block_size, theirs.lora_id, theirs.medium) == (
                    list(b.block_hashes), parent, list(b.token_ids), 4, None, "GPU")
            elif isinstance(theirs, BlockRemoved):
                assert (theirs.block_hashes, theirs.medium) == (
                    list(ours.block_removed.block_hashes), "GPU")
        # the LoRA name and the group ride after the example's fields (vLLM's later layout)
        import msgpack
        raw = msgpack.unpackb(payload)
        stored = [e for e in raw[1] if e[0] == "BlockStored"]
        assert {e[7] for e in stored} >= {"sql"} and {e[9] for e in stored} == {0}
        assert raw[2] == 0  # data_parallel_rank
    finally:
        sub.close(linger=0)


def test_the_examples_gap_handling_replays_a_missed_batch_over_req(zmq_log):
    """The example's loop, unchanged in substance: a batch it missed is asked for over REQ."""
    s, worker, events, publisher = zmq_log
    ctx = zmq.Context.instance()
    sub, last_seq = _subscriber(ctx, publisher, s, worker, events)
    replay = ctx.socket(zmq.REQ)
    replay.connect(publisher.replay_endpoint)
    poller = zmq.Poller()
    poller.register(replay, zmq.POLLIN)
    decoder = Decoder(type=KVEventBatch)
    try:
        _run(s, worker, 1)
        missed = events.flush()
        assert sub.poll(TIMEOUT_MS)
        sub.recv_multipart()  # (lost: the example never sees it)
        _run(s, worker, 2)
        events.flush()
        got = []
        assert sub.poll(TIMEOUT_MS)
        _, seq_bytes, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        assert seq > last_seq + 1  # the gap the example looks for
        replay.send((last_seq + 1).to_bytes(8, "big"))
        while poller.poll(timeout=TIMEOUT_MS):
            seq_bytes, replay_payload = replay.recv_multipart()
            if not replay_payload:
                break
            replay_seq = int.from_bytes(seq_bytes, "big")
            if replay_seq > last_seq:
                got.append((replay_seq, decoder.decode(replay_payload)))
                last_seq = replay_seq
                if replay_seq >= seq - 1:
                    break
        got.append((seq, decoder.decode(payload)))
        assert [q for q, _ in got] == [missed.sequence_number, missed.sequence_number + 1]
        hashes = got[0][1].events[0].block_hashes
        assert hashes == list(missed.events[0].block_stored.block_hashes)
        assert len(hashes) == 2 and hashes[0] in {
            external_block_hash(k) for (_, k) in s.block_manager.cached_blocks}
    finally:
        sub.close(linger=0)
        replay.close(linger=0)


def test_a_dealer_replay_gets_every_buffered_batch_then_the_end_marker(zmq_log):
    s, worker, events, publisher = zmq_log
    for i in range(5):
        _run(s, worker, i)
        events.flush()
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while len(publisher._buffer) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)  # (the thread sends and buffers them; a replay serves what it has)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        seqs = []
        while dealer.poll(TIMEOUT_MS):
            _, seq_bytes, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert payload == b""
                break
            Decoder(type=KVEventBatch).decode(payload)
            seqs.append(seq)
        assert seqs == [2, 3, 4]
    finally:
        dealer.close(linger=0)


def test_a_taken_port_is_an_error_naming_the_flag():
    ctx = zmq.Context.instance()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://*")
    try:
        with pytest.raises(ValueError, match="--kv-events-config: cannot open"):
            ZmqEventPublisher(KVEventsConfig(True, "zmq", f"tcp://*:{port}"))
    finally:
        taken.close(linger=0)
