"""Anthropic Messages requests -> the chat request ``/v1/chat/completions`` builds, so both
routes share one path (``openai.requests.parse_chat``: tools, grammars, sampling, then
``generation.prepare``'s validation) and one set of rules:

    Messages                                          chat
    system: "text" | [text blocks]                    a system message, first (blocks joined
                                                      by newlines)
    {"role", "content": "text"}                       the same message
    user content blocks: text                         a user message (consecutive texts joined)
    user content blocks: tool_result {tool_use_id,    {"role": "tool", "tool_call_id",
                         content}                      "content"} (text blocks joined)
    assistant content blocks: text, tool_use          one assistant message: its content and
                         {id, name, input}             tool_calls (input as JSON text)
    thinking / redacted_thinking blocks               dropped (an earlier turn's thinking)
    max_tokens                                        max_tokens
    stop_sequences                                    stop
    temperature, top_p, top_k, stream                 the same
    tools: [{name, description, input_schema}]        [{"type": "function", "function":
                                                        {name, description, parameters}}]
    tool_choice: auto | any | tool {name} | none      "auto" | "required" | {"type":
                                                      "function", ...} | "none"
    tool_choice.disable_parallel_tool_use: true       parallel_tool_calls: false
    output_config.format: {type: json_schema,          response_format: {"type": "json_schema",
                           schema}                      "json_schema": {"name", "schema"}}

vLLM's sampling extras (``seed``, ``min_p``, ``structured_outputs``, ``chat_template_kwargs``,
... : ``_EXTRAS``) pass through unchanged. ``tool_choice`` ``auto`` needs the router's
``--enable-auto-tool-choice --tool-call-parser`` (as on chat); ``any`` and ``tool`` are
enforced by a grammar. A tool_result must answer a tool_use of an earlier assistant turn.
"""

from __future__ import annotations

import json
from typing import Any

from services.router.anthropic.errors import invalid
from services.router.anthropic.models import (
    CountTokensRequest,
    MessagesRequest,
    TextBlockParam,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from services.router.openai.requests import ParsedRequest, parse_chat

# vLLM's sampling extras the chat route reads, passed through unchanged.
_EXTRAS = ("seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
           "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
           "include_stop_str_in_output", "priority", "logit_bias", "structured_outputs",
           "chat_template_kwargs")


def to_chat(req: MessagesRequest, body: dict, tool_parser: str | None) -> ParsedRequest:
    """The chat request of a validated Messages request.

    Args:
        body: the request's JSON (its vLLM extras, ``_EXTRAS``, pass through).
        tool_parser: the router's ``--tool-call-parser`` when ``--enable-auto-tool-choice``
            is set, else None (``tool_choice`` auto with tools is then refused, as on chat).

    Raises:
        AnthropicError: 400 naming the field (a block in the wrong role, a tool_result that
            answers no tool_use, a tool_choice without tools).
        OpenAIError: 400 from the chat mapping (``errors.from_openai`` names the Messages
            fields).
    """
    chat: dict[str, Any] = {k: body[k] for k in _EXTRAS if k in body}
    chat.update(prompt(req))
    chat["max_tokens"] = req.max_tokens
    if req.stop_sequences is not None:
        chat["stop"] = req.stop_sequences
    for name in ("temperature", "top_p", "top_k", "stream"):
        value = getattr(req, name)
        if value is not None:
            chat[name] = value
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt.json_schema}}
    choice = req.tool_choice
    if choice is not None:
        if not req.tools and not isinstance(choice, (ToolChoiceAuto, ToolChoiceNone)):
            raise invalid(f"tool_choice {choice.type!r} needs tools")
        if not req.tools:
            chat["tool_choice"] = "none"
        elif isinstance(choice, ToolChoiceAuto):
            chat["tool_choice"] = "auto"
        elif isinstance(choice, ToolChoiceAny):
            chat["tool_choice"] = "required"
        elif isinstance(choice, ToolChoiceNone):
            chat["tool_choice"] = "none"
        else:
            if choice.name not in {t.name for t in req.tools}:
                raise invalid(f"tool_choice.name {choice.name!r} is not the name of a tool in "
                              "tools")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        if getattr(choice, "disable_parallel_tool_use", None):
            chat["parallel_tool_calls"] = False
    return parse_chat(chat, tool_parser)


def prompt(req: CountTokensRequest) -> dict[str, Any]:
    """The chat ``messages`` (and ``tools``, when there are any) of a request: what its
    prompt is rendered from.

    Raises:
        AnthropicError: 400 naming the block (see ``to_chat``).
    """
    messages: list[dict[str, Any]] = []
    system = (req.system if isinstance(req.system, str) or req.system is None
              else "\n".join(block.text for block in req.system))
    if system:
        messages.append({"role": "system", "content": system})
    calls: set[str] = set()  # the ids of the tool_use blocks so far
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            messages.append(_assistant(m.content, f"messages[{i}]", calls))
        else:
            messages += _user(m.content, f"messages[{i}]", calls)
    out: dict[str, Any] = {"messages": messages}
    if req.tools:
        out["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}}
            for t in req.tools]
    return out


def _assistant(blocks: list, where: str, calls: set[str]) -> dict[str, Any]:
    """One assistant turn's blocks as one chat message (text, then its tool calls)."""
    text, tool_calls = "", []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlockParam):
            text += block.text
        elif isinstance(block, ToolUseBlockParam):
            if block.id in calls:
                raise invalid(f"{where}.content[{j}].id {block.id!r} is the id of an earlier "
                              "tool_use block")
            calls.add(block.id)
            tool_calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlockParam):
            raise invalid(f"{where}.content[{j}]: a tool_result block belongs in a user "
                          "message")
    message: dict[str, Any] = {"role": "assistant",
                               "content": text if text or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _user(blocks: list, where: str, calls: set[str]) -> list[dict[str, Any]]:
    """One user turn's blocks as chat messages: a tool message per tool_result, a user message
    per run of text blocks, in their order."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush():
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
            texts.clear()

    for j, block in enumerate(blocks):
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlockParam):
            if block.tool_use_id not in calls:
                raise invalid(f"{where}.content[{j}].tool_use_id {block.tool_use_id!r} answers "
                              "no tool_use block of an earlier assistant message")
            flush()
            content = block.content
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": (
                content if isinstance(content, str)
                else "".join(b.text for b in content or ()))})
        elif isinstance(block, ToolUseBlockParam):
            raise invalid(f"{where}.content[{j}]: a tool_use block belongs in an assistant "
                          "message")
    flush()
    return out or [{"role": "user", "content": ""}]
