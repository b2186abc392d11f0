"""The HTTP handlers' use of the ``openai.schemas`` models: a request body checked against its
model before the hand parsers read it (``check_body``), and every JSON answer and stream event
written through ``json_response`` / ``sse`` / ``sse_event``.

With ``PAGEDSERVE_CHECK_RESPONSES=1`` (the tests set it for their whole session) every answer
and every streamed event is also validated against its model, and one that does not match fails
loudly: a whole answer becomes an HTTP 500 (and an ERROR log line naming the field), a stream
event raises ``ResponseMismatch`` (the stream breaks off without ``[DONE]``). Production leaves
the variable unset and skips the check (it would parse every answer twice).
"""

from __future__ import annotations

import json
import logging
import os
import re
from types import UnionType
from typing import Any, Union, get_args, get_origin

from aiohttp import web
from pydantic import BaseModel, ValidationError

from services.router.openai.errors import OpenAIError, bad_request

log = logging.getLogger(__name__)
CHECK_ENV = "PAGEDSERVE_CHECK_RESPONSES"
# A union member's or validator's tag in a pydantic error location (not a field name):
# "str", "list[int]", "function-after[...]", a model's class name.
_TAG = re.compile(r"[A-Z]\w*|str|int|float|bool|none|.*\[.*\]|.*-.*")


class ResponseMismatch(AssertionError):
    """An answer the handler built does not match its declared model (a server bug)."""


def checking() -> bool:
    """Whether answers are checked (``PAGEDSERVE_CHECK_RESPONSES=1``)."""
    return os.environ.get(CHECK_ENV, "") == "1"


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int) or (isinstance(part, str) and not part.isidentifier()
                                     and not _TAG.fullmatch(part)):
            out += f"[{part}]"  # a list index, or a dict key such as logit_bias' "50256"
        elif not _TAG.fullmatch(part):
            out += f".{part}" if out else part
    return out


def _shown(value: Any) -> str:
    text = repr(value)  # (as the hand parsers show a value)
    return text if len(text) <= 60 else text[:57] + "..."


# pydantic's error types -> what the value must be (the hand parsers' wording)
_KINDS = {"string_type": "a string", "int_type": "an integer", "int_from_float": "an integer",
          "float_type": "a number", "bool_type": "a boolean", "list_type": "a list",
          "dict_type": "an object", "model_type": "an object", "model_attributes_type":
          "an object", "none_required": "null"}


def _kind(error: Any) -> str:
    if error["type"] == "literal_error":  # expected: "'a', 'b' or 'c'"
        return "one of " + error["ctx"]["expected"].replace("'", "").replace(" or ", ", ")
    return _KINDS.get(error["type"], error["msg"])


def _expects(model: type[BaseModel], name: str) -> str | None:
    """A top-level field's description when it says what the value is (a union or a list,
    whose type alone makes a vague message)."""
    field = model.model_fields.get(name)
    if field is None or not field.description or field.description.startswith("not "):
        return None
    kind = field.annotation
    kinds = ([a for a in get_args(kind) if a is not type(None)]
             if get_origin(kind) in (Union, UnionType) else [kind])
    many = len(kinds) > 1 or get_origin(kinds[0]) is list
    return field.description if many else None


def _depth(path: str) -> int:
    return path.count(".") + path.count("[")


def describe(model: type[BaseModel], error: ValidationError) -> tuple[str, str | None]:
    """``(message, param)`` of a request's validation error, in the hand parsers' words: the
    first wrong field's path (e.g. ``messages[2].content``), what it must be (every union
    member's kind; a top-level union or list field: its description) and the value sent; when a
    union member got further, its deepest error first (``messages[0].content[1].type must be
    one of text, got 'image_url' (messages[0].content must be a string, got [...])``);
    ``param`` is its top-level field."""
    errors = error.errors(include_url=False)
    first = errors[0]
    path = _path(first["loc"])
    top = path.split(".")[0].split("[")[0]
    expects = _expects(model, top)
    if first["type"] == "value_error":  # a range (schemas.common.ranged): its own words
        return str(first["ctx"]["error"]), top or None
    if first["type"] == "missing":
        message = f"{path} is required" + (f": {expects}" if expects and path == top else "")
    elif expects is not None and any(_path(e["loc"]) == top for e in errors):
        path = top
        message = f"{top} must be {expects}, got {_shown(first['input'])}"
    else:
        message = f"{path or 'the body'} must be {_kinds(errors, path)}, got " \
            f"{_shown(first['input'])}"
    deepest = max(errors, key=lambda e: _depth(_path(e["loc"])))
    deep = _path(deepest["loc"])
    if _depth(deep) > _depth(path) and deep.startswith(path):  # the closest union member's
        message = (f"{deep} is required" if deepest["type"] == "missing" else
                   f"{deep} must be {_kinds(errors, deep)}, got {_shown(deepest['input'])}") \
            + f" ({message})"
    return message, top or None


def _kinds(errors: list, path: str) -> str:
    kinds: list[str] = []
    for e in errors:
        if _path(e["loc"]) == path and _kind(e) not in kinds:
            kinds.append(_kind(e))
    return " or ".join(kinds)


def check_body(model: type[BaseModel], body: dict) -> None:
    """Validate a request's parsed JSON object against its model.

    Raises:
        OpenAIError: 400 naming the field path, what it must be and the value sent; its
            ``param`` is the top-level field.
    """
    try:
        model.model_validate(body)
    except ValidationError as e:
        message, param = describe(model, e)
        raise bad_request(message[:500], param) from None
    except RecursionError:  # a body nested thousands deep
        raise bad_request("the request body is nested too deeply") from None


def _mismatch(model: type[BaseModel], text: str) -> str | None:
    """Why ``text`` (JSON) does not match ``model``, or None."""
    try:
        model.model_validate_json(text)
    except ValidationError as e:
        return f"{model.__name__}: {e}"
    return None


def dumps(body: Any) -> str:
    """JSON text of an answer as the handlers write it (UTF-8 characters kept)."""
    return json.dumps(body, ensure_ascii=False)


def json_response(model: type[BaseModel], body: Any, status: int = 200,
                  headers: dict | None = None) -> web.Response:
    """An ``application/json`` answer; checked against ``model`` when ``checking()``: a
    mismatch is logged and answered HTTP 500 instead."""
    text = dumps(body)
    if checking():
        why = _mismatch(model, text)
        if why is not None:
            log.error("answer does not match its schema: %s\n%s", why, text[:2000])
            error = OpenAIError(500, f"answer does not match its schema: {why}"[:2000],
                                "server_error", code="response_mismatch")
            return web.json_response(error.body(), status=500)
    return web.json_response(text=text, status=status, headers=headers)


def _checked(model: type[BaseModel] | None, text: str) -> str:
    if model is not None and checking():
        why = _mismatch(model, text)
        if why is not None:
            log.error("stream event does not match its schema: %s\n%s", why, text[:2000])
            raise ResponseMismatch(why)
    return text


def sse(body: dict | str, model: type[BaseModel] | None = None) -> bytes:
    """A server-sent event ``data: <JSON>`` (a string is sent as it is, e.g. ``[DONE]``),
    checked against ``model`` when ``checking()``.

    Raises:
        ResponseMismatch: (checking) the event does not match ``model``.
    """
    data = body if isinstance(body, str) else _checked(
        model, json.dumps(body, ensure_ascii=False, separators=(",", ":")))
    return f"data: {data}\n\n".encode()


def sse_event(body: dict, model: type[BaseModel] | None = None) -> bytes:
    """A named server-sent event ``event: <type>`` then ``data: <JSON>`` (Responses), checked
    as ``sse``."""
    data = _checked(model, json.dumps(body, ensure_ascii=False, separators=(",", ":")))
    return f"event: {body['type']}\ndata: {data}\n\n".encode()
