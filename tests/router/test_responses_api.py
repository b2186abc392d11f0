"""The Responses API without the stack: the request mapping (``openai.responses_input``) and the
event builder (``openai.responses_api``), every object checked against the ``openai``
package's own pydantic types (validated, not the client's lenient construction)."""

from __future__ import annotations

import grpc
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from services.common.finish_reason import FinishReason
from services.common.pb.pagedserve.v1 import api_pb2
from services.router.openai.errors import OpenAIError
from services.router.openai.reasoning import ReasoningOptions, ReasoningSplitter
from services.router.openai.requests import from_error
from services.router.openai.responses import ResponseBuilder
from services.router.openai.responses_api import ResponseEvents
from services.router.openai.responses_input import parse_responses, rename
from services.router.openai.responses_store import ResponseStore
from services.router.openai.tool_calls import NamedParser
from services.router.validation import RequestError

EVENT = TypeAdapter(ResponseStreamEvent)


def _messages(*texts: str, reason: FinishReason = FinishReason.STOP):
    """GenerateResponses of one choice, one token each, the last final."""
    out = [api_pb2.GenerateResponse(text=t, token_ids=[i]) for i, t in enumerate(texts)]
    out[-1].finish_reason = reason.pb
    out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens = 5, len(texts)
    out[-1].usage.num_cached_tokens = 2
    return out


def _run(builder: ResponseEvents, messages) -> list[dict]:
    events = builder.start()
    for m in messages:
        events += builder.feed(m)
    for e in events:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _echo(**overrides) -> dict:
    return parse_responses({"input": "x", **overrides}).echo


def test_split_seam_puts_a_reasoning_item_before_the_message():
    builder = ResponseEvents("m", _echo(), split=ReasoningSplitter)
    events = _run(builder, _messages("let me ", "think</think>The ", "answer."))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    final = Response.model_validate(events[-1]["response"])
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text == "let me think" and reasoning.summary == []
    assert message.type == "message" and final.output_text == "The answer."
    assert final.usage.output_tokens_details.reasoning_tokens == 2  # up to the closing one
    assert final.usage.input_tokens_details.cached_tokens == 2
    assert final.usage.total_tokens == 8 and final.status == "completed"
    assert reasoning.status == "completed" and message.status == "completed"
    whole = ResponseEvents("m", _echo(), split=ReasoningSplitter)
    for m in _messages("let me ", "think</think>The ", "answer."):
        whole.feed(m)
    assert whole.response()["output"][0]["content"] == final.output[0].model_dump()["content"]


def test_no_split_and_length_is_incomplete():
    builder = ResponseEvents("m", _echo(max_output_tokens=2))
    events = _run(builder, _messages("Hi", " there", reason=FinishReason.LENGTH))
    final = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.incomplete" and final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete" and final.output_text == "Hi there"
    assert final.max_output_tokens == 2 and final.usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("texts, reason, expected", [
    (["a", "b", "</think>", "c"], FinishReason.STOP, 3),  # the closing message counts
    (["<think>", "a", "</th", "ink>", "b"], FinishReason.STOP, 4),  # a tag over two messages
    (["a", "b", "", "c"], FinishReason.LENGTH, 4),  # never closed: every token is reasoning
    (["x</think>", "y"], FinishReason.STOP, 1),
])
def test_reasoning_tokens_are_counted_as_chat_counts_them(texts, reason, expected):
    """One rule on both routes (``ReasoningSplitter.reasoning_tokens``): every token of a
    message that arrives while the span is open, the one that closes it included."""
    events = ResponseEvents("m", _echo(), split=ReasoningSplitter)
    for m in _messages(*texts, reason=reason):
        events.feed(m)
    chat = ResponseBuilder(True, "m", 1, reasoning=ReasoningOptions(True))
    for m in _messages(*texts, reason=reason):
        chat.add(m)
    usage = Response.model_validate(events.response()).usage
    assert usage.output_tokens_details.reasoning_tokens == expected
    assert chat.response()["usage"]["completion_tokens_details"]["reasoning_tokens"] == expected


def test_a_length_finish_inside_the_span_leaves_an_incomplete_reasoning_item():
    builder = ResponseEvents("m", _echo(max_output_tokens=4), split=ReasoningSplitter)
    events = _run(builder, _messages("a", "b", "c", "d", reason=FinishReason.LENGTH))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [("reasoning", "incomplete")]
    final = Response.model_validate(events[-1]["response"])
    (item,) = final.output
    assert item.type == "reasoning" and item.status == "incomplete"
    assert final.usage.output_tokens_details.reasoning_tokens == 4


def test_every_item_type_has_a_status_as_the_openai_types_expect():
    builder = ResponseEvents("m", _echo(), split=ReasoningSplitter,
                             tool_calls=lambda: NamedParser("f"))
    events = _run(builder, _messages("hm</think>", '{"a"', ": 1}"))
    final = Response.model_validate(events[-1]["response"])
    assert [(i.type, i.status) for i in final.output] == [("reasoning", "completed"),
                                                          ("function_call", "completed")]
    added = [e["item"]["status"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["in_progress", "in_progress"]


def test_named_call_streams_argument_deltas():
    builder = ResponseEvents("m", _echo(), tool_calls=lambda: NamedParser("f"))
    events = _run(builder, _messages('{"a"', ": 1}"))
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    (call,) = Response.model_validate(events[-1]["response"]).output
    assert call.type == "function_call" and call.name == "f" and call.arguments == '{"a": 1}'
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"


def test_items_map_onto_chat_messages():
    parsed = parse_responses({
        "instructions": "be kind", "tools": [{"type": "function", "name": "f"}],
        "tool_choice": {"type": "function", "name": "f"}, "max_output_tokens": 9,
        "input": [{"role": "user", "content": "q"},
                  {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call_output", "call_id": "a", "output": "1"},
                  {"type": "function_call_output", "call_id": "b",
                   "output": [{"type": "input_text", "text": "2"}]}]})
    req = parsed.chat.request
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "be kind"), ("user", "q"), ("assistant", ""), ("tool", "1"), ("tool", "2")]
    assert [c.id for c in req.chat.messages[2].tool_calls] == ["a", "b"]
    assert [t.name for t in req.chat.tools] == ["f"]
    assert req.sampling_params.max_tokens == 9
    assert req.sampling_params.HasField("structured_outputs")  # the named call's grammar
    assert parsed.echo["tools"] == [{"type": "function", "name": "f", "strict": True}]
    Response.model_validate(ResponseEvents("m", parsed.echo).response())


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text",
     "text.format.schema"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools",
     "tools[0].name"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools", "'file_search'"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "tool_choice"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "[]"}]},
     "input", "input[0].arguments"),
    ({"input": "x", "truncation": "auto"}, "truncation", "truncation"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "reasoning.effort"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning", "reasoning.summary"),
    ({"input": "x", "reasoning": "high"}, "reasoning", "reasoning must be an object"),
    ({"input": "x", "chat_template_kwargs": [1]}, "chat_template_kwargs",
     "chat_template_kwargs must be an object"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input",
     "input[0].content[0].text must be a string"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input", "'input_image'"),
    ({"input": "x", "store": True}, "store", "--enable-responses-api-store"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id",
     "--enable-responses-api-store"),
])
def test_errors_name_the_responses_field(body, param, words):
    with pytest.raises(OpenAIError) as e:
        parse_responses(body)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


@pytest.mark.parametrize("reasoning", [None, {}, {"effort": None}, {"summary": None},
                                       {"effort": None, "summary": None,
                                        "generate_summary": None}])
def test_a_default_reasoning_is_accepted(reasoning):
    parsed = parse_responses({"input": "x", "reasoning": reasoning,
                              "chat_template_kwargs": {"enable_thinking": False}})
    assert parsed.chat.chat_template_kwargs == {"enable_thinking": False}
    assert parsed.chat.request.chat.chat_template_kwargs == '{"enable_thinking": false}'


def test_grammar_errors_of_text_format_name_text_format():
    grammar = RequestError(grpc.StatusCode.INVALID_ARGUMENT, "structured_outputs.json: bad schema",
                           "structured_outputs")
    renamed = rename(from_error(grammar, "input", "text"))  # text.format set the grammar
    assert renamed.message == "text.format.schema: bad schema" and renamed.param == "text"
    err = OpenAIError(400, "structured_outputs.json_object must be true", param="text")
    assert rename(err).message == "text.format must be true"
    own = rename(from_error(grammar, "input", "structured_outputs"))  # vLLM's extra set it
    assert (own.message, own.param) == ("structured_outputs.json: bad schema",
                                        "structured_outputs")


@pytest.mark.parametrize("field, param", [("max_tokens", "max_output_tokens"),
                                          ("messages", "input"), ("prompt", "input"),
                                          ("temperature", "temperature"), ("tools", "tools")])
def test_validation_errors_name_the_responses_field(field, param):
    e = RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field} is wrong", field)
    assert rename(from_error(e, "input", "text")).param == param


def test_store_is_an_lru_of_conversations():
    store = ResponseStore(2)
    ids = []
    for i in range(3):
        parsed = parse_responses({"input": f"q{i}", "instructions": "sys"}, store=store)
        events = ResponseEvents("m", parsed.echo)
        for m in _messages(f"a{i}"):
            events.feed(m)
        store.put(events.response(), parsed.messages)
        ids.append(events.id)
    assert len(store) == 2 and store.get(ids[0]) is None
    parsed = parse_responses({"input": "next", "previous_response_id": ids[2]}, store=store)
    assert [(m.role, m.content) for m in parsed.chat.request.chat.messages] == [
        ("user", "q2"), ("assistant", "a2"), ("user", "next")]  # no instructions carried
    assert parsed.echo["store"] is True and parsed.echo["previous_response_id"] == ids[2]


def test_error_event_after_the_start_is_an_openai_error_event():
    builder = ResponseEvents("m", _echo())
    events = builder.start() + builder.feed(api_pb2.GenerateResponse(text="a", token_ids=[1]))
    error = builder.error("engine failed", "internal", None)
    EVENT.validate_python(error)
    assert error["type"] == "error" and error["sequence_number"] == len(events)
