"""Chat message validation as OpenAI does it: the JSON rules of ``openai.messages`` and the
rules shared with gRPC in ``validation.validate_messages`` / ``validate_tools``; every refusal
names the message index and field (HTTP: a 400 with ``param: "messages"``)."""

from __future__ import annotations

import grpc
import pytest

from services.common.pb.pagedserve.v1 import api_pb2
from services.router.openai.errors import OpenAIError
from services.router.openai.requests import from_error, parse_chat
from services.router.validation import RequestError, validate_messages, validate_tools

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
USER = {"role": "user", "content": "weather?"}
ASKS = {"role": "assistant", "content": None, "tool_calls": [CALL]}
ANSWER = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def http_error(messages) -> OpenAIError:
    """The 400 of a chat request with ``messages``, from the JSON rules or the shared ones."""
    try:
        parsed = parse_chat({"messages": messages})
        validate_messages(parsed.request.chat.messages)
    except OpenAIError as e:
        return e
    except RequestError as e:
        return from_error(e, prompt_param="messages")
    raise AssertionError("accepted")


def test_a_tool_call_round_trip_maps_onto_the_protos_and_the_template_shape():
    messages = parse_chat({"messages": [USER, ASKS, {**ANSWER, "name": "get_weather"}]}
                          ).request.chat.messages
    assert messages[1] == api_pb2.ChatMessage(role="assistant", content="", tool_calls=[
        api_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')])
    assert (messages[2].tool_call_id, messages[2].name) == ("call_1", "get_weather")
    assert validate_messages(messages) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "name": "get_weather", "tool_call_id": "call_1"}]


@pytest.mark.parametrize("messages, where", [
    # content: a string or text parts; null only for an assistant that calls tools
    ([{"role": "user", "content": None}], "messages[0].content must be a string or a list"),
    ([{"role": "system"}], "messages[0].content must be a string"),
    ([USER, {"role": "assistant", "content": None}], "messages[1].content must be a string"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": []}],
     "messages[1].content must be a string"),
    ([{"role": "developer", "content": 7}], "messages[0].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0]: only text parts"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0]"),
    (["hi"], "messages[0] must be an object with a string role"),
    ([{"role": None, "content": "x"}], "messages[0] must be an object with a string role"),
    # tool calls: {"id", "type": "function", "function": {"name", "arguments" (a string)}}
    ([USER, {**ASKS, "tool_calls": CALL}], "messages[1].tool_calls must be a list"),
    ([USER, {**ASKS, "tool_calls": [{**CALL, "type": "code"}]}],
     'messages[1].tool_calls[0].type must be "function"'),
    ([USER, {**ASKS, "tool_calls": [{**CALL, "function": "f"}]}],
     "messages[1].tool_calls[0].function must be an object"),
    ([USER, {**ASKS, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}]}],
     "messages[1].tool_calls[0].function.arguments must be a string"),
    ([USER, {**ASKS, "tool_calls": [{**CALL, "id": None}]}],
     "messages[1].tool_calls[0].id must be a string"),
    ([USER, {**ASKS, "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]}],
     "messages[1].tool_calls[0].function.name must be a string"),
    ([USER, ASKS, {**ANSWER, "tool_call_id": 1}], "messages[2].tool_call_id must be a string"),
    ([USER, ASKS, {**ANSWER, "name": ["f"]}], "messages[2].name must be a string"),
    # the rules gRPC shares (validation.validate_messages)
    ([USER, {**ASKS, "tool_calls": [{**CALL, "id": ""}]}],
     "messages[1].tool_calls[0].id must be a non-empty string"),
    ([USER, {**ASKS, "tool_calls": [{**CALL, "function": {"name": "", "arguments": "{}"}}]}],
     "messages[1].tool_calls[0].name must be a non-empty string"),
    ([USER, {**ASKS, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]}],
     "messages[1].tool_calls[0].arguments must be a JSON object as text"),
    ([USER, {**ASKS, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[1].tool_calls[0].arguments must be a JSON object as text, got a list"),
    ([{**USER, "tool_calls": [CALL]}], "messages[0].tool_calls: only an assistant message"),
    ([USER, ASKS, {"role": "tool", "content": "sunny"}],
     "messages[2].tool_call_id is required on a tool message"),
    ([USER, ASKS, {**ANSWER, "tool_call_id": "call_9"}],
     "messages[2].tool_call_id 'call_9' answers no tool call of an earlier assistant message"),
    ([USER, ANSWER, ASKS], "messages[1].tool_call_id 'call_1' answers no tool call"),
    ([USER, ASKS, ANSWER, {**USER, "tool_call_id": "call_1"}],
     "messages[3].tool_call_id: only a tool message answers a tool call"),
    ([USER, {"role": "wizard", "content": "x"}], "messages[1].role must be one of"),
])
def test_each_message_rule_is_a_400_naming_index_and_field(messages, where):
    error = http_error(messages)
    assert (error.status, error.param) == (400, "messages")
    assert error.message.startswith(where), error.message


def test_the_same_rules_hold_for_grpc_chat_messages():
    """ChatMessage protos (Generate's chat, the Chat RPC) get the same checks and messages."""
    call = api_pb2.ToolCall(id="c", name="f", arguments="{}")
    ok = [api_pb2.ChatMessage(role="user", content="q"),
          api_pb2.ChatMessage(role="assistant", tool_calls=[call]),
          api_pb2.ChatMessage(role="tool", tool_call_id="c", content="r")]
    assert validate_messages(ok)[2] == {"role": "tool", "content": "r", "tool_call_id": "c"}
    for bad, message in [
            ([*ok[:2], api_pb2.ChatMessage(role="tool", tool_call_id="x", content="r")],
             "messages[2].tool_call_id 'x' answers no tool call"),
            ([api_pb2.ChatMessage(role="user", content="q", tool_calls=[call])],
             "messages[0].tool_calls: only an assistant message")]:
        with pytest.raises(RequestError) as err:
            validate_messages(bad)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.message.startswith(message)


def test_tools_of_the_grpc_api_are_checked_and_shaped_for_the_template():
    assert validate_tools([api_pb2.Tool(name="f", description="d", parameters_json='{"a": 1}'),
                           api_pb2.Tool(name="g")]) == [
        {"type": "function", "function": {"name": "f", "description": "d",
                                          "parameters": {"a": 1}}},
        {"type": "function", "function": {"name": "g"}}]
    for tools, message in [([api_pb2.Tool()], "tools[0].name is empty"),
                           ([api_pb2.Tool(name="f"), api_pb2.Tool(name="f")],
                            "tools[1].name 'f' is taken by tools[0]"),
                           ([api_pb2.Tool(name="f", parameters_json="[]")],
                            "tools[0].parameters_json must be a JSON object as text")]:
        with pytest.raises(RequestError) as err:
            validate_tools(tools)
        assert err.value.message.startswith(message)
        assert from_error(err.value).param == "tools"
