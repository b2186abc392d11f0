"""A constraint the worker cannot honour ends the request as an error, never as a normal stop
(issue 56), through the whole stack on the tiny model: HTTP 500 with an OpenAI error body, an
SSE ``error`` event then ``[DONE]`` once the stream has started, gRPC INTERNAL; no KV block
leaks (the ``tiny`` fixture's check) and the server keeps serving.

The JSON schema and tool-call cases are real: a schema of 1000 optional properties
(``benchmarks.structured_output_schemas.wide``) passes the router's checks and llguidance's
compile and first mask, then its parser refuses the row after ``{`` (max_items_in_row). No
regex breaks llguidance by itself (its lexer is lazy), so the regex case uses a seam: the
worker's ``RequestGrammar.advance`` is wrapped to feed the matcher a digit, which the regex
refuses, at its fourth token (the break path after that is the real one).
"""

from __future__ import annotations

import json

import grpc
import pytest
import requests

from benchmarks.structured_output_schemas import wide
from pagedserve_client import Client
from services.common.tokenizer_loading import load_tokenizer
from services.router.structured_output_grammar import build_grammar
from services.worker.sample import structured_output_masks
from services.worker.sample.structured_output_masks import RequestGrammar

WIDE = {**wide(1000), "x-guidance": {"whitespace_flexible": False}}  # breaks at ``{``
# breaks at the inner ``{``, after ``{"b":<digit>,"a":`` (the stream has begun)
NESTED = {"type": "object", "required": ["b", "a"], "properties": {
    "b": {"type": "integer", "minimum": 0, "maximum": 9}, "a": WIDE},
    "x-guidance": {"whitespace_flexible": False}}
REGEX = r"[a-z]{40,50}"  # the seam breaks it at its fourth token
LIMIT = "max is 2000"  # llguidance's row limit, in the message
ASK = [{"role": "user", "content": "Answer:"}]


def _post(stack, path: str, body: dict) -> requests.Response:
    return requests.post(f"{stack.http_url}{path}", json={"model": stack.info().model, **body},
                         timeout=120)


def _assert_internal(r: requests.Response, kind: str, reason: str) -> None:
    assert r.status_code == 500, r.text
    assert r.headers["x-should-retry"] == "false"  # (OpenAI's SDK would send it again)
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal", error
    assert error["message"].startswith(f"structured output ({kind}) cannot be honoured"), error
    assert reason in error["message"], error


def _events(r: requests.Response) -> list:
    """The SSE ``data:`` payloads of a streamed answer (JSON decoded; ``[DONE]`` as is)."""
    assert r.status_code == 200, r.text
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _assert_error_event(events: list, kind: str, reason: str) -> str:
    """The stream ends with an error event then ``[DONE]``, no choice ever finished; returns
    the text the client saw before the error."""
    assert events[-1] == "[DONE]", events
    error = events[-2]["error"]
    assert error["code"] == "internal" and error["type"] == "server_error", error
    assert f"({kind}) cannot be honoured" in error["message"] and reason in error["message"]
    seen = ""
    for e in events[:-2]:
        for c in e["choices"]:
            assert c["finish_reason"] is None, e
            seen += (c.get("delta") or {}).get("content") or c.get("text") or ""
    return seen


def _still_serving(stack) -> None:
    r = _post(stack, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}


def test_wide_json_schema_is_a_500_not_a_stop(tiny):
    for n in (1, 2):  # n > 1: the whole request ends as the error
        r = _post(tiny, "/v1/chat/completions", {"messages": ASK, "max_tokens": 20, "n": n,
                                                 "response_format": _schema(WIDE)})
        _assert_internal(r, "json_schema", LIMIT)
    _still_serving(tiny)


def test_wide_json_schema_streamed(tiny):
    """Broken at the first token: nothing was sent yet, so the stream answers a plain 500;
    broken at the inner object: the client has seen the valid prefix before it, then the
    error event and [DONE]."""
    body = {"messages": ASK, "max_tokens": 20, "stream": True}
    r = _post(tiny, "/v1/chat/completions", {**body, "response_format": _schema(WIDE)})
    _assert_internal(r, "json_schema", LIMIT)
    r = _post(tiny, "/v1/chat/completions", {**body, "response_format": _schema(NESTED)})
    seen = _assert_error_event(_events(r), "json_schema", LIMIT)
    # the valid prefix; never the token that broke it (the one with the inner ``{``)
    assert seen.startswith('{"b":') and "{" not in seen[1:], seen
    _still_serving(tiny)


def test_wide_json_schema_over_grpc_is_internal(tiny):
    with Client(tiny.address, timeout=120, max_retries=0) as c:
        for schema in (WIDE, NESTED):
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt="Answer:", max_tokens=20, structured_outputs={"json": schema})
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "(json_schema) cannot be honoured" in e.value.details()
            assert LIMIT in e.value.details()
        assert c.generate(prompt="Hi", max_tokens=3).choices[0].finish_reason == "length"


def test_tool_call_grammar_breaks_as_an_error(tiny):
    """tool_choice named (the output is the arguments object) and "required" (with one tool
    ``[{"name": "f", "parameters": {`` is forced from the first token on): both break at their
    first token, so streamed too the answer is a plain 500."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": WIDE}}]
    body = {"messages": ASK, "max_tokens": 40, "tools": tools}
    r = _post(tiny, "/v1/chat/completions",
              {**body, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    _assert_internal(r, "json_schema", LIMIT)
    r = _post(tiny, "/v1/chat/completions", {**body, "tool_choice": "required", "stream": True})
    _assert_internal(r, "json_schema", LIMIT)
    _still_serving(tiny)


@pytest.fixture
def regex_breaks(monkeypatch, tiny_model_dir):
    """The seam: the worker's matcher of ``REGEX`` gets a digit at the request's fourth
    token (the sampled token is what the runner reports; only the matcher sees the digit)."""
    grammar = build_grammar("regex", REGEX)
    digit = load_tokenizer(tiny_model_dir).encode("7")[0]
    advance = RequestGrammar.advance
    counts: dict[str, int] = {}

    def breaking(self, token: int) -> None:
        if self.grammar == grammar:
            counts[self.request_id] = counts.get(self.request_id, 0) + 1
            if counts[self.request_id] == 4:
                token = digit
        advance(self, token)

    monkeypatch.setattr(structured_output_masks.RequestGrammar, "advance", breaking)
    return counts


def test_regex_grammar_breaks_as_an_error(tiny, regex_breaks):
    body = {"prompt": "Answer:", "max_tokens": 60, "structured_outputs": {"regex": REGEX}}
    _assert_internal(_post(tiny, "/v1/completions", body), "regex", "refused token")
    seen = _assert_error_event(_events(_post(tiny, "/v1/completions", {**body, "stream": True})),
                               "regex", "refused token")
    assert seen.isalpha() and seen.islower(), seen  # the 3 tokens before the break
    with Client(tiny.address, timeout=120, max_retries=0) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(prompt="Answer:", max_tokens=60, structured_outputs={"regex": REGEX})
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert "(regex) cannot be honoured" in e.value.details()
    assert len(regex_breaks) == 3
    _still_serving(tiny)
