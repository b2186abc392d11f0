"""Plain result types of the SDK (no protobuf in user code)."""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = {0: None, 1: "stop", 2: "length", 3: "abort"}


@dataclass(slots=True)
class Usage:
    """Token counts of one choice.

    Attributes:
        prompt_tokens: tokens in the prompt (after the chat template).
        completion_tokens: tokens generated for this choice (a stop token included).
        num_cached_tokens: prompt tokens whose KV the server reused from its prefix cache
            (OpenAI's ``prompt_tokens_details.cached_tokens``); 0 on a miss or with caching off.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class TopLogprob:
    """One of the most likely tokens at a position: its id and natural log probability."""

    token_id: int
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's natural log probability, and the ``logprobs`` most likely tokens at
    its position (most likely first). Raw distribution: log_softmax of the model's logits before
    temperature, penalties, top-k, top-p and min-p (vLLM V1's default)."""

    token_id: int
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass(slots=True)
class StreamDelta:
    """One streamed piece of one choice: new token ids and text; the last piece of each choice
    has finish_reason and usage. With ``n > 1`` the choices' pieces interleave: ``index`` says
    which choice (0 .. n-1) this one belongs to."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the choice's last delta
    usage: Usage | None = None
    # the matched stop string, or the stop_token_ids entry that ended the choice; else None
    stop_reason: str | int | None = None
    index: int = 0                    # the choice, 0 .. n-1
    # with the ``logprobs`` parameter: one per token of token_ids, aligned; else None
    logprobs: list[TokenLogprob] | None = None
    # with ``prompt_logprobs``, on the choice's first delta: prompt tokens 1 .. P-1; else None
    prompt_logprobs: list[TokenLogprob] | None = None
    # beam search: the hypothesis's score (cumulative logprob / length ** length_penalty)
    beam_score: float | None = None


@dataclass(slots=True)
class Choice:
    """One whole completion (choice ``index`` of a request with ``n`` choices)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1 .. P-1, when asked for
    beam_score: float | None = None  # beam search: the hypothesis's score; else None


@dataclass(slots=True)
class GenerationResult:
    """A whole request: all its choices, and choice 0's fields at the top level.

    Attributes:
        request_id: the request's id.
        text, token_ids, finish_reason, usage, stop_reason, logprobs, prompt_logprobs,
            beam_score: choice 0's (with the default ``n=1``, the only choice; with beam
            search, the best hypothesis).
        choices: every choice, ordered by index (``len(choices) == n``).
    """

    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    stop_reason: str | int | None = None
    choices: list[Choice] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    beam_score: float | None = None


def delta_from_pb(msg) -> StreamDelta:
    """Convert a GenerateResponse message."""
    final = msg.finish_reason != 0
    usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens,
                  msg.usage.num_cached_tokens) if final else None
    return StreamDelta(
        request_id=msg.request_id, token_ids=list(msg.token_ids), text=msg.text,
        finish_reason=FINISH_REASONS.get(msg.finish_reason), usage=usage,
        stop_reason=(msg.stop_token_id if msg.HasField("stop_token_id")
                     else msg.stop_reason or None), index=msg.index,
        logprobs=_logprobs(msg.logprobs), prompt_logprobs=_logprobs(msg.prompt_logprobs),
        beam_score=msg.beam_score if msg.HasField("beam_score") else None)


def _logprobs(entries) -> list[TokenLogprob] | None:
    return [TokenLogprob(t.token_id, t.logprob, [TopLogprob(x.token_id, x.logprob) for x in t.top])
            for t in entries] if entries else None


def join(deltas: list[StreamDelta]) -> GenerationResult:
    """Fold a stream (of any number of interleaved choices) into one result."""
    choices: dict[int, Choice] = {}
    parts: dict[int, list[str]] = {}
    for d in deltas:
        choice = choices.setdefault(d.index, Choice(d.index))
        parts.setdefault(d.index, []).append(d.text)
        choice.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if choice.logprobs is None:
                choice.logprobs = []
            choice.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            choice.prompt_logprobs = d.prompt_logprobs
        if d.beam_score is not None:
            choice.beam_score = d.beam_score
        if d.finish_reason:
            choice.finish_reason, choice.usage, choice.stop_reason = (
                d.finish_reason, d.usage or Usage(), d.stop_reason)
    for i, choice in choices.items():
        choice.text = "".join(parts[i])
    ordered = [choices[i] for i in sorted(choices)]
    result = GenerationResult(request_id=deltas[0].request_id if deltas else "", text="",
                              choices=ordered)
    if ordered:
        first = ordered[0]
        result.text, result.token_ids, result.finish_reason, result.usage, result.stop_reason = (
            first.text, first.token_ids, first.finish_reason, first.usage, first.stop_reason)
        result.logprobs, result.prompt_logprobs = first.logprobs, first.prompt_logprobs
        result.beam_score = first.beam_score
    return result
