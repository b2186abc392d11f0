"""Verification of draft tokens (speculative decoding), vectorised over a step's requests.

A request verifying ``d`` drafts ``d_0 .. d_{d-1}`` contributes ``1 + d`` logits rows, one per
position: row ``j`` is the target's distribution of the token after ``t_{n-1}, d_0 .. d_{j-1}``
(``t_{n-1}`` the last token of its list). The Sampler draws ``x_j`` from every row with the
request's own sampling parameters; then::

    accept d_j while x_j == d_j         a = the accepted count, 0..d
    output   d_0 .. d_{a-1}, x_a        a + 1 tokens (x_j == d_j for j < a: x_0 .. x_a)

Why this is lossless (Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", ICML 2023, §2.3; Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling", 2023, Algorithm 2): with draft distribution ``q`` and target ``p`` at a
position, accept the draft ``d`` with probability ``min(1, p(d) / q(d))``, else draw from the
residual ``norm(max(0, p - q))``; the emitted token is distributed as ``p``. Both our proposers
(prompt lookup; a draft model decoding greedily) are deterministic, a point mass ``q = δ_d``:
acceptance is then ``min(1, p(d) / 1) = p(d)``, and the residual ``max(0, p - δ_d)`` is ``p``
with ``d`` removed, renormalised. Sampling ``x ~ p`` and accepting iff ``x == d`` does exactly
that: ``P(accept) = p(d)``, and given a rejection ``x`` is ``p`` conditioned on ``x != d``.
Greedy rows (argmax) accept while the draft is the argmax. Positions after the first rejection
are computed but their samples are dropped (their context was wrong), so every output token is
drawn from the target given the true prefix, with the request's temperature, top-k/p, min-p,
logit_bias and min_tokens (the rows' sampling tensors, ``sampling_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.worker.ragged import ragged_arange


@dataclass(slots=True)
class Verdict:
    """What verification kept of one step's drafts.

    Attributes:
        num_accepted: ``[S]`` int64, accepted drafts per request (0..d_i); each request
            outputs ``num_accepted + 1`` tokens.
        output_rows: ``[O]`` int64, the logits rows whose samples are the output tokens, in
            order (request i's: its first ``num_accepted[i] + 1`` rows), ``O = S + sum(a)``.
    """

    num_accepted: np.ndarray
    output_rows: np.ndarray


def verify_drafts(sampled: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray) -> Verdict:
    """Accept each request's drafts while the sample at their position equals them.

    Args:
        sampled: ``[L]`` int64, the token sampled at every logits row; request i owns
            ``1 + num_drafts[i]`` consecutive rows, requests in order (``L = S + D``).
        drafts: ``[D]`` int64, the drafts, request by request (``num_drafts[i]`` each).
        num_drafts: ``[S]`` int64, drafts per request (>= 0).

    Returns:
        The ``Verdict``; the output tokens are ``sampled[verdict.output_rows]``.

    Raises:
        ValueError: the three lengths disagree.

    Layout (request 0 with 2 drafts, request 1 with none, request 2 with 1)::

        rows     0   1   2 | 3 | 4   5        seg_start = [0, 3, 4]
        draft   d0  d1   - | - | e0  -        match = sampled == draft (False at "-")
        a = first False in each segment - seg_start
    """
    counts = num_drafts + 1  # [S] rows per request
    seg_end = np.cumsum(counts)  # [S]
    seg_start = seg_end - counts
    if len(sampled) != int(seg_end[-1] if len(seg_end) else 0) or len(drafts) != int(
            num_drafts.sum()):
        raise ValueError(f"verify_drafts: {len(sampled)} sampled rows and {len(drafts)} drafts "
                         f"for draft counts summing to {int(num_drafts.sum())} over "
                         f"{len(num_drafts)} requests")
    match = np.zeros(len(sampled), dtype=bool)  # [L]; the last row of a segment never matches
    draft_rows = ragged_arange(seg_start, num_drafts)  # [D]
    match[draft_rows] = sampled[draft_rows] == drafts
    misses = np.flatnonzero(~match)  # sorted; every segment has one (its last row)
    first_miss = misses[np.searchsorted(misses, seg_start)]  # [S]
    num_accepted = first_miss - seg_start
    return Verdict(num_accepted, ragged_arange(seg_start, num_accepted + 1))

