"""What one engine step asks of a worker, and what it answers (plain dataclasses, no torch).

The gRPC servicer converts the StepRequest protobuf into a ``StepInput`` and a ``StepOutput``
back into a StepResult. vLLM V1 style: a request is sent in full once (``NewRequest``), then
only as diffs (``CachedRequest``); the worker keeps the rest (token ids, block table, sampling
parameters, RNG) in its per-request state. The worker owns its tokens: the last pipeline stage
appends what it samples; ``new_token_ids`` carries tokens only to the earlier stages, to every
rank for a beam (``sampling.beam_width > 0``: the scheduler picks its next token among the
candidates the step returned), and, as the whole list, for a request resumed from preemption
(see worker.proto's CachedRequests). Copy-on-write of shared KV blocks (beam search) comes as
``StepInput.blocks_to_copy`` and ``CachedRequest.first_new_block``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from services.common.sampling_params import EngineSamplingParams


def check_sampling(params: EngineSamplingParams, vocab_size: int) -> None:
    """Refuse parameters the sampler cannot use: a temperature, top_p, min_p, penalty or
    logit bias that is not a finite number in its domain, a stop token id, logit_bias token id
    or logprobs count outside the vocabulary (a beam asks for more than the router's 20 top
    logprobs, up to the vocabulary), a negative beam_width, or a structured_output that is not
    llguidance grammar JSON (an object with a ``grammars`` list; the grammar itself is the
    router's to validate, and a matcher that fails anyway only lets the request end).

    Not a second validation: the router's (``services/router/validation.py``) names fields and
    limits, and all it accepts passes here. This is the worker's guard against a malformed
    internal message, which would otherwise sample garbage (a NaN temperature, a top_p of 0)
    or fail inside the step (an index outside the vocabulary). Called once per new request.

    Raises:
        ValueError: naming the parameters.
    """
    p = params
    floats = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
              p.frequency_penalty)
    if not (all(map(math.isfinite, floats)) and p.temperature >= 0 and 0 < p.top_p <= 1
            and 0 <= p.min_p <= 1 and p.repetition_penalty > 0 and p.beam_width >= 0
            and all(0 <= t < vocab_size for t in p.stop_token_ids)
            and all(k is None or 0 <= k <= vocab_size for k in (p.logprobs, p.prompt_logprobs))):
        raise ValueError(f"sampling parameters the sampler cannot use (vocab_size {vocab_size}; "
                         f"the router never sends these): {p}")
    bad_bias = [(t, b) for t, b in p.logit_bias if not (0 <= t < vocab_size and math.isfinite(b))]
    if bad_bias or len({t for t, _ in p.logit_bias}) != len(p.logit_bias):
        raise ValueError(f"logit_bias the sampler cannot use (token ids distinct in [0, "
                         f"{vocab_size}), finite biases; the router never sends these): "
                         f"{bad_bias[:5] or 'a repeated token id'}")
    if p.structured_output:
        try:
            grammar = json.loads(p.structured_output)
        except ValueError as e:
            raise ValueError(f"structured_output is not llguidance grammar JSON: {e}") from None
        if not (isinstance(grammar, dict) and isinstance(grammar.get("grammars"), list)):
            raise ValueError("structured_output is not llguidance grammar JSON: expected an "
                             "object with a \"grammars\" list (llguidance.grammar_from's result)")


def check_block_copies(pairs: list[tuple[int, int]], num_kv_blocks: int) -> None:
    """Refuse copy-on-write pairs ``(src, dst)`` the block copy cannot run as asked: a block
    id outside ``[0, num_kv_blocks)``, a destination named twice, or a destination that is
    also a source (the copy reads every source before it writes any destination,
    ``kernels.copy_blocks``, which equals copying the pairs in order only without those; the
    scheduler never sends them).

    Raises:
        ValueError: naming the offending ids.
    """
    if not pairs:
        return
    ids = [b for pair in pairs for b in pair]
    if min(ids) < 0 or max(ids) >= num_kv_blocks:
        raise ValueError(f"block copies must name block ids in [0, {num_kv_blocks}), got "
                         f"[{min(ids)}, {max(ids)}]")
    dst = [d for _, d in pairs]
    chained = set(dst) & {s for s, _ in pairs}
    if len(set(dst)) != len(dst) or chained:
        raise ValueError("block copies must write distinct blocks that no copy of the step "
                         f"reads; got {pairs[:8]}{' ...' if len(pairs) > 8 else ''}")


@dataclass(slots=True)
class NewRequest:
    """A request the worker has not seen (or has dropped), sent in full once."""

    request_id: str
    prompt_token_ids: list[int]  # every token the worker must hold (prompt + any output so far)
    sampling: EngineSamplingParams  # as the router validated them
    block_ids: list[int]  # the block tables, one per KV cache group, concatenated group by
    # group (n each), in logical order; -1 = no block (before a sliding window)
    num_computed_tokens: int  # tokens whose K/V are already in the cache (e.g. a prefix hit)
    num_scheduled_tokens: int  # tokens to compute this step


@dataclass(slots=True)
class CachedRequest:
    """A request the worker already holds: what changed since the previous step."""

    request_id: str
    new_token_ids: list[int]  # appended to the token list (earlier pipeline stages; a beam on
    # every rank), or the whole token list if resumed
    new_block_ids: list[int]  # appended to the block tables (k per KV cache group, group by
    # group), or the whole tables if resumed; -1 = no block
    resumed_from_preemption: bool  # True: new_block_ids and new_token_ids REPLACE table and list
    num_computed_tokens: int
    num_scheduled_tokens: int
    # the table index new_block_ids are written from in every group (replacing the entries from
    # there: copy-on-write gave the request a copy of its last block); -1 = appended. Ignored
    # when resumed (its tables are replaced from 0).
    first_new_block: int = -1
    # speculative decoding: the d draft tokens this step verifies (num_scheduled_tokens is then
    # 1 + d: the last token of the list and the drafts after it); never part of the token list
    # until the step accepts them
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepInput:
    """One engine step. Requests are computed in the order new_requests, then cached_requests."""

    step_id: int
    new_requests: list[NewRequest]
    cached_requests: list[CachedRequest]
    finished_request_ids: list[str]  # dropped before anything else in this step
    # (src, dst) block ids: copied in every layer, in order, before this step's forward
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # speculative decoding: draft tokens the driver proposes after this step per request that
    # got a token (StepOutput.draft_token_ids); 0 = none
    num_speculative_tokens: int = 0


@dataclass(slots=True)
class StepOutput:
    """The sampled tokens of the requests whose chunk reached the end of their token list."""

    step_id: int
    request_ids: list[str]
    # the new tokens of each request, concatenated: one each, or (speculative decoding) its
    # accepted drafts and then the token sampled after them
    sampled_token_ids: list[int]
    logprobs: SampledLogprobs | None = None  # None when no request of the step asked
    prompt_logprobs: list[PromptChunkLogprobs] = field(default_factory=list)
    # per request, how many of sampled_token_ids are its (1 + accepted drafts); None = one each
    num_sampled_token_ids: list[int] | None = None
    # per request (parallel to request_ids), the drafts proposed to follow its new tokens
    # (StepInput.num_speculative_tokens > 0; [] where none); None = no proposals this step
    draft_token_ids: list[list[int]] | None = None


@dataclass(slots=True)
class PromptChunkLogprobs:
    """Raw logprobs of the prompt tokens one request's chunk scored this step.

    Prompt token ``first_position + j`` (``j < len(logprobs)``) has logprob ``logprobs[j]``
    given the tokens before it; ``top_token_ids`` / ``top_logprobs`` hold k pairs per scored
    token (k = their length / len(logprobs)), most likely first. Position 0 is never scored.
    """

    request_id: str
    first_position: int
    logprobs: list[float]
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SampledLogprobs:
    """Columnar logprobs of one step (the StepResult's layout; see worker.proto).

    ``num_top_logprobs[i]`` is k for sampled token i of the StepOutput (``sampled_token_ids``,
    so one per request unless a request accepted drafts), or -1 when its request asked for
    none; ``sampled_logprobs`` has one float (natural log) per token with k >= 0, in order;
    ``top_token_ids`` / ``top_logprobs`` hold k entries per such token, most likely first.
    """

    num_top_logprobs: list[int]
    sampled_logprobs: list[float]
    top_token_ids: list[int]
    top_logprobs: list[float]
