"""Reasoning output through the whole stack with the ``openai`` client, unchanged: a tiny random
Llama whose tokenizer (SmolLM2's) has ``<think>`` / ``</think>`` as added tokens (as Qwen3's
and DeepSeek-R1's have) and a chat template that ends the generation prompt with ``<think>\\n``
(DeepSeek-R1 style), or with a closed ``<think>\\n\\n</think>\\n\\n`` when ``enable_thinking`` is
false (Qwen3 style); the router runs ``--reasoning-parser deepseek_r1`` with Hermes tool calls.

A random model writes no ``</think>`` by itself, so a ``structured_outputs`` grammar (Lark)
makes it write a span, the ``</think>`` token (by id: llguidance counts added tokens as
special, which only a grammar can name) and an answer."""

from __future__ import annotations

import json
import re

import openai
import pytest
from tokenizers import AddedToken

from tests.helpers import make_tiny_llama
from tests.stack.conftest import _leak_check
from tests.stack_harness import InProcessStack

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if note is defined %}<|im_start|>system\nnote: {{ note }}<|im_end|>\n"
    "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
END_ID = 49153  # </think>: the tokenizer's 49152 tokens, then <think> and </think>
# a span of two words, the end tag, an answer (then EOS: the grammar allows nothing more)
GRAMMAR = rf"""start: /[a-z]{{2,6}} [a-z]{{2,6}}/ <[{END_ID}]> "\n\nThe answer is " /[0-9]/ "." """
OUTPUT = re.compile(r"[a-z]{2,6} [a-z]{2,6}</think>\n\nThe answer is [0-9]\.")
ANSWER = re.compile(r"\n\nThe answer is [0-9]\.")
CALL = r'/<tool_call>\{"name": "ping", "arguments": \{"n": [0-9]\}\}<\/tool_call>/'
TOOLS = [{"type": "function", "function": {
    "name": "ping", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def reasoning_stack(tmp_path_factory):
    from services.router.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("tiny-reasoner")
    make_tiny_llama(path, vocab_size=49160)  # the tokenizer's 49152 tokens and the two tags
    tokenizer = load_tokenizer(None)
    tokenizer.add_tokens([AddedToken("<think>", special=False),
                          AddedToken("</think>", special=False)])  # (as Qwen3's are)
    assert tokenizer.convert_tokens_to_ids("</think>") == END_ID
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(path))
    stack = InProcessStack(str(path),
                           worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB",
                                        "--enforce-eager"],
                           scheduler_argv=["--max-num-batched-tokens", "256"],
                           router_argv=["--reasoning-parser", "deepseek_r1",
                                        "--enable-auto-tool-choice",
                                        "--tool-call-parser", "hermes"]).start()
    stack.tokenizer = tokenizer  # (for the tests' expectations)
    yield stack
    stack.stop()


@pytest.fixture
def client(reasoning_stack):
    c = openai.OpenAI(base_url=f"{reasoning_stack.http_url}/v1", api_key="unused",
                      max_retries=0, timeout=120)
    yield c
    c.close()
    _leak_check(reasoning_stack)


def chat(client, stream: bool = False, grammar: str = GRAMMAR, **kwargs):
    """``(message fields, usage)`` of one chat completion; a stream's deltas are folded into
    the same fields (text joined, tool calls gathered)."""
    kwargs = {"model": "", "messages": ASK, "max_tokens": 40, "seed": 3, "temperature": 1.0,
              **kwargs}
    kwargs["extra_body"] = {"structured_outputs": {"grammar": grammar},
                            **kwargs.get("extra_body", {})}
    if not stream:
        r = client.chat.completions.create(**kwargs)
        m = r.choices[0].message
        extra = m.model_extra or {}
        return ({"content": m.content, "reasoning_content": extra.get("reasoning_content"),
                 "reasoning": extra.get("reasoning"), "has_reasoning": "reasoning" in extra,
                 "tool_calls": [(t.function.name, t.function.arguments)
                                for t in m.tool_calls or []],
                 "finish_reason": r.choices[0].finish_reason}, r.usage)
    folded: dict = {"content": None, "reasoning_content": None, "reasoning": None,
                    "has_reasoning": False, "tool_calls": [], "finish_reason": None}
    usage = None
    for chunk in client.chat.completions.create(stream=True,
                                                stream_options={"include_usage": True},
                                                **kwargs):
        usage = chunk.usage or usage
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            for name, value in (("content", c.delta.content),
                                ("reasoning_content", extra.get("reasoning_content")),
                                ("reasoning", extra.get("reasoning"))):
                if value:
                    folded[name] = (folded[name] or "") + value
            folded["has_reasoning"] |= "reasoning" in extra
            folded["tool_calls"] += [(t.function.name, t.function.arguments)
                                     for t in c.delta.tool_calls or []]
            folded["finish_reason"] = c.finish_reason or folded["finish_reason"]
    return folded, usage


@pytest.mark.parametrize("stream", [False, True])
def test_the_span_is_reasoning_content_and_the_answer_content(client, stream):
    message, usage = chat(client, stream)
    assert re.fullmatch(r"[a-z]{2,6} [a-z]{2,6}", message["reasoning_content"])
    assert message["reasoning"] == message["reasoning_content"]
    assert ANSWER.fullmatch(message["content"]) and message["finish_reason"] == "stop"
    reasoning_tokens = usage.completion_tokens_details.reasoning_tokens
    # the span's tokens and </think>, not the answer's (at least 5 tokens, 1 per character)
    assert 2 <= reasoning_tokens <= usage.completion_tokens - 5
    assert chat(client, not stream)[0] == message  # streamed and whole alike (same seed)


def test_include_reasoning_false_drops_the_span(client):
    for stream in (False, True):
        message, usage = chat(client, stream, extra_body={"include_reasoning": False})
        assert not message["has_reasoning"] and message["reasoning_content"] is None
        assert ANSWER.fullmatch(message["content"])
        assert usage.completion_tokens_details.reasoning_tokens >= 2


def test_an_output_cut_inside_the_span_is_all_reasoning(client):
    message, usage = chat(client, max_tokens=3, grammar="start: /[a-z]{20,30}/")
    assert message["content"] is None and message["finish_reason"] == "length"
    assert re.fullmatch(r"[a-z]+", message["reasoning_content"])
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens == 3


def test_chat_template_kwargs_reach_the_template(client, reasoning_stack):
    """enable_thinking false closes the span in the prompt: the output is all content (and
    the prompt longer); any other variable is printed by this template."""
    _, usage = chat(client)
    off, off_usage = chat(client, extra_body={"chat_template_kwargs":
                                              {"enable_thinking": False}})
    assert off["reasoning_content"] is None and off["has_reasoning"]
    assert OUTPUT.fullmatch(off["content"])  # the whole output, </think> and all
    assert off_usage.completion_tokens_details.reasoning_tokens == 0
    tokens = reasoning_stack.tokenizer.tokenize
    assert (off_usage.prompt_tokens - usage.prompt_tokens
            == len(tokens("<think>\n\n</think>\n\n")) - len(tokens("<think>\n")))
    _, noted = chat(client, extra_body={"chat_template_kwargs": {"note": "be brief"}})
    assert noted.prompt_tokens > usage.prompt_tokens + 3


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_parsed_from_the_content_only(client, stream):
    grammar = f'start: "I could " {CALL} <[{END_ID}]> {CALL}'
    message, _ = chat(client, stream, grammar=grammar, tools=TOOLS, max_tokens=80)
    assert re.fullmatch(r"I could <tool_call>.*</tool_call>", message["reasoning_content"])
    assert message["content"] is None and message["finish_reason"] == "tool_calls"
    assert [name for name, _ in message["tool_calls"]] == ["ping"]


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs",
     "chat_template_kwargs must be an object"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs",
     "may not set 'tokenize'"),
    ({"include_reasoning": "false"}, "include_reasoning", "include_reasoning must be a boolean"),
])
def test_bad_fields_are_400s_and_the_server_keeps_serving(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=ASK, max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param and words in e.value.body["message"]
    message, _ = chat(client)
    assert ANSWER.fullmatch(message["content"])


def test_grpc_clients_set_chat_template_kwargs_too(reasoning_stack):
    """ChatMessages / ChatRequest.chat_template_kwargs (JSON text) reach the template the same
    way: Tokenize counts what Chat then sends; a bad one is INVALID_ARGUMENT naming it."""
    import grpc

    from services.common.pb.pagedserve.v1 import api_pb2, api_pb2_grpc

    messages = [api_pb2.ChatMessage(role="user", content="hi")]
    off = json.dumps({"enable_thinking": False})
    with grpc.insecure_channel(reasoning_stack.address) as channel:
        stub = api_pb2_grpc.GenerationServiceStub(channel)

        def count(kwargs: str) -> int:
            return stub.Tokenize(api_pb2.TokenizeRequest(chat=api_pb2.ChatMessages(
                messages=messages, chat_template_kwargs=kwargs)), timeout=30).count

        assert count(off) > count("") and count('{"note": "x"}') > count("")
        final = list(stub.Chat(api_pb2.ChatRequest(
            messages=messages, chat_template_kwargs=off,
            sampling_params=api_pb2.SamplingParams(max_tokens=2)), timeout=60))[-1]
        assert final.delta.usage.prompt_tokens == count(off)
        with pytest.raises(grpc.RpcError) as e:
            count('{"enable_thinking": false')
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat.chat_template_kwargs must be a JSON object" in e.value.details()
    _leak_check(reasoning_stack)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_carry_the_span_as_a_reasoning_item(client, stream):
    """POST /v1/responses on the same parser: a ``reasoning`` item (its text the span) before
    the message, whose text is the answer only; streamed (``.stream``) as whole."""
    kwargs = {"model": "", "input": ASK[0]["content"], "max_output_tokens": 40,
              "temperature": 1.0,
              "extra_body": {"seed": 3, "structured_outputs": {"grammar": GRAMMAR}}}
    if stream:
        with client.responses.stream(**kwargs) as events:
            kinds = [e.type for e in events]
            r = events.get_final_response()
        assert "response.reasoning_text.delta" in kinds
        assert kinds.index("response.reasoning_text.done") < kinds.index(
            "response.output_text.delta")
    else:
        r = client.responses.create(**kwargs)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert re.fullmatch(r"[a-z]{2,6} [a-z]{2,6}", reasoning.content[0].text)
    assert ANSWER.fullmatch(r.output_text)
    assert 2 <= r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens - 5
    whole, usage = chat(client)  # the chat route splits the same output the same way
    assert (reasoning.content[0].text, r.output_text) == (whole["reasoning_content"],
                                                          whole["content"])
    # and counts its reasoning tokens by the same rule
    assert (r.usage.output_tokens_details.reasoning_tokens
            == usage.completion_tokens_details.reasoning_tokens)
    assert reasoning.status == message.status == "completed"


def _responses(client, **kwargs):
    """A whole /v1/responses answer for ASK on the span-then-answer grammar (seed 3)."""
    extra = {"seed": 3, "structured_outputs": {"grammar": GRAMMAR}, **kwargs.pop("extra", {})}
    return client.responses.create(**{"model": "", "input": ASK[0]["content"],
                                      "max_output_tokens": 40, "temperature": 1.0,
                                      "extra_body": extra, **kwargs})


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_length_finish_inside_the_span(client, stream):
    """max_output_tokens 4 inside the span: all 4 tokens are reasoning (chat's count) and
    the reasoning item, the last, is incomplete."""
    kwargs = {"model": "", "input": ASK[0]["content"], "max_output_tokens": 4,
              "extra_body": {"structured_outputs": {"grammar": "start: /[a-z]{20,30}/"}}}
    if stream:
        # NOTE: the SDK's get_final_response() accepts only response.completed, so a length
        # finish is read from the response.incomplete event itself
        with client.responses.stream(**kwargs) as events:
            (last,) = [e for e in events if e.type == "response.incomplete"]
        r = last.response
    else:
        r = client.responses.create(**kwargs)
    (item,) = r.output
    assert r.status == "incomplete" and item.type == "reasoning" and item.status == "incomplete"
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 4
    _, usage = chat(client, max_tokens=4, grammar="start: /[a-z]{20,30}/")
    assert usage.completion_tokens_details.reasoning_tokens == 4


@pytest.mark.parametrize("reasoning", [None, {}, {"effort": None}, {"summary": None}])
def test_responses_take_chat_template_kwargs_and_a_default_reasoning(client, reasoning):
    """chat_template_kwargs reach the template as on chat (enable_thinking false closes the
    span in the prompt: no reasoning item, the whole output the message's, the prompt as
    chat's); a default ``reasoning`` is accepted."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    kwargs = {} if reasoning is None else {"reasoning": reasoning}
    r = _responses(client, extra=off, **kwargs)
    _, chat_usage = chat(client, extra_body=off)
    assert [item.type for item in r.output] == ["message"]
    assert OUTPUT.fullmatch(r.output_text)  # the whole output, </think> and all
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens == chat_usage.prompt_tokens
    on = _responses(client, **kwargs)
    assert [item.type for item in on.output] == ["reasoning", "message"]
    assert on.usage.input_tokens < r.usage.input_tokens


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs",
     "may not set 'tokenize'"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs",
     "chat_template_kwargs must be an object"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning.effort"),
    ({"reasoning": {"summary": "auto"}}, "reasoning", "reasoning.summary"),
])
def test_responses_bad_template_and_reasoning_fields_are_400s(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="", input="hi", max_output_tokens=2, extra_body=body)
    assert e.value.body["param"] == param and words in e.value.body["message"]
    assert ANSWER.fullmatch(_responses(client).output_text)  # the server keeps serving


def test_the_sdk_passes_chat_template_kwargs(reasoning_stack):
    """``Client.chat`` / ``generate(messages=...)`` take ``chat_template_kwargs``: the prompt
    the engine got (usage) is what Tokenize counts with the same variables; without messages
    the SDK refuses it before sending."""
    from pagedserve_client import Client

    messages = [{"role": "user", "content": "hi"}]
    off = {"enable_thinking": False}
    with Client(reasoning_stack.address) as c:
        plain = c.tokenize(messages=messages).count
        thinking_off = c.chat(messages, max_tokens=2, chat_template_kwargs=off)
        whole = c.generate(messages=messages, max_tokens=2, chat_template_kwargs=off)
        assert thinking_off.usage.prompt_tokens == whole.usage.prompt_tokens > plain
        with pytest.raises(ValueError, match="needs messages"):
            c.generate("hi", max_tokens=2, chat_template_kwargs=off)
        counted = c.tokenize(messages=messages, chat_template_kwargs=off)
        assert counted.count == thinking_off.usage.prompt_tokens
        with pytest.raises(ValueError, match="needs messages"):
            c.tokenize("hi", chat_template_kwargs=off)
    _leak_check(reasoning_stack)


def test_the_async_sdk_tokenizes_with_chat_template_kwargs(reasoning_stack):
    import asyncio

    from pagedserve_client import AsyncClient

    messages = [{"role": "user", "content": "hi"}]

    async def counts() -> tuple[int, int, int]:
        async with AsyncClient(reasoning_stack.address) as c:
            off = await c.tokenize(messages=messages,
                                   chat_template_kwargs={"enable_thinking": False})
            answer = await c.chat(messages, max_tokens=2,
                                  chat_template_kwargs={"enable_thinking": False})
            plain = await c.tokenize(messages=messages)
            return off.count, answer.usage.prompt_tokens, plain.count

    off, used, plain = asyncio.run(counts())
    assert off == used > plain
