"""Tools on the OpenAI chat route without a stack: ``tools`` / ``tool_choice`` mapping and
refusals (``openai.tools``), the tool-call parsers (``openai.tool_calls``) streamed at every
split and whole, and the response shapes they give (``openai.responses``)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from services.common.pb.pagedserve.v1 import api_pb2
from services.router.openai.errors import OpenAIError
from services.router.openai.requests import parse_chat
from services.router.openai.responses import ResponseBuilder
from services.router.openai.tool_calls import (
    HermesParser,
    NamedParser,
    RequiredParser,
    join,
    merge,
)
from services.router.openai.tools import AUTO_NEEDS_FLAGS

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["C", "F"]}}, "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
USER = [{"role": "user", "content": "hi"}]
HERMES_TEMPLATE = Path(__file__).parents[2] / "examples" / "tool_chat_template_hermes.jinja"


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def whole(parser, text: str) -> dict:
    return merge([parser.feed(text), parser.finish()])


def streamed(parser, pieces: list[str]) -> dict:
    return merge([parser.feed(p) for p in pieces] + [parser.finish()])


def without_ids(message: dict) -> dict:
    calls = message.get("tool_calls", [])
    assert all(c["id"].startswith("chatcmpl-tool-") and len(c["id"]) == 14 + 32 for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    if not calls:
        return message
    return {**message, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in calls]}


def fn(name: str, arguments: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# ---- Hermes (tool_choice "auto") ----------------------------------------------------------
def test_hermes_one_call_is_a_tool_call_and_null_content():
    parser = HermesParser()
    message = without_ids(whole(parser, call("get_weather", {"city": "Paris"})))
    assert message == {"role": "assistant", "content": None,
                       "tool_calls": [fn("get_weather", '{"city": "Paris"}')]}
    assert parser.called


def test_hermes_two_calls_with_text_around_them():
    text = ("Let me look.\n" + call("get_weather", {"city": "Oslo"}) + "\n"
            + call("ping", {}) + "\nDone.")
    parser = HermesParser()
    message = without_ids(whole(parser, text))
    assert message["content"] == "Let me look.\n\n\nDone."
    assert message["tool_calls"] == [fn("get_weather", '{"city": "Oslo"}'), fn("ping", "{}")]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "ping", "arguments": {}\n</tool_call>',  # a brace missing
    '<tool_call>\n{"name": "ping"}\n</tool_call>',  # no arguments
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
    '<tool_call>[1, 2]</tool_call> and text',
    'text <tool_call>{"name": "ping", "arguments": ',  # cut short
    "plain text, a < sign and <tool_ at the end <tool_c",
    "  \n ",  # whitespace only, no call: kept
    "",
])
def test_hermes_text_without_a_valid_call_is_content_as_written(text):
    parser = HermesParser()
    assert whole(parser, text) == {"role": "assistant", "content": text}
    assert not parser.called


def test_hermes_malformed_block_stays_content_next_to_a_valid_call():
    bad = '<tool_call>{"name": "ping", "arguments": 1}</tool_call>'
    message = without_ids(whole(HermesParser(), bad + call("ping", {"n": 1})))
    assert message == {"role": "assistant", "content": bad,
                       "tool_calls": [fn("ping", '{"n": 1}')]}


def test_hermes_unclosed_call_at_the_end_is_still_a_call():
    message = without_ids(whole(HermesParser(), '<tool_call>\n{"name": "ping", "arguments": {}}'))
    assert message == {"role": "assistant", "content": None, "tool_calls": [fn("ping", "{}")]}


HERMES_TEXTS = [
    call("get_weather", {"city": "Rome"}),
    "  Sure: " + call("ping", {"deep": {"a": ["<tool_call>", "}"]}}) + " and " + call("ping", {}),
    "\n" + call("ping", {}) + "\n\n" + call("get_weather", {"city": "Ürümqi"}) + "\n",
    'a <tool_call>{"name": "ping", "arguments": {"x": 1}</tool_call> <tool_cal',
    "no calls at all <tool_call",
]


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_streamed_at_every_split_equals_whole(text):
    expected = without_ids(whole(HermesParser(), text))
    for k in range(len(text) + 1):
        assert without_ids(streamed(HermesParser(), [text[:k], text[k:]])) == expected, k
    assert without_ids(streamed(HermesParser(), list(text))) == expected


def test_hermes_streams_content_before_a_call_and_holds_a_possible_tag():
    parser = HermesParser()
    assert parser.feed("Hello <tool") == {"content": "Hello "}
    assert parser.feed("_call>") == {}
    assert parser.feed('{"name": "ping", "arguments": {}}') == {}
    delta = parser.feed("</tool_call>")
    assert [c["function"] for c in delta["tool_calls"]] == [{"name": "ping", "arguments": "{}"}]
    assert delta["tool_calls"][0]["index"] == 0 and delta["tool_calls"][0]["type"] == "function"
    assert parser.feed(" \n") == {"content": " \n"}  # content has started: sent as it comes
    quiet = HermesParser()  # only whitespace around the calls: held, then dropped
    assert quiet.feed("\n") == {} and "tool_calls" in quiet.feed(call("ping", {}))
    assert quiet.feed(" \n") == {} and quiet.finish() == {}


# ---- required / named (enforced by a grammar) ---------------------------------------------
REQUIRED_TEXT = ('[{"name": "get_weather", "parameters": {"city": "a}b", "unit": "C"}}, '
                 '\n {"name": "ping", "parameters": {}}]')


def test_required_array_gives_one_call_per_element_at_every_split():
    parser = RequiredParser()
    expected = without_ids(whole(parser, REQUIRED_TEXT))
    assert parser.called
    assert expected == {"role": "assistant", "content": None, "tool_calls": [
        fn("get_weather", '{"city": "a}b", "unit": "C"}'), fn("ping", "{}")]}
    for k in range(len(REQUIRED_TEXT) + 1):
        pieces = [REQUIRED_TEXT[:k], REQUIRED_TEXT[k:]]
        assert without_ids(streamed(RequiredParser(), pieces)) == expected, k


def test_required_sends_each_call_once_its_object_is_complete():
    parser = RequiredParser()
    first = REQUIRED_TEXT.index("}}") + 2
    assert parser.feed(REQUIRED_TEXT[:first - 1]) == {}
    assert [c["function"]["name"] for c in parser.feed("}")["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("text", ['[{"name": "ping", "parame', "not json", '[{"name": 1}]'])
def test_required_output_that_does_not_parse_is_content(text):
    parser = RequiredParser()
    assert whole(parser, text) == {"role": "assistant", "content": text}
    assert not parser.called


def test_named_output_is_the_arguments_of_one_call_at_every_split():
    text = '{"city": "Lima", "unit": "F"}'
    for k in range(len(text) + 1):
        parser = NamedParser("get_weather")
        message = without_ids(streamed(parser, [text[:k], text[k:]]))
        assert message == {"role": "assistant", "content": None,
                           "tool_calls": [fn("get_weather", text)]}
        assert not parser.called  # OpenAI ends a forced function with "stop"
    first = NamedParser("f").feed("")["tool_calls"][0]  # the first delta names the call
    assert first["function"] == {"name": "f", "arguments": ""} and first["index"] == 0


def test_join_concatenates_content_and_calls():
    a, b = {"content": "x", "tool_calls": [{"index": 0}]}, {"tool_calls": [{"index": 1}]}
    assert join(a, b) == {"content": "x", "tool_calls": [{"index": 0}, {"index": 1}]}
    assert join({}, {}) == {}


# ---- request mapping ----------------------------------------------------------------------
def test_tools_map_onto_chat_tools_and_auto_needs_the_parser():
    parsed = parse_chat({"messages": USER, "tools": TOOLS}, tool_parser="hermes")
    tools = parsed.request.chat.tools
    assert [(t.name, t.description) for t in tools] == [("get_weather", "weather now"),
                                                        ("ping", "")]
    assert json.loads(tools[0].parameters_json) == WEATHER and tools[1].parameters_json == ""
    assert isinstance(parsed.tool_calls(), HermesParser)  # default choice with tools: auto
    assert not parsed.request.sampling_params.HasField("structured_outputs")
    with pytest.raises(OpenAIError) as err:
        parse_chat({"messages": USER, "tools": TOOLS})  # router without the flags
    assert (err.value.status, err.value.param, err.value.message) == (400, "tool_choice",
                                                                       AUTO_NEEDS_FLAGS)


def test_tool_choice_none_renders_tools_but_parses_nothing():
    parsed = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert len(parsed.request.chat.tools) == 2 and parsed.tool_calls is None
    assert parse_chat({"messages": USER}).tool_calls is None


def test_named_tool_choice_is_enforced_with_the_function_parameters_schema():
    parsed = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    so = parsed.request.sampling_params.structured_outputs
    assert so.WhichOneof("kind") == "json"
    assert json.loads(so.json) == {"x-guidance": {  # written as json.dumps writes JSON
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}, **WEATHER}
    assert isinstance(parsed.tool_calls(), NamedParser)
    assert parsed.structured_param == "tools"  # a schema llguidance refuses names the tools
    no_params = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "ping"}}}).request.sampling_params
    assert json.loads(no_params.structured_outputs.json)["properties"] == {}


def test_required_schema_admits_calls_of_the_tools_only():
    parsed = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "required"})
    schema = json.loads(parsed.request.sampling_params.structured_outputs.json)
    assert isinstance(parsed.tool_calls(), RequiredParser)
    jsonschema.validate(json.loads(REQUIRED_TEXT), schema)
    for bad in ([], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"city": "x" * 13}}],
                [{"name": "ping", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_without_parallel_calls_asks_for_exactly_one():
    parsed = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "required",
                         "parallel_tool_calls": False})
    schema = json.loads(parsed.request.sampling_params.structured_outputs.json)
    jsonschema.validate([{"name": "ping", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(REQUIRED_TEXT), schema)


def test_required_schema_lifts_defs_to_the_top():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "$defs": {"Unit": {"enum": ["C", "F"]}}, "type": "object",
        "properties": {"u": {"$ref": "#/$defs/Unit"}}}}}
    parsed = parse_chat({"messages": USER, "tools": [tool], "tool_choice": "required"})
    schema = json.loads(parsed.request.sampling_params.structured_outputs.json)
    assert schema["$defs"] == {"Unit": {"enum": ["C", "F"]}}
    jsonschema.validate([{"name": "f", "parameters": {"u": "C"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"u": "K"}}], schema)


@pytest.mark.parametrize("body, param, message", [
    ({"tools": {"type": "function"}}, "tools", "tools must be a list"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].function must be an object"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools",
     "tools[0].function.name must be 1 to 64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools",
     "tools[0].function.parameters must be a JSON Schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}, "tools",
     "tools[0].function.description must be a string"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "tools[2].function.name 'get_weather' is used by"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools"),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice 'auto' needs tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "tool_choice names function 'nope', which is not in tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice must"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be used with it"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "ping"}},
      "structured_outputs": {"regex": "a"}}, "tool_choice", "cannot be used with it"),
    ({"functions": [{"name": "f"}]}, "functions", "functions is not supported"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"},
     "parallel_tool_calls", "parallel_tool_calls must be a boolean"),
])
def test_tool_refusals_name_the_field(body, param, message):
    with pytest.raises(OpenAIError) as err:
        parse_chat({"messages": USER, **body}, tool_parser="hermes")
    assert (err.value.status, err.value.param) == (400, param)
    assert message in err.value.message


# ---- response shapes ----------------------------------------------------------------------
def _responses(texts: list[str], reason=api_pb2.FINISH_REASON_STOP):
    """Both choices' text, a few characters a message, then their final messages."""
    out = []
    for start in range(0, max(map(len, texts)), 5):
        out += [api_pb2.GenerateResponse(index=i, text=t[start:start + 5])
                for i, t in enumerate(texts) if t[start:start + 5]]
    return out + [api_pb2.GenerateResponse(index=i, finish_reason=reason,
                                           usage=api_pb2.Usage(completion_tokens=3))
                  for i in range(len(texts))]


def test_response_and_stream_carry_tool_calls_per_choice():
    texts = ["Hi " + call("ping", {"a": 1}), "no call here"]
    whole_builder = ResponseBuilder(True, "m", 2, tool_calls=HermesParser)
    for r in _responses(texts):
        whole_builder.add(r)
    choices = whole_builder.response()["choices"]
    assert [c["finish_reason"] for c in choices] == ["tool_calls", "stop"]
    messages = [without_ids(c["message"]) for c in choices]
    assert messages == [{"role": "assistant", "content": "Hi ",
                         "tool_calls": [fn("ping", '{"a": 1}')]},
                        {"role": "assistant", "content": "no call here"}]
    stream_builder = ResponseBuilder(True, "m", 2, tool_calls=HermesParser)
    chunks = [c for r in _responses(texts) if (c := stream_builder.chunk(r, False))]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert all(c["delta"] or c["finish_reason"] for c in mine)  # nothing empty is sent
        assert without_ids(merge([c["delta"] for c in mine])) == messages[i]
        assert mine[-1]["finish_reason"] == choices[i]["finish_reason"]


def test_a_cut_choice_keeps_finish_reason_length():
    builder = ResponseBuilder(True, "m", 1, tool_calls=RequiredParser)
    for r in _responses(['[{"name": "ping", "parameters": {}}, {"na'],
                        api_pb2.FINISH_REASON_LENGTH):
        builder.add(r)
    choice = builder.response()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["message"]["tool_calls"]) == 1
    assert choice["message"]["content"] == ' {"na'


# ---- the shipped Hermes template ----------------------------------------------------------
def test_hermes_template_renders_tools_calls_and_responses_that_the_parser_reads_back():
    from services.router.tokenizer import encode_chat, read_chat_template
    from tests.router import smollm2_tokenizer

    tok = smollm2_tokenizer()
    template = read_chat_template(str(HERMES_TEMPLATE))
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    for messages in (plain, plain[1:]):  # without tools: SmolLM2's own rendering
        assert (tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                        chat_template=template)
                == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    parsed = parse_chat({"tool_choice": "none", "tools": TOOLS, "messages": [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}).request.chat
    saved, tok.chat_template = tok.chat_template, template
    try:
        text = tok.decode(encode_chat(tok, parsed.messages, tools=parsed.tools))
    finally:
        tok.chat_template = saved
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert without_ids(whole(HermesParser(), turn)) == {
        "role": "assistant", "content": None, "tool_calls": [fn("get_weather",
                                                                '{"city": "Oslo"}')]}
