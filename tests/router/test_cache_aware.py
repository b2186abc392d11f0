"""cache_aware routing: ``ReplicaSet`` over fake replicas whose KV indexes the test fills (the
cache hit wins above the threshold, prefix_affinity's choice below it and for replicas without
synced events, the imbalance guard, predictions counted against the reported cached tokens),
and ``KvEventSubscriber`` against a fake scheduler serving ``SubscribeKvEvents`` over real gRPC
(snapshot first, replay after a broken stream or a gap, a snapshot again after a restart, no
index while events are off)."""

from __future__ import annotations

import asyncio

import grpc

from services.common.block_hash import lora_extra_key
from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2, engine_pb2_grpc
from services.common.sampling_params import EngineSamplingParams
from services.router.cache_aware import CacheAwareConfig
from services.router.kv_event_subscriber import KvEventSubscriber
from services.router.kv_index import KvIndex
from services.router.metrics import RouterMetrics
from services.router.replicas import ReplicaSet, pick_rendezvous, prefix_key
from tests.helpers import asynctest
from tests.router.kv_events_fakes import batch, hashes, removed, stored
from tests.router.test_replicas import BLOCK, FakeReplica

PARAMS = EngineSamplingParams()
ADDRESSES = ("a:1", "b:1", "c:1")


class FakeSubscriber:
    """A ``KvEventSubscriber`` stand-in: its index is filled by the test."""

    def __init__(self, client):
        self.address = client.address
        self.index = KvIndex()
        self.events_off = False
        self.started = self.closed = False

    @property
    def synced(self):
        return self.index.synced and not self.events_off

    def hold(self, tokens: list[int], extra: bytes = b"") -> None:
        """The replica now caches the full blocks of ``tokens`` (and nothing else)."""
        self.index.apply(batch(0, stored(hashes(tokens, BLOCK, extra), block_size=BLOCK),
                               snapshot=True))

    def start(self):
        self.started = True

    async def close(self):
        self.closed = True


class Harness:
    """A cache_aware ReplicaSet over three fake replicas, every one up."""

    def __init__(self, **config):
        self.fakes: dict[str, FakeReplica] = {}
        self.subs: dict[str, FakeSubscriber] = {}
        self.metrics = RouterMetrics()

        def factory(address, on_serving):
            self.fakes[address] = FakeReplica(address, on_serving)
            return self.fakes[address]

        def subscriber(client):
            self.subs[client.address] = FakeSubscriber(client)
            return self.subs[client.address]

        async def on_serving(up):
            pass

        self.rs = ReplicaSet(list(ADDRESSES), policy="cache_aware", client_factory=factory,
                             on_serving=on_serving, metrics=self.metrics,
                             cache_aware=CacheAwareConfig(**config),
                             kv_subscriber_factory=subscriber)

    async def start(self):
        task = asyncio.create_task(self.rs.start(timeout=5))
        await asyncio.sleep(0)
        for fake in self.fakes.values():
            await fake.up()
        await task
        return self

    def pick(self, prompt, **kwargs) -> str:
        return self.rs.pick(prompt, **kwargs).address

    def counter(self, name: str, replica: str) -> float:
        return self.metrics.registry.get_sample_value(f"pagedserve:router_{name}_total",
                                                      {"replica": replica}) or 0.0


def tokens(seed: int, length: int) -> list[int]:
    return [(seed * 37 + i * 11) % 1000 for i in range(length)]


SYSTEM = tokens(1, 6 * BLOCK)
PROMPT = SYSTEM + tokens(2, 2 * BLOCK + 1)  # 75 % of it is the system prompt


def not_rendezvous(prompt) -> str:
    """A replica prefix_affinity would not pick for ``prompt``."""
    key = prefix_key(prompt, BLOCK, 2)
    return next(a for a in ADDRESSES if a != pick_rendezvous(key, list(ADDRESSES)))


@asynctest
async def test_the_replica_holding_the_longest_prefix_wins():
    h = await Harness().start()
    assert all(s.started for s in h.subs.values())
    target = not_rendezvous(PROMPT)
    h.subs[target].hold(SYSTEM)
    other = next(a for a in ADDRESSES if a != target)
    h.subs[other].hold(SYSTEM[:3 * BLOCK])  # a shorter match elsewhere
    assert {h.pick(PROMPT) for _ in range(5)} == {target}
    await h.rs.close()
    assert all(s.closed for s in h.subs.values())


@asynctest
async def test_a_cold_prompt_goes_to_the_least_loaded_and_its_prefix_gathers_there():
    h = await Harness(cache_threshold=0.8).start()
    holder = not_rendezvous(PROMPT)
    h.subs[holder].hold(SYSTEM)  # 75 % < 80 %: cold
    for s in h.subs.values():
        s.index.synced = True
    idle = next(a for a in ADDRESSES if a != holder)
    for a in ADDRESSES:
        h.fakes[a].load = engine_pb2.LoadReport(num_running=0 if a == idle else 3)
    assert h.pick(PROMPT) == idle
    h.rs.submit("r1", PROMPT, PARAMS)
    assert "r1" in h.fakes[idle].pending
    h.fakes[idle].load = engine_pb2.LoadReport(num_running=3)
    for a in ADDRESSES:  # now another replica is the idlest: the prefix in flight draws it
        if a not in (idle, holder):
            h.fakes[a].load = engine_pb2.LoadReport(num_running=1)
    same_start = SYSTEM[:2 * BLOCK] + tokens(9, 4 * BLOCK)
    h.rs.submit("r2", same_start, PARAMS)
    assert "r2" in h.fakes[idle].pending
    h.fakes[idle].on_end(engine_pb2.RequestOutput(request_id="r1",
                                                  finish_reason=api_pb2.FINISH_REASON_STOP))
    h.rs.release("r2")  # none in flight any more: the least loaded again
    assert h.pick(same_start) != idle
    await h.rs.close()


@asynctest
async def test_without_synced_events_cache_aware_is_prefix_affinity():
    h = await Harness().start()
    target = not_rendezvous(PROMPT)
    h.subs[target].hold(SYSTEM)
    h.subs[target].index.desync()  # its stream broke: not trusted
    affinity = pick_rendezvous(prefix_key(PROMPT, BLOCK, 2), list(ADDRESSES))
    assert h.pick(PROMPT) == affinity
    h.subs[target].index.synced = True
    h.subs[target].events_off = True  # refused: events off
    assert h.pick(PROMPT) == affinity
    h.subs[target].events_off = False
    assert h.pick(PROMPT) == target
    for s in h.subs.values():  # no replica publishes events: prefix_affinity
        s.events_off = True
    assert h.pick(tokens(3, 5 * BLOCK)) == pick_rendezvous(
        prefix_key(tokens(3, 5 * BLOCK), BLOCK, 2), list(ADDRESSES))
    await h.rs.close()


@asynctest
async def test_an_imbalance_sends_the_request_to_the_least_loaded():
    h = await Harness(balance_abs_threshold=4, balance_rel_threshold=2.0).start()
    target = not_rendezvous(PROMPT)
    h.subs[target].hold(SYSTEM)
    idle = next(a for a in ADDRESSES if a != target)
    for a in ADDRESSES:  # 3 - 0 > 4 is false: balanced
        h.fakes[a].load = engine_pb2.LoadReport(num_running=0 if a == idle else 3)
    assert h.pick(PROMPT) == target
    for a in ADDRESSES:  # 10 - 5 > 4, but 10 > 2 x 5 is false: balanced
        h.fakes[a].load = engine_pb2.LoadReport(num_running=5 if a == idle else 10)
    assert h.pick(PROMPT) == target
    for a in ADDRESSES:  # 10 - 4 > 4 and 10 > 2 x 4: imbalanced
        h.fakes[a].load = engine_pb2.LoadReport(num_running=4 if a == idle else 10)
    assert h.pick(PROMPT) == idle
    await h.rs.close()


@asynctest
async def test_predictions_are_counted_against_the_reported_cached_tokens():
    h = await Harness().start()
    target = not_rendezvous(PROMPT)
    h.subs[target].hold(PROMPT)  # every full block
    h.rs.submit("r1", PROMPT, PARAMS)
    assert "r1" in h.fakes[target].pending
    # the scheduler computes the last prompt token: (33 - 1) // 4 = 8 blocks
    done = engine_pb2.RequestOutput(request_id="r1", num_cached_tokens=8 * BLOCK - BLOCK,
                                    finish_reason=api_pb2.FINISH_REASON_LENGTH)
    h.fakes[target].on_end(done)
    assert h.counter("predicted_cached_tokens", target) == 8 * BLOCK
    assert h.counter("cached_tokens", target) == 7 * BLOCK
    # an aborted or failed request, or one whose caller left, is not counted
    h.rs.submit("r2", PROMPT, PARAMS)
    h.fakes[target].on_end(engine_pb2.RequestOutput(
        request_id="r2", finish_reason=api_pb2.FINISH_REASON_ABORT))
    h.rs.submit("r3", PROMPT, PARAMS)
    h.rs.release("r3")
    h.fakes[target].on_end(engine_pb2.RequestOutput(
        request_id="r3", num_cached_tokens=5, finish_reason=api_pb2.FINISH_REASON_STOP))
    assert h.counter("predicted_cached_tokens", target) == 8 * BLOCK
    assert h.counter("cached_tokens", target) == 7 * BLOCK
    await h.rs.close()


@asynctest
async def test_the_prediction_follows_the_scheduler_rules():
    h = await Harness().start()
    ca, info = h.rs.cache_aware, h.rs.info
    exact = SYSTEM[:4 * BLOCK]  # 4 full blocks: the last token is computed, 3 may hit
    for s in h.subs.values():
        s.hold(exact)
    candidates = h.rs.available()

    def predict(prompt, lora, info, params=None) -> dict[str, int]:
        """The cached tokens each candidate would report (what ``choose`` predicts)."""
        return ca.choose(candidates, prompt, lora, info, candidates[0], lambda c: 0,
                         params).predicted

    assert set(predict(exact, None, info).values()) == {3 * BLOCK}
    assert set(predict([*exact, 5], None, info).values()) == {4 * BLOCK}
    logprobs = EngineSamplingParams(prompt_logprobs=1)
    assert set(predict([*exact, 5], None, info, logprobs).values()) == {0}
    lora = LoRARequest(1, "x", "/adapters/x")
    assert set(predict([*exact, 5], lora, info).values()) == {0}
    h.subs["a:1"].hold(exact, lora_extra_key("x", "/adapters/x"))
    assert predict([*exact, 5], lora, info) == {
        "a:1": 4 * BLOCK, "b:1": 0, "c:1": 0}
    assert h.pick([*exact, 5], lora=lora) == "a:1"
    await h.rs.close()


# ---- the subscriber against a fake scheduler --------------------------------------------
class FakeScheduler(engine_pb2_grpc.EngineServiceServicer):
    """Serves SubscribeKvEvents by the contract: a live log of batches (seq = position), a
    replay from ``start_sequence_number`` for the same publisher while it is kept
    (``kept_from`` on), else a snapshot of ``blocks``; ``cut(code)`` ends every stream."""

    def __init__(self):
        self.publisher = "p1"
        self.log: list[engine_pb2.KvEventBatch] = []
        self.blocks: set[int] = set()
        self.kept_from = 0
        self.requests: list[engine_pb2.SubscribeKvEventsRequest] = []
        self.refuse: grpc.StatusCode | None = None
        self.changed = asyncio.Condition()
        self.cut_code: grpc.StatusCode | None = None
        self.skip_next = False  # send the next live batch one sequence number too far

    async def publish(self, *events) -> None:
        b = batch(len(self.log), *events, publisher=self.publisher)
        for e in events:
            if e.HasField("block_stored"):
                self.blocks.update(e.block_stored.block_hashes)
            elif e.HasField("block_removed"):
                self.blocks.difference_update(e.block_removed.block_hashes)
        self.log.append(b)
        async with self.changed:
            self.changed.notify_all()

    async def restart(self) -> None:
        """A new process: new publisher, empty cache, nothing kept."""
        self.publisher, self.log, self.blocks, self.kept_from = "p2", [], set(), 0
        await self.cut(grpc.StatusCode.UNAVAILABLE)

    async def cut(self, code: grpc.StatusCode) -> None:
        self.cut_code = code
        async with self.changed:
            self.changed.notify_all()

    async def SubscribeKvEvents(self, request, context):
        self.requests.append(request)
        if self.refuse is not None:
            await context.abort(self.refuse, "KV events are off")
        self.cut_code = None
        start = request.start_sequence_number
        if (request.HasField("start_sequence_number") and request.publisher_id == self.publisher
                and self.kept_from <= start <= len(self.log)):
            pos = start
        else:
            yield batch(len(self.log) - 1, stored(sorted(self.blocks)), snapshot=True,
                        publisher=self.publisher)
            pos = len(self.log)
        while True:
            while pos < len(self.log):
                b = self.log[pos]
                if self.skip_next:
                    self.skip_next = False
                    b = batch(b.sequence_number + 1, *b.events, publisher=self.publisher)
                yield b
                pos += 1
            async with self.changed:
                await self.changed.wait_for(lambda p=pos: p < len(self.log) or self.cut_code)
            if self.cut_code is not None:
                await context.abort(self.cut_code, "cut")


async def until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def subscribed(fake: FakeScheduler):
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    sub = KvEventSubscriber("fake", engine_pb2_grpc.EngineServiceStub(channel), off_retry=0.05)
    sub.start()
    return server, channel, sub


H = hashes(list(range(40)), BLOCK)  # 10 blocks of one prompt


@asynctest
async def test_the_subscriber_snapshots_then_replays_after_a_broken_stream():
    fake = FakeScheduler()
    await fake.publish(stored(H[:2]))  # before the router subscribes: in the snapshot
    server, channel, sub = await subscribed(fake)
    try:
        await until(lambda: sub.synced and sub.index.match(H) == 2)
        assert not fake.requests[0].HasField("start_sequence_number")
        await fake.publish(stored(H[2:4]))
        await until(lambda: sub.index.match(H) == 4)
        await fake.cut(grpc.StatusCode.RESOURCE_EXHAUSTED)  # too slow: cut off
        await until(lambda: len(fake.requests) == 2)
        await fake.publish(stored(H[4:5]))  # (published while it was away: replayed)
        await until(lambda: sub.synced and sub.index.match(H) == 5)
        replay = fake.requests[1]
        assert (replay.start_sequence_number, replay.publisher_id) == (2, "p1")
        fake.skip_next = True  # a gap: the subscriber asks for a replay of the missing one
        await fake.publish(stored(H[5:6]))
        await until(lambda: len(fake.requests) == 3 and sub.index.match(H) == 6)
        assert fake.requests[2].start_sequence_number == 3
        await fake.cut(grpc.StatusCode.UNAVAILABLE)  # nothing to replay: trusted after a grace
        await until(lambda: len(fake.requests) == 4)
        assert not sub.synced
        await until(lambda: sub.synced)
        assert fake.requests[3].start_sequence_number == 4 and sub.index.match(H) == 6
    finally:
        await sub.close()
        await channel.close()
        await server.stop(None)


@asynctest
async def test_a_restarted_scheduler_sends_a_snapshot_that_replaces_the_index():
    fake = FakeScheduler()
    await fake.publish(stored(H[:3]))
    server, channel, sub = await subscribed(fake)
    try:
        await until(lambda: sub.index.match(H) == 3)
        await fake.publish(removed(H[2:3]))
        await until(lambda: sub.index.match(H) == 2)
        await fake.restart()
        await fake.publish(stored(H[:1]))
        await until(lambda: sub.index.publisher_id == "p2" and sub.index.match(H) == 1)
        assert fake.requests[-1].publisher_id == "p1"  # it asked for a replay, got a snapshot
        assert sub.synced
    finally:
        await sub.close()
        await channel.close()
        await server.stop(None)


@asynctest
async def test_a_replica_with_events_off_has_no_index_until_they_are_on():
    fake = FakeScheduler()
    fake.refuse = grpc.StatusCode.FAILED_PRECONDITION
    await fake.publish(stored(H[:2]))
    server, channel, sub = await subscribed(fake)
    try:
        await until(lambda: sub.events_off and len(fake.requests) >= 2)  # and asks again
        assert not sub.synced and sub.index.match(H) == 0
        fake.refuse = None  # restarted with events on
        await until(lambda: sub.synced and sub.index.match(H) == 2)
        assert not sub.events_off
    finally:
        await sub.close()
        await channel.close()
        await server.stop(None)
