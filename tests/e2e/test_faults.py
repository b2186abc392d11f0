"""Faults across process boundaries: a worker killed mid-stream, then brought back."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import grpc
import pytest
from pagedserve_client import Client

from tests.e2e.test_serve import CLI, _free_ports
from tests.helpers import make_servable_tiny_llama

pytestmark = pytest.mark.slow


def _health(address: str) -> str:
    out = subprocess.run(CLI + ["health", "--address", address, "--timeout", "1"],
                         capture_output=True, text=True)
    return out.stdout.strip()


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


@pytest.fixture
def tiny_model(tmp_path):
    # a long context, so the stream below is still running when the worker dies
    return make_servable_tiny_llama(tmp_path / "tiny", max_position_embeddings=32768)


def test_worker_killed_mid_stream_then_restarted(tiny_model):
    router_port, sched_port, worker_port = _free_ports(3)
    router, sched, worker = (f"127.0.0.1:{p}" for p in (router_port, sched_port, worker_port))
    worker_cmd = CLI + ["worker", "--port", str(worker_port), "--model", tiny_model,
                        "--kv-cache-memory", "64MiB"]
    procs = [subprocess.Popen(worker_cmd),
             subprocess.Popen(CLI + ["scheduler", "--port", str(sched_port), "--workers", worker]),
             subprocess.Popen(CLI + ["router", "--port", str(router_port), "--scheduler", sched,
                                     "--model", tiny_model])]
    try:
        _wait_for(lambda: _health(router) == "SERVING" or any(p.poll() is not None for p in procs),
                  120, "the stack")
        assert all(p.poll() is None for p in procs), "a service exited during start-up"
        errors: list = []
        streaming = threading.Event()

        def long_stream():
            try:
                with Client(router) as c:
                    for _ in c.stream(prompt_token_ids=[5, 6, 7], ignore_eos=True):
                        streaming.set()
            except grpc.RpcError as e:
                errors.append((e.code(), time.monotonic()))

        t = threading.Thread(target=long_stream)
        t.start()
        assert streaming.wait(30), "no token streamed"
        procs[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        t.join(10)
        assert errors and errors[0][0] == grpc.StatusCode.UNAVAILABLE
        assert errors[0][1] - killed_at < 5, "in-flight request not failed within 5 s"
        _wait_for(lambda: _health(sched) == "NOT_SERVING", 5, "scheduler NOT_SERVING")

        procs[0] = subprocess.Popen(worker_cmd)  # a new worker on the same address
        _wait_for(lambda: _health(sched) == "SERVING", 120, "scheduler serving again")
        with Client(router) as c:
            r = c.generate(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
        assert r.usage.completion_tokens == 4
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
