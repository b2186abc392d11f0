"""SDK deadlines and retries against a scripted GenerationService (real gRPC on loopback):
UNAVAILABLE before the first message is retried with backoff, never after one; other codes are
never retried; the per-call deadline covers the retries."""

from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
import pytest
from pagedserve_client import AsyncClient, Client
from pagedserve_client.pb.pagedserve.v1 import api_pb2, api_pb2_grpc


class Scripted(api_pb2_grpc.GenerationServiceServicer):
    """Fails the first ``failures`` calls with ``code``; then streams two messages. With
    ``fail_after_first`` every call sends one message and then fails with UNAVAILABLE."""

    def __init__(self, failures=0, code=grpc.StatusCode.UNAVAILABLE, fail_after_first=False,
                 delay=0.0):
        self.failures, self.code, self.fail_after_first, self.delay = (
            failures, code, fail_after_first, delay)
        self.calls = 0

    def Generate(self, request, context):
        self.calls += 1
        time.sleep(self.delay)
        if self.calls <= self.failures:
            context.abort(self.code, f"scripted failure {self.calls}")
        yield api_pb2.GenerateResponse(request_id="r", token_ids=[1], text="a")
        if self.fail_after_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "died mid-stream")
        yield api_pb2.GenerateResponse(request_id="r", token_ids=[2], text="b",
                                       finish_reason=api_pb2.FINISH_REASON_LENGTH)

    def ListModels(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            context.abort(self.code, "scripted failure")
        return api_pb2.ListModelsResponse()


@pytest.fixture
def serve():
    servers = []

    def start(servicer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        api_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"
    yield start
    for s in servers:
        s.stop(None)


def test_unavailable_before_the_first_message_is_retried(serve):
    svc = Scripted(failures=2)
    with Client(serve(svc), retry_backoff=0.01) as c:
        r = c.generate(prompt="x")
    assert (r.text, svc.calls) == ("ab", 3)


def test_retries_give_up_after_max_retries(serve):
    svc = Scripted(failures=5)
    with Client(serve(svc), max_retries=2, retry_backoff=0.01) as c, \
            pytest.raises(grpc.RpcError) as err:
        c.generate(prompt="x")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and svc.calls == 3


def test_no_retry_once_a_message_arrived(serve):
    svc = Scripted(fail_after_first=True)
    got = []
    with Client(serve(svc), retry_backoff=0.01) as c, pytest.raises(grpc.RpcError) as err:
        for d in c.stream(prompt="x"):
            got.append(d.text)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert got == ["a"] and svc.calls == 1  # the delivered token is not generated twice


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_other_codes_are_not_retried(serve, code):
    svc = Scripted(failures=1, code=code)
    with Client(serve(svc), retry_backoff=0.01) as c, pytest.raises(grpc.RpcError) as err:
        c.generate(prompt="x")
    assert err.value.code() == code and svc.calls == 1


def test_per_call_deadline_overrides_the_client_default(serve):
    svc = Scripted(delay=1.0)
    with Client(serve(svc), timeout=30) as c:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            c.generate(prompt="x", timeout=0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 1.0


def test_deadline_covers_the_retries(serve):
    svc = Scripted(failures=100)
    with Client(serve(svc), max_retries=100, retry_backoff=0.1) as c:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError):
            c.generate(prompt="x", timeout=0.5)
        assert time.monotonic() - t0 < 1.5 and svc.calls < 10


def test_unary_calls_are_retried_too(serve):
    svc = Scripted(failures=1)
    with Client(serve(svc), retry_backoff=0.01) as c:
        assert c.list_models() == [] and svc.calls == 2


def test_async_client_retries_and_honours_deadlines(serve):
    svc = Scripted(failures=1)
    address = serve(svc)

    async def run():
        async with AsyncClient(address, retry_backoff=0.01) as c:
            r = await c.generate(prompt="x")
            slow = Scripted(delay=1.0)
            async with AsyncClient(serve(slow)) as c2:
                with pytest.raises(grpc.RpcError) as err:
                    await c2.generate(prompt="x", timeout=0.2)
            return r, err.value.code()
    r, code = asyncio.run(run())
    assert (r.text, svc.calls) == ("ab", 2)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
