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
        _wait_for(lambda: _health(router) == "SERVING" or any(p.poll() is not None for p in procs),
                  120, "the stack")
        assert all(p.poll() is None for p in procs), "a service exited during start-up"
        prompt = [(5 * i) % 300 + 3 for i in range(40)]  # 2 full KV blocks + 8 tokens
        with Client(router) as c:  # puts the prompt's blocks in the prefix cache
            before = c.generate(prompt_token_ids=prompt, temperature=0, max_tokens=6,
                                ignore_eos=True)
            assert c.generate(prompt_token_ids=prompt, temperature=0, max_tokens=1,
                              ignore_eos=True).usage.num_cached_tokens == 32
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
