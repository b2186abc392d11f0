"""OpenAI ``response_format`` and vLLM ``structured_outputs`` JSON -> ``api_pb2.StructuredOutputs``.

Both routes (/v1/completions and /v1/chat/completions, as vLLM) accept either field:

    response_format                                     structured_outputs
    {"type": "text"} (or absent)                        (none)
    {"type": "json_object"}                             json_object = true
    {"type": "json_schema",                             json = the schema as JSON text
     "json_schema": {"name", "schema", "strict"?,
                     "description"?}}
    structured_outputs: exactly one of                  json (an object, or its JSON text),
      json, regex, choice, grammar, json_object         regex, choice, grammar, json_object

The ``structured_outputs`` dict is mapped by the SDK's ``pagedserve_client.structured_outputs``
(one mapping for the SDK's keyword and this route; its TypeError / ValueError become a 400
here). Only the JSON types are checked here (a 400 naming the field); the grammar itself is
compiled and validated later by ``services.router.structured_output_grammar`` (its errors start with
``structured_outputs.<kind>``; ``error_param`` says which request field they are about).
Refused with a 400: both fields at once, ``response_format`` types other than the three above
(e.g. vLLM's ``structural_tag``), vLLM's per-request grammar options (``disable_*``,
``whitespace_pattern``: a schema's ``"x-guidance"`` object sets llguidance's options), and
the removed ``guided_*`` fields (so they are never silently ignored).
"""

from __future__ import annotations

import json

from pagedserve_client.structured_outputs import KINDS, structured_outputs_fields
from services.common.pb.pagedserve.v1 import api_pb2
from services.router.openai.errors import bad_request

# vLLM's StructuredOutputsParams options this server does not implement (their defaults pass).
_UNSUPPORTED_OPTIONS = {"disable_any_whitespace": False, "disable_additional_properties": False,
                        "disable_fallback": False, "whitespace_pattern": None,
                        "structural_tag": None}
# vLLM's removed top-level guided decoding fields (now structured_outputs).
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "guided_whitespace_pattern", "guided_decoding_backend")


def error_param(body: dict) -> str:
    """The request field a ``structured_outputs.<kind>`` error is about: "response_format"
    when the body set a constraining response_format, else "structured_outputs"."""
    fmt = body.get("response_format")
    return ("response_format" if isinstance(fmt, dict) and fmt.get("type", "text") != "text"
            else "structured_outputs")


def parse_structured_outputs(body: dict, sp: api_pb2.SamplingParams) -> None:
    """Set ``sp.structured_outputs`` from the body's ``response_format`` or
    ``structured_outputs`` (left unset when neither constrains the output).

    Raises:
        OpenAIError: 400 naming the field, e.g. ``response_format.json_schema.schema must be a
            JSON object``, or both fields set.
    """
    for name in _GUIDED:
        if body.get(name) is not None:
            raise bad_request(f"{name} is not supported: use structured_outputs (vLLM's "
                              "current field) or response_format", name)
    from_format = _response_format(body.get("response_format"))
    from_vllm = _vllm(body.get("structured_outputs"))
    if from_format is not None and from_vllm is not None:
        raise bad_request("response_format and structured_outputs cannot both constrain the "
                          "output; set one", "structured_outputs")
    chosen = from_format or from_vllm
    if chosen is not None:
        sp.structured_outputs.CopyFrom(chosen)


def _response_format(fmt) -> api_pb2.StructuredOutputs | None:
    param = "response_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object with a type", param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return api_pb2.StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise bad_request("response_format.type must be one of text, json_object, json_schema, "
                          f"got {kind!r}", param)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with name and schema",
                          param)
    if not isinstance(spec.get("name"), str):
        raise bad_request("response_format.json_schema.name must be a string", param)
    for name, kind_ in (("description", str), ("strict", bool)):
        if spec.get(name) is not None and not isinstance(spec[name], kind_):
            raise bad_request(f"response_format.json_schema.{name} must be a "
                              f"{'string' if kind_ is str else 'boolean'}", param)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON object (the JSON "
                          "Schema)", param)
    return api_pb2.StructuredOutputs(json=json.dumps(schema))


def _vllm(so) -> api_pb2.StructuredOutputs | None:
    param = "structured_outputs"
    if so is None:
        return None
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object with one of "
                          + ", ".join(KINDS), param)
    for name, default in _UNSUPPORTED_OPTIONS.items():
        if so.get(name) not in (None, default):
            raise bad_request(f"structured_outputs.{name} is not supported by this server "
                              "(set llguidance's options in the schema's \"x-guidance\" object)",
                              param)
    try:
        return api_pb2.StructuredOutputs(**structured_outputs_fields(so))
    except (TypeError, ValueError) as e:
        raise bad_request(str(e), param) from None
