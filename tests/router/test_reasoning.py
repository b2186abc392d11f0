"""Reasoning output without a stack: the ``<think>`` splitter (``openai.reasoning``) whole and
at every chunking, when a request's output starts in the span, the response shapes
(``openai.responses``: fields, tool calls read from the content only, ``include_reasoning``,
``reasoning_tokens``), and the request fields (``chat_template_kwargs``,
``include_reasoning``) with their 400s."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.pb.pagedserve.v1 import api_pb2
from services.router.openai.errors import OpenAIError
from services.router.openai.reasoning import (
    ReasoningOptions,
    ReasoningSplitter,
    constrain_after,
    prompt_ends_reasoning,
    split,
    starts_in_reasoning,
    tag_ids,
)
from services.router.openai.requests import parse_chat
from services.router.openai.responses import ResponseBuilder
from services.router.openai.tool_calls import HermesParser
from services.router.validation import RequestError

USER = [{"role": "user", "content": "hi"}]
CALL = '<tool_call>{"name": "ping", "arguments": {"a": 1}}</tool_call>'


@pytest.mark.parametrize(("text", "thinking", "expected"), [
    ("<think>plan</think>answer", True, ("plan", "answer")),
    ("plan</think>answer", True, ("plan", "answer")),  # <think> was in the prompt
    ("plan\n</think>\n\nanswer", True, ("plan\n", "\n\nanswer")),
    ("all reasoning, cut short", True, ("all reasoning, cut short", "")),
    ("<think>a</think>b</think>c", True, ("a", "b</think>c")),  # the first end counts
    ("a<think>b</think>c<think>d", True, ("ab", "c<think>d")),
    ("</think>", True, ("", "")),
    ("x </thin", True, ("x </thin", "")),  # a tag that never completed is text
    ("", True, ("", "")),
    ("plan</think>answer", False, (None, "plan</think>answer")),
])
def test_split(text, thinking, expected):
    assert split(text, thinking) == expected


def _streamed(pieces: list[str], thinking: bool = True) -> tuple[list[str], list[str]]:
    splitter = ReasoningSplitter(thinking)
    out = [splitter.feed(p) for p in pieces] + [splitter.flush()]
    return [r for r, _ in out], [c for _, c in out]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think", ">", "/",
                                 "a", " ", "\n", "é", "</thi", "nk>"]), max_size=14),
       st.lists(st.integers(0, 40), max_size=8))
def test_streaming_equals_whole_at_every_chunking(parts, cuts):
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    reasoning, content = _streamed(pieces)
    # (a tag sent in pieces would show in the joined text: split removes every tag)
    assert ("".join(reasoning), "".join(content)) == split(text)


def test_a_possible_tag_is_held_back_until_it_resolves():
    splitter = ReasoningSplitter()
    assert splitter.feed("I think </th") == ("I think ", "")
    assert splitter.in_reasoning
    assert splitter.feed("ink>Yes") == ("", "Yes")
    assert not splitter.in_reasoning
    assert splitter.feed(" <think>") == ("", " <think>")  # after the span: plain content
    assert ReasoningSplitter(thinking=False).feed("a</think>") == ("", "a</think>")


def test_when_the_output_starts_in_the_span():
    assert starts_in_reasoning("deepseek_r1", {})
    assert starts_in_reasoning("deepseek_r1", {"enable_thinking": False})  # qwen3's switch only
    assert starts_in_reasoning("qwen3", {}) and starts_in_reasoning("qwen3",
                                                                    {"enable_thinking": True})
    assert not starts_in_reasoning("qwen3", {"enable_thinking": False})
    assert not starts_in_reasoning("deepseek_r1", {}, prompt_ends=True)
    ids = (7, 8)  # <think>, </think>
    assert prompt_ends_reasoning([1, 7, 2, 8, 3], ids)
    assert not prompt_ends_reasoning([1, 8, 7, 3], ids)
    assert not prompt_ends_reasoning([1, 2], ids) and not prompt_ends_reasoning([8], None)


def test_tag_ids_of_a_tokenizer_with_and_without_think_tokens():
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from tests.router import smollm2_tokenizer

    tok = smollm2_tokenizer()
    assert tag_ids(tok) is None
    copy = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tok.backend_tokenizer.to_str()))
    copy.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    start, end = tag_ids(copy)
    assert copy.encode("a<think>b</think>")[1:4:2] == [start, end]


# ---- responses ------------------------------------------------------------------------------
def _responses(texts: list[str], index: int = 0,
               finish=api_pb2.FINISH_REASON_STOP) -> list[api_pb2.GenerateResponse]:
    """One message per text (one token each), the last one final."""
    out = [api_pb2.GenerateResponse(index=index, text=t, token_ids=[100 + k])
           for k, t in enumerate(texts)]
    out[-1].finish_reason = finish
    out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens = 5, len(texts)
    return out


def _whole(texts, **kwargs) -> dict:
    builder = ResponseBuilder(True, "m", 1, **kwargs)
    for r in _responses(texts):
        builder.add(r)
    return builder.response()


def _stream(texts, **kwargs) -> tuple[list[dict], dict]:
    builder = ResponseBuilder(True, "m", 1, **kwargs)
    chunks = [c for r in _responses(texts) if (c := builder.chunk(r, False))]
    return [c["choices"][0]["delta"] for c in chunks], builder.usage()


TEXTS = ["<think>", "Let", " me </", "think", ">", "The answer", " is 4."]


def test_whole_and_streamed_messages_carry_the_span_apart():
    body = _whole(TEXTS, reasoning=ReasoningOptions(True))
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "The answer is 4.",
                       "reasoning_content": "Let me ", "reasoning": "Let me "}
    # messages 0..4 arrived while the span was open (the last holds the end of </think>)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    deltas, usage = _stream(TEXTS, reasoning=ReasoningOptions(True))
    assert all(deltas)  # nothing empty is sent
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me "
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "The answer is 4."
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 5}


def test_an_output_that_never_closes_the_span_is_all_reasoning_and_content_null():
    message = _whole(["<think>", "hmm"], reasoning=ReasoningOptions(True))["choices"][0][
        "message"]
    assert message["content"] is None and message["reasoning_content"] == "hmm"


def test_thinking_off_and_include_reasoning_false():
    off = _whole(TEXTS, reasoning=ReasoningOptions(False))
    assert off["choices"][0]["message"] == {
        "role": "assistant", "content": "".join(TEXTS), "reasoning_content": None,
        "reasoning": None}
    assert off["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    dropped = _whole(TEXTS, reasoning=ReasoningOptions(True, include=False))
    assert dropped["choices"][0]["message"] == {"role": "assistant",
                                                "content": "The answer is 4."}
    assert dropped["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    deltas, _ = _stream(TEXTS, reasoning=ReasoningOptions(True, include=False))
    assert deltas == [{"content": "The answer"}, {"content": " is 4."}]
    plain = _whole(TEXTS)
    assert "completion_tokens_details" not in plain["usage"]
    assert plain["choices"][0]["message"]["content"] == "".join(TEXTS)


def test_tool_calls_are_read_from_the_content_only():
    texts = ["I could ", CALL[:20], CALL[20:], " maybe</think>", "Sure. ", CALL]
    options = {"reasoning": ReasoningOptions(True), "tool_calls": HermesParser}
    message = _whole(texts, **options)["choices"][0]["message"]
    assert message["reasoning_content"] == "I could " + CALL + " maybe"
    assert message["content"] == "Sure. "
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "ping",
                                                               "arguments": '{"a": 1}'}]
    deltas, _ = _stream(texts, **options)
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert sum(len(d.get("tool_calls", [])) for d in deltas) == 1


# ---- request fields -------------------------------------------------------------------------
def test_chat_template_kwargs_and_include_reasoning_are_parsed():
    parsed = parse_chat({"messages": USER, "chat_template_kwargs": {"enable_thinking": False,
                                                                    "note": "é"},
                         "include_reasoning": False})
    assert json.loads(parsed.request.chat.chat_template_kwargs) == {"enable_thinking": False,
                                                                    "note": "é"}
    assert parsed.chat_template_kwargs == {"enable_thinking": False, "note": "é"}
    assert parsed.include_reasoning is False
    default = parse_chat({"messages": USER, "chat_template_kwargs": None})
    assert default.request.chat.chat_template_kwargs == "" and default.include_reasoning


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs",
     "chat_template_kwargs must be an object of template variables, got [1]"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"x": "\ud800"}}, "chat_template_kwargs", "lone surrogate"),
    ({"include_reasoning": "no"}, "include_reasoning",
     "include_reasoning must be a boolean, got 'no'"),
])
def test_bad_fields_are_400s_naming_them(body, param, message):
    with pytest.raises(OpenAIError) as e:
        parse_chat({"messages": USER, **body})
    assert e.value.status == 400 and e.value.param == param and message in e.value.message


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused():
    from services.router.tokenizer import encode_chat
    from tests.router import tiny_bos_tokenizer

    tok = tiny_bos_tokenizer()
    template = tok.chat_template
    try:
        tok.chat_template = template + "{% if note is defined %} {{ note }}{% endif %}"
        plain = encode_chat(tok, USER)
        noted = encode_chat(tok, USER, chat_template_kwargs='{"note": "hello world"}')
        assert noted == plain + tok.encode("hello world", add_special_tokens=False)
        for key in ("tokenize", "messages", "add_generation_prompt", "return_dict"):
            with pytest.raises(RequestError, match=f"may not set '{key}'"):
                encode_chat(tok, USER, chat_template_kwargs=json.dumps({key: True}))
        with pytest.raises(RequestError, match=r"chat\.chat_template_kwargs must be a JSON object"):
            encode_chat(tok, USER, chat_template_kwargs="[1]")
    finally:
        tok.chat_template = template


def test_a_grammar_waits_for_the_end_tag_or_makes_the_output_content():
    """With a grammar, a request that starts in the span waits for ``</think>``'s id; without
    tag tokens there is nothing to wait for and the (constrained) output is content; without
    a grammar, or outside the span, nothing changes."""
    on, off = ReasoningOptions(True, include=False), ReasoningOptions(False)
    assert constrain_after(on, (7, 8), constrained=True) == (on, 8)
    assert constrain_after(on, None, constrained=True) == (ReasoningOptions(False, False), None)
    for options, ids, constrained in ((on, (7, 8), False), (on, None, False),
                                      (off, (7, 8), True), (off, None, True)):
        assert constrain_after(options, ids, constrained) == (options, None)
