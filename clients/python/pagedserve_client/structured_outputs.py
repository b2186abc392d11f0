"""vLLM's ``structured_outputs`` dict -> the fields of a ``StructuredOutputs`` message.

The one mapping of that dict: the SDK's ``structured_outputs=`` keyword and the router's
OpenAI layer (``services/router/openai/structured_output_format.py``) both call
``structured_outputs_fields``.
It returns keyword arguments, not a message, because the SDK and the router each have their
own generated stubs (``pagedserve_client.pb`` / ``services.common.pb``): each caller builds
its own ``api_pb2.StructuredOutputs(**fields)``. What other keys of the dict mean is up to the
caller (the SDK refuses unknown keys; the router ignores them, as vLLM does, and refuses the
vLLM options it does not implement).

NOTE: ``None`` members and ``json_object: False`` count as unset, so a client that sends
every field (``{"regex": "a", "json": None, "json_object": False}``) means the one it filled.
vLLM counts ``json_object: False`` as a kind (``is not None``) but never constrains by it
(its grammar key tests ``if params.json_object``): alone it fails in the engine, beside
another kind it is refused as two kinds. Here alone it is "no kind set", beside another
kind it is ignored; it never reaches the proto, where ``json_object=false`` is a set but
invalid kind (the server refuses it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_fields(value: Mapping[str, Any]) -> dict[str, Any]:
    """The one kind ``value`` sets, as ``StructuredOutputs`` keyword arguments, e.g.
    ``{"json": "<schema as JSON text>"}`` or ``{"choice": {"choices": [...]}}``.

    ``json`` may be a schema (a dict, dumped as JSON) or its JSON text; ``choice`` a list
    (or tuple) of strings; ``regex`` and ``grammar`` strings; ``json_object`` True.
    Keys other than ``KINDS`` are not read.

    Raises:
        ValueError: not exactly one kind set (``structured_outputs must set exactly one of
            ...``), or a string that is not valid Unicode (a lone surrogate).
        TypeError: a value of the wrong type, ``structured_outputs.<kind> must be ...``.
    """
    # ``is``, not ``in (None, False)``: 0 == False, and a 0 is a wrong value, not "unset"
    given = [k for k in KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        raise ValueError("structured_outputs must set exactly one of " + ", ".join(KINDS) +
                         (f", got {', '.join(given)}" if given else ""))
    kind = given[0]
    v = value[kind]
    field = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(v, dict):
            return {"json": json.dumps(v)}
        if not isinstance(v, str):
            raise TypeError(f"{field} must be a JSON Schema object or its JSON text, got "
                            f"{type(v).__name__}")
        return {"json": _unicode(v, field)}
    if kind == "json_object":
        if v is not True:
            raise TypeError(f"{field} must be true, got {v!r}")
        return {"json_object": True}
    if kind == "choice":
        if not isinstance(v, list | tuple) or not all(isinstance(c, str) for c in v):
            raise TypeError(f"{field} must be a list of strings")
        return {"choice": {"choices": [_unicode(c, f"{field}[{i}]") for i, c in enumerate(v)]}}
    if not isinstance(v, str):
        raise TypeError(f"{field} must be a string, got {type(v).__name__}")
    return {kind: _unicode(v, field)}


def _unicode(text: str, name: str) -> str:
    """``text``, checked to encode as UTF-8 (protobuf strings): JSON's ``\\ud800`` escapes
    decode to lone surrogates.

    Raises:
        ValueError: ``<name> is not valid Unicode: lone surrogate U+D800 at character 3``.
    """
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{name} is not valid Unicode: lone surrogate "
                             f"U+{ord(text[e.start]):04X} at character {e.start}") from None
    return text
