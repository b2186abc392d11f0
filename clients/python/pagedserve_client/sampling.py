"""The sampling keyword arguments that are not plain proto scalars: ``structured_outputs``,
``logit_bias`` and ``early_stopping`` (vLLM's / OpenAI's forms -> SamplingParams fields).

    structured_outputs={"json": {...schema...}}     or {"json": "<schema as JSON text>"}
    structured_outputs={"regex": r"\\d{3}"}
    structured_outputs={"choice": ["yes", "no"]}
    structured_outputs={"grammar": 'root ::= "a" | "b"'}   (Lark or GBNF)
    structured_outputs={"json_object": True}
    structured_outputs=api_pb2.StructuredOutputs(...)
    logit_bias={50256: -100, 13: 5.0}               token id -> bias in [-100, 100]
    early_stopping=True | False | "never"           beam search's stop rule (transformers')

The server checks the grammar (an invalid one is INVALID_ARGUMENT naming
``structured_outputs.<kind>``) and the token ids and biases.
"""

from __future__ import annotations

from pagedserve_client.pb.pagedserve.v1 import api_pb2
from pagedserve_client.structured_outputs import KINDS, structured_outputs_fields


def structured_outputs_pb(value) -> api_pb2.StructuredOutputs:
    """The ``StructuredOutputs`` message of ``value``: a dict with exactly one of
    ``KINDS`` (mapped by ``structured_outputs.structured_outputs_fields``: None values and
    ``json_object: False`` ignored), or a StructuredOutputs message of either stubs.

    Raises:
        ValueError: not exactly one known kind, or an unknown key.
        TypeError: a value of the wrong type (e.g. a choice that is not a list of strings).
    """
    if getattr(getattr(value, "DESCRIPTOR", None), "full_name", "") == (
            api_pb2.StructuredOutputs.DESCRIPTOR.full_name):
        return api_pb2.StructuredOutputs.FromString(value.SerializeToString())
    if not isinstance(value, dict):
        raise TypeError("structured_outputs must be a dict like {'json': schema} or a "
                        f"StructuredOutputs message, got {type(value).__name__}")
    unknown = set(value) - set(KINDS)
    if unknown:
        raise ValueError(f"structured_outputs: unknown key(s) {sorted(unknown)}; "
                         f"known: {list(KINDS)}")
    return api_pb2.StructuredOutputs(**structured_outputs_fields(value))


def set_logit_bias(params: api_pb2.SamplingParams, bias) -> None:
    """Copy ``bias`` (a mapping token id -> bias) into ``params.logit_bias``.

    Raises:
        TypeError: not a mapping, an id that is not an int, or a bias that is not a number.
        ValueError: an id outside int32.
    """
    if not hasattr(bias, "items"):
        raise TypeError(f"logit_bias must be a dict token id -> bias, got {type(bias).__name__}")
    for token_id, b in bias.items():
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise TypeError(f"logit_bias: token id {token_id!r} must be an int")
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise TypeError(f"logit_bias[{token_id}]: bias {b!r} must be a number")
        try:
            params.logit_bias[token_id] = b
        except (ValueError, TypeError) as e:  # protobuf's int32 range check
            raise type(e)(f"logit_bias: token id {token_id}: {e}") from None


def early_stopping_str(value) -> str:
    """The wire form of ``early_stopping``: True -> "true", False -> "false", a string as it
    is ("never"; the server refuses any but "true", "false", "never").

    Raises:
        TypeError: neither a bool nor a string.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if not isinstance(value, str):
        raise TypeError(f'early_stopping must be True, False or "never", got {value!r}')
    return value
