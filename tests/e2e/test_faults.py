"""Faults across process boundaries, each a SIGKILL of a real service process:

- a worker killed mid-stream, then brought back (the scheduler serves again without a restart);
- one of two scheduler replicas killed: the router marks it down, its in-flight streams end
  with UNAVAILABLE, a request that had not started is retried by the SDK onto the other
  replica, and new requests keep being served;
- the router killed and a new one started on the same port: an SDK client created before
  keeps working.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest

from pagedserve_client import Client
from services.common.pb.pagedserve.v1 import engine_pb2, engine_pb2_grpc
from services.common.ports import free_ports
from tests.e2e.test_serve import CLI
from tests.helpers import make_servable_tiny_llama
from tests.parallel.conftest import stream_in_background, wait_for

pytestmark = pytest.mark.slow


def _health(address: str) -> str:
    out = subprocess.run(CLI + ["health", "--address", address, "--timeout", "1"],
                         capture_output=True, text=True)
    return out.stdout.strip()


@pytest.fixture
def tiny_model(tmp_path):
    # a long context, so the stream below is still running when the worker dies
    return make_servable_tiny_llama(tmp_path / "tiny", max_position_embeddings=32768)


def test_worker_killed_mid_stream_then_restarted(tiny_model):
    router_port, sched_port, worker_port = free_ports(3)
    router, sched, worker = (f"127.0.0.1:{p}" for p in (router_port, sched_port, worker_port))
    worker_cmd = CLI + ["worker", "--port", str(worker_port), "--metrics-port", "0",
                        "--model", tiny_model,
                        "--kv-cache-memory", "64MiB"]
    procs = [subprocess.Popen(worker_cmd),
             subprocess.Popen(CLI + ["scheduler", "--port", str(sched_port), "--workers", worker,
                                     "--metrics-port", "0"]),
             subprocess.Popen(CLI + ["router", "--port", str(router_port), "--http-port", "0",
                                     "--metrics-port", "0",
                                     "--scheduler", sched,
                                     "--model", tiny_model])]
    try:
        wait_for(lambda: _health(router) == "SERVING" or any(p.poll() is not None for p in procs),
                  120, "the stack")
        assert all(p.poll() is None for p in procs), "a service exited during start-up"
        prompt = [(5 * i) % 300 + 3 for i in range(40)]  # 2 full KV blocks + 8 tokens
        with Client(router) as c:  # puts the prompt's blocks in the prefix cache
            before = c.generate(prompt_token_ids=prompt, temperature=0, max_tokens=6,
                                ignore_eos=True)
            assert c.generate(prompt_token_ids=prompt, temperature=0, max_tokens=1,
                              ignore_eos=True).usage.num_cached_tokens == 32
        t, errors = stream_in_background(router)
        procs[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        t.join(10)
        assert errors and errors[0][0] == grpc.StatusCode.UNAVAILABLE
        assert errors[0][1] - killed_at < 5, "in-flight request not failed within 5 s"
        wait_for(lambda: _health(sched) == "NOT_SERVING", 5, "scheduler NOT_SERVING")

        procs[0] = subprocess.Popen(worker_cmd)  # a new worker on the same address
        wait_for(lambda: _health(sched) == "SERVING", 120, "scheduler serving again")
        assert procs[1].poll() is None, "the scheduler was restarted (or died)"
        with Client(router) as c:
            r = c.generate(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
            after = c.generate(prompt_token_ids=prompt, temperature=0, max_tokens=6,
                               ignore_eos=True)
        assert r.usage.completion_tokens == 4
        # The new worker's KV cache is empty: the scheduler forgot every cached prefix, so the
        # prompt is recomputed (no hit on blocks the new worker never wrote) with equal tokens.
        assert after.usage.num_cached_tokens == 0
        assert after.token_ids == before.token_ids
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


class _Procs:
    """Service processes started by a test; all stopped at the end (SIGTERM, then SIGKILL)."""

    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        self.procs[name] = subprocess.Popen(CLI + list(argv))
        return self.procs[name]

    def kill(self, name: str) -> float:
        """SIGKILL one process and reap it; returns the monotonic time of the kill."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        at = time.monotonic()
        proc.wait(10)
        return at

    def wait_serving(self, *addresses: str, timeout: float = 180) -> None:
        wait_for(lambda: all(_health(a) == "SERVING" for a in addresses)
                  or any(p.poll() is not None for p in self.procs.values()),
                  timeout, f"{addresses} serving")
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        assert not dead, f"exited during start-up: {dead}"

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


@pytest.fixture
def procs():
    p = _Procs()
    yield p
    p.stop()


def _stats(address: str) -> engine_pb2.GetEngineStatsResponse:
    with grpc.insecure_channel(address) as ch:
        return engine_pb2_grpc.EngineServiceStub(ch).GetEngineStats(
            engine_pb2.GetEngineStatsRequest(), timeout=5)


def _metric(port: int, line_prefix: str) -> float:
    """The value of the first Prometheus sample line starting with ``line_prefix`` (0 if
    none)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _stream_in_thread(address: str, results: dict, key: str, started: threading.Event,
                      client_kwargs: dict | None = None, **kwargs) -> threading.Thread:
    """Stream one request on a thread; ``results[key]`` is ("ok", tokens) or
    ("error", code, monotonic time, tokens received before it)."""
    def run():
        n = 0
        try:
            with Client(address, **(client_kwargs or {})) as c:
                for d in c.stream(**kwargs):
                    n += len(d.token_ids)
                    started.set()
            results[key] = ("ok", n)
        except grpc.RpcError as e:
            results[key] = ("error", e.code(), time.monotonic(), n)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_scheduler_replica_killed(tiny_model, procs):
    w1, w2, s1, s2, r, rm = free_ports(6)
    scheds = [f"127.0.0.1:{s1}", f"127.0.0.1:{s2}"]
    router = f"127.0.0.1:{r}"
    for wport, sport in ((w1, s1), (w2, s2)):
        procs.start(f"worker{wport}", "worker", "--port", str(wport), "--metrics-port", "0",
                    "--model", tiny_model, "--kv-cache-memory", "64MiB")
        # one running request per replica: a second one waits (has not started)
        procs.start(f"scheduler{sport}", "scheduler", "--port", str(sport), "--workers",
                    f"127.0.0.1:{wport}", "--metrics-port", "0", "--max-num-seqs", "1")
    procs.start("router", "router", "--port", str(r), "--http-port", "-1", "--metrics-port",
                str(rm), "--schedulers", ",".join(scheds), "--routing-policy", "round_robin",
                "--model", tiny_model)
    procs.wait_serving(router, *scheds)
    wait_for(lambda: _metric(rm, "pagedserve:router_replicas_available") == 2, 30,
              "both replicas available")

    # round_robin sends A, C, B to replicas x, y, x: A streams on x, C on y, B waits behind A.
    results: dict = {}
    events = {k: threading.Event() for k in "ACB"}
    threads = {"A": _stream_in_thread(router, results, "A", events["A"],
                                      prompt_token_ids=[5, 6, 7], ignore_eos=True)}
    assert events["A"].wait(60), "A never streamed"
    threads["C"] = _stream_in_thread(router, results, "C", events["C"],
                                     prompt_token_ids=[8, 9], max_tokens=400, ignore_eos=True)
    assert events["C"].wait(60), "C never streamed"
    threads["B"] = _stream_in_thread(router, results, "B", events["B"],
                                     prompt_token_ids=[10, 11], max_tokens=8, ignore_eos=True)
    x = None
    deadline = time.monotonic() + 30
    while x is None:
        assert time.monotonic() < deadline, "B never queued behind A"
        x = next((a for a in scheds if _stats(a).num_waiting == 1), None)
        time.sleep(0.1)
    assert not events["B"].is_set()
    killed_at = procs.kill(f"scheduler{x.rsplit(':', 1)[1]}")

    threads["A"].join(10)
    assert results.get("A", ("running",))[:2] == ("error", grpc.StatusCode.UNAVAILABLE), results
    assert results["A"][2] - killed_at < 5, "A's stream not failed within 5 s"
    assert results["A"][3] > 0  # it had started, so the SDK did not retry it
    # the router marked the replica down and counted A's (and B's first try's) failure there
    assert _metric(rm, "pagedserve:router_replicas_available") == 1
    assert _metric(rm, f'pagedserve:router_replica_requests_total{{code="UNAVAILABLE",'
                       f'replica="{x}"}}') >= 1
    assert _health(router) == "SERVING"
    # B had not started: its UNAVAILABLE was retried by the SDK onto the other replica
    threads["B"].join(120)
    threads["C"].join(120)
    assert results["B"] == ("ok", 8), results
    assert results["C"] == ("ok", 400), results
    # new requests keep being served, all by the replica left
    with Client(router) as c:
        for i in range(6):
            assert c.generate(prompt_token_ids=[3, i + 4], max_tokens=4,
                              ignore_eos=True).usage.completion_tokens == 4
    y = next(a for a in scheds if a != x)
    s = _stats(y)
    assert s.num_running == 0 and s.num_free_blocks == s.num_total_blocks


def test_router_killed_and_restarted_on_the_same_port(tiny_model, procs):
    w, s, r = free_ports(3)
    sched, router = f"127.0.0.1:{s}", f"127.0.0.1:{r}"
    router_cmd = ("router", "--port", str(r), "--http-port", "-1", "--metrics-port", "0",
                  "--scheduler", sched, "--model", tiny_model)
    procs.start("worker", "worker", "--port", str(w), "--metrics-port", "0", "--model",
                tiny_model, "--kv-cache-memory", "64MiB")
    procs.start("scheduler", "scheduler", "--port", str(s), "--workers", f"127.0.0.1:{w}",
                "--metrics-port", "0")
    procs.start("router", *router_cmd)
    procs.wait_serving(router)
    # generous retries: a call made while the router is down waits for the new one
    client = Client(router, max_retries=20, retry_backoff=0.5)
    try:
        assert client.generate(prompt_token_ids=[5, 6], max_tokens=3,
                               ignore_eos=True).usage.completion_tokens == 3
        procs.kill("router")
        assert _health(router) != "SERVING"
        results: dict = {}
        during = _stream_in_thread(router, results, "during", threading.Event(),
                                   {"max_retries": 20, "retry_backoff": 0.5},
                                   prompt_token_ids=[7, 8], max_tokens=5, ignore_eos=True)
        procs.start("router", *router_cmd)  # a new router on the same port
        procs.wait_serving(router)
        # the client made before the restart reconnects by itself
        assert client.generate(prompt_token_ids=[5, 6], max_tokens=3,
                               ignore_eos=True).usage.completion_tokens == 3
        during.join(60)
    finally:
        client.close()
    # a call made while no router listened had not started: the SDK retried it until the new
    # router answered
    assert results.get("during") == ("ok", 5), results
    st = _stats(sched)
    assert st.num_running == 0 and st.num_free_blocks == st.num_total_blocks
