"""Tool calling through the whole stack with the ``openai`` client, unchanged: a tiny random
Llama with SmolLM2's tokenizer behind a router started with the shipped Hermes template,
``--enable-auto-tool-choice --tool-call-parser hermes``.

A random model writes no tool call by itself, so "required" and named functions show the
grammar at work (their arguments must validate against the function's bounded parameters),
and "auto" is driven by a ``structured_outputs`` regex that makes the model write a Hermes
``<tool_call>`` block (or, for the plain-content case, a fixed sentence)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.stack.conftest import _leak_check
from tests.stack_harness import InProcessStack

TEMPLATE = Path(__file__).parents[2] / "examples" / "tool_chat_template_hermes.jinja"
WEATHER = {"type": "object", "additionalProperties": False,
           "required": ["city", "unit", "days"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                          "unit": {"enum": ["C", "F"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
ALARM = {"type": "object", "additionalProperties": False, "required": ["hour"],
         "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
ASK = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]
# what a Hermes model writes for a call; the regex makes the random model write one
CALL_REGEX = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", '
              r'"unit": "[CF]", "days": [1-7]\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def tool_stack(tiny_model_dir):
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
def client(tool_stack):
    c = openai.OpenAI(base_url=f"{tool_stack.http_url}/v1", api_key="unused", max_retries=0,
                      timeout=120)
    yield c
    c.close()
    _leak_check(tool_stack)


def chat(client, stream: bool = False, **kwargs):
    """One chat completion; streamed, its chunks folded into the same final shape:
    ``(content, [(name, arguments)], finish_reason)`` per choice."""
    kwargs = {"model": client.models.list().data[0].id, "messages": ASK, "tools": TOOLS,
              "max_tokens": 80, "seed": 7, **kwargs}
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return [(c.message.content, [(t.function.name, t.function.arguments)
                                     for t in c.message.tool_calls or []], c.finish_reason)
                for c in r.choices]
    folded: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            f = folded.setdefault(c.index, {"content": None, "calls": {}, "finish": None})
            if c.delta.content:
                f["content"] = (f["content"] or "") + c.delta.content
            for t in c.delta.tool_calls or []:
                call = f["calls"].setdefault(t.index, {"id": t.id, "name": "", "arguments": ""})
                assert t.id in (None, call["id"])  # the id comes with the call's first delta
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
            f["finish"] = c.finish_reason or f["finish"]
    for f in folded.values():
        assert all(c["id"].startswith("chatcmpl-tool-") for c in f["calls"].values())
    return [(f["content"], [(c["name"], c["arguments"]) for _, c in sorted(f["calls"].items())],
             f["finish"]) for _, f in sorted(folded.items())]


def assert_valid_calls(calls):
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_returns_valid_calls_and_streams_the_same(client):
    results = chat(client, tool_choice="required", parallel_tool_calls=False, n=2,
                   temperature=1.0)
    for content, calls, finish in results:
        assert (content, finish, len(calls)) == (None, "tool_calls", 1)
        assert_valid_calls(calls)
    assert chat(client, stream=True, tool_choice="required", parallel_tool_calls=False, n=2,
                temperature=1.0) == results


def test_named_function_returns_its_call_with_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "set_alarm"}}
    [(content, calls, finish)] = results = chat(client, tool_choice=choice)
    assert content is None and finish == "stop"  # OpenAI: a forced function ends with stop
    assert [name for name, _ in calls] == ["set_alarm"]
    assert_valid_calls(calls)
    assert calls[0][1] == json.dumps(json.loads(calls[0][1]))  # json.dumps's layout, no blanks
    assert chat(client, stream=True, tool_choice=choice) == results


def test_auto_returns_the_call_the_model_writes(client):
    forced = {"structured_outputs": {"regex": CALL_REGEX}}
    [(content, calls, finish)] = results = chat(client, extra_body=forced)
    assert (content, finish) == (None, "tool_calls")
    assert [name for name, _ in calls] == ["get_weather"]
    assert_valid_calls(calls)
    assert chat(client, stream=True, extra_body=forced) == results


def test_auto_with_parallel_tool_calls_false_returns_the_first_call_only(client):
    second = (r'<tool_call>\n\{"name": "set_alarm", "arguments": \{"hour": [0-9]\}\}\n'
              r'</tool_call>')
    forced = {"structured_outputs": {"regex": CALL_REGEX + r"\n" + second}}
    [(_, calls, finish)] = both = chat(client, max_tokens=120, extra_body=forced)
    assert [name for name, _ in calls] == ["get_weather", "set_alarm"] and finish == "tool_calls"
    for stream in (False, True):
        [(content, calls, finish)] = chat(client, stream=stream, max_tokens=120,
                                          parallel_tool_calls=False, extra_body=forced)
        assert (content, finish) == (None, "tool_calls")
        assert calls == both[0][1][:1]


def test_auto_without_a_call_is_plain_content(client):
    sentence = "It will be sunny in Oslo."
    plain = {"structured_outputs": {"regex": sentence.replace(".", r"\.")}}
    assert chat(client, extra_body=plain) == [(sentence, [], "stop")]
    assert chat(client, stream=True, extra_body=plain) == [(sentence, [], "stop")]


def test_a_follow_up_turn_with_the_tool_result_renders(client):
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "oslo", "unit": "C", "days": 3}'}}
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
    [(_, _, finish)] = chat(client, messages=turns, tool_choice="none", max_tokens=4)
    assert finish in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, messages=[*turns[:2], {**turns[2], "tool_call_id": "call_9"}])
    assert err.value.param == "messages"
    assert "messages[2].tool_call_id 'call_9'" in err.value.message
