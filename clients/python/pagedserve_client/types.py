"""Plain result types of the SDK (no protobuf in user code)."""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = {0: None, 1: "stop", 2: "length", 3: "abort"}


@dataclass(slots=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class StreamDelta:
    """One streamed piece: new token ids and text; the last one has finish_reason and usage."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    usage: Usage | None = None
    stop_reason: str | None = None    # the matched stop string, if any


@dataclass(slots=True)
class GenerationResult:
    """A whole completion."""

    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    stop_reason: str | None = None


def delta_from_pb(msg) -> StreamDelta:
    """Convert a GenerateResponse message."""
    final = msg.finish_reason != 0
    return StreamDelta(
        request_id=msg.request_id, token_ids=list(msg.token_ids), text=msg.text,
        finish_reason=FINISH_REASONS.get(msg.finish_reason),
        usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens) if final else None,
        stop_reason=msg.stop_reason or None)


def join(deltas: list[StreamDelta]) -> GenerationResult:
    """Fold a stream into one result."""
    result = GenerationResult(request_id=deltas[0].request_id if deltas else "", text="")
    parts: list[str] = []
    for d in deltas:
        parts.append(d.text)
        result.token_ids.extend(d.token_ids)
        if d.finish_reason:
            result.finish_reason, result.usage, result.stop_reason = (
                d.finish_reason, d.usage, d.stop_reason)
    result.text = "".join(parts)
    return result
