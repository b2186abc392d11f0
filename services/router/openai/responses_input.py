"""OpenAI Responses API requests (POST /v1/responses) -> the chat request the chat route builds.

The Responses body is checked here (JSON shapes, the fields this server cannot serve) and
rewritten as a chat completions body, which ``openai.requests.parse_chat`` maps as it maps any
chat request (tools, structured outputs, sampling), so both routes share one path and one set
of rules:

    Responses                                        chat
    instructions                                     a system message, first
    input: "text"                                    [{"role": "user", "content": "text"}]
    input: [{"role", "content"}]                     a message (content parts input_text /
                                                     output_text joined)
    input: [{"type": "function_call", "call_id",     an assistant message's tool_calls (calls in
             "name", "arguments"}]                   a row share one message)
    input: [{"type": "function_call_output",         {"role": "tool", "tool_call_id",
             "call_id", "output"}]                   "content"}
    input: [{"type": "reasoning", ...}]              dropped (an earlier turn's thinking)
    tools: [{"type": "function", "name", ...}]       [{"type": "function", "function": {...}}]
    tool_choice: {"type": "function", "name"}        {"type": "function", "function": {"name"}}
    text.format: {"type": "json_schema", "name",     response_format: {"type": "json_schema",
                  "schema", "strict"?}                 "json_schema": {...}}
    max_output_tokens                                max_completion_tokens

vLLM's sampling extras (``seed``, ``top_k``, ``stop``, ``ignore_eos``, ...; openai client:
``extra_body``) pass through as on the chat route. With the router's store
(``openai.responses_store``) ``store`` (default true) keeps the answer and
``previous_response_id`` puts a stored conversation before the input; without it both are
refused. ``background: true``, ``include``, ``truncation: "auto"``, ``conversation``,
``prompt``, ``max_tool_calls``, non-zero ``top_logprobs`` and a ``reasoning`` with a non-null
``effort`` / ``summary`` are refused with a 400 naming them (``reasoning: {}`` is the default;
vLLM's ``chat_template_kwargs`` passes to the template as on chat, e.g. ``{"enable_thinking":
false}``), as are hosted tools (web_search, file_search, ...) and input items other than
the above. Errors from the shared chat mapping are renamed to the
Responses fields (``rename``), so every 400 names a field of the request the client sent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.router.openai.errors import OpenAIError, bad_request
from services.router.openai.requests import ParsedRequest, parse_chat
from services.router.openai.responses_store import ResponseStore

# vLLM's sampling extras the chat route reads, passed through unchanged.
_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
           "skip_special_tokens", "include_stop_str_in_output", "priority", "logit_bias",
           "structured_outputs", "chat_template_kwargs")
_PASSED = (*_EXTRAS, "temperature", "top_p", "stream", "parallel_tool_calls", "model")
# Fields refused unless null or this default: what a stateless server cannot serve.
_REFUSED: dict[str, Any] = {"background": False, "conversation": None, "prompt": None,
                            "include": [], "truncation": "disabled",
                            "max_tool_calls": None, "top_logprobs": 0}
# ``reasoning``'s fields: only null (the model's default) is served; the template decides.
_REASONING = ("effort", "summary", "generate_summary")
NO_STORE = "this router stores no responses (see --enable-responses-api-store)"
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# Chat field names in the text of the shared mapping's errors -> the Responses fields they came
# from (the text only: an error's ``param`` is renamed by ``_PARAMS``).
_RENAMES = [(re.compile(r"\b(?:max_completion_tokens|max_tokens)\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
            (re.compile(r"\bresponse_format\b"), "text.format"),
            (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
            (re.compile(r"\b(?:chat\.)?messages\b"), "input")]
# An error's chat ``param`` -> the Responses field it came from (the others are the same).
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text", "messages": "input"}
# A grammar error's chat-side name in its text (``structured_outputs.<kind>``) when
# text.format set the grammar (its ``param`` is then "text").
_GRAMMAR_RENAMES = [(re.compile(r"\bstructured_outputs\.json_object\b"), "text.format"),
                    (re.compile(r"\bstructured_outputs\.json\b"), "text.format.schema")]


@dataclass(slots=True)
class ParsedResponses:
    """A POST /v1/responses body mapped onto the chat path.

    Attributes:
        chat: the chat request (``parse_chat``'s), its error params already renamed to the
            Responses fields; ``chat.structured_param`` is "text" when ``text.format`` set
            the grammar.
        echo: the request fields a Response object repeats (``instructions``,
            ``max_output_tokens``, ``metadata``, ``parallel_tool_calls``,
            ``previous_response_id``, ``store``, ``temperature``, ``top_p``, ``text``,
            ``tool_choice``, ``tools``, ``user``), defaults filled in.
        messages: the conversation as chat messages without the instructions (what the store
            keeps before the answer).
        store: keep the answer in the router's store.
    """

    chat: ParsedRequest
    echo: dict[str, Any]
    messages: list[dict]
    store: bool


def parse_responses(body: dict, tool_parser: str | None = None,
                    store: ResponseStore | None = None) -> ParsedResponses:
    """Check a Responses body and map it onto a chat request.

    Args:
        tool_parser: the router's ``--tool-call-parser`` when ``--enable-auto-tool-choice``
            is set, else None (``tool_choice: "auto"`` with tools is then refused, as on chat).
        store: the router's response store, or None (``store: true`` and
            ``previous_response_id`` are then refused).

    Raises:
        OpenAIError: 400 naming the field (``input``, ``tools``, ``tool_choice``, ``text``,
            ``metadata``, ``previous_response_id`` unknown, a refused field, ...).
    """
    for name, default in _REFUSED.items():
        value = body.get(name)
        if value is not None and value != default:
            raise bad_request(f"{name} is not supported by this server", name)
    _reasoning(body.get("reasoning"))
    keep = body.get("store")
    if keep is not None and not isinstance(keep, bool):
        raise bad_request("store must be a boolean", "store")
    if keep and store is None:
        raise bad_request(f"store is not supported: {NO_STORE}", "store")
    history = _history(body.get("previous_response_id"), store)
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    messages = history + _input(body.get("input"), _call_ids(history))
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions
                        else []) + messages
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = [{"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}}
            for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "name": ...}', "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    text = _text_config(body.get("text"))
    fmt = text["format"]
    if fmt["type"] == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    metadata = _metadata(body.get("metadata"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("user must be a string", "user")
    try:
        parsed = parse_chat(chat, tool_parser)
    except OpenAIError as e:
        raise rename(e) from None
    if parsed.structured_param == "response_format":
        parsed.structured_param = "text"
    parsed.prompt_param = "input"
    limit = body.get("max_output_tokens")  # (an integer: parse_chat checked it; 5.0 -> 5)
    echo = {"instructions": instructions,
            "max_output_tokens": int(limit) if limit is not None else None,
            "metadata": metadata, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "store": store is not None and keep is not False,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "text": text,
            "tool_choice": choice if choice is not None else ("auto" if tools else "none"),
            "tools": [{"strict": True, **t} for t in tools], "user": user}
    return ParsedResponses(parsed, echo, messages, echo["store"])


def rename(e: OpenAIError) -> OpenAIError:
    """``e`` (an error of the chat mapping, its grammar's param already the request's
    ``ParsedRequest.structured_param``, see ``requests.from_error``) with its ``param``
    replaced by the Responses field it came from (``_PARAMS``: ``max_tokens`` ->
    ``max_output_tokens``, ``response_format`` -> ``text``, ``messages`` -> ``input``), and
    the chat field names in its text by the Responses ones (``tools[i].function.x`` ->
    ``tools[i].x``, ...; with param "text" also ``structured_outputs.json`` ->
    ``text.format.schema``, ``structured_outputs.json_object`` -> ``text.format``).
    """
    param = _PARAMS.get(e.param, e.param) if e.param is not None else None
    message = e.message
    for pattern, name in _RENAMES + (_GRAMMAR_RENAMES if param == "text" else []):
        message = pattern.sub(name, message)
    return OpenAIError(e.status, message, e.type, param, e.code)


def _reasoning(reasoning) -> None:
    """``reasoning``: null, or an object whose ``effort`` / ``summary`` are null (the model's
    default; ``chat_template_kwargs`` such as ``{"enable_thinking": false}`` turn a template's
    thinking off).

    Raises:
        OpenAIError: 400 naming ``reasoning.<field>`` when one is set.
    """
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise bad_request("reasoning must be an object {effort, summary} or null", "reasoning")
    for name in _REASONING:
        if reasoning.get(name) is not None:
            raise bad_request(f"reasoning.{name} is not supported by this server, got "
                              f"{reasoning[name]!r}: only null (the model's default); turn a "
                              "template's thinking off with chat_template_kwargs "
                              '{"enable_thinking": false}', "reasoning")


def _history(previous, store: ResponseStore | None) -> list[dict]:
    """The stored conversation ``previous_response_id`` continues (a copy), or []."""
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise bad_request("previous_response_id must be a string", "previous_response_id")
    if store is None:
        raise bad_request(f"previous_response_id is not supported: {NO_STORE}",
                          "previous_response_id")
    entry = store.get(previous)
    if entry is None:
        raise bad_request(f"previous_response_id {previous!r} is not a response stored by this "
                          f"router (it keeps the last {store.capacity})", "previous_response_id")
    return [dict(m) for m in entry.conversation]


def _call_ids(messages: list[dict]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls", ())}


def _input(value, calls: set[str]) -> list[dict]:
    """``input`` as chat messages (``calls``: the ids of earlier tool calls, added to)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got "
                                  f"{role!r}", "input")
            messages.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {k: _string(item, k, where) for k in ("call_id", "name", "arguments")}
            try:
                arguments = json.loads(call["arguments"])
            except (ValueError, RecursionError):
                arguments = None
            if not isinstance(arguments, dict):
                raise bad_request(f"{where}.arguments must be a JSON object as text", "input")
            calls.add(call["call_id"])
            tool_call = {"id": call["call_id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls in a row: one turn
                last.setdefault("tool_calls", []).append(tool_call)
            else:
                messages.append({"role": "assistant", "content": None,
                                 "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in calls:
                raise bad_request(f"{where}.call_id {call_id!r} answers no function_call of an "
                                  "earlier input item", "input")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _content(item.get("output"), where, "output")})
        elif kind != "reasoning":
            raise bad_request(f"{where}.type {kind!r} is not supported: input items are "
                              "messages, function_call, function_call_output and reasoning",
                              "input")
    if not messages:
        raise bad_request("input has no message", "input")
    return messages


def _content(content, where: str, field: str = "content") -> str:
    """A message's ``content`` (or an output's ``output``): a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.{field} must be a string or a list of input_text parts",
                          "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.{field}[{j}].text must be a string (a {kind} part's "
                              "text)", "input")
        if kind not in _TEXT_PARTS:
            raise bad_request(f"{where}.{field}[{j}]: only text parts ({{\"type\": "
                              f"\"input_text\", \"text\": ...}}) are supported, got {kind!r}",
                              "input")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{name} must be a non-empty string", "input")
    return value


def _tools(tools) -> list[dict]:
    """``tools`` checked to be function tools in the Responses' flat shape."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request('tools must be a list of {"type": "function", "name", ...}', "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}].type {kind!r} is not supported: only function "
                              "tools are (no hosted tools)", "tools")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise bad_request(f"tools[{i}].strict must be a boolean", "tools")
        out.append({k: tool[k] for k in ("type", "name", "description", "parameters", "strict")
                    if tool.get(k) is not None})
    return out


def _text_config(text) -> dict:
    """``text`` with its ``format`` checked (default ``{"type": "text"}``)."""
    if text is None:
        return {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise bad_request("text must be an object {format}", "text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format.type must be one of text, json_object, json_schema, got "
                          f"{kind!r}", "text")
    return {**text, "format": fmt}


def _metadata(metadata) -> dict | None:
    """``metadata``: at most 16 string keys (64 characters) to string values (512), OpenAI's
    limits."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise bad_request("metadata must be an object of at most 16 keys", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise bad_request(f"metadata[{key!r}] must be a string of at most 512 characters, "
                              "under a key of at most 64", "metadata")
    return metadata
