"""Readiness follows the ability to serve, across real processes (issue 15, item 3).

Worker, scheduler and router run as separate processes. With the worker killed (while idle),
the scheduler and the router report NOT_SERVING (gRPC health "" and the service name) and the
router's ``GET /health`` answers 503 within 5 s, while requests get a clear UNAVAILABLE / 503;
once a new worker is up, all are SERVING / 200 again. Liveness (the ``liveness`` health name)
stays SERVING on the router and the scheduler throughout, so Kubernetes never restarts them for
waiting on their workers.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import pytest

from services.common.grpc_utils import LIVENESS, health_status
from services.common.pb.pagedserve.v1 import api_pb2, api_pb2_grpc
from services.common.ports import free_ports
from tests.e2e.test_serve import CLI
from tests.helpers import make_servable_tiny_llama

pytestmark = pytest.mark.slow
ROUTER_SERVICE = "pagedserve.v1.GenerationService"


def _health(address: str, service: str = "") -> str:
    return asyncio.run(health_status(address, 1.0, service=service))


def _http(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_for(predicate, timeout: float, what: str, procs=()) -> float:
    """Poll ``predicate`` every 0.1 s; returns the seconds it took (fails after ``timeout``)."""
    t0 = time.monotonic()
    while not predicate():
        assert all(p.poll() is None for p in procs), f"a service exited waiting for {what}"
        assert time.monotonic() - t0 < timeout, f"timed out ({timeout} s) waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_readiness_follows_the_workers_and_liveness_stays(tmp_path):
    model = make_servable_tiny_llama(tmp_path / "tiny")
    router_port, http_port, sched_port, worker_port = free_ports(4)
    router, sched, worker = (f"127.0.0.1:{p}" for p in (router_port, sched_port, worker_port))
    health_url = f"http://127.0.0.1:{http_port}/health"
    worker_cmd = CLI + ["worker", "--port", str(worker_port), "--metrics-port", "0",
                        "--model", model, "--kv-cache-memory", "64MiB"]
    procs = {"worker": subprocess.Popen(worker_cmd)}
    try:
        procs["scheduler"] = subprocess.Popen(CLI + [
            "scheduler", "--port", str(sched_port), "--workers", worker, "--metrics-port", "0"])
        procs["router"] = subprocess.Popen(CLI + [
            "router", "--port", str(router_port), "--http-port", str(http_port),
            "--metrics-port", "0", "--scheduler", sched, "--model", model])
        alive = list(procs.values())
        # liveness answers SERVING as soon as the servers are up, before they can serve
        _wait_for(lambda: _health(sched, LIVENESS) == "SERVING", 60, "scheduler liveness", alive)
        _wait_for(lambda: _health(router, LIVENESS) == "SERVING", 60, "router liveness", alive)
        _wait_for(lambda: _health(router) == "SERVING", 180, "the stack", alive)
        assert _http(health_url)[0] == 200

        def readiness() -> tuple:
            return (_health(router), _health(router, ROUTER_SERVICE), _http(health_url)[0],
                    _health(sched))

        # 1. the worker dies while idle: NOT_SERVING / 503 within 5 s, liveness unchanged
        procs["worker"].send_signal(signal.SIGKILL)
        procs["worker"].wait(10)
        down = _wait_for(lambda: readiness() == ("NOT_SERVING", "NOT_SERVING", 503,
                                                 "NOT_SERVING"), 5, "NOT_SERVING")
        print(f"\nworker killed -> router NOT_SERVING and /health 503 after {down:.2f} s")
        assert _health(router, LIVENESS) == _health(sched, LIVENESS) == "SERVING"
        status, body = _http(f"http://127.0.0.1:{http_port}/v1/completions",
                             {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and "no worker" in json.loads(body)["error"]["message"]
        with grpc.insecure_channel(router) as channel:
            with pytest.raises(grpc.RpcError) as e:
                list(api_pb2_grpc.GenerationServiceStub(channel).Generate(
                    api_pb2.GenerateRequest(prompt="hi", sampling_params=api_pb2.SamplingParams(
                        max_tokens=2)), timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no worker" in e.value.details()

        # 2. a new worker on the same address: SERVING / 200 again
        restarted = time.monotonic()
        procs["worker"] = subprocess.Popen(worker_cmd)
        alive = list(procs.values())
        _wait_for(lambda: _health(sched) == "SERVING", 180, "scheduler SERVING again", alive)
        sched_up = time.monotonic() - restarted
        lag = _wait_for(lambda: readiness() == ("SERVING", "SERVING", 200, "SERVING"), 5,
                        "router SERVING again", alive)
        print(f"worker restarted -> scheduler SERVING after {sched_up:.2f} s, "
              f"router SERVING and /health 200 {lag:.2f} s later")
        assert _health(router, LIVENESS) == _health(sched, LIVENESS) == "SERVING"
        status, body = _http(f"http://127.0.0.1:{http_port}/v1/completions",
                             {"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
