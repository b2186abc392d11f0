"""Anthropic Messages requests without the stack: validation (``anthropic.models``, 400s
naming the field), the mapping onto the chat path (``anthropic.mapping``) and the error
bodies (``anthropic.errors``)."""

from __future__ import annotations

import json

import pytest
from anthropic.types import ErrorResponse

from services.router.anthropic.errors import AnthropicError, from_openai
from services.router.anthropic.handler import ROUTES, validate
from services.router.anthropic.mapping import prompt, to_chat
from services.router.anthropic.models import CountTokensRequest, MessagesRequest
from services.router.openai.errors import OpenAIError
from services.router.openai.tool_calls import HermesParser, NamedParser, RequiredParser
from services.router.openapi import document

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"name": "get_weather", "description": "forecast", "input_schema": SCHEMA},
         {"name": "set_alarm", "input_schema": {"type": "object"}}]


def _body(**fields) -> dict:
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}],
            **fields}


def _chat(tool_parser: str | None = "hermes", **fields):
    body = _body(**fields)
    return to_chat(validate(MessagesRequest, body), body, tool_parser)


def _error(**fields) -> str:
    with pytest.raises(AnthropicError) as e:
        _chat(**fields)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    ErrorResponse.model_validate(e.value.body())  # the SDK's error type
    return e.value.message


def test_system_blocks_and_turns_map_to_chat_messages():
    parsed = _chat(system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "terse."}],
                   messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]},
                             {"role": "assistant", "content": "c"},
                             {"role": "user", "content": "d"}])
    chat = parsed.request.chat
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be\nterse."), ("user", "ab"), ("assistant", "c"), ("user", "d")]
    assert parsed.prompt_param == "messages" and not parsed.stream and parsed.tool_calls is None


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_messages():
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "And tomorrow?"}]}]
    out = prompt(validate(CountTokensRequest, {"model": "m", "messages": messages,
                                               "tools": TOOLS}))
    assert out["messages"] == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"}]
    assert out["tools"][0] == {"type": "function", "function": {
        "name": "get_weather", "parameters": SCHEMA, "description": "forecast"}}
    parsed = _chat(messages=messages, tools=TOOLS)  # the chat path accepts it
    assert [m.role for m in parsed.request.chat.messages] == ["user", "assistant", "tool",
                                                             "user"]


def test_sampling_fields_and_extras_reach_the_request():
    parsed = _chat(max_tokens=7, stop_sequences=["\n\n", "END"], temperature=0.5, top_p=0.9,
                   top_k=4, stream=True, seed=3, metadata={"user_id": "u"}, anything="else")
    sp = parsed.request.sampling_params
    assert (sp.max_tokens, list(sp.stop), sp.top_k, sp.seed) == (7, ["\n\n", "END"], 4, 3)
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)
    assert parsed.stream


@pytest.mark.parametrize("choice,kind", [
    (None, HermesParser), ({"type": "auto"}, HermesParser), ({"type": "any"}, RequiredParser),
    ({"type": "none"}, None)])
def test_tool_choice_maps_to_chats(choice, kind):
    parsed = _chat(tools=TOOLS, **({"tool_choice": choice} if choice else {}))
    assert [t.name for t in parsed.request.chat.tools] == ["get_weather", "set_alarm"]
    assert json.loads(parsed.request.chat.tools[0].parameters_json) == SCHEMA
    made = parsed.tool_calls() if parsed.tool_calls is not None else None
    assert type(made) is kind if kind is not None else made is None
    enforced = parsed.request.sampling_params.HasField("structured_outputs")
    assert enforced == (kind is RequiredParser)


def test_named_tool_is_enforced_by_its_schema():
    parsed = _chat(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True})
    made = parsed.tool_calls()
    assert isinstance(made, NamedParser) and made.name == "get_weather"
    schema = json.loads(parsed.request.sampling_params.structured_outputs.json)
    assert schema["properties"] == SCHEMA["properties"]
    assert parsed.structured_param == "tools"


def test_auto_without_the_routers_parser_is_refused_as_on_chat():
    with pytest.raises(OpenAIError) as e:
        _chat(tool_parser=None, tools=TOOLS)
    assert "--enable-auto-tool-choice" in from_openai(e.value).message


@pytest.mark.parametrize("fields,message", [
    ({"max_tokens": "5"}, "max_tokens: Input should be a valid integer"),
    ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
    ({"temperature": True}, "temperature: Input should be a valid number"),
    ({"messages": []}, "messages: List should have at least 1 item"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role: Input should be"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]: Input tag 'image'"),
    ({"messages": [{"role": "user", "content": 5}]},
     "messages[0].content: Input should be a valid string / Input should be a valid list"),
    ({"system": [{"type": "text"}]}, "system[0].text: Field required"),
    ({"tools": [{"name": "a b", "input_schema": {}}]}, "tools[0].name: String should match"),
    ({"tools": [{"type": "web_search_20250305", "name": "s", "input_schema": {}}]},
     "tools[0].type: Input should be 'custom'"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name: Field required"),
    ({"stop_sequences": "END"}, "stop_sequences: Input should be a valid list"),
])
def test_bad_fields_are_400s_naming_them(fields, message):
    with pytest.raises(AnthropicError) as e:
        validate(MessagesRequest, _body(**fields))
    assert e.value.status == 400 and e.value.message.startswith(message), e.value.message


def test_block_rules_are_400s_naming_the_block():
    assert _error(tool_choice={"type": "any"}) == "tool_choice 'any' needs tools"
    assert "tool_choice.name 'nope' is not the name of a tool" in _error(
        tools=TOOLS, tool_choice={"type": "tool", "name": "nope"})
    assert _error(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9"}]}]).startswith(
        "messages[0].content[0].tool_use_id 'toolu_9' answers no tool_use block")
    assert "belongs in an assistant message" in _error(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}])
    assert "belongs in a user message" in _error(messages=[{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}])


def test_chat_errors_are_renamed_and_typed_by_status():
    e = from_openai(OpenAIError(400, "max_completion_tokens must be in [1, 100], got 500",
                                param="max_completion_tokens"))
    assert (e.status, e.type, e.message) == (400, "invalid_request_error",
                                             "max_tokens must be in [1, 100], got 500")
    e = from_openai(OpenAIError(400, "stop[1] must be at most 64 characters", param="stop"))
    assert e.message == "stop_sequences[1] must be at most 64 characters"
    e = from_openai(OpenAIError(400, "tools[0].function.parameters is not a valid schema"))
    assert e.message == "tools[0].input_schema is not a valid schema"
    assert [from_openai(OpenAIError(s, "x")).type for s in (401, 404, 413, 429, 500, 503)] == [
        "authentication_error", "not_found_error", "request_too_large", "rate_limit_error",
        "api_error", "overloaded_error"]


def test_routes_go_into_the_openapi_document():
    doc = document(ROUTES, "t", "0")
    op = doc["paths"]["/v1/messages"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/MessagesRequest")
    assert set(op["responses"]) >= {"200", "400", "401", "404", "429"}
    assert "MessagesRequest" in doc["components"]["schemas"]
    assert "/v1/messages/count_tokens" in doc["paths"]


def test_count_tokens_prompt_leaves_sampling_out():
    out = prompt(validate(CountTokensRequest, {"model": "m", "messages": [
        {"role": "user", "content": "Hi"}]}))
    assert out == {"messages": [{"role": "user", "content": "Hi"}]}


def test_output_config_format_is_a_json_schema_grammar():
    parsed = _chat(output_config={"format": {"type": "json_schema", "schema": SCHEMA},
                                  "effort": "low"})
    assert json.loads(parsed.request.sampling_params.structured_outputs.json) == SCHEMA
    assert parsed.structured_param == "response_format"
    with pytest.raises(OpenAIError) as e:  # a forced tool is a grammar already
        _chat(tools=TOOLS, tool_choice={"type": "any"},
              output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    assert "output_config.format" in from_openai(e.value).message
