"""Anthropic answers without the stack: ``anthropic.events.MessageEvents`` turns a choice's
GenerateResponses into Anthropic's stream events and the whole Message, every object checked
against the ``anthropic`` package's own pydantic types (validated, not the SDK's lenient
construction), and a stream folded by the SDK's own accumulator equals the whole answer."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from services.common.finish_reason import FinishReason
from services.common.pb.pagedserve.v1 import api_pb2
from services.router.anthropic.errors import AnthropicError
from services.router.anthropic.events import MessageEvents
from services.router.openai.reasoning import ReasoningSplitter
from services.router.openai.tool_calls import HermesParser, NamedParser, RequiredParser

EVENT = TypeAdapter(RawMessageStreamEvent)


def _messages(*texts: str, reason: FinishReason = FinishReason.STOP, stop: str = ""):
    """GenerateResponses of one choice, one token each, the last final."""
    out = [api_pb2.GenerateResponse(text=t, token_ids=[i]) for i, t in enumerate(texts)]
    out[-1].finish_reason = reason.pb
    out[-1].stop_reason = stop
    out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens = 5, len(texts)
    return out


def _run(events: MessageEvents, messages) -> list[dict]:
    """Every event of the stream, each validated as the SDK's type; the SDK's accumulator's
    message equals the whole one."""
    out = events.start()
    for m in messages:
        out += events.feed(m)
    snapshot, bufs = None, {}
    for e in out:
        if e == {"type": "ping"}:  # (no RawMessageStreamEvent: the SDK's stream skips it)
            continue
        snapshot = accumulate_event(event=EVENT.validate_python(e), current_snapshot=snapshot,
                                    json_bufs=bufs)
    whole = Message.model_validate(events.message())
    assert snapshot is not None
    assert Message.model_validate(snapshot.to_dict()).model_dump() == whole.model_dump()
    return out


def test_text_streams_as_one_block_between_start_and_stop():
    events = MessageEvents("m", 5)
    out = _run(events, _messages("Hel", "lo", " there"))
    assert [e["type"] for e in out] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert out[0]["message"]["content"] == [] and out[0]["message"]["stop_reason"] is None
    assert out[0]["message"]["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert out[2] == {"type": "content_block_start", "index": 0,
                      "content_block": {"type": "text", "text": ""}}
    assert out[-2] == {"type": "message_delta", "usage": {"output_tokens": 3},
                       "delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    message = events.message()
    assert message["id"].startswith("msg_") and message["model"] == "m"
    assert message["content"] == [{"type": "text", "text": "Hello there"}]
    assert message["usage"] == {"input_tokens": 5, "output_tokens": 3}


@pytest.mark.parametrize("reason,stop,expected", [
    (FinishReason.LENGTH, "", ("max_tokens", None)),
    (FinishReason.STOP, "\n\n", ("stop_sequence", "\n\n")),
    (FinishReason.STOP, "", ("end_turn", None)),
    (FinishReason.ABORT, "", ("end_turn", None))])
def test_stop_reason_follows_the_finish(reason, stop, expected):
    events = MessageEvents("m", 5)
    _run(events, _messages("a", "b", reason=reason, stop=stop))
    message = events.message()
    assert (message["stop_reason"], message["stop_sequence"]) == expected


def test_empty_answer_has_no_block():
    events = MessageEvents("m", 5)
    out = _run(events, _messages(""))
    assert [e["type"] for e in out] == ["message_start", "ping", "message_delta",
                                        "message_stop"]
    assert events.message()["content"] == []


def test_hermes_calls_become_tool_use_blocks_after_the_text():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    events = MessageEvents("m", 5, HermesParser)
    pieces = ["Let me check. ", call[:20], call[20:], call.replace("Oslo", "Rome")]
    out = _run(events, _messages(*pieces))
    message = events.message()
    assert [b["type"] for b in message["content"]] == ["text", "tool_use", "tool_use"]
    assert message["content"][0]["text"] == "Let me check. "
    assert [b["input"] for b in message["content"][1:]] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert all(b["id"].startswith("toolu_") for b in message["content"][1:])
    assert len({b["id"] for b in message["content"][1:]}) == 2
    assert message["stop_reason"] == "tool_use"
    starts = [e for e in out if e["type"] == "content_block_start"]
    assert [e["index"] for e in starts] == [0, 1, 2]
    assert starts[1]["content_block"]["input"] == {}  # the input comes as JSON deltas
    deltas = [e["delta"]["partial_json"] for e in out if e["type"] == "content_block_delta"
              and e["index"] == 1]
    assert json.loads("".join(deltas)) == {"city": "Oslo"}


def test_forced_tool_streams_its_input_in_pieces():
    events = MessageEvents("m", 5, lambda: NamedParser("set_alarm"))
    out = _run(events, _messages('{"ho', 'ur": ', "7}"))
    deltas = [e["delta"] for e in out if e["type"] == "content_block_delta"]
    assert deltas == [{"type": "input_json_delta", "partial_json": p}
                      for p in ('{"ho', 'ur": ', "7}")]
    message = events.message()
    assert message["content"][0]["name"] == "set_alarm"
    assert message["content"][0]["input"] == {"hour": 7}
    assert message["stop_reason"] == "tool_use"  # (OpenAI says "stop"; Anthropic tool_use)


def test_required_calls_are_blocks_and_a_cut_input_is_empty():
    events = MessageEvents("m", 5, RequiredParser)
    _run(events, _messages('[{"name": "a", "parameters": {"x": 1}}]'))
    assert [b["input"] for b in events.message()["content"]] == [{"x": 1}]
    events = MessageEvents("m", 5, lambda: NamedParser("a"))
    events.start()
    for m in _messages('{"x": ', reason=FinishReason.LENGTH):
        events.feed(m)
    message = Message.model_validate(events.message())
    assert message.stop_reason == "max_tokens" and message.content[0].input == {}


def test_error_event_is_anthropics_error_body():
    e = MessageEvents.error(AnthropicError(429, "queue full"))
    assert e == {"type": "error", "error": {"type": "rate_limit_error",
                                            "message": "queue full"}}
    from anthropic.types import ErrorResponse
    assert ErrorResponse.model_validate(e).error.type == "rate_limit_error"


def test_reasoning_is_a_thinking_block_before_the_text():
    events = MessageEvents("m", 5, split=ReasoningSplitter)
    out = _run(events, _messages("<think>let me ", "think</think>The ", "answer."))
    message = events.message()
    assert message["content"] == [
        {"type": "thinking", "thinking": "let me think", "signature": ""},
        {"type": "text", "text": "The answer."}]
    deltas = [e["delta"]["type"] for e in out if e["type"] == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
