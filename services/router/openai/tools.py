"""OpenAI chat ``tools`` and ``tool_choice`` -> the gRPC request, and how the answer is read.

- ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?}}]``
  (``strict`` is accepted and ignored) -> ``chat.tools`` (``api_pb2.Tool``, the parameters as
  JSON text), which reach the chat template as ``tools``. Names follow OpenAI's rule
  (``^[a-zA-Z0-9_-]{1,64}$``); an empty list is the same as none.
- ``tool_choice``: "none" | "auto" | "required" | ``{"type": "function", "function": {"name"}}``;
  default "auto" with tools, "none" without. As vLLM:
  - "none": the tools still reach the template, the text is not parsed for calls.
  - "auto": the text is parsed by the router's ``--tool-call-parser`` (``hermes``, see
    ``openai.tool_calls``); without ``--enable-auto-tool-choice`` and a parser it is a 400.
  - "required" and a named function are *enforced*: ``structured_outputs.json`` becomes a
    JSON schema (named: the function's parameters, the whole output being its arguments;
    required: vLLM's array, ``minItems`` 1, of ``{"name": const, "parameters": schema}``, one
    ``anyOf`` branch per tool), compiled like any structured output, written as
    ``json.dumps`` writes JSON (``", "``, ``": "``, no other whitespace: llguidance's
    ``x-guidance`` options, unless the parameters set their own). Asking for another
    structured output (``response_format``, ``structured_outputs``) as well is a 400.
  - a choice other than "none" without tools, or naming a function not in ``tools``: 400.
- ``parallel_tool_calls: false`` makes "required" ask for exactly one call (``maxItems`` 1); a
  named function is one call anyway, and "auto" returns only the first call the model wrote
  (vLLM's rule; the others are dropped).

Errors are 400 with ``param`` "tools" or "tool_choice".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.pb.pagedserve.v1 import api_pb2
from services.router.openai.errors import OpenAIError, bad_request, utf8
from services.router.openai.tool_calls import HermesParser, NamedParser, RequiredParser

TOOL_PARSERS = ("hermes",)  # router --tool-call-parser choices
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's function name rule
_NO_PARAMETERS = {"type": "object", "properties": {}}
# llguidance's JSON options for tool calls: the layout json.dumps writes, no free whitespace
_DUMPS_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What a chat request asked of the tools.

    Attributes:
        mode: "none", "auto", "required" or "function" (a named function).
        name: the function's name (mode "function").
    """

    mode: str
    name: str = ""

    @property
    def enforced(self) -> bool:
        """The output is forced into tool calls by a grammar."""
        return self.mode in ("required", "function")


def parse_tools(body: dict, req: api_pb2.GenerateRequest, tool_parser: str | None
                ) -> Callable[[], object] | None:
    """Map ``tools`` / ``tool_choice`` of a chat body into ``req`` (``chat.tools``, and for
    "required" / a named function ``sampling_params.structured_outputs.json``).

    Args:
        tool_parser: the router's ``--tool-call-parser`` when ``--enable-auto-tool-choice``
            is set, else None ("auto" is then refused).

    Returns:
        A factory of the per-choice output parser (``openai.tool_calls``), or None when the
        text is returned as it is (no tools, or "none").

    Raises:
        OpenAIError: 400 naming "tools" or "tool_choice".
    """
    functions = _functions(body.get("tools"))
    choice = _choice(body.get("tool_choice"), functions)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    for name, function in functions.items():
        req.chat.tools.add(name=name, description=function.get("description", ""),
                           parameters_json=(json.dumps(function["parameters"])
                                            if "parameters" in function else ""))
    if choice.enforced:
        fmt = body.get("response_format")
        if body.get("structured_outputs") is not None or (
                fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text")):
            raise bad_request(f"tool_choice {_spelled(choice)} is enforced with structured "
                              "outputs: response_format / structured_outputs cannot be used "
                              "with it", "tool_choice")
        schema = (functions[choice.name].get("parameters", _NO_PARAMETERS)
                  if choice.mode == "function"
                  else _required_schema(functions, one=parallel is False))
        schema = {"x-guidance": _DUMPS_LAYOUT, **schema}
        req.sampling_params.structured_outputs.json = json.dumps(schema)
    if choice.mode == "none":
        return None
    if choice.mode == "function":
        return lambda: NamedParser(choice.name)
    if choice.mode == "required":
        return RequiredParser
    if tool_parser is None:
        raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
    assert tool_parser in TOOL_PARSERS  # the flag's choices
    return (lambda: HermesParser(one=True)) if parallel is False else HermesParser


def _spelled(choice: ToolChoice) -> str:
    return f"function {choice.name!r}" if choice.mode == "function" else repr(choice.mode)


def _bad(message: str) -> OpenAIError:
    return bad_request(message, "tools")


def _functions(tools) -> dict[str, dict]:
    """``tools`` checked: function name -> ``{"description"?, "parameters"?}``."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise _bad('tools must be a list of {"type": "function", "function": {...}}')
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(f'{where} must be {{"type": "function", "function": {{...}}}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _bad(f"{where}.function must be an object {{name, description, parameters}}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"{where}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, "
                       f"got {name!r}")
        if name in out:
            raise _bad(f"{where}.function.name {name!r} is used by two tools")
        entry: dict[str, Any] = {}
        description = function.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise _bad(f"{where}.function.description must be a string")
            entry["description"] = utf8(description, f"{where}.function.description", "tools")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise _bad(f"{where}.function.parameters must be a JSON Schema object")
            utf8(json.dumps(parameters, ensure_ascii=False), f"{where}.function.parameters",
                  "tools")
            entry["parameters"] = parameters
        out[name] = entry
    return out


def _choice(value, functions: dict[str, dict]) -> ToolChoice:
    """``tool_choice`` checked against the tools."""
    if value is None:
        return ToolChoice("auto" if functions else "none")
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if name not in functions:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools",
                              "tool_choice")
        return ToolChoice("function", name)
    if value not in ("none", "auto", "required"):
        raise bad_request(f'tool_choice must be "none", "auto", "required" or a named '
                          f"function, got {value!r}", "tool_choice")
    if value != "none" and not functions:
        raise bad_request(f"tool_choice {value!r} needs tools", "tool_choice")
    return ToolChoice(value)


def _required_schema(functions: dict[str, dict], one: bool) -> dict:
    """vLLM's schema for "required": a non-empty array (``one``: of exactly one element) of
    ``{"name", "parameters"}`` objects, one ``anyOf`` branch per function; each parameters'
    ``$defs`` are lifted to the top (references are ``#/$defs/...``, relative to the whole
    document)."""
    defs: dict = {}
    branches = []
    for name, function in functions.items():
        parameters = dict(function.get("parameters", _NO_PARAMETERS))
        lifted = parameters.pop("$defs") if isinstance(parameters.get("$defs"), dict) else {}
        for key, value in lifted.items():
            if defs.setdefault(key, value) != value:
                raise _bad(f"tools: functions define $defs {key!r} differently; one schema "
                           "holds them all under tool_choice \"required\"")
        branches.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if one:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
