"""Backpressure: a client that stops reading its stream must not stall the others, must cost
the router bounded memory (``--max-stream-buffer``), and ends with RESOURCE_EXHAUSTED while its
engine request is aborted (no KV blocks kept)."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from pagedserve_client import Client

from services.common.pb.pagedserve.v1 import api_pb2, api_pb2_grpc
from tests.helpers import make_servable_tiny_llama
from tests.stack.conftest import _leak_check
from tests.stack_harness import InProcessStack

BUFFER = 32  # the router's --max-stream-buffer here
# NOTE: a client's HTTP/2 window normally grows with BDP probing, and what it admits piles up
# in the client process, not the router. These options pin a small window so the router's
# writes block soon, as they do for any client once its window is full.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 8192)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = make_servable_tiny_llama(tmp_path_factory.mktemp("tiny-long"),
                                     max_position_embeddings=32768)
    s = InProcessStack(model, worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB"],
                       router_argv=["--max-stream-buffer", str(BUFFER)]).start()
    yield s
    s.stop()


def _fast_streams(address: str, count: int) -> float:
    """Seconds for ``count`` concurrent 48-token streams, all read promptly."""
    def one(i):
        with Client(address) as c:
            n = sum(len(d.token_ids) for d in c.stream(prompt_token_ids=[3 + i, 4, 5],
                                                         max_tokens=48, ignore_eos=True))
            assert n == 48
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return time.monotonic() - t0


def test_a_client_that_stops_reading_is_cut_off_and_does_not_stall_others(stack):
    baseline = _fast_streams(stack.address, 4)
    with grpc.insecure_channel(stack.address, options=SMALL_WINDOW) as ch:
        call = api_pb2_grpc.GenerationServiceStub(ch).Generate(api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=[9, 8, 7]),
            sampling_params=api_pb2.SamplingParams(max_tokens=30000, ignore_eos=True)))
        next(call)  # started; from now on this client reads nothing
        with_slow = _fast_streams(stack.address, 4)
        # the slow request is aborted in the engine once its buffer overflows
        s = stack.wait_idle(timeout=120)
        assert s.num_running == 0 and s.num_waiting == 0, "the slow stream was never cut off"
        assert with_slow < 3 * baseline + 5, (baseline, with_slow)
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:  # what the transport held, then the status
                pass
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "reads too slowly" in err.value.details()
    _leak_check(stack)
    metrics = urllib.request.urlopen(
        f"http://127.0.0.1:{stack.router_args.metrics_port}/metrics", timeout=5).read().decode()
    assert ('pagedserve:router_requests_total{code="RESOURCE_EXHAUSTED",method="Generate"} 1.0'
            in metrics)


def test_max_stream_buffer_is_a_router_flag_passed_through_serve(monkeypatch):
    from services.cli.flags import forwarded_argv, serve_parser

    ns = serve_parser().parse_args(["--max-stream-buffer", "100"])
    argv = forwarded_argv("router", ns)
    assert argv[argv.index("--max-stream-buffer") + 1] == "100"
    assert "--max-stream-buffer" not in forwarded_argv("scheduler", ns)
    monkeypatch.setenv("PAGEDSERVE_MAX_STREAM_BUFFER", "7")
    assert serve_parser().parse_args([]).max_stream_buffer == 7
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--max-stream-buffer", "0"])
