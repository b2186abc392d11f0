"""Beam search at the router: the fan-in of its one engine request's final RequestOutput into n
choices (``services.router.beam_search_choices``), as gRPC messages, HTTP bodies and stream
chunks, against a fake engine; an engine error, a deadline and a client that goes away abort it."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.generation import EngineError, PreparedRequest, stream_responses
from services.router.openai.http import OpenAIServer
from services.router.validation import TextOptions
from tests.router import smollm2_tokenizer
from tests.router.test_beam_validation import INFO, USER

RID = "req"
EOS = 2  # SmolLM2's <|im_end|>
STOP, LENGTH, ABORT = (api_pb2.FINISH_REASON_STOP, api_pb2.FINISH_REASON_LENGTH,
                       api_pb2.FINISH_REASON_ABORT)


def ids_of(text: str) -> list[int]:
    return smollm2_tokenizer()(text, add_special_tokens=False)["input_ids"]


def beam(text: str, score: float, finish=STOP, eos=True) -> engine_pb2.BeamHypothesis:
    ids = ids_of(text) + ([EOS] if eos else [])
    return engine_pb2.BeamHypothesis(token_ids=ids, score=score, cumulative_logprob=score * 2,
                                     finish_reason=finish)


# The engine's final output of a search with 3 beams, best first.
BEAMS = [beam(" Paris is big", -0.5), beam(" Paris, France", -0.75),
         beam(" Lyon", -1.25, LENGTH, eos=False)]


def final(beams=BEAMS, cached=0) -> engine_pb2.RequestOutput:
    return engine_pb2.RequestOutput(request_id=RID, beams=beams,
                                    finish_reason=beams[0].finish_reason,
                                    num_cached_tokens=cached)


# ---- the fan-in: one engine request, n choices -------------------------------------------
class BeamEngine:
    """A scheduler replica set that answers each submit with ``outputs`` under the submitted
    id (no outputs: it never answers); records submits, aborts and releases."""

    def __init__(self, outputs=(), running=()):
        self.outputs = list(outputs)
        self.running = set(running)
        self.submitted: list[tuple[str, EngineSamplingParams, str]] = []
        self.aborted: list[str] = []
        self.released: list[str] = []
        self.info = INFO
        self.serving = asyncio.Event()
        self.serving.set()

    def submit(self, request_id, prompt_token_ids, params, *, priority=0, queue=None,
               parent_request_id="", lora=None):
        self.submitted.append((request_id, params, parent_request_id))
        for out in self.outputs:
            answer = engine_pb2.RequestOutput()
            answer.CopyFrom(out)
            answer.request_id = request_id
            queue.put_nowait(answer)
        return queue

    def is_running(self, request_id):
        return request_id in self.running

    def abort(self, request_id):
        self.aborted.append(request_id)

    def release(self, request_id):
        self.released.append(request_id)


PROMPT = ids_of("The capital of France is")
BEAM_PARAMS = EngineSamplingParams(temperature=0.0, beam_width=3)


def beam_request(n=2, skip_special_tokens=True) -> PreparedRequest:
    return PreparedRequest(RID, PROMPT, BEAM_PARAMS,
                           TextOptions(skip_special_tokens=skip_special_tokens), n=n)


async def collect(engine, req) -> list[api_pb2.GenerateResponse]:
    return [r async for r in stream_responses(engine, smollm2_tokenizer(), req)]


def test_one_engine_request_and_the_first_n_hypotheses_as_choices():
    engine = BeamEngine([final(cached=4)])
    msgs = asyncio.run(collect(engine, beam_request(n=2)))
    assert engine.submitted == [(RID, BEAM_PARAMS, "")]  # one request, its own id, no parent
    assert [m.index for m in msgs] == [0, 1] and all(m.request_id == RID for m in msgs)
    assert [m.text for m in msgs] == [" Paris is big", " Paris, France"]
    assert [list(m.token_ids) for m in msgs] == [list(b.token_ids) for b in BEAMS[:2]]
    assert [m.token_ids[-1] for m in msgs] == [EOS, EOS]  # the EOS as the engine sent it
    assert [m.finish_reason for m in msgs] == [STOP, STOP]
    assert [m.beam_score for m in msgs] == [-0.5, -0.75]
    assert [(m.usage.prompt_tokens, m.usage.completion_tokens, m.usage.num_cached_tokens)
            for m in msgs] == [(len(PROMPT), len(b.token_ids), 4) for b in BEAMS[:2]]
    assert engine.aborted == engine.released == []  # it ended in the engine


def test_all_hypotheses_with_their_own_finish_reasons_and_special_tokens_kept():
    engine = BeamEngine([final()])
    msgs = asyncio.run(collect(engine, beam_request(n=3, skip_special_tokens=False)))
    assert [m.text for m in msgs] == [" Paris is big<|im_end|>", " Paris, France<|im_end|>",
                                      " Lyon"]
    assert [m.finish_reason for m in msgs] == [STOP, STOP, LENGTH]
    assert msgs[2].usage.completion_tokens == len(ids_of(" Lyon"))


def test_an_output_without_hypotheses_ends_every_choice_with_its_reason():
    engine = BeamEngine([engine_pb2.RequestOutput(request_id=RID, finish_reason=ABORT)])
    msgs = asyncio.run(collect(engine, beam_request(n=2)))
    assert [(m.index, m.finish_reason, m.text, list(m.token_ids), m.HasField("beam_score"))
            for m in msgs] == [(0, ABORT, "", [], False), (1, ABORT, "", [], False)]


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL])
def test_an_engine_error_reaches_the_caller(code):
    engine = BeamEngine([engine_pb2.RequestOutput(request_id=RID, finish_reason=ABORT,
                                                  error_code=code.value[0],
                                                  error_message="no room for 3 beams")])
    with pytest.raises(EngineError) as e:
        asyncio.run(collect(engine, beam_request()))
    assert (e.value.code, e.value.message) == (code, "no room for 3 beams")
    assert engine.aborted == []  # the engine has already ended it


def test_a_deadline_or_cancel_aborts_the_search():
    engine = BeamEngine()  # never answers
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(collect(engine, beam_request()), 0.05))
    assert engine.aborted == engine.released == [RID]


def test_a_running_request_id_is_refused():
    engine = BeamEngine([final()], running=(RID,))
    with pytest.raises(EngineError) as e:
        asyncio.run(collect(engine, beam_request()))
    assert e.value.message == "request_id 'req' is already running"
    assert engine.submitted == [] and engine.aborted == []


# ---- over HTTP: bodies and stream chunks ---------------------------------------------------
async def post(engine, path: str, body: dict):
    """POST ``body`` to an in-process OpenAIServer over ``engine``: (status, JSON body or the
    stream's events)."""
    server = OpenAIServer(engine, smollm2_tokenizer())
    async with TestClient(TestServer(server.app)) as client:
        resp = await client.post(path, json=body)
        text = await resp.text()
    if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return resp.status, [json.loads(e) for e in events[:-1]]
    return resp.status, json.loads(text)


def test_http_chat_returns_the_hypotheses_as_choices():
    engine = BeamEngine([final(cached=3)])
    status, body = asyncio.run(post(engine, "/v1/chat/completions", {
        "messages": USER, "use_beam_search": True, "n": 2, "beam_width": 3}))
    assert status == 200
    assert [(c["index"], c["message"], c["finish_reason"]) for c in body["choices"]] == [
        (0, {"role": "assistant", "content": " Paris is big"}, "stop"),
        (1, {"role": "assistant", "content": " Paris, France"}, "stop")]
    ((_, params, parent),) = engine.submitted
    assert (params.beam_width, params.temperature, parent) == (3, 0.0, "")
    usage = body["usage"]
    assert usage["completion_tokens"] == sum(len(b.token_ids) for b in BEAMS[:2])
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3


def test_http_chat_stream_sends_each_hypothesis_whole_at_the_end():
    engine = BeamEngine([final()])
    status, events = asyncio.run(post(engine, "/v1/chat/completions", {
        "messages": USER, "use_beam_search": True, "n": 3, "stream": True,
        "stream_options": {"include_usage": True}}))
    assert status == 200
    roles, chunks, usage = events[:3], events[3:6], events[6]
    assert [e["choices"][0]["delta"] for e in roles] == [{"role": "assistant", "content": ""}] * 3
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
            for c in chunks] == [(0, {"content": " Paris is big"}, "stop"),
                                 (1, {"content": " Paris, France"}, "stop"),
                                 (2, {"content": " Lyon"}, "length")]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == sum(
        len(b.token_ids) for b in BEAMS)


def test_http_completion_with_echo_and_a_stream():
    engine = BeamEngine([final()])
    prompt = "The capital of France is"
    status, body = asyncio.run(post(engine, "/v1/completions", {
        "prompt": prompt, "use_beam_search": True, "n": 2, "beam_width": 3, "echo": True}))
    assert status == 200
    assert [c["text"] for c in body["choices"]] == [prompt + " Paris is big",
                                                    prompt + " Paris, France"]
    engine = BeamEngine([final()])
    status, events = asyncio.run(post(engine, "/v1/completions", {
        "prompt": prompt, "use_beam_search": True, "n": 2, "beam_width": 3, "stream": True}))
    assert [(e["choices"][0]["index"], e["choices"][0]["text"],
             e["choices"][0]["finish_reason"]) for e in events] == [
        (0, " Paris is big", "stop"), (1, " Paris, France", "stop")]


def test_http_refusal_and_engine_error():
    engine = BeamEngine([final()])
    status, body = asyncio.run(post(engine, "/v1/chat/completions", {
        "messages": USER, "use_beam_search": True, "temperature": 0.8}))
    assert status == 400 and body["error"]["param"] == "temperature"
    assert engine.submitted == []
    engine = BeamEngine([engine_pb2.RequestOutput(
        request_id=RID, finish_reason=ABORT, error_code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        error_message="queue is full")])
    for stream in (False, True):
        status, body = asyncio.run(post(engine, "/v1/completions", {
            "prompt": "hi", "use_beam_search": True, "stream": stream}))
        assert status == 429 and body["error"]["message"] == "queue is full"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_aborts_the_search(stream):
    engine = BeamEngine()  # never answers: the search is still running when the client leaves

    async def run():
        server = OpenAIServer(engine, smollm2_tokenizer())
        async with TestClient(TestServer(server.app)) as client:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.post("/v1/chat/completions", json={
                    "messages": USER, "use_beam_search": True, "n": 2, "stream": stream}), 0.2)
            for _ in range(100):  # the handler is cancelled once the server sees the close
                if engine.aborted:
                    break
                await asyncio.sleep(0.01)

    asyncio.run(run())
    ((rid, _, _),) = engine.submitted
    assert engine.aborted == engine.released == [rid]
