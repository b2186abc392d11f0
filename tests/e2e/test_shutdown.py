"""Graceful shutdown across processes: SIGTERM to ``pagedserve serve`` drains the requests in
flight (router and scheduler first, the worker after), refuses new ones with UNAVAILABLE, ends
what outlives ``--shutdown-timeout`` with an explicit UNAVAILABLE, and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve_client import Client
from services.common.ports import free_ports
from tests.e2e.test_serve import CLI, _wait_healthy
from tests.helpers import make_servable_tiny_llama

pytestmark = pytest.mark.slow


def _health(address: str, service: str = "") -> str:
    """The health status name at ``address``, or "UNREACHABLE"."""
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError:
        return "UNREACHABLE"


def _wait_for(predicate, timeout: float, what: str) -> float:
    """Seconds until ``predicate()`` held (fails the test after ``timeout`` s)."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - t0


class _Stream(threading.Thread):
    """One streaming Generate call through the SDK, recording its deltas or its error."""

    def __init__(self, address: str, max_tokens: int):
        super().__init__(daemon=True)
        self.address, self.max_tokens = address, max_tokens
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: grpc.RpcError | None = None
        self.started = threading.Event()
        self.ended_at: float | None = None

    def run(self):
        try:
            with Client(self.address, max_retries=0) as c:
                for d in c.stream(prompt_token_ids=[5, 6, 7, 8], max_tokens=self.max_tokens,
                                  ignore_eos=True, temperature=0):
                    self.token_ids.extend(d.token_ids)
                    self.finish_reason = d.finish_reason or self.finish_reason
                    self.started.set()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.started.set()


@pytest.fixture
def start_serve(tmp_path):
    model = make_servable_tiny_llama(tmp_path / "tiny", max_position_embeddings=32768)
    procs = []

    def start(*flags: str) -> tuple[subprocess.Popen, dict[str, str]]:
        port, sport, wport, hport = free_ports(4)
        proc = subprocess.Popen(CLI + ["serve", "--port", str(port), "--scheduler-port",
                                       str(sport), "--worker-port", str(wport), "--http-port",
                                       str(hport), "--metrics-port", "0", "--model", model,
                                       "--kv-cache-memory", "64MiB", *flags],
                                start_new_session=True)
        procs.append(proc)
        addresses = {"router": f"127.0.0.1:{port}", "scheduler": f"127.0.0.1:{sport}",
                     "worker": f"127.0.0.1:{wport}", "http": f"http://127.0.0.1:{hport}"}
        _wait_healthy(addresses["router"], proc)
        return proc, addresses

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _post_completion(url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_sigterm_drains_requests_in_flight_then_exits_0(start_serve):
    proc, addr = start_serve("--shutdown-timeout", "60")
    max_tokens = 400
    streams = [_Stream(addr["router"], max_tokens) for _ in range(3)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60) and s.error is None, s.error
    proc.send_signal(signal.SIGTERM)
    sigterm_at = time.monotonic()

    # 1. health NOT_SERVING at once (overall and per service), router and scheduler
    took = _wait_for(lambda: _health(addr["router"]) == "NOT_SERVING", 3, "router NOT_SERVING")
    assert _health(addr["router"], "pagedserve.v1.GenerationService") == "NOT_SERVING"
    _wait_for(lambda: _health(addr["scheduler"]) == "NOT_SERVING", 3, "scheduler NOT_SERVING")
    assert _health(addr["scheduler"], "pagedserve.v1.EngineService") == "NOT_SERVING"
    # 2. new requests are refused, over gRPC and HTTP
    with Client(addr["router"], max_retries=0) as c:
        with pytest.raises(grpc.RpcError) as refused:
            c.generate(prompt_token_ids=[5, 6], max_tokens=2)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in refused.value.details()
    status, body = _post_completion(addr["http"])
    assert status == 503 and "shutting down" in body["error"]["message"], body
    # ... while the requests in flight were still running (else this test proves nothing)
    assert all(s.ended_at is None for s in streams), "the streams ended before the checks"
    assert took < 2, f"health turned NOT_SERVING {took:.2f}s after SIGTERM"

    # 3. every stream in flight finishes normally, with all its tokens
    for s in streams:
        s.join(60)
        assert s.error is None, s.error
        assert (len(s.token_ids), s.finish_reason) == (max_tokens, "length")
    # 4. exit 0 within the timeout, every service gone
    assert proc.wait(60 - (time.monotonic() - sigterm_at)) == 0
    for name in ("router", "scheduler", "worker"):
        assert _health(addr[name]) == "UNREACHABLE", f"{name} outlived serve"


def test_requests_outliving_the_shutdown_timeout_end_with_unavailable(start_serve):
    proc, addr = start_serve("--shutdown-timeout", "0.5")
    stream = _Stream(addr["router"], max_tokens=30000)  # minutes on the tiny model
    stream.start()
    assert stream.started.wait(60) and stream.error is None, stream.error
    proc.send_signal(signal.SIGTERM)
    sigterm_at = time.monotonic()
    stream.join(30)
    assert stream.error is not None, "the long stream was not ended"
    assert stream.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in stream.error.details(), stream.error.details()
    assert 0.4 < stream.ended_at - sigterm_at < 10
    assert 0 < len(stream.token_ids) < 30000 and stream.finish_reason is None
    assert proc.wait(30) == 0
