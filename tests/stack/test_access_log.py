"""The access log: every public request leaves one line when it ends — OpenAI HTTP (whole JSON
and streamed: when the stream ends) and gRPC alike — with its request id, route, status,
prompt and completion tokens and duration, and never the prompt's text."""

from __future__ import annotations

import json
import logging
import time

import grpc
import pytest
import requests

from services.common.logs import JsonFormatter, record_request_id
from services.common.pb.pagedserve.v1 import api_pb2, api_pb2_grpc

SECRET = "walrus-tangerine-obelisk"


def _access(caplog, request_id: str, timeout: float = 5.0) -> list[logging.LogRecord]:
    """The access log records of ``request_id`` (waiting a moment: a stream's line is written
    once the server has ended it, which may be just after the client read the last byte)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in caplog.records
                 if r.name == "pagedserve.access" and record_request_id(r) == request_id]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _fields(record: logging.LogRecord) -> dict:
    """The record as the JSON log format writes it."""
    return json.loads(JsonFormatter("router").format(record))


@pytest.mark.parametrize("stream", [False, True])
def test_openai_request_leaves_one_access_line(tiny, caplog, stream):
    body = {"prompt": f"say {SECRET}", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with caplog.at_level(logging.INFO):
        r = requests.post(f"{tiny.http_url}/v1/completions", json=body, timeout=60,
                          headers={"X-Request-Id": f"http-{stream}"})
        assert r.status_code == 200 and r.headers["X-Request-Id"] == f"http-{stream}"
        if stream:
            events = [e.removeprefix("data: ") for e in r.text.strip().split("\n\n")]
            usage = json.loads(events[-2])["usage"]
        else:
            usage = r.json()["usage"]
        (record,) = _access(caplog, f"http-{stream}")
    line = _fields(record)
    assert line["logger"] == "pagedserve.access" and line["level"] == "INFO"
    assert line["request_id"] == f"http-{stream}"
    assert line["route"] == "/v1/completions" and line["status"] == 200
    assert line["prompt_tokens"] == usage["prompt_tokens"] > 0
    assert line["completion_tokens"] == usage["completion_tokens"] == 5
    assert 0 < line["duration_ms"] < 60_000
    info_text = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert SECRET not in info_text


def test_openai_request_without_an_id_is_logged_under_the_response_id(tiny, caplog):
    with caplog.at_level(logging.INFO):
        r = requests.post(f"{tiny.http_url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200
        rid = r.json()["id"]
        assert rid.startswith("chatcmpl-") and r.headers["X-Request-Id"] == rid
        (record,) = _access(caplog, rid)
    line = _fields(record)
    assert line["route"] == "/v1/chat/completions" and line["status"] == 200
    assert line["completion_tokens"] == r.json()["usage"]["completion_tokens"]


def test_refused_openai_request_is_logged_with_its_status(tiny, caplog):
    with caplog.at_level(logging.INFO):
        r = requests.post(f"{tiny.http_url}/v1/completions", timeout=60,
                          headers={"X-Request-Id": "bad-temperature"},
                          json={"prompt": "a", "temperature": -1})
        assert r.status_code == 400
        (record,) = _access(caplog, "bad-temperature")
    line = _fields(record)
    assert line["status"] == 400 and line["completion_tokens"] == 0


def test_grpc_request_leaves_the_same_line(tiny, caplog):
    with caplog.at_level(logging.INFO):
        with grpc.insecure_channel(tiny.address) as channel:
            params = api_pb2.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, n=2)
            responses = list(api_pb2_grpc.GenerationServiceStub(channel).Generate(
                api_pb2.GenerateRequest(prompt=f"say {SECRET}", sampling_params=params),
                metadata=(("x-request-id", "grpc-1"),), timeout=60))
        (record,) = _access(caplog, "grpc-1")
    line = _fields(record)
    assert line["route"] == "/pagedserve.v1.GenerationService/Generate"
    assert line["status"] == "OK"
    assert line["prompt_tokens"] == responses[-1].usage.prompt_tokens > 0
    assert line["completion_tokens"] == 6  # both choices
    info_text = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert SECRET not in info_text
