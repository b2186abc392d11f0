"""KV events (services/scheduler/kv_events.py): a subscriber that knows nothing but the events
rebuilds the prefix cache exactly.

The property test extends the scheduler's state machine (tests/scheduler/test_properties.py:
shared prefixes, a small cache so evictions and preemptions are common, aborts, several KV
cache groups, a KV tier whose loads join the cache) with two rules: the subscriber reconnects
(with a replay from its next sequence number, a stale one, another publisher's id, or none:
a snapshot) and the prefix cache is reset (the workers restarted). After every operation the
engine's flush runs and the subscriber's rebuild (``Mirror``) must equal ``cached_blocks``:
the same (group, hash) set, each with its parent hash and token ids. The ``Mirror`` is strict:
a block stored twice, a block removed that it does not hold, or a batch out of sequence fails.

Then the contract's corners one by one: one request's blocks merge into one BlockStored; no
batch for a step that changed nothing; LoRA names; replay vs. snapshot choice; a restarted
scheduler (new publisher_id); a slow subscriber cut off; flag validation.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from services.common.block_hash import chain_hashes, external_block_hash
from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import engine_pb2
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_events import KVEventLog, medium_of
from services.scheduler.kv_events_config import KVEventsConfig
from tests.scheduler.factories import FakeWorker, make_request, make_scheduler, run_to_completion
from tests.scheduler.test_properties import SchedulerMachine


class Mirror:
    """A subscriber's view of one replica's prefix cache, built from KvEventBatches alone (the
    proto's contract): (group, hash) -> (parent hash or None, token ids, lora name)."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, int], tuple[int | None, tuple[int, ...], str]] = {}
        self.publisher_id = ""
        self.last_seq: int | None = None  # of the last batch applied
        self.num_snapshots = 0
        self.num_removed = 0  # blocks removed (evictions)
        self.num_cleared = 0  # AllBlocksCleared events outside snapshots

    def apply(self, batch: engine_pb2.KvEventBatch) -> None:
        """Apply one batch; a live batch must follow the last one of the same publisher (one
        it already applied, replayed again, is skipped)."""
        if not batch.snapshot and batch.publisher_id == self.publisher_id and (
                self.last_seq is not None and batch.sequence_number <= self.last_seq):
            return
        if batch.snapshot:
            assert batch.events[0].WhichOneof("event") == "all_blocks_cleared"
            self.num_snapshots += 1
        else:
            assert (batch.publisher_id, batch.sequence_number) == (
                self.publisher_id, (self.last_seq if self.last_seq is not None else -1) + 1)
        for e in batch.events:
            kind = e.WhichOneof("event")
            if kind == "all_blocks_cleared":
                self.blocks.clear()
                self.num_cleared += 0 if batch.snapshot else 1
            elif kind == "block_stored":
                s = e.block_stored
                assert len(s.token_ids) == s.block_size * len(s.block_hashes)
                parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
                for i, h in enumerate(s.block_hashes):
                    assert (s.group_idx, h) not in self.blocks, "stored twice"
                    self.blocks[(s.group_idx, h)] = (
                        parent, tuple(s.token_ids[i * s.block_size:(i + 1) * s.block_size]),
                        s.lora_name)
                    parent = h
            else:
                r = e.block_removed
                self.num_removed += len(r.block_hashes)
                for h in r.block_hashes:
                    assert self.blocks.pop((r.group_idx, h), None) is not None, "not held"
        self.publisher_id, self.last_seq = batch.publisher_id, batch.sequence_number

    def next_start(self) -> int | None:
        return None if self.last_seq is None else self.last_seq + 1


def cache_view(block_manager) -> dict:
    """``cached_blocks`` as a Mirror holds it (lora names aside)."""
    return {(g, external_block_hash(k)): (
        external_block_hash(b.parent_hash) if b.parent_hash else None, b.token_ids)
        for (g, k), b in block_manager.cached_blocks.items()}


def mirror_view(mirror: Mirror) -> dict:
    return {key: (parent, tokens) for key, (parent, tokens, _) in mirror.blocks.items()}


def drain(sub, mirror: Mirror) -> None:
    while not sub.queue.empty():
        batch = sub.queue.get_nowait()
        assert batch is not None
        mirror.apply(batch)


class EventsMachine(SchedulerMachine):
    """``SchedulerMachine`` with an event log on its BlockManager and one subscriber."""

    def _log(self) -> KVEventLog:
        bm = self.scheduler.block_manager
        if bm.events is None:  # (first check after setup: subscribe with a snapshot)
            bm.events = KVEventLog(bm.block_size, "CPU", buffer_steps=3)
            self.mirror = Mirror()
            self.sub, initial = bm.events.subscribe(None, "", bm.cached_blocks)
            for batch in initial:
                self.mirror.apply(batch)
        return bm.events

    @rule(how=st.sampled_from(["replay", "replay", "stale", "other", "none"]))
    def reconnect(self, how):
        """The subscriber's stream breaks; it comes back asking to resume, or not."""
        events = self._log()
        events.unsubscribe(self.sub)
        drain(self.sub, self.mirror)  # (what was already on the wire)
        start = {"replay": self.mirror.next_start(), "stale": 0, "other": 0, "none": None}[how]
        pid = "someone-else" if how == "other" else self.mirror.publisher_id
        self.sub, initial = events.subscribe(start, pid, self.scheduler.block_manager.cached_blocks)
        for batch in initial:
            self.mirror.apply(batch)

    @rule()
    def reset_prefix_cache(self):
        """The workers restarted: every cached prefix is forgotten (without a KV tier, whose
        loads in flight the engine's reset also abandons along with their requests)."""
        if self.tier_dir is None:
            self.scheduler.reset_prefix_cache()

    @invariant()
    def events_rebuild_the_prefix_cache(self):
        events = self._log()
        events.flush()  # (the engine's, after each step and any change outside one)
        drain(self.sub, self.mirror)
        assert mirror_view(self.mirror) == cache_view(self.scheduler.block_manager)


TestEvents = EventsMachine.TestCase
TestEvents.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow])


def _step(scheduler, worker) -> None:
    out = scheduler.schedule()
    scheduler.update_from_output(out, worker.output(out, worker.execute(out)))


def _stored(batch) -> list:
    return [e.block_stored for e in batch.events if e.WhichOneof("event") == "block_stored"]


def test_one_requests_blocks_are_one_event_and_a_shared_prefix_names_its_parent():
    s = make_scheduler(32, block_size=4)
    bm = s.block_manager
    bm.events = events = KVEventLog(4, medium_of("cuda:0"))
    worker = FakeWorker(s)
    first = make_request(1, 10, max_tokens=1)
    s.add_request(first)
    _step(s, worker)
    batch = events.flush()
    assert batch is not None and batch.sequence_number == 0 and not batch.snapshot
    [stored] = _stored(batch)
    keys = [k for (_, k) in bm.cached_blocks]
    assert list(stored.block_hashes) == [external_block_hash(k) for k in keys]
    assert not stored.HasField("parent_block_hash") and stored.block_size == 4
    assert list(stored.token_ids) == first.prompt_token_ids[:8]
    assert (stored.medium, stored.lora_name, stored.group_idx) == ("GPU", "", 0)
    assert events.flush() is None  # nothing changed: no batch
    second = make_request(2, 13, max_tokens=1)
    second.prompt_token_ids[:8] = first.prompt_token_ids[:8]
    s.add_request(second)
    _step(s, worker)
    [stored] = _stored(events.flush())
    assert stored.parent_block_hash == external_block_hash(keys[1])  # its hit's last block
    assert list(stored.token_ids) == second.prompt_token_ids[8:12]
    assert events.next_sequence_number == 2


def test_lora_blocks_carry_the_adapters_name_in_events_and_snapshots():
    s = make_scheduler(32, block_size=4)
    s.block_manager.events = events = KVEventLog(4, "CPU")
    request = make_request(1, 9, max_tokens=1)
    request.lora = LoRARequest(1, "sql", "/adapters/sql")
    s.add_request(request)
    _step(s, FakeWorker(s))
    [stored] = _stored(events.flush())
    assert stored.lora_name == "sql" and stored.medium == "CPU"
    snap = events.snapshot(s.block_manager.cached_blocks)
    assert {b.lora_name for b in _stored(snap)} == {"sql"}


def _log_with_batches(n: int, buffer_steps: int = 4):
    """A log over a scheduler that ran ``n`` requests of distinct prompts (a batch each)."""
    s = make_scheduler(64, block_size=4)
    s.block_manager.events = events = KVEventLog(4, "CPU", buffer_steps=buffer_steps)
    worker = FakeWorker(s)
    for i in range(n):
        s.add_request(make_request(i, 9, max_tokens=1))
        run_to_completion(s, worker)
        assert events.flush() is not None
    return s, events, worker


def test_replay_from_a_buffered_sequence_number_else_a_snapshot():
    s, events, _ = _log_with_batches(6, buffer_steps=4)  # batches 0..5; 2..5 buffered
    cached, pid = s.block_manager.cached_blocks, events.publisher_id
    _, replay = events.subscribe(3, pid, cached)
    assert [b.sequence_number for b in replay] == [3, 4, 5]
    assert not any(b.snapshot for b in replay)
    assert events.subscribe(6, pid, cached)[1] == []  # up to date: only live batches follow
    for start, publisher in ((1, pid), (7, pid), (None, pid), (3, "restarted"), (3, "")):
        [snap] = events.subscribe(start, publisher, cached)[1]
        assert snap.snapshot and snap.sequence_number == 5 and snap.publisher_id == pid
        mirror = Mirror()
        mirror.apply(snap)
        assert mirror_view(mirror) == cache_view(s.block_manager)


def test_a_snapshot_flushes_pending_changes_first_and_orders_parents_first():
    s, events, worker = _log_with_batches(2)
    s.add_request(make_request(7, 17, max_tokens=1))
    run_to_completion(s, worker)  # (not flushed)
    sub, none = events.subscribe(2, events.publisher_id, s.block_manager.cached_blocks)
    assert none == []  # (a subscriber up to date: no flush)
    mirror = Mirror()
    [snap] = events.subscribe(None, "", s.block_manager.cached_blocks)[1]
    assert snap.sequence_number == 2 and events.next_sequence_number == 3
    mirror.apply(snap)
    assert mirror_view(mirror) == cache_view(s.block_manager)
    seen: set[int] = set()
    for stored in _stored(snap):
        assert len(stored.block_hashes) == 1
        if stored.HasField("parent_block_hash") and any(
                external_block_hash(b.block_hash[1]) == stored.parent_block_hash
                for b in s.block_manager.cached_blocks.values()):
            assert stored.parent_block_hash in seen
        seen.add(stored.block_hashes[0])
    assert sub.queue.qsize() == 1  # the earlier subscriber got the flushed batch 2 live


def test_a_restarted_scheduler_resyncs_its_subscriber_from_a_snapshot():
    old, old_events, _ = _log_with_batches(3)
    mirror = Mirror()
    for batch in old_events.subscribe(None, "", old.block_manager.cached_blocks)[1]:
        mirror.apply(batch)
    new, new_events, _ = _log_with_batches(1)  # another process: sequence numbers from 0 again
    assert new_events.publisher_id != old_events.publisher_id
    [snap] = new_events.subscribe(mirror.next_start(), mirror.publisher_id,
                                  new.block_manager.cached_blocks)[1]
    assert snap.snapshot
    mirror.apply(snap)
    assert mirror_view(mirror) == cache_view(new.block_manager) != cache_view(old.block_manager)


def test_a_slow_subscriber_is_cut_off_and_resumes_with_a_replay():
    s = make_scheduler(64, block_size=4)
    s.block_manager.events = events = KVEventLog(4, "CPU", max_queue_size=2)
    mirror = Mirror()
    sub, initial = events.subscribe(None, "", s.block_manager.cached_blocks)
    for batch in initial:
        mirror.apply(batch)
    worker = FakeWorker(s)
    for i in range(3):
        s.add_request(make_request(i, 9, max_tokens=1))
        run_to_completion(s, worker)
        events.flush()
    assert sub.cut_off and sub.queue.get_nowait() is None and events.num_cut_off_total == 1
    sub, replay = events.subscribe(mirror.next_start(), mirror.publisher_id,
                                   s.block_manager.cached_blocks)
    assert [b.sequence_number for b in replay] == [0, 1, 2]
    for batch in replay:
        mirror.apply(batch)
    assert mirror_view(mirror) == cache_view(s.block_manager)


def test_a_kv_tier_load_that_lands_in_ram_is_a_block_stored(tmp_path):
    from tests.scheduler.test_kv_tier import evicted_prefix, request

    s, worker, shared = evicted_prefix(tmp_path)  # the tier holds shared's blocks; RAM not
    bm = s.block_manager
    bm.events = events = KVEventLog(bm.block_size, "CPU")
    mirror = Mirror()
    for batch in events.subscribe(None, "", bm.cached_blocks)[1]:
        mirror.apply(batch)
    s.add_request(request(1, [*shared, 1, 2, 3]))
    out = s.schedule()  # a tier hit: two loads, not registered until they land
    early = events.flush()  # (the blocks the loads go to were evicted: BlockRemoved only)
    assert len(out.kv_loads) == 2 and early is not None and _stored(early) == []
    mirror.apply(early)
    s.update_from_output(out, worker.output(out, worker.execute(out)))
    run_to_completion(s, worker)
    assert s.prefix_cache_tier_hits_total == 8
    batch = events.flush()
    loaded = [h for st in _stored(batch) for h in st.block_hashes]
    assert loaded[:2] == [external_block_hash(k) for k in chain_hashes(shared, 4, max_blocks=2)]
    mirror.apply(batch)
    assert mirror_view(mirror) == cache_view(bm)


def test_reset_is_all_blocks_cleared():
    s, events, _ = _log_with_batches(2)
    s.reset_prefix_cache()
    batch = events.flush()
    assert [e.WhichOneof("event") for e in batch.events] == ["all_blocks_cleared"]


def test_events_off_by_default_and_refused_without_prefix_caching():
    assert make_scheduler(32).block_manager.events is None
    with pytest.raises(ValueError, match=r"--kv-events-config: .*--no-enable-prefix-caching"):
        SchedulerConfig(enable_prefix_caching=False,
                        kv_events=KVEventsConfig(enable_kv_cache_events=True))
    SchedulerConfig(enable_prefix_caching=False, kv_events=KVEventsConfig())  # (off: fine)


@pytest.mark.parametrize(("text", "message"), [
    ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1, got 0"),
    ('{"max_queue_size": "9"}', "max_queue_size must be an integer >= 1, got '9'"),
    ('{"publisher": "kafka"}', "publisher must be one of ['zmq', 'null'], got 'kafka'"),
    ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events must be true or false, got 1"),
    ('{"topics": "x"}', "unknown field 'topics'"),
    ("[]", "must be a JSON object"),
])
def test_bad_kv_events_configs_name_the_field(text, message):
    with pytest.raises(ValueError, match=r"^--kv-events-config") as e:
        KVEventsConfig.parse(text)
    assert message in str(e.value)


def test_publisher_defaults_follow_vllm_and_the_flag_value_round_trips():
    on = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert on is not None and on.publisher == "zmq" and on.endpoint == "tcp://*:5557"
    off = KVEventsConfig.parse("{}")
    assert off is not None and off.publisher == "null" and not off.enable_kv_cache_events
    assert KVEventsConfig.parse(on.as_flag_value()) == on
    assert KVEventsConfig.parse("") is None


class _Context:
    async def abort(self, code, message):
        raise grpc.RpcError(code, message)


def test_subscribing_with_events_off_is_failed_precondition_naming_the_flag():
    from services.scheduler.server import EngineServicer

    servicer = EngineServicer()
    servicer.engine = type("E", (), {"scheduler": make_scheduler(32)})()

    async def first():
        return await servicer.SubscribeKvEvents(
            engine_pb2.SubscribeKvEventsRequest(), _Context()).__anext__()

    with pytest.raises(grpc.RpcError) as e:
        asyncio.run(first())
    code, message = e.value.args
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "--kv-events-config" in message


def test_a_subscriber_that_falls_behind_is_cut_off_with_resource_exhausted():
    from services.scheduler.server import EngineServicer

    s, events, _ = _log_with_batches(1)
    events.max_queue_size = 1
    servicer = EngineServicer()
    servicer.engine = type("E", (), {"scheduler": s})()

    async def read_all():
        stream = servicer.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(), _Context())
        got = [await stream.__anext__()]  # the snapshot; now it is subscribed
        s.block_manager.reset_prefix_cache()
        events.flush()
        s.block_manager.reset_prefix_cache()
        events.flush()  # (a second batch with one waiting: cut off)
        async for batch in stream:
            got.append(batch)
        return got

    with pytest.raises(grpc.RpcError) as e:
        asyncio.run(read_all())
    code, message = e.value.args
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "start_sequence_number" in message
    assert events.num_cut_off_total == 1 and not events._subscribers


def test_the_engine_flushes_each_step_and_its_reset_after_a_worker_failure():
    """The engine loop on fake ranks: a subscriber's mirror equals the cache once the loop
    idles (the last step's batch and the idle flush); a failed loop resets the cache, and
    the AllBlocksCleared reaches the subscriber without another step."""
    from tests.scheduler.test_engine_loop import _engine, _submit

    async def main():
        engine, _ranks, _health = _engine()
        bm = engine.scheduler.block_manager
        bm.events = events = KVEventLog(bm.block_size, "CPU")
        mirror = Mirror()
        sub, initial = events.subscribe(None, "", bm.cached_blocks)
        for batch in initial:
            mirror.apply(batch)
        loop = asyncio.create_task(engine.run())
        sink = engine.attach()
        for i in range(6):
            _submit(engine, sink, i % 3, 9 + i, 5)  # (shared prompts: hits)
        async with asyncio.timeout(10):
            while engine.scheduler.has_unfinished_requests() or not bm.cached_blocks:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # (the loop reaches its idle flush)
        drain(sub, mirror)
        assert mirror_view(mirror) == cache_view(bm) != {}
        assert events.next_sequence_number > 1  # (one batch per step that changed the cache)

        def fail(*args, **kwargs):
            raise RuntimeError("injected")

        engine.scheduler.update_from_output = fail
        _submit(engine, sink, 7, 9, 5)
        async with asyncio.timeout(10):
            while engine.num_loop_failures_total == 0 or mirror.blocks:
                await asyncio.sleep(0.01)
                drain(sub, mirror)
        assert bm.cached_blocks == {} and mirror.num_cleared == 1
        loop.cancel()

    asyncio.run(main())
