"""OpenAI chat ``messages`` (JSON) -> ``api_pb2.ChatMessage`` protos, with OpenAI's JSON rules.

What only JSON can get wrong is checked here: ``content`` is a string or a list of text parts
(``{"type": "text", "text": ...}``, joined), and ``null`` (or absent) only on an ``assistant``
message that carries ``tool_calls``; ``tool_calls`` is a list of ``{"id", "type": "function",
"function": {"name", "arguments"}}`` with string fields; ``tool_call_id`` and ``name`` are
strings. The rules a gRPC client can break too (roles, a tool message answering an earlier
tool call, arguments being a JSON object, ...) are ``validation.validate_messages``'s, which
runs afterwards through ``generation.prepare``. Every error is a 400 naming the message index
and field, ``param: "messages"``.
"""

from __future__ import annotations

from services.common.pb.pagedserve.v1 import api_pb2
from services.router.openai.errors import OpenAIError, bad_request, utf8


def parse_messages(messages) -> list[api_pb2.ChatMessage]:
    """The ChatMessage protos of a chat request's ``messages`` (an empty list gives none: the
    "is empty" error is validation's).

    Raises:
        OpenAIError: 400 ``messages[i].<field> ...`` for a wrong JSON shape.
    """
    if not isinstance(messages, list):
        raise _bad("messages must be a list of {role, content} objects")
    return [_message(m, i) for i, m in enumerate(messages)]


def _bad(message: str) -> OpenAIError:
    return bad_request(message, "messages")


def _message(m, i: int) -> api_pb2.ChatMessage:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise _bad(f"messages[{i}] must be an object with a string role")
    where = f"messages[{i}]"
    out = api_pb2.ChatMessage(role=_text(m["role"], f"{where}.role"))
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise _bad(f"{where}.tool_calls must be a list of tool calls")
        out.tool_calls.extend(_tool_call(c, f"{where}.tool_calls[{j}]")
                              for j, c in enumerate(calls))
    content = m.get("content")
    if content is None:
        if not (m["role"] == "assistant" and out.tool_calls):
            raise _bad(f"{where}.content must be a string or a list of text parts; null is "
                       "only allowed on an assistant message with tool_calls")
    else:
        out.content = _content(content, where)
    for name in ("tool_call_id", "name"):
        value = m.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise _bad(f"{where}.{name} must be a string, got {value!r}")
            setattr(out, name, _text(value, f"{where}.{name}"))
    return out


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return _text(content, f"{where}.content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _bad(f"{where}.content[{j}]: only text parts "
                           "({\"type\": \"text\", \"text\": ...}) are supported")
            texts.append(_text(part["text"], f"{where}.content[{j}].text"))
        return "".join(texts)
    raise _bad(f"{where}.content must be a string or a list of text parts")


def _tool_call(call, where: str) -> api_pb2.ToolCall:
    """One ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    if not isinstance(call, dict):
        raise _bad(f"{where} must be an object {{id, type, function}}")
    if call.get("type") != "function":
        raise _bad(f"{where}.type must be \"function\", got {call.get('type')!r}")
    function = call.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function must be an object {{name, arguments}}")
    fields = {"id": call.get("id"), "name": function.get("name"),
              "arguments": function.get("arguments")}
    texts = {}
    for name, value in fields.items():
        path = f"{where}.{'id' if name == 'id' else 'function.' + name}"
        if not isinstance(value, str):
            raise _bad(f"{path} must be a string, got {value!r}")
        texts[name] = _text(value, path)
    return api_pb2.ToolCall(**texts)


def _text(text: str, name: str) -> str:
    return utf8(text, name, "messages")
