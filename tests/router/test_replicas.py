"""``ReplicaSet`` against fake replicas: the routing policies, n choices kept together, abort /
release reaching the owner, replicas taken out when down or disagreeing, health, and DNS
membership changes (drain, then close)."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from services.common.pb.pagedserve.v1 import engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.replicas import (AFFINITY_MARGIN, ReplicaSet, parse_targets,
                                      pick_rendezvous, prefix_key)
from tests.helpers import asynctest

BLOCK = 4
INFO = engine_pb2.GetEngineInfoResponse(model="m", max_model_len=64, vocab_size=100,
                                        block_size=BLOCK)
PARAMS = EngineSamplingParams()


class FakeReplica:
    """An EngineClient stand-in: ``up()`` / ``down()`` drive the connection, ``workers(ok)``
    its engine's workers; submits are recorded and stay in flight until ``finish``."""

    def __init__(self, address, on_serving=None, info=INFO):
        self.address, self.on_serving, self.info = address, on_serving, info
        self.load = engine_pb2.LoadReport()
        self.connected = asyncio.Event()
        self.serving = asyncio.Event()
        self.pending: dict[str, str] = {}  # request id -> parent id
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.closed = False

    def connect_in_background(self):
        pass

    async def up(self, info=None):
        self.info = info or self.info
        self.connected.set()
        self.serving.set()
        await self.on_serving(True)

    async def down(self):
        self.connected.clear()
        self.serving.clear()
        self.pending.clear()
        await self.on_serving(False)

    async def workers(self, ok: bool):
        """The engine lost its workers (False) or has them back (True); the stream stays up."""
        self.load = engine_pb2.LoadReport(waiting_for_workers=not ok)
        if ok:
            self.serving.set()
        else:
            self.serving.clear()
        await self.on_serving(ok)

    @property
    def num_pending(self):
        return len(self.pending)

    def submit(self, request_id, prompt_token_ids, params, *, priority=0, queue=None,
               parent_request_id="", lora=None):
        queue = asyncio.Queue() if queue is None else queue
        self.pending[request_id] = parent_request_id
        self.submitted.append(request_id)
        return queue

    def is_running(self, request_id):
        return request_id in self.pending

    def abort(self, request_id):
        self.aborted.append(request_id)

    def release(self, request_id):
        self.pending.pop(request_id, None)

    def finish(self, request_id):
        self.pending.pop(request_id, None)

    async def close(self):
        self.closed = True


class Harness:
    """A ReplicaSet over fakes, with the health callback's calls recorded."""

    def __init__(self, addresses=("a:1", "b:1"), **kwargs):
        self.fakes: dict[str, FakeReplica] = {}
        self.health: list[bool] = []

        def factory(address, on_serving):
            self.fakes[address] = FakeReplica(address, on_serving)
            return self.fakes[address]

        async def on_serving(up):
            self.health.append(up)

        self.rs = ReplicaSet(list(addresses), client_factory=factory,
                             on_serving=on_serving, **kwargs)

    async def start(self, up=None):
        task = asyncio.create_task(self.rs.start(timeout=5))
        await asyncio.sleep(0)
        for address in (up if up is not None else list(self.fakes)):
            await self.fakes[address].up()
        return await task

    def where(self, request_id) -> str:
        return next(a for a, f in self.fakes.items() if request_id in f.submitted)


def prompt(seed: int, length: int = 3 * BLOCK) -> list[int]:
    return [(seed * 31 + i) % 97 for i in range(length)]


@asynctest
async def test_round_robin_alternates():
    h = Harness(policy="round_robin")
    assert (await h.start()).model == "m"
    for i in range(6):
        h.rs.submit(f"r{i}", prompt(i), PARAMS)
    assert [len(f.submitted) for f in h.fakes.values()] == [3, 3]


@asynctest
async def test_least_loaded_uses_the_report_and_own_in_flight_count():
    h = Harness(policy="least_loaded")
    await h.start()
    h.fakes["a:1"].load = engine_pb2.LoadReport(num_running=5, num_waiting=2)
    h.rs.submit("r0", prompt(0), PARAMS)
    assert h.where("r0") == "b:1"
    # a burst before any new report: this router's own in-flight count spreads it
    for i in range(1, 12):
        h.rs.submit(f"r{i}", prompt(i), PARAMS)
    counts = {a: len(f.submitted) for a, f in h.fakes.items()}
    # b takes requests until its 7 in flight equal a's reported 7, then they alternate
    assert h.fakes["b:1"].submitted[:7] == [f"r{i}" for i in range(7)]
    assert counts["a:1"] in (4, 5) and sum(counts.values()) == 12


@asynctest
async def test_least_loaded_breaks_ties_by_kv_usage():
    h = Harness(policy="least_loaded")
    await h.start()
    h.fakes["a:1"].load = engine_pb2.LoadReport(num_running=1, kv_cache_usage=0.9)
    h.fakes["b:1"].load = engine_pb2.LoadReport(num_running=1, kv_cache_usage=0.1)
    for i in range(3):
        h.rs.submit(f"r{i}", prompt(i), PARAMS)
        h.fakes[h.where(f"r{i}")].finish(f"r{i}")
    assert {h.where(f"r{i}") for i in range(3)} == {"b:1"}


@asynctest
async def test_prefix_affinity_groups_a_shared_prefix_and_spreads_others():
    h = Harness(policy="prefix_affinity", affinity_blocks=2)
    await h.start()
    shared = prompt(1, 2 * BLOCK)
    for i in range(6):  # same first 2 blocks, different tails
        h.rs.submit(f"s{i}", shared + prompt(100 + i, BLOCK + i), PARAMS)
        h.fakes[h.where(f"s{i}")].finish(f"s{i}")
    assert len({h.where(f"s{i}") for i in range(6)}) == 1
    for i in range(40):
        h.rs.submit(f"u{i}", prompt(1000 + i), PARAMS)
        h.fakes[h.where(f"u{i}")].finish(f"u{i}")
    spread = collections.Counter(h.where(f"u{i}") for i in range(40))
    assert len(spread) == 2 and min(spread.values()) >= 8


@asynctest
async def test_prefix_affinity_falls_back_past_the_margin():
    h = Harness(policy="prefix_affinity")
    await h.start()
    p = prompt(3)
    home = pick_rendezvous(prefix_key(p, BLOCK, 2), ["a:1", "b:1"])
    other = "b:1" if home == "a:1" else "a:1"
    h.fakes[home].load = engine_pb2.LoadReport(num_running=AFFINITY_MARGIN)
    h.rs.submit("r0", p, PARAMS)
    assert h.where("r0") == home  # within the margin: affinity wins
    h.fakes[home].load = engine_pb2.LoadReport(num_running=AFFINITY_MARGIN + 2)
    h.rs.submit("r1", p, PARAMS)
    assert h.where("r1") == other


@asynctest
async def test_prefix_affinity_without_a_full_block_goes_least_loaded():
    h = Harness(policy="prefix_affinity")
    await h.start()
    h.fakes["a:1"].load = engine_pb2.LoadReport(num_waiting=3)
    h.rs.submit("r0", [1, 2], PARAMS)
    assert h.where("r0") == "b:1"


def test_rendezvous_moves_only_the_removed_replicas_keys():
    keys = [prefix_key(prompt(i), BLOCK, 2) for i in range(300)]
    three = ["a:1", "b:1", "c:1"]
    before = {k: pick_rendezvous(k, three) for k in keys}
    after = {k: pick_rendezvous(k, ["a:1", "b:1"]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "c:1" for k in moved)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "prefix_affinity"])
@asynctest
async def test_the_choices_of_one_request_share_a_replica(policy):
    h = Harness(policy=policy)
    await h.start()
    for parent in ("p", "q", "r", "s"):
        for i in range(4):
            h.rs.submit(f"{i}_{parent}", prompt(i), PARAMS, parent_request_id=parent)
        assert len({h.where(f"{i}_{parent}") for i in range(4)}) == 1


@asynctest
async def test_abort_release_and_is_running_reach_the_owner():
    h = Harness(policy="round_robin")
    await h.start()
    h.rs.submit("x", prompt(0), PARAMS)
    owner = h.fakes[h.where("x")]
    assert h.rs.is_running("x") and not h.rs.is_running("y")
    h.rs.abort("x")
    assert owner.aborted == ["x"]
    assert all(f.aborted == [] for f in h.fakes.values() if f is not owner)
    h.rs.release("x")
    assert not h.rs.is_running("x")


@asynctest
async def test_a_running_id_is_refused_in_the_router_before_any_replica(monkeypatch):
    """The one router-side check (``stream_responses``) sees the ids of every replica, also
    of one draining after a DNS change: a client reusing a running id gets INVALID_ARGUMENT
    and no replica gets anything."""
    from services.router.generation import EngineError, PreparedRequest, stream_responses
    from services.router.validation import TextOptions
    from tests.router import tiny_bos_tokenizer

    answers = [["10.0.0.1:7", "10.0.0.2:7"], ["10.0.0.2:7"]]
    h = Harness(addresses=(), dns_target="svc:7", dns_refresh=3600, policy="round_robin")

    async def resolve():
        return answers[0]
    monkeypatch.setattr(h.rs, "_resolve", resolve)
    await h.start()
    h.rs.submit("x", prompt(0), PARAMS)
    h.rs.submit("y", prompt(1), PARAMS)
    draining = h.fakes[h.where("x")]
    answers[0] = [a for a in answers[0] if a != draining.address]
    await h.rs.refresh()
    assert draining.address not in h.rs.replicas and h.rs.is_running("x")
    for rid in ("x", "y"):
        req = PreparedRequest(rid, prompt(2), PARAMS, TextOptions())
        with pytest.raises(EngineError) as err:
            await anext(stream_responses(h.rs, tiny_bos_tokenizer(), req))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.message == f"request_id {rid!r} is already running"
    assert sorted(r for f in h.fakes.values() for r in f.submitted) == ["x", "y"]
    await h.rs.close()


@asynctest
async def test_a_replica_down_is_skipped_and_health_follows_the_last_one():
    h = Harness(policy="round_robin")
    await h.start()
    assert h.health == [True] and h.rs.serving.is_set()
    await h.fakes["a:1"].down()
    for i in range(4):
        h.rs.submit(f"r{i}", prompt(i), PARAMS)
    assert h.fakes["a:1"].submitted == [] and len(h.fakes["b:1"].submitted) == 4
    assert h.health == [True]
    await h.fakes["b:1"].down()
    assert h.health == [True, False] and not h.rs.serving.is_set()
    out = h.rs.submit("late", prompt(0), PARAMS).get_nowait()
    assert out.error_code == grpc.StatusCode.UNAVAILABLE.value[0]
    await h.fakes["a:1"].up()
    assert h.health == [True, False, True]


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "prefix_affinity"])
@asynctest
async def test_a_replica_without_workers_gets_nothing_and_health_follows_the_engines(policy):
    """A replica whose stream is up but whose engine waits for its workers takes no new
    request; the set is serving (router readiness) exactly while one engine can serve."""
    h = Harness(policy=policy)
    await h.start()
    await h.fakes["a:1"].workers(False)
    assert h.health == [True] and h.rs.serving.is_set()
    for i in range(6):
        h.rs.submit(f"r{i}", prompt(i), PARAMS)
    assert h.fakes["a:1"].submitted == [] and len(h.fakes["b:1"].submitted) == 6
    await h.fakes["b:1"].workers(False)
    assert h.health == [True, False] and not h.rs.serving.is_set()
    out = h.rs.submit("late", prompt(0), PARAMS).get_nowait()
    assert out.error_code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "no worker" in out.error_message and "retry later" in out.error_message
    await h.fakes["a:1"].workers(True)
    assert h.health == [True, False, True] and h.rs.serving.is_set()
    h.rs.submit("back", prompt(0), PARAMS)
    assert h.where("back") == "a:1"


@asynctest
async def test_no_replica_connected_is_unavailable_not_no_worker():
    h = Harness(policy="round_robin")
    await h.start()
    await h.fakes["a:1"].down()
    await h.fakes["b:1"].down()
    out = h.rs.submit("x", prompt(0), PARAMS).get_nowait()
    assert out.error_code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert out.error_message == "scheduler a:1,b:1 unavailable"


@asynctest
async def test_a_replica_with_another_model_is_refused(caplog):
    h = Harness(policy="round_robin")
    task = asyncio.create_task(h.rs.start(timeout=5))
    await asyncio.sleep(0)
    await h.fakes["a:1"].up()
    other = engine_pb2.GetEngineInfoResponse()
    other.CopyFrom(INFO)
    other.max_model_len = 32
    await h.fakes["b:1"].up(info=other)
    await task
    assert "max_model_len=32 (expected 64)" in caplog.text
    assert h.rs.available() == [h.fakes["a:1"]]
    for i in range(3):
        h.rs.submit(f"r{i}", prompt(i), PARAMS)
    assert h.fakes["b:1"].submitted == []


@asynctest
async def test_start_times_out_without_a_replica():
    h = Harness()
    with pytest.raises(TimeoutError, match="no scheduler of a:1,b:1 ready"):
        await h.rs.start(timeout=0.05)


@asynctest
async def test_dns_refresh_adds_and_drains(monkeypatch):
    answers = [["10.0.0.1:7", "10.0.0.2:7"], ["10.0.0.2:7", "10.0.0.3:7"]]
    h = Harness(addresses=(), dns_target="svc:7", dns_refresh=3600)

    async def resolve():
        return answers[0]
    monkeypatch.setattr(h.rs, "_resolve", resolve)
    await h.start()
    assert set(h.rs.replicas) == {"10.0.0.1:7", "10.0.0.2:7"}
    h.fakes["10.0.0.1:7"].pending["busy"] = ""
    answers.pop(0)
    await h.rs.refresh()
    assert set(h.rs.replicas) == {"10.0.0.2:7", "10.0.0.3:7"}
    old = h.fakes["10.0.0.1:7"]
    assert not old.closed and h.rs.is_running("busy")  # drains: its request still ends there
    h.rs.release("busy")
    await asyncio.sleep(0)
    assert old.closed
    await h.rs.close()


def test_parse_targets():
    assert parse_targets("a:1, b:2") == (["a:1", "b:2"], None)
    assert parse_targets("dns:///svc.ns:50052") == ([], "svc.ns:50052")
    for bad in ("", "a", "a:1,a:1", "dns:///svc:1,b:2", "a:x"):
        with pytest.raises(ValueError):
            parse_targets(bad)


def test_router_flags(capsys):
    import argparse

    from services.router import server
    p = argparse.ArgumentParser()
    server.add_args(p)
    ns = p.parse_args([])
    assert (ns.schedulers, ns.routing_policy) == (None, "prefix_affinity")
    assert server.replica_set(ns).replicas == {}  # nothing connects before start()
    ns = p.parse_args(["--schedulers", "a:1,b:2", "--scheduler", "c:3"])
    rs = server.replica_set(ns)
    assert rs._static == ["a:1", "b:2"]  # --schedulers wins over --scheduler
    with pytest.raises(SystemExit):
        p.parse_args(["--schedulers", "a"])
    assert "argument --schedulers: scheduler address must be host:port" in capsys.readouterr().err


@asynctest
async def test_a_failed_resolution_keeps_the_replicas(monkeypatch):
    h = Harness(addresses=(), dns_target="svc:7", dns_refresh=3600)
    answers = [["10.0.0.1:7"]]

    async def resolve():
        if not answers:
            raise OSError("no such name")
        return answers.pop()
    monkeypatch.setattr(h.rs, "_resolve", resolve)
    await h.start()
    await h.rs.refresh()
    assert set(h.rs.replicas) == {"10.0.0.1:7"} and h.rs.serving.is_set()
    await h.rs.close()


@asynctest
async def test_resolve_a_real_name():
    rs = ReplicaSet(dns_target="localhost:7")
    assert "127.0.0.1:7" in await rs._resolve()


@asynctest
async def test_a_name_that_resolves_later_is_retried(monkeypatch):
    h = Harness(addresses=(), dns_target="svc:7", dns_refresh=0.01)
    answers = [["10.0.0.1:7"], None]

    async def resolve():
        answer = answers.pop()
        if answer is None:
            raise OSError("no such name yet")
        return answer
    monkeypatch.setattr(h.rs, "_resolve", resolve)
    task = asyncio.create_task(h.rs.start(timeout=5))
    while "10.0.0.1:7" not in h.fakes:
        await asyncio.sleep(0.01)
    await h.fakes["10.0.0.1:7"].up()
    assert (await task).model == "m"
    await h.rs.close()
