"""Speculative decoding as the scheduler sees it: draft token ids, how many a step verifies,
and what came back (no torch; the worker proposes and verifies).

A request's drafts (``Request.spec_token_ids``) come back with a step's result: the driver
proposes them after sampling (``StepRequest.num_speculative_tokens``; prompt lookup or a draft
model, see ``--speculative-config``). The next step schedules the request's last token and d of
them, 1 + d tokens under the one scheduling rule, and the worker returns the a accepted drafts
(0 <= a <= d) followed by one token it sampled after them::

    before    tokens t0 .. t(N-1)    num_computed = N - 1           drafts d0 .. d(k-1)
    schedule  computes t(N-1) d0 .. d(d-1)  (1 + d tokens)  num_computed = N + d
    result    d0 .. d(a-1), x   appended one by one (stop checks after each)
              num_computed = N + a  (the K/V of the d - a rejected drafts is dead: their
              slots are overwritten later, blocks only they used are freed)

Lossless verification (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", §2.3; Chen et al. 2023): both proposers are point masses, so the worker's rule
"sample every position from the target, accept while the sample equals the draft" is the
rejection rule accept-with-min(1, p/q) with its normalised residual.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters (vLLM's ``spec_decode_*`` metrics), read by the scheduler's metrics.

    Attributes:
        num_drafts: request steps that verified at least one draft.
        num_draft_tokens: drafts verified.
        num_accepted_tokens: drafts accepted.
        accepted_per_position: ``[i]`` = drafts accepted at draft position i (0-based).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """One request's step verified ``num_draft`` drafts and accepted ``num_accepted``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_position
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1


def num_drafts_to_verify(num_drafts: int, budget: int, num_output_tokens: int,
                         max_tokens: int | None, num_tokens: int, max_model_len: int) -> int:
    """How many of a decode step's ``num_drafts`` drafts to schedule: one token of ``budget``
    is the request's last token; an accepted run never passes max_tokens or max_model_len (the
    token sampled after the drafts counts too)."""
    room = min(num_drafts, budget - 1, max_model_len - num_tokens - 1)
    if max_tokens is not None:
        room = min(room, max_tokens - num_output_tokens - 1)
    return max(0, room)
