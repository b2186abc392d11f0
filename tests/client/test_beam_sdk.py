"""The SDK's beam search: the keyword arguments of every generating method (sync and async)
reach SamplingParams, ``early_stopping`` in vLLM's forms, and ``beam_score`` on deltas, choices
and results; against a scripted GenerationService over real gRPC on loopback."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from pagedserve_client import AsyncClient, Client, build_request
from pagedserve_client.pb.pagedserve.v1 import api_pb2, api_pb2_grpc
from pagedserve_client.types import delta_from_pb, join

BEAM = {"use_beam_search": True, "n": 2, "beam_width": 4, "length_penalty": 0.5,
        "early_stopping": "never"}
STOP, LENGTH = api_pb2.FINISH_REASON_STOP, api_pb2.FINISH_REASON_LENGTH


def _final(index: int, text: str, ids: list[int], score: float, reason=STOP):
    return api_pb2.GenerateResponse(
        request_id="r", index=index, text=text, token_ids=ids, finish_reason=reason,
        beam_score=score, usage=api_pb2.Usage(prompt_tokens=3, completion_tokens=len(ids)))


ANSWER = [_final(0, " Paris", [5, 2], -0.25), _final(1, " Lyon", [6], -1.5, LENGTH)]


@pytest.mark.parametrize("value, wire", [(True, "true"), (False, "false"), ("never", "never"),
                                         ("true", "true")])
def test_beam_kwargs_reach_sampling_params(value, wire):
    sp = build_request("hi", **{**BEAM, "early_stopping": value}).sampling_params
    assert (sp.use_beam_search, sp.n, sp.beam_width, sp.length_penalty, sp.early_stopping) == (
        True, 2, 4, 0.5, wire)
    plain = build_request("hi").sampling_params
    assert not plain.use_beam_search and not plain.HasField("beam_width")
    assert not plain.HasField("length_penalty") and not plain.HasField("early_stopping")


def test_beam_kwarg_type_errors_name_the_field():
    with pytest.raises(TypeError, match="early_stopping"):
        build_request("hi", use_beam_search=True, early_stopping=1)
    with pytest.raises(TypeError, match="beam_width"):
        build_request("hi", use_beam_search=True, beam_width="4")
    with pytest.raises(ValueError, match="beam_width"):
        build_request("hi", use_beam_search=True, beam_width=2**40)


def test_beam_score_on_deltas_choices_and_result():
    deltas = [delta_from_pb(m) for m in ANSWER]
    assert [d.beam_score for d in deltas] == [-0.25, -1.5]
    assert delta_from_pb(api_pb2.GenerateResponse(token_ids=[1])).beam_score is None
    result = join(deltas)
    assert [(c.text, c.token_ids, c.finish_reason, c.beam_score) for c in result.choices] == [
        (" Paris", [5, 2], "stop", -0.25), (" Lyon", [6], "length", -1.5)]
    assert result.beam_score == -0.25 and result.text == " Paris"
    assert join([delta_from_pb(api_pb2.GenerateResponse(finish_reason=STOP))]).beam_score is None


class Recorder(api_pb2_grpc.GenerationServiceServicer):
    """Answers Generate and Chat with ``ANSWER``; keeps the sampling params it received."""

    def __init__(self):
        self.received: list[api_pb2.SamplingParams] = []

    def Generate(self, request, context):
        self.received.append(request.sampling_params)
        yield from ANSWER

    def Chat(self, request, context):
        self.received.append(request.sampling_params)
        for m in ANSWER:
            yield api_pb2.ChatResponse(delta=m)


@pytest.fixture
def recorder():
    servicer = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    api_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def _check(servicer: Recorder, calls: int) -> None:
    assert len(servicer.received) == calls
    for sp in servicer.received:
        assert (sp.use_beam_search, sp.n, sp.beam_width, sp.length_penalty,
                sp.early_stopping) == (True, 2, 4, 0.5, "never")


def test_every_sync_method_takes_the_beam_kwargs(recorder):
    servicer, address = recorder
    messages = [{"role": "user", "content": "Capital of France?"}]
    with Client(address) as c:
        results = [c.generate("hi", **BEAM), c.chat(messages, **BEAM),
                   join(list(c.stream("hi", **BEAM))),
                   join(list(c.chat_stream(messages, **BEAM)))]
    _check(servicer, 4)
    for r in results:
        assert [ch.beam_score for ch in r.choices] == [-0.25, -1.5]


def test_every_async_method_takes_the_beam_kwargs(recorder):
    servicer, address = recorder
    messages = [{"role": "user", "content": "Capital of France?"}]

    async def run():
        async with AsyncClient(address) as c:
            return [await c.generate("hi", **BEAM), await c.chat(messages, **BEAM),
                    join([d async for d in c.stream("hi", **BEAM)]),
                    join([d async for d in c.chat_stream(messages, **BEAM)])]

    results = asyncio.run(run())
    _check(servicer, 4)
    for r in results:
        assert r.beam_score == -0.25 and r.choices[1].beam_score == -1.5
