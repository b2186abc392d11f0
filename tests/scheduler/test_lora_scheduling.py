"""LoRA adapters in the scheduler: at most max_loras distinct adapters run per step (a base
request takes no slot), a request whose adapter has no slot waits without being starved, the
adapter goes to the workers with the new request and survives preemption, the prefix cache
never shares blocks between adapters, the engine maps each router's adapter ids to its own,
an adapter the workers cannot load ends its requests (only those) with the workers' error,
and the metrics report the adapters."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.common.step import StepOutput
from services.scheduler.engine import Engine, RouterSink
from services.scheduler.metrics import SchedulerMetrics
from tests.helpers import asynctest
from tests.scheduler.factories import (
    FakeRanks,
    FakeWorker,
    final_outputs,
    make_request,
    make_scheduler,
    step_output,
)

A, B, C = (LoRARequest(i, name, f"/adapters/{name}") for i, name in ((1, "a"), (2, "b"), (3, "c")))


def lora_request(index: int, lora: LoRARequest | None, prompt_len: int = 4, **sampling):
    r = make_request(index, prompt_len, arrival_time=float(index), **sampling)
    r.lora = lora
    return r


def running_adapters(scheduler) -> set[str]:
    return {r.lora.name for r in scheduler.running if r.lora is not None}


def test_at_most_max_loras_adapters_run_and_base_requests_take_no_slot():
    scheduler = make_scheduler(max_loras=2)
    for i, lora in enumerate([A, B, C, None, A]):
        scheduler.add_request(lora_request(i, lora, max_tokens=3))
    out = scheduler.schedule()
    assert running_adapters(scheduler) == {"a", "b"}
    assert {r.request_id: r.lora for r in out.new_requests} == {
        "req-0": A, "req-1": B, "req-3": None, "req-4": A}
    assert [r.request_id for r in scheduler.waiting] == ["req-2"]


def test_the_passed_over_request_keeps_its_place_in_line():
    scheduler = make_scheduler(max_loras=1)
    for i, lora in enumerate([A, B, C, A, None]):
        scheduler.add_request(lora_request(i, lora, max_tokens=3))
    scheduler.schedule()
    assert [r.request_id for r in scheduler.running] == ["req-0", "req-3", "req-4"]
    assert [r.request_id for r in scheduler.waiting] == ["req-1", "req-2"]


def _steps_until_scheduled(max_lora_skips: int, limit: int = 60) -> int | None:
    """A busy adapter A gets a new request every step; adapter B's one request arrives second.
    The step at which B's request first runs, or None within ``limit`` steps."""
    scheduler = make_scheduler(max_loras=1, max_lora_skips=max_lora_skips, max_num_seqs=64,
                               num_kv_blocks=512)
    worker = FakeWorker(scheduler)
    scheduler.add_request(lora_request(0, A, max_tokens=4, ignore_eos=True))
    starving = lora_request(1, B, max_tokens=2, ignore_eos=True)
    scheduler.add_request(starving)
    for step in range(limit):
        scheduler.add_request(lora_request(2 + step, A, max_tokens=4, ignore_eos=True))
        out = scheduler.schedule()
        if any(r.request_id == "req-1" for r in out.new_requests):
            assert starving.num_lora_skips == step  # (passed over at every step before)
            return step
        scheduler.update_from_output(out, step_output(out, worker.execute(out)))
    return None


def test_a_rare_adapter_is_not_starved_behind_a_busy_one():
    # with a bound of 3 skips it runs once A's running requests drain (4 tokens each)
    step = _steps_until_scheduled(max_lora_skips=3)
    assert step is not None and step <= 3 + 1 + 5
    # without the bound (in effect) it would wait for as long as A keeps getting requests
    assert _steps_until_scheduled(max_lora_skips=10_000) is None


def test_preemption_keeps_the_adapter_and_the_workers_keep_the_request():
    scheduler = make_scheduler(num_kv_blocks=6, block_size=4, max_model_len=24, max_loras=2)
    worker = FakeWorker(scheduler)
    early, late = lora_request(0, A, 8, max_tokens=12, ignore_eos=True), lora_request(
        1, B, 8, max_tokens=12, ignore_eos=True)
    scheduler.add_request(early)
    scheduler.add_request(late)
    resumed = False
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        resumed |= any(c.request_id == "req-1" and c.resumed_from_preemption
                       for c in out.cached_requests)
        scheduler.update_from_output(out, step_output(out, worker.execute(out)))
    assert late.num_preemptions > 0 and resumed
    assert late.lora == B and early.lora == A
    # the adapter was sent once, with the request in full; a resume is a diff of the same
    # request (the workers keep its state: it never was in finished_request_ids meanwhile)
    sent = [r for o in worker.outputs for r in o.new_requests if r.request_id == "req-1"]
    assert [r.lora for r in sent] == [B]


def test_the_prefix_cache_never_shares_blocks_between_adapters():
    scheduler = make_scheduler(block_size=4)
    worker = FakeWorker(scheduler)

    def run(index: int, lora: LoRARequest | None) -> int:
        r = lora_request(index, lora, prompt_len=1, max_tokens=1)
        r.prompt_token_ids = list(range(100, 112))  # the same 12-token prompt every time
        scheduler.add_request(r)
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            scheduler.update_from_output(out, step_output(out, worker.execute(out)))
        return r.num_cached_tokens

    assert run(0, A) == 0
    assert run(1, B) == 0  # another adapter: its K/V differ
    assert run(2, None) == 0  # the base model's too
    assert run(3, A) == 8  # the same adapter: both full blocks but the last (recomputed)
    assert run(4, None) == 8
    # the key is the adapter's name and folder, not its engine-wide id (the KV tier on disk
    # outlives the process and is shared by replicas, whose ids differ)
    assert run(5, LoRARequest(A.lora_id + 7, A.name, A.path)) == 8
    assert run(6, LoRARequest(A.lora_id, "a-again", "/elsewhere")) == 0


def test_lora_metrics_name_the_running_and_waiting_adapters():
    scheduler = make_scheduler(max_loras=1)
    metrics = SchedulerMetrics(scheduler, model_name="m")
    for i, lora in enumerate([A, B, A, None]):
        r = lora_request(i, lora, max_tokens=2)
        scheduler.add_request(r)
        metrics.observe_arrival(r.request_id, 0.0, lora.name if lora else None)
    before = time.time()
    scheduler.schedule()
    labels = {"running_lora_adapters": "a", "waiting_lora_adapters": "b", "max_lora": "1"}
    value = metrics.registry.get_sample_value("pagedserve:lora_requests_info", labels)
    assert value is not None and before <= value <= time.time()

    def count(name):
        return metrics.registry.get_sample_value(
            "pagedserve:lora_requests_total", {"model_name": "m", "lora_name": name})

    assert (count("a"), count("b")) == (2.0, 1.0)


def _submit(engine: Engine, sink: RouterSink, rid: str, lora_id: int, name: str, path: str):
    engine.submit(sink, engine_pb2.SubmitRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3],
        lora=engine_pb2.LoRARequest(lora_id=lora_id, name=name, path=path)))
    return engine.scheduler.get_request(rid)


def test_each_routers_adapter_ids_map_to_engine_wide_ids():
    engine = Engine(make_scheduler(), workers=None)
    engine.lora_slots = 2
    one, two = RouterSink(), RouterSink()
    first = _submit(engine, one, "r1", 1, "sql", "/a/sql")
    assert first.lora == LoRARequest(1, "sql", "/a/sql")
    assert _submit(engine, one, "r2", 1, "sql", "/a/sql").lora == first.lora
    # another router's id 1 is another adapter
    assert _submit(engine, two, "r3", 1, "chat", "/a/chat").lora == LoRARequest(
        2, "chat", "/a/chat")
    # a router id naming other weights (cannot happen with a router's registry): a new id
    assert _submit(engine, one, "r4", 1, "sql", "/b/sql").lora.lora_id == 3
    engine.detach(two)  # its adapters are forgotten; ids are never reused
    assert not [key for key in engine._loras if key[0] is two]
    assert _submit(engine, RouterSink(), "r6", 1, "chat", "/a/chat").lora.lora_id == 4


@pytest.mark.parametrize(("slots", "lora_id", "name", "message"), [
    (0, 1, "sql", "model 'sql' is a LoRA adapter but the workers run no adapters"),
    (1, 0, "sql", "an adapter needs a lora_id >= 1"),
    (1, 1, "", "an adapter needs a lora_id >= 1, a name and a path"),
])
def test_an_adapter_the_engine_cannot_run_is_refused_with_invalid_argument(
        slots, lora_id, name, message):
    engine = Engine(make_scheduler(), workers=None)
    engine.lora_slots = slots
    sink = RouterSink()
    assert _submit(engine, sink, "r1", lora_id, name, "/a/sql") is None
    batch = sink.queue.get_nowait()
    out = batch.outputs[0]
    assert out.error_code == 3 and message in out.error_message  # INVALID_ARGUMENT


def test_the_engine_takes_its_adapter_slots_from_the_workers():
    from services.common.pb.pagedserve.v1 import worker_pb2
    from services.scheduler.server import lora_slots_of

    def infos(*slots):
        return [worker_pb2.GetWorkerInfoResponse(max_loras=n) for n in slots]

    assert lora_slots_of(infos(0, 0), max_loras=4) == 0  # no LoRA: requests naming one refused
    assert lora_slots_of(infos(4, 4), max_loras=2) == 4
    with pytest.raises(ValueError, match="the scheduler has --max-loras 4 but the workers hold "
                                         "2 LoRA adapters at once"):
        lora_slots_of(infos(2, 2), max_loras=4)


class AdapterFailingRanks(FakeRanks):
    """Fake ranks that cannot load the adapter named "bad" in the first step that names it
    (its folder is back after that): that step leaves its new requests of "bad" out and
    reports them, as the workers' ``LoRAManager`` does (the fake worker still ran them: the
    engine must not use what it sampled)."""

    MESSAGE = "LoRA adapter 'bad': /a/bad: no such adapter folder"
    failed_once = False

    async def receive(self, out) -> StepOutput:
        result = await super().receive(out)
        failed = [] if self.failed_once else [
            r.request_id for r in out.new_requests if r.lora and r.lora.name == "bad"]
        self.failed_once |= bool(failed)
        kept = [(rid, t) for rid, t in zip(result.request_ids, result.sampled_token_ids,
                                           strict=True) if rid not in failed]
        return StepOutput(result.step_id, [rid for rid, _ in kept], [t for _, t in kept],
                          failed_request_ids=failed, failed_messages=[self.MESSAGE] * len(failed))


@asynctest
async def test_an_adapter_the_workers_cannot_load_ends_its_requests_and_only_those():
    """Two requests of "bad" (one running, one still waiting behind max_num_seqs), one of
    "good" and one of the base model: both "bad" ones end with INVALID_ARGUMENT and the
    workers' message (the waiting one too: under the failed id it could hit blocks that were
    registered but never written), the others finish, no block leaks, and a later request of
    "bad" gets a new engine-wide adapter id and runs (the workers load it again)."""
    scheduler = make_scheduler(64, max_loras=2, max_num_seqs=3)
    engine = Engine(scheduler, AdapterFailingRanks(scheduler))
    engine.lora_slots = 2
    sink = RouterSink()
    params = EngineSamplingParams(max_tokens=4, ignore_eos=True).to_pb()
    adapters = {"bad": (1, "/a/bad"), "good": (2, "/a/good")}

    def submit(index: int, model: str) -> str:
        rid = f"req-{index}"
        msg = engine_pb2.SubmitRequest(request_id=rid, prompt_token_ids=[1, 2, 3, index],
                                       sampling_params=params)
        if model:
            lora_id, path = adapters[model]
            msg.lora.CopyFrom(engine_pb2.LoRARequest(lora_id=lora_id, name=model, path=path))
        engine.submit(sink, msg)
        return rid

    rids = [submit(i, model) for i, model in enumerate(["bad", "good", "", "bad"])]
    failed_id = scheduler.get_request(rids[0]).lora.lora_id
    loop = asyncio.ensure_future(engine.run())
    try:
        finals: dict[str, engine_pb2.RequestOutput] = {}
        async with asyncio.timeout(10):
            while len(finals) < len(rids):
                finals.update((o.request_id, o) for o in (await sink.queue.get()).outputs
                              if o.finish_reason)
        for rid in (rids[0], rids[3]):
            assert finals[rid].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert finals[rid].error_message == AdapterFailingRanks.MESSAGE
        for rid in (rids[1], rids[2]):
            assert finals[rid].error_code == 0 and finals[rid].finish_reason
        assert not scheduler.has_unfinished_requests()
        assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
        retry = submit(4, "bad")
        assert scheduler.get_request(retry).lora.lora_id != failed_id
        final = (await final_outputs(sink, retry))[-1]
        assert final.error_code == 0 and final.finish_reason
    finally:
        loop.cancel()
