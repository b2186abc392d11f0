"""POST /v1/responses through the whole stack with the official ``openai`` client, unchanged:
``client.responses.create`` (whole and ``stream=True``) and ``client.responses.stream``.

The tiny random Llama (SmolLM2's tokenizer) is served with the shipped Hermes tool template
and ``--enable-auto-tool-choice --tool-call-parser hermes``, so function calls and their
outputs in ``input`` render, and with a small responses store (``previous_response_id``). A Responses request runs on the chat path, so its greedy answer
must be the chat route's answer to the same conversation, token for token."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jsonschema
import openai
import pytest
import requests

from services.common.logs import JsonFormatter
from tests.stack.conftest import _leak_check
from tests.stack.test_access_log import _access
from tests.stack_harness import InProcessStack

TEMPLATE = Path(__file__).parents[2] / "examples" / "tool_chat_template_hermes.jinja"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "forecast",
          "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "set_alarm",
          "parameters": {"type": "object", "additionalProperties": False, "required": ["hour"],
                         "properties": {"hour": {"type": "integer", "minimum": 0,
                                                 "maximum": 23}}}}]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
GREEDY = {"temperature": 0, "max_output_tokens": 12}
NO_EOS = {"ignore_eos": True}  # vLLM's extra, through extra_body
STORE_SIZE = 4


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    s = InProcessStack(tiny_model_dir,
                       worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB",
                                    "--enforce-eager"],
                       scheduler_argv=["--max-num-batched-tokens", "256"],
                       router_argv=["--chat-template", str(TEMPLATE),
                                    "--enable-auto-tool-choice",
                                    "--tool-call-parser", "hermes",
                                    "--enable-responses-api-store",
                                    "--responses-api-store-size", str(STORE_SIZE)]).start()
    yield s
    s.stop()


@pytest.fixture
def client(stack):
    c = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                      timeout=120)
    yield c
    c.close()
    _leak_check(stack)


@pytest.fixture(scope="module")
def model(stack):
    return stack.info().model


def _chat_text(client, model, messages, **kwargs) -> str:
    r = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                       max_completion_tokens=12, **kwargs)
    return r.choices[0].message.content


def test_create_with_a_string_is_the_chat_answer(client, model):
    r = client.responses.create(model=model, input="Hello there", metadata={"k": "v"},
                                extra_body=NO_EOS, **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert r.output_text == item.content[0].text != ""
    assert r.output_text == _chat_text(client, model, [{"role": "user", "content": "Hello there"}],
                                       extra_body=NO_EOS)
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.metadata == {"k": "v"} and r.max_output_tokens == 12 and r.tools == []


def test_message_items_and_instructions(client, model):
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                          {"type": "input_text", "text": "colour."}]}]
    r = client.responses.create(model=model, input=items, instructions="Be brief.", **GREEDY)
    assert r.instructions == "Be brief."
    assert r.output_text == _chat_text(client, model, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a colour."}])


def test_function_call_items_render_as_tool_turns(client, model):
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Oslo", "days": 2}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = client.responses.create(model=model, input=items, tools=TOOLS, tool_choice="none",
                                **GREEDY)
    assert r.output_text == _chat_text(client, model, [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        tools=[{"type": "function", "function": {k: t[k] for k in t if k not in ("type",
                                                                                   "strict")}}
               for t in TOOLS], tool_choice="none")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "set_alarm"}])
def test_forced_tool_calls_are_function_call_items(client, model, choice):
    r = client.responses.create(model=model, input="Wake me at 7", tools=TOOLS,
                                tool_choice=choice, max_output_tokens=80, extra_body={"seed": 3})
    assert r.status == "completed" and r.output
    for item in r.output:
        assert item.type == "function_call" and item.id.startswith("fc_") and item.call_id
        assert item.status == "completed"
        jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])
    if isinstance(choice, dict):
        assert [item.name for item in r.output] == ["set_alarm"]
    assert r.output_text == ""


def test_text_format_json_schema_gives_valid_json(client, model):
    schema = {"type": "object", "required": ["colour"], "additionalProperties": False,
              "properties": {"colour": {"enum": ["red", "green", "blue"]}}}
    r = client.responses.create(model=model, input="A colour?", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "c",
                                                 "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_stream_helper_rebuilds_the_whole_answer(client, model):
    # a regex the answer ends in (then EOS), so the response completes: the helper's
    # get_final_response needs response.completed
    kwargs = {"model": model, "input": "Tell me a story", "temperature": 0,
              "max_output_tokens": 40,
              "extra_body": {"structured_outputs": {"regex": "[a-z]{1,6}( [a-z]{1,6}){3,6}"}}}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"} and len(types) > 9
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas == done.text == final.output_text == whole.output_text
    assert len(whole.output_text.split()) >= 4
    assert final.id == events[0].response.id and final.status == whole.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_create_stream_true_events_in_order(client, model):
    whole = client.responses.create(model=model, input="Count", extra_body=NO_EOS, **GREEDY)
    events = list(client.responses.create(model=model, input="Count", stream=True,
                                          extra_body=NO_EOS, **GREEDY))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in events[4:-4]) == last.output[0].content[0].text
    assert last.output[0].content[0].text == whole.output_text
    assert last.usage.output_tokens == 12


def test_streamed_forced_call_sends_argument_events(client, model):
    choice = {"type": "function", "name": "get_weather"}
    whole = client.responses.create(model=model, input="Oslo?", tools=TOOLS, tool_choice=choice,
                                    max_output_tokens=80, temperature=0)
    with client.responses.stream(model=model, input="Oslo?", tools=TOOLS, tool_choice=choice,
                                 max_output_tokens=80, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert types[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    (call,) = final.output
    assert deltas == call.arguments == whole.output[0].arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)


@pytest.mark.parametrize("kwargs, param", [
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "store": "yes"}, "store"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata"),
])
def test_bad_input_is_400_naming_the_field(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert param.split(".")[0] in e.value.body["message"]
    assert client.responses.create(model=model, input="still serving?",
                                   max_output_tokens=2).status in ("completed", "incomplete")


def test_raw_stream_is_named_events_and_leaves_one_access_line(stack, client, caplog):
    with caplog.at_level(logging.INFO):
        r = requests.post(f"{stack.http_url}/v1/responses", timeout=60,
                          headers={"X-Request-Id": "resp-raw"},
                          json={"input": "hi", "max_output_tokens": 3, "stream": True,
                                "ignore_eos": True})
        assert r.status_code == 200 and r.headers["X-Request-Id"] == "resp-raw"
        assert r.headers["Content-Type"].startswith("text/event-stream")
        (record,) = _access(caplog, "resp-raw")
    blocks = r.text.strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event == f"event: {json.loads(data.removeprefix('data: '))['type']}"
    last = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    assert last["type"] == "response.incomplete"
    line = json.loads(JsonFormatter("router").format(record))
    assert line["route"] == "/v1/responses" and line["status"] == 200
    assert line["completion_tokens"] == last["response"]["usage"]["output_tokens"] == 3


def test_previous_response_id_continues_the_stored_conversation(client, model):
    first = client.responses.create(model=model, input="My name is Ada.", instructions="Hi.",
                                    **GREEDY)
    assert first.store is True
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(model=model, previous_response_id=first.id,
                                     input="What is my name?", **GREEDY)
    assert second.previous_response_id == first.id
    # the instructions are not carried over (OpenAI's rule); the answer is an assistant turn
    assert second.output_text == _chat_text(client, model, [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    unstored = client.responses.create(model=model, input="x", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for _ in range(STORE_SIZE):  # the store keeps the last STORE_SIZE: the first is evicted
        client.responses.create(model=model, input="y", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, previous_response_id=first.id, input="z")
    assert e.value.body["param"] == "previous_response_id"


def test_a_stored_function_call_is_answered_by_the_next_request(client, model):
    call = client.responses.create(model=model, input="Weather in Oslo?", tools=TOOLS,
                                   tool_choice={"type": "function", "name": "get_weather"},
                                   max_output_tokens=80, temperature=0)
    (item,) = call.output
    answer = client.responses.create(
        model=model, previous_response_id=call.id, tools=TOOLS, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}],
        **GREEDY)
    assert answer.output_text == _chat_text(client, model, [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": item.call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": item.arguments}}]},
        {"role": "tool", "tool_call_id": item.call_id, "content": "sunny"}],
        tools=[{"type": "function", "function": {k: t[k] for k in t if k not in ("type",
                                                                                   "strict")}}
               for t in TOOLS], tool_choice="none")


@pytest.mark.parametrize("stream", [False, True])
def test_an_invalid_text_format_schema_is_a_400_naming_text(client, model, stream):
    bad = {"type": "object", "properties": {"a": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="hi", stream=stream, max_output_tokens=4,
                                text={"format": {"type": "json_schema", "name": "x",
                                                 "schema": bad}})
    assert e.value.body["param"] == "text"
    assert e.value.body["message"].startswith("text.format.schema: ")  # the request's field
    assert client.responses.create(model=model, input="ok?", max_output_tokens=2).output_text
