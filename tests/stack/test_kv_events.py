"""KV events through a real worker + scheduler (tiny Llama, a KV cache of 12 blocks): a gRPC
subscriber (SubscribeKvEvents) rebuilds the scheduler's prefix cache from the events alone
(``Mirror``, tests/scheduler/test_kv_events.py) and, each time the scheduler is idle, its
rebuild equals an independent view of the cache: a snapshot subscription (built from
``cached_blocks`` directly, not from events) and GetEngineStats' ``num_cached_blocks``.

One scenario, in order: concurrent requests with shared prefixes (evictions and preemptions,
asserted); the subscriber disconnects, more requests run, it reconnects asking for a replay
from its next sequence number (and gets exactly the batches it missed); the scheduler
restarts (its streams end; a new publisher_id): the subscriber reconnects with its old
position and resyncs from a snapshot; more requests; equal again. The ZMQ publisher is on too
(ephemeral ports): it is opened and closed with each scheduler process.
"""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import pytest

from services.common.pb.pagedserve.v1 import engine_pb2, engine_pb2_grpc
from services.common.sampling_params import EngineSamplingParams
from services.scheduler import server as scheduler_server
from services.worker import server as worker_server
from tests.scheduler.test_kv_events import Mirror
from tests.stack.test_equivalence import kv_bytes_per_block
from tests.stack_harness import _args, _BackgroundStack

pytestmark = pytest.mark.slow

BLOCKS = 12  # KV blocks of 16 tokens: four 60-token requests at once cannot all fit
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})


class _Stack(_BackgroundStack):
    """A worker and a scheduler (no router) whose scheduler can be restarted on its port."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.worker_args = _args(worker_server, [
            "--port", "0", "--model", model, "--dtype", "float32", "--max-model-len", "128",
            "--kv-cache-memory", str(kv_bytes_per_block(model) * BLOCKS)])
        self.scheduler_args = _args(scheduler_server, [
            "--port", "0", "--kv-events-config", EVENTS, "--shutdown-timeout", "5"])
        self.scheduler_address = ""

    async def _start(self) -> None:
        self._stop = asyncio.Event()
        self._tasks.append(await self._serve(worker_server, self.worker_args, self._stop))
        self.scheduler_args.workers = f"127.0.0.1:{self.worker_args.port}"
        await self._start_scheduler()

    async def _start_scheduler(self) -> None:
        self._scheduler_stop = asyncio.Event()
        self._scheduler = await self._serve(scheduler_server, self.scheduler_args,
                                            self._scheduler_stop)
        self.scheduler_address = f"127.0.0.1:{self.scheduler_args.port}"  # (the same port)

    async def _stop_scheduler(self) -> None:
        self._scheduler_stop.set()
        await asyncio.gather(self._scheduler, return_exceptions=True)

    def restart_scheduler(self) -> None:
        async def restart():
            await self._stop_scheduler()
            await self._start_scheduler()
        self._run(restart(), timeout=60)

    def stop(self) -> None:
        if getattr(self, "_scheduler", None) is not None:
            self._run(self._stop_scheduler(), timeout=60)
        self._stop_services()
        self._close_loop()


async def _generate(stub, prompts: list[list[int]], tag: str, max_tokens: int = 8) -> None:
    """Submit every prompt at once on one Connect stream and wait for each final output."""
    params = EngineSamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    done = asyncio.Event()

    async def submits():
        for i, prompt in enumerate(prompts):
            yield engine_pb2.EngineRequest(submit=engine_pb2.SubmitRequest(
                request_id=f"{tag}-{i}", prompt_token_ids=prompt,
                sampling_params=params.to_pb()))
        await done.wait()  # (closing our side would abort what runs)

    call = stub.Connect(submits())
    finished: set[str] = set()
    async for batch in call:
        for out in batch.outputs:
            assert not out.error_code, out.error_message
            if out.finish_reason:
                finished.add(out.request_id)
        if len(finished) == len(prompts):
            break
    done.set()
    call.cancel()


class _Subscriber:
    """A SubscribeKvEvents stream applied to a ``Mirror`` by a task; ``connect`` resumes from
    the mirror's position (publisher_id and next sequence number)."""

    def __init__(self) -> None:
        self.mirror = Mirror()
        self.first: list[engine_pb2.KvEventBatch] = []  # each connection's first batch
        self._task: asyncio.Task | None = None

    def connect(self, stub) -> None:
        request = engine_pb2.SubscribeKvEventsRequest(publisher_id=self.mirror.publisher_id)
        if self.mirror.next_start() is not None:
            request.start_sequence_number = self.mirror.next_start()

        async def read():
            first = True
            async for batch in stub.SubscribeKvEvents(request):
                if first:
                    self.first.append(batch)
                    first = False
                self.mirror.apply(batch)
        self._task = asyncio.create_task(read())

    async def disconnect(self) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def ended(self) -> None:
        """Wait for the stream to end on its own (the scheduler stopped)."""
        assert self._task is not None
        await asyncio.wait_for(self._task, 30)


async def _assert_equals_the_cache(stub, sub: _Subscriber) -> None:
    """Once idle: the mirror at the snapshot's sequence number equals the snapshot, which is
    read from ``cached_blocks`` directly, and the cache's size the stats report."""
    for _ in range(600):
        stats = await stub.GetEngineStats(engine_pb2.GetEngineStatsRequest())
        if stats.num_running == 0 and stats.num_waiting == 0:
            break
        await asyncio.sleep(0.05)
    call = stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest())
    snapshot = await call.read()
    call.cancel()
    assert snapshot.snapshot and snapshot.publisher_id == sub.mirror.publisher_id
    for _ in range(600):
        if sub.mirror.last_seq == snapshot.sequence_number:
            break
        await asyncio.sleep(0.01)
    truth = Mirror()
    truth.apply(snapshot)
    assert sub.mirror.blocks == truth.blocks and sub.mirror.blocks
    stats = await stub.GetEngineStats(engine_pb2.GetEngineStatsRequest())
    assert len(sub.mirror.blocks) == stats.num_cached_blocks


def _prompts(rng: random.Random, shared: list[list[int]], n: int) -> list[list[int]]:
    """``n`` prompts of 40..70 tokens, most starting with one of the ``shared`` prefixes."""
    out = []
    for _ in range(n):
        prefix = rng.choice([*shared, []])
        out.append(prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(40, 70)
                                                                   - len(prefix))])
    return out


def test_a_subscriber_rebuilds_the_prefix_cache_through_evictions_reconnects_and_a_restart(
        tiny_model_dir):
    stack = _Stack(tiny_model_dir).start()
    rng = random.Random(55)
    shared = [[rng.randrange(3, 500) for _ in range(33)] for _ in range(2)]

    async def scenario():
        sub = _Subscriber()
        async with grpc.aio.insecure_channel(stack.scheduler_address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            sub.connect(stub)
            for round_ in range(3):
                await _generate(stub, _prompts(rng, shared, 4), f"a{round_}")
            # six prompts one token short of 3 blocks, each then needing a 4th and 5th block
            # to decode: 12 blocks cannot hold them all (preemption)
            await _generate(stub, [[rng.randrange(3, 500) for _ in range(47)] for _ in range(6)],
                            "p", max_tokens=20)
            stats = await stub.GetEngineStats(engine_pb2.GetEngineStatsRequest())
            assert stats.num_preemptions_total > 0
            await _assert_equals_the_cache(stub, sub)
            assert sub.mirror.num_removed > 0  # (evictions)

            await sub.disconnect()  # the subscriber goes away; the cache changes meanwhile
            resume_at = sub.mirror.next_start()
            await _generate(stub, _prompts(rng, shared, 4), "b")
            sub.connect(stub)
            await _assert_equals_the_cache(stub, sub)
            assert not sub.first[-1].snapshot  # a replay: exactly the batches it missed
            assert sub.first[-1].sequence_number == resume_at
            old_publisher = sub.mirror.publisher_id
            stack.restart_scheduler()  # its streams end; a new process' cache is empty
            await sub.ended()
        async with grpc.aio.insecure_channel(stack.scheduler_address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            sub.connect(stub)  # (asks to resume at its old position)
            await _generate(stub, _prompts(rng, shared, 4), "c")
            await _assert_equals_the_cache(stub, sub)
            assert sub.first[-1].snapshot and sub.mirror.publisher_id != old_publisher
            await sub.disconnect()

    try:
        asyncio.run(scenario())
    finally:
        stack.stop()
