"""A step's ``StepOutput`` cut per request (``RequestResult``): the one walk over its columns
that ``Scheduler.update_from_output`` reads (no torch; the worker fills the columns).

Logprobs are natural logs of the model's raw distribution (see api.proto).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.step import Logprobs, StepOutput
from services.scheduler.request import Request


@dataclass(slots=True)
class RequestResult:
    """What one step returned for one request.

    Attributes:
        token_ids: its new tokens: the drafts it accepted, in order, then the token sampled
            after them (one token without speculative decoding; [] for a pooling step).
        logprobs: theirs (``start`` left 0: the caller knows the position), when asked.
        draft_token_ids: the drafts proposed to follow them (the next step's; [] for none).
        embedding: a pooling step's vector (None under the generate runner).
    """

    token_ids: list[int]
    logprobs: Logprobs | None = None
    draft_token_ids: list[int] = field(default_factory=list)
    embedding: list[float] | None = None


def results_by_request(out: StepOutput) -> dict[str, RequestResult]:
    """Cut ``out``'s columns into one RequestResult per request id (O(tokens + logprobs)).
    ``out`` is well-formed (``step_wire.step_output_from_pb`` checked a worker's)."""
    rids = out.request_ids
    if out.embeddings is not None:  # (a pooling step: vectors, no tokens)
        return {rid: RequestResult([], embedding=e)
                for rid, e in zip(rids, out.embeddings, strict=True)}
    counts = out.num_sampled_token_ids or [1] * len(rids)
    drafts = out.draft_token_ids or [[] for _ in rids]
    lp = out.logprobs
    results: dict[str, RequestResult] = {}
    t = top = lp_index = 0  # the next token, top pair and sampled logprob
    for rid, n, proposed in zip(rids, counts, drafts, strict=True):
        result = results[rid] = RequestResult(out.sampled_token_ids[t:t + n],
                                              draft_token_ids=proposed)
        if lp is not None and lp.num_top_logprobs[t] >= 0:  # (the same k for all its tokens)
            ks = lp.num_top_logprobs[t:t + n]
            pairs = sum(ks)
            result.logprobs = Logprobs(rid, 0, lp.sampled_logprobs[lp_index:lp_index + n],
                                       lp.top_token_ids[top:top + pairs],
                                       lp.top_logprobs[top:top + pairs])
            lp_index, top = lp_index + n, top + pairs
        t += n
    return results


def first_tokens(logprobs: Logprobs | None, n: int, start: int) -> Logprobs | None:
    """The logprobs of the first ``n`` tokens of ``logprobs``, placed at token index
    ``start`` (None stays None)."""
    if logprobs is None:
        return None
    k = logprobs.k
    return Logprobs(logprobs.request_id, start, logprobs.logprobs[:n],
                    logprobs.top_token_ids[:n * k], logprobs.top_logprobs[:n * k])


def new_prompt_logprobs(request: Request, chunk: Logprobs | None) -> Logprobs | None:
    """The part of ``chunk`` the router does not have yet; advances the bookmark."""
    if chunk is None or request.sampling_params.prompt_logprobs is None:
        return None
    chunk = chunk.from_position(request.prompt_logprobs_next)
    if chunk is None or chunk.start != request.prompt_logprobs_next:
        return None  # NOTE: a gap cannot happen (no cache hit while unsent); be safe.
    request.prompt_logprobs_next += len(chunk.logprobs)
    return chunk
