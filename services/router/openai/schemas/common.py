"""The models every route shares: OpenAI's error body, the request and answer bases, and
``bounds`` (a fixed range shown in the document; enforced by the hand parsers / validation,
whose messages name the limit)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo


def _integral(value: Any) -> Any:
    """2.0 -> 2 (a JSON integer written as a float, as the parsers accept it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _number(value: Any) -> Any:
    """An int beyond float's range -> inf (the parsers' rule: validation calls it not
    finite)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return float("inf") if value > 0 else float("-inf")
    return value


# JSON types as the hand parsers read them (the models are strict: no "1" for 1, no 1 for true).
Int = Annotated[int, BeforeValidator(_integral)]
Float = Annotated[float, BeforeValidator(_number)]


def ranged(lo: float, hi: float | None = None, *, open_lo: bool = False) -> Any:
    """An optional number field with a fixed range, checked on the JSON value (a double) in
    validation's words (``min_p must be in [0, 1], got 1.0000000000000002``) and shown in the
    document. (Checked here because the proto's float32 would round such a value onto the
    bound; a non-finite value is left to validation, whose message says so.)"""
    interval = (f"{'(' if open_lo else '['}{lo:g}, {hi:g}]" if hi is not None
                else f"{'>' if open_lo else '>='} {lo:g}")
    words = f"in {interval}" if hi is not None else interval

    def check(value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and math.isfinite(value) and not (
                (value > lo if open_lo else value >= lo) and (hi is None or value <= hi)):
            raise ValueError(f"{info.field_name} must be {words}, got {value!r}")
        return value

    extra: dict[str, Any] = {"exclusiveMinimum" if open_lo else "minimum": lo}
    if hi is not None:
        extra["maximum"] = hi
    return Annotated[Float | None, AfterValidator(check), Field(json_schema_extra=extra)]


class Request(BaseModel):
    """A request body: fields it does not know are allowed (OpenAI clients send extras);
    strict JSON types (``Int`` and ``Float`` as the parsers take them)."""

    model_config = ConfigDict(extra="allow", strict=True)


class Answer(BaseModel):
    """An answer body: exactly the fields the handler sends."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorDetail(Answer):
    """What went wrong: ``message`` names the field (a 400) and the limit."""

    message: str
    type: str = Field(description="e.g. invalid_request_error, rate_limit_error, server_error")
    param: str | None = Field(description="the request field at fault (top-level), or null")
    code: str | None = Field(description="machine-readable, e.g. model_not_found, or null")


class ErrorResponse(Answer):
    """OpenAI's error body, for every error status (also a stream's ``error`` event data)."""

    error: ErrorDetail


def bounds(minimum: float | None = None, maximum: float | None = None, *,
           exclusive_minimum: float | None = None, max_items: int | None = None,
           max_properties: int | None = None, description: str | None = None) -> Any:
    """A ``Field`` whose JSON schema shows these limits (JSON Schema keywords) without pydantic
    enforcing them: the parsers check them with messages that name the field and the limit."""
    extra: dict[str, Any] = {}
    for key, value in (("minimum", minimum), ("maximum", maximum),
                       ("exclusiveMinimum", exclusive_minimum), ("maxItems", max_items),
                       ("maxProperties", max_properties)):
        if value is not None:
            extra[key] = value
    return Field(None, json_schema_extra=extra, description=description)


# The error statuses of a route that takes a body and runs on the engine.
ENGINE_ERRORS = {400: "invalid request (the message names the field and the limit)",
                 404: "unknown model", 413: "request body too large",
                 429: "the engine's queue is full", 500: "internal error",
                 503: "no scheduler replica can serve"}
