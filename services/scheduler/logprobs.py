"""Logprobs as the scheduler carries them: cut from a step's output, filtered, and
handed to the routers on RequestUpdates (no torch; the worker computes them).

Both kinds are natural logs of the model's raw distribution (see api.proto).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.step import StepOutput


@dataclass(slots=True)
class TokenLogprobs:
    """The raw logprobs of one sampled token.

    Attributes:
        logprob: the sampled token's.
        top_token_ids / top_logprobs: the k most likely tokens and theirs, most likely first.
    """

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobs:
    """The raw logprobs of consecutive prompt tokens ``start, start + 1, ...``.

    Attributes:
        start: prompt index of the first (>= 1).
        logprobs: one per prompt token.
        top_token_ids / top_logprobs: ``k`` pairs per prompt token, most likely first.
        k: top pairs per prompt token.
    """

    start: int
    logprobs: list[float]
    top_token_ids: list[int]
    top_logprobs: list[float]
    k: int

    def from_position(self, position: int) -> PromptLogprobs | None:
        """The part from prompt index ``position`` on (None if nothing is left): a chunk
        recomputed after a preemption repeats tokens the router already has."""
        skip = max(0, position - self.start)
        if skip >= len(self.logprobs):
            return None
        if skip == 0:
            return self
        k = self.k
        return PromptLogprobs(self.start + skip, self.logprobs[skip:],
                              self.top_token_ids[skip * k:], self.top_logprobs[skip * k:], k)


def token_logprobs_of(out: StepOutput) -> dict[str, list[TokenLogprobs]] | None:
    """Cut a step's columnar logprobs into a TokenLogprobs per sampled token of each asking
    request (in order; one unless it accepted drafts, ``num_sampled_token_ids``). ``out`` is
    well-formed (``step_wire.step_output_from_pb`` checked a worker's)."""
    if out.logprobs is None:
        return None
    lp = out.logprobs
    counts = lp.num_top_logprobs
    per_request = out.num_sampled_token_ids or [1] * len(out.request_ids)
    ids, lps = lp.top_token_ids, lp.top_logprobs
    sampled = iter(lp.sampled_logprobs)
    per_token: dict[str, list[TokenLogprobs]] = {}
    t, c = 0, 0
    for rid, n in zip(out.request_ids, per_request, strict=True):
        for k in counts[c:c + n]:
            if k >= 0:
                per_token.setdefault(rid, []).append(TokenLogprobs(next(sampled), ids[t:t + k],
                                                                   lps[t:t + k]))
                t += k
        c += n
    return per_token


def logprobs_of(out: StepOutput) -> dict[str, TokenLogprobs] | None:
    """The logprobs of each asking request's last sampled token (``token_logprobs_of``)."""
    per_token = token_logprobs_of(out)
    return None if per_token is None else {rid: lps[-1] for rid, lps in per_token.items()}


def prompt_logprobs_of(out: StepOutput) -> dict[str, PromptLogprobs] | None:
    """One PromptLogprobs per request whose chunk scored prompt tokens this step."""
    if not out.prompt_logprobs:
        return None
    return {p.request_id: PromptLogprobs(p.first_position, p.logprobs, p.top_token_ids,
                                         p.top_logprobs,
                                         len(p.top_token_ids) // max(1, len(p.logprobs)))
            for p in out.prompt_logprobs}
