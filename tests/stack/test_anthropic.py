"""Anthropic's Messages API through the whole stack with the ``anthropic`` SDK, unchanged: a
tiny random Llama with SmolLM2's tokenizer behind a router started with the shipped Hermes
template, ``--enable-auto-tool-choice --tool-call-parser hermes`` (as tests/stack/test_tools.py).

A random model writes no tool call by itself: a named ``tool_choice`` shows the grammar at
work (its input must validate against the tool's bounded schema), and ``auto`` is driven by a
``structured_outputs`` regex that makes the model write a Hermes ``<tool_call>`` block."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
import requests

from tests.stack.conftest import _leak_check
from tests.stack.test_tools import CALL_REGEX, TEMPLATE, WEATHER
from tests.stack_harness import InProcessStack

TOOLS = [{"name": "get_weather", "description": "forecast", "input_schema": WEATHER},
         {"name": "set_alarm", "input_schema": {"type": "object", "properties": {
             "hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["hour"],
             "additionalProperties": False}}]
SYSTEM = [{"type": "text", "text": "You are terse."}]
TURNS = [{"role": "user", "content": "Hi"},
         {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
         {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]}]
# (this SDK has no sampling arguments: temperature / top_p / top_k go in the body as extras)
GREEDY = {"max_tokens": 12, "extra_body": {"temperature": 0.0, "ignore_eos": True}}
ZERO = {"extra_body": {"temperature": 0.0}}


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = InProcessStack(tiny_model_dir,
                           worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB",
                                        "--enforce-eager"],  # no compile warm-up
                           scheduler_argv=["--max-num-batched-tokens", "256"],
                           router_argv=["--chat-template", str(TEMPLATE),
                                        "--enable-auto-tool-choice",
                                        "--tool-call-parser", "hermes"]).start()
    yield stack
    stack.stop()


@pytest.fixture
def client(stack):
    c = anthropic.Anthropic(base_url=stack.http_url, api_key="unused", max_retries=0,
                            timeout=120)
    yield c
    c.close()
    _leak_check(stack)


def url(client) -> str:
    return str(client.base_url).rstrip("/")


def model(client) -> str:
    return requests.get(f"{url(client)}/v1/models", timeout=30).json()["data"][0]["id"]


def streamed(client, **kwargs):
    """The streamed answer: (event types in order, text from text_stream, final message)."""
    with client.messages.stream(**kwargs) as s:
        kinds = []
        for event in s:
            kinds.append(event.type)
        final = s.get_final_message()
    return kinds, final


def without_ids(message) -> dict:
    out = message.model_dump()
    out.pop("id")
    for block in out["content"]:
        block.pop("id", None)
    return out


def test_streamed_text_is_the_whole_answer(client):
    kwargs = {"model": model(client), "system": SYSTEM, "messages": TURNS, **GREEDY}
    whole = client.messages.create(**kwargs)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    [block] = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    with client.messages.stream(**kwargs) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == block.text
    assert without_ids(final) == without_ids(whole)
    kinds, _ = streamed(client, **kwargs)
    # the SDK's events (it adds a "text" event per delta and its own *_stop snapshots)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_delta") \
        < kinds.index("content_block_stop") < kinds.index("message_delta")


def test_raw_stream_is_anthropics_event_sequence(client):
    body = {"model": model(client), "messages": TURNS, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True}
    r = requests.post(f"{url(client)}/v1/messages", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = []
    for chunk in r.text.strip().split("\n\n"):
        kind, data = chunk.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert events[0]["message"]["usage"]["output_tokens"] == 0
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": 5}


def test_stop_sequence_ends_the_answer_there(client):
    kwargs = {"model": model(client), "messages": TURNS, **GREEDY}
    text = client.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    out = client.messages.create(stop_sequences=[stop], **kwargs)
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
    assert out.content[0].text == text[:text.index(stop)] if text.index(stop) else not out.content


def test_named_tool_call_validates_and_streams_the_same(client):
    kwargs = {"model": model(client), "messages": TURNS, "tools": TOOLS, "max_tokens": 60,
              **ZERO, "tool_choice": {"type": "tool", "name": "get_weather"}}
    whole = client.messages.create(**kwargs)
    [call] = whole.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    assert whole.stop_reason == "tool_use"
    _, final = streamed(client, **kwargs)
    assert without_ids(final) == without_ids(whole)
    # the call's answer goes back as a tool_result; the next turn is text
    again = client.messages.create(
        model=kwargs["model"], tools=TOOLS, tool_choice={"type": "none"}, max_tokens=4,
        **ZERO, messages=[*TURNS, {"role": "assistant", "content": whole.content},
                                   {"role": "user", "content": [{
                                       "type": "tool_result", "tool_use_id": call.id,
                                       "content": "sunny, 20 C"}]}])
    assert again.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in again.content)


def test_auto_tool_choice_returns_the_call_the_model_writes(client):
    kwargs = {"model": model(client), "messages": TURNS, "tools": TOOLS, "max_tokens": 80,
              "extra_body": {"temperature": 0.0,
                             "structured_outputs": {"regex": CALL_REGEX}}}
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use"
    assert [b.type for b in whole.content] == ["tool_use"]
    jsonschema.validate(whole.content[0].input, WEATHER)
    _, final = streamed(client, **kwargs)
    assert without_ids(final) == without_ids(whole)


def test_output_config_format_makes_json_of_the_schema(client):
    out = client.messages.create(model=model(client), messages=TURNS, max_tokens=60,
                                 output_config={"format": {"type": "json_schema",
                                                           "schema": WEATHER}}, **ZERO)
    assert out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(out.content[0].text), WEATHER)


def test_count_tokens_is_the_prompt_the_answer_counts(client):
    kwargs = {"model": model(client), "system": SYSTEM, "messages": TURNS, "tools": TOOLS}
    counted = client.messages.count_tokens(**kwargs).input_tokens
    out = client.messages.create(max_tokens=1, tool_choice={"type": "none"}, **kwargs)
    assert counted == out.usage.input_tokens > 0
    fewer = client.messages.count_tokens(model=kwargs["model"], messages=TURNS).input_tokens
    assert 0 < fewer < counted  # the tools and the system prompt are in the rendered prompt


def test_errors_are_anthropics(client):
    name = model(client)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=name, messages=TURNS, max_tokens=4,
                               extra_body={"temperature": "hot"})
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("temperature:")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=name, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": 7}]}])
    assert e.value.body["error"]["message"].startswith("messages[0].content[0].text:")
    with pytest.raises(anthropic.BadRequestError) as e:  # a range rule of the chat path
        client.messages.create(model=name, messages=TURNS, max_tokens=4,
                               extra_body={"top_p": 7.0})
    assert "top_p" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", messages=TURNS, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=TURNS)
    r = requests.post(f"{url(client)}/v1/messages", json={"model": name, "messages": TURNS},
                      timeout=30)
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = requests.post(f"{url(client)}/v1/chat/completions", timeout=30,
                      json={"model": "no-such-model", "messages": TURNS[:1]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # OpenAI's
