"""The scheduler's engine loop (services/scheduler/engine.py) on fake worker ranks: aborts while
steps are in flight under pipeline parallelism never stop it, and an unexpected exception fails
the requests in flight with an explicit error, turns health NOT_SERVING and restarts the loop.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from services.common.pb.pagedserve.v1 import engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.scheduler.engine import Engine
from tests.helpers import asynctest
from tests.scheduler.factories import FakeRanks, fake_token, final_outputs, make_scheduler


def _submit(engine: Engine, sink, index: int, prompt_len: int, max_tokens: int) -> str:
    rid = f"req-{index}"
    engine.submit(sink, engine_pb2.SubmitRequest(
        request_id=rid, prompt_token_ids=[1000 * index + j for j in range(prompt_len)],
        sampling_params=EngineSamplingParams(max_tokens=max_tokens, ignore_eos=True).to_pb()))
    return rid


def _engine(stages: int = 1, **kwargs) -> tuple[Engine, FakeRanks, list[bool]]:
    scheduler = make_scheduler(64, pipeline_parallel_size=stages,
                               long_prefill_token_threshold=8, **kwargs)
    health: list[bool] = []

    async def on_health(ok: bool) -> None:
        health.append(ok)

    ranks = FakeRanks(scheduler)
    return Engine(scheduler, ranks, on_health=on_health), ranks, health


@pytest.mark.parametrize("stages", [2, 3])
@asynctest
async def test_aborts_while_steps_are_in_flight_never_stop_the_loop(stages):
    """The pipeline-parallel abort storm: many requests cancelled at random points, then,
    beside one long request, one at a time each cancelled after a few steps (often the only
    request of a step in flight: the old in-flight bookkeeping raised on that step's result
    and the loop died), then a normal request, which gets exactly the tokens it would get
    alone; the loop never failed and no block is leaked."""
    engine, _ranks, health = _engine(stages, max_model_len=256)
    loop = asyncio.create_task(engine.run())
    sink = engine.attach()
    rng = random.Random(stages)
    rids = [_submit(engine, sink, i, rng.randint(1, 30), rng.randint(1, 20)) for i in range(40)]
    for rid in rng.sample(rids, 20):
        await asyncio.sleep(rng.random() * 0.01)
        engine.abort(rid)
    long = _submit(engine, sink, 99, 4, 200)
    for i in range(40, 90):
        rid = _submit(engine, sink, i, rng.randint(1, 12), 50)
        for _ in range(rng.randint(1, 12)):
            await asyncio.sleep(0.002)
        engine.abort(rid)
    engine.abort(long)
    last = _submit(engine, sink, 90, 9, 12)
    tokens = [t for o in await final_outputs(sink, last) for t in o.new_token_ids]
    assert tokens == [fake_token(last, 9 + k) for k in range(12)]
    assert not loop.done() and health == [] and engine.num_loop_failures_total == 0
    async with asyncio.timeout(10):
        while engine.scheduler.has_unfinished_requests():
            await asyncio.sleep(0.01)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    loop.cancel()


@asynctest
async def test_an_unexpected_exception_fails_the_requests_and_the_loop_restarts(monkeypatch,
                                                                              caplog):
    engine, ranks, health = _engine()
    sink = engine.attach()
    real = engine.scheduler.update_from_output
    calls = {"n": 0}

    def update_from_output(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.scheduler, "update_from_output", update_from_output)
    loop = asyncio.create_task(engine.run())
    a, b = _submit(engine, sink, 1, 5, 20), _submit(engine, sink, 2, 6, 20)
    for rid in (a, b):
        final = (await final_outputs(sink, rid))[-1]
        assert final.error_code == grpc.StatusCode.INTERNAL.value[0]
        assert "engine loop failed: RuntimeError: injected" in final.error_message
    assert health == [False, True] and ranks.connects == 1
    assert engine.num_loop_failures_total == 1 and "Traceback" in caplog.text
    c = _submit(engine, sink, 3, 4, 5)  # the loop is back
    assert [t for o in await final_outputs(sink, c) for t in o.new_token_ids] == [
        fake_token(c, 4 + k) for k in range(5)]
    assert not loop.done()
    loop.cancel()


@asynctest
async def test_a_loop_that_cannot_recover_raises(monkeypatch):
    """Recovery that leaves a request in the scheduler (here: one no router owns) gives up:
    ``run`` raises, and the server exits non-zero on that."""
    engine, _ranks, health = _engine()
    sink = engine.attach()

    def boom(*args, **kwargs):
        from tests.scheduler.factories import make_request

        engine.scheduler.add_request(make_request(9, 3))  # not failed by fail_all: no sink
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.scheduler, "update_from_output", boom)
    loop = asyncio.create_task(engine.run())
    _submit(engine, sink, 1, 5, 20)
    with pytest.raises(RuntimeError, match="could not recover"):
        async with asyncio.timeout(10):
            await loop
    assert health[0] is False


@asynctest
async def test_an_id_running_from_another_router_is_refused_on_the_second_stream_only():
    """Request ids are the clients' own, so two routers may submit the same one: the scheduler
    (its one check, ``Scheduler.add_request``) refuses the second on the stream it came from,
    and the first request runs to the end."""
    engine, _ranks, _health = _engine()
    loop = asyncio.create_task(engine.run())
    first, second = engine.attach(), engine.attach()
    for sink in (first, second):
        sink.queue.get_nowait()  # the handshake batches
    rid = _submit(engine, first, 0, 4, 6)
    _submit(engine, second, 0, 4, 6)
    (refused,) = await final_outputs(second, rid)
    assert refused.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert refused.error_message == f"request_id {rid!r} is already running"
    tokens = [t for o in await final_outputs(first, rid) for t in o.new_token_ids]
    assert tokens == [fake_token(rid, 4 + k) for k in range(6)]
    loop.cancel()
