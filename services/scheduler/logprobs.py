"""Logprobs as the scheduler carries them: decoded from a worker's StepResult, filtered, and
handed to the routers on RequestUpdates (no torch; the worker computes them).

Both kinds are natural logs of the model's raw distribution (see api.proto).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.pb.pagedserve.v1 import worker_pb2


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


def token_logprobs_from_pb(result: worker_pb2.StepResult
                           ) -> dict[str, list[TokenLogprobs]] | None:
    """Cut a StepResult's columnar logprobs into a TokenLogprobs per sampled token of each
    asking request (in order; one unless it accepted drafts, ``num_sampled_token_ids``).

    Raises:
        ValueError: the columns disagree in length (a malformed message).
    """
    counts = result.num_top_logprobs
    if not counts:
        return None
    asking = [k for k in counts if k >= 0]
    per_request = (list(result.num_sampled_token_ids) if result.num_sampled_token_ids
                   else [1] * len(result.request_ids))
    if (len(per_request) != len(result.request_ids) or len(counts) != sum(per_request)
            or len(asking) != len(result.sampled_logprobs)
            or not sum(asking) == len(result.top_token_ids) == len(result.top_logprobs)):
        raise ValueError(f"step {result.step_id}: malformed logprobs columns")
    ids, lps = list(result.top_token_ids), list(result.top_logprobs)
    sampled = iter(result.sampled_logprobs)
    out: dict[str, list[TokenLogprobs]] = {}
    t, c = 0, 0
    for rid, n in zip(result.request_ids, per_request, strict=True):
        for k in counts[c:c + n]:
            if k >= 0:
                out.setdefault(rid, []).append(TokenLogprobs(next(sampled), ids[t:t + k],
                                                             lps[t:t + k]))
                t += k
        c += n
    return out


def logprobs_from_pb(result: worker_pb2.StepResult) -> dict[str, TokenLogprobs] | None:
    """The logprobs of each asking request's last sampled token (``token_logprobs_from_pb``).

    Raises:
        ValueError: the columns disagree in length (a malformed message).
    """
    per_token = token_logprobs_from_pb(result)
    return None if per_token is None else {rid: lps[-1] for rid, lps in per_token.items()}


def prompt_logprobs_from_pb(result: worker_pb2.StepResult) -> dict[str, PromptLogprobs] | None:
    """Cut a StepResult's prompt logprobs columns into one PromptLogprobs per request.

    Raises:
        ValueError: the columns disagree in length (a malformed message).
    """
    rids = result.prompt_request_ids
    if not rids:
        return None
    counts, ks = result.prompt_num_tokens, result.prompt_num_top
    n = len(rids)
    if (not len(result.prompt_first_positions) == len(counts) == len(ks) == n
            or sum(counts) != len(result.prompt_logprobs)
            or not (sum(c * k for c, k in zip(counts, ks, strict=True))
                    == len(result.prompt_top_token_ids) == len(result.prompt_top_logprobs))):
        raise ValueError(f"step {result.step_id}: malformed prompt logprobs columns")
    lps, ids, tops = (list(result.prompt_logprobs), list(result.prompt_top_token_ids),
                      list(result.prompt_top_logprobs))
    out, t, u = {}, 0, 0
    for rid, start, c, k in zip(rids, result.prompt_first_positions, counts, ks, strict=True):
        out[rid] = PromptLogprobs(start, lps[t:t + c], ids[u:u + c * k], tops[u:u + c * k], k)
        t += c
        u += c * k
    return out
