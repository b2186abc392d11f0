"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` bodies -> the gRPC API's Tokenize and
Detokenize (``services.router.text_api``), so the ids are exactly those a completion or chat
request with the same input sends to the engine.

    /tokenize    {"prompt": str, "add_special_tokens"?: true}
                 or {"messages": [...], "add_generation_prompt"?: true,
                     "continue_final_message"?: false, "add_special_tokens"?: false,
                     "chat_template_kwargs"?: {...}, "tools"?: [...]}
                 either with "return_token_strs"?: false
                 -> {"count", "max_model_len", "tokens", "token_strs"?}
    /detokenize  {"tokens": [int, ...]} -> {"prompt": str}

``model`` is checked by the caller (``openai.http``). Only JSON types are checked here; the
rest (empty input, the chat template's refusals, ids outside the vocabulary) is
``text_api``'s, whose ``RequestError`` becomes a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.router import text_api
from services.router.openai.errors import OpenAIError, bad_request, utf8
from services.router.openai.messages import parse_messages
from services.router.openai.requests import chat_template_kwargs
from services.router.openai.tools import parse_tools
from services.router.validation import RequestError

_INT32 = (-(2**31), 2**31 - 1)


def _flag(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {value!r}", name)
    return value


def tokenize(body: dict, tokenizer, info: engine_pb2.GetEngineInfoResponse) -> dict:
    """The ``/tokenize`` answer for a JSON body (``prompt`` or ``messages``, vLLM's two forms).

    Raises:
        OpenAIError: 400 naming the field: both or neither of prompt and messages, a wrong
            JSON type, an empty input, a conversation the chat template refuses.
    """
    req = api_pb2.TokenizeRequest()
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad_request("set exactly one of prompt (a string) or messages (a chat)",
                          "prompt" if prompt is not None else "messages")
    add_special = _flag(body, "add_special_tokens")
    if add_special is not None:
        req.add_special_tokens = add_special
    strs = _flag(body, "return_token_strs")
    if prompt is not None:
        param = "prompt"
        if not isinstance(prompt, str):
            raise bad_request("prompt must be a string", param)
        if not prompt:  # (text_api would name the gRPC API's fields)
            raise bad_request("prompt is empty: send a non-empty prompt, or messages", param)
        req.prompt = utf8(prompt, param)
    else:
        param = "messages"
        if messages == []:  # (text_api would name the gRPC API's field, chat.messages)
            raise bad_request("messages is empty", param)
        req.chat.messages.extend(parse_messages(messages))
        if body.get("tools") is not None:
            generate = api_pb2.GenerateRequest()
            parse_tools({"tools": body["tools"], "tool_choice": "none"}, generate, None)
            req.chat.tools.extend(generate.chat.tools)
        for name in ("add_generation_prompt", "continue_final_message"):
            value = _flag(body, name)
            if value is not None:
                setattr(req, name, value)
        chat_template_kwargs(body, req.chat)
    try:
        out = text_api.tokenize(req, tokenizer, info)
    except RequestError as e:
        raise OpenAIError(400, e.message, param=e.param or param,
                          code=e.code.name.lower()) from None
    answer: dict[str, Any] = {"count": out.count, "max_model_len": out.max_model_len,
                              "tokens": list(out.token_ids)}
    if strs:
        answer["token_strs"] = tokenizer.convert_ids_to_tokens(answer["tokens"])
    return answer


def detokenize(body: dict, tokenizer, info: engine_pb2.GetEngineInfoResponse) -> dict:
    """The ``/detokenize`` answer for a JSON body ``{"tokens": [ids]}``: the ids decoded in one
    piece, special tokens left out (vLLM's default).

    Raises:
        OpenAIError: 400 (param "tokens"): not a list of ints, or an id outside
            [0, vocab_size) (``tokens[1] must be in [0, 49152), got 60000 (49152 is the
            vocabulary size)``).
    """
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
        raise bad_request("tokens must be a list of token ids (ints)", "tokens")
    bad = next((i for i, t in enumerate(tokens) if not _INT32[0] <= t <= _INT32[1]), None)
    if bad is not None:
        raise bad_request(f"tokens[{bad}] must be in [0, {info.vocab_size}), got {tokens[bad]} "
                          f"({info.vocab_size} is the vocabulary size)", "tokens")
    try:
        out = text_api.detokenize(api_pb2.DetokenizeRequest(token_ids=tokens), tokenizer, info,
                                  field="tokens")
    except RequestError as e:
        raise OpenAIError(400, f"{e.message} ({info.vocab_size} is the vocabulary size)",
                          param="tokens", code=e.code.name.lower()) from None
    return {"prompt": out.text}
