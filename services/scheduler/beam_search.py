"""Beam search as a group of scheduler requests on shared KV blocks (torch-free).

A request with ``beam_width`` k > 0 is a ``BeamGroup``: up to k live beams, each an ordinary
``Request`` to the scheduling rule and the workers (beam 0 keeps the submitted id, the others
are ``f"{id}#beam{i}"``). Each beam asks the worker for its ``num_candidates`` most likely next
tokens (the worker's top raw logprobs: ``EngineSamplingParams.logprobs``); once every live beam
of the group has proposed, ``BeamGroup.select`` keeps the k best continuations and the
scheduler forks the surviving parents' block tables onto the children (ref counts, and
copy-on-write when a child writes into a partial block its sibling still reads: see
``block_manager.py``).

The selection is transformers' (5.24, ``GenerationMixin._beam_search``; the algorithm of
Wu et al. 2016, "Google's Neural Machine Translation System", §7 for the length penalty), one
step for generated length s = 1, 2, ...::

    candidates  every live beam b's top-C (token, lp): score = f32(cum[b] + lp); the best C
                over all beams (C = max(2, 1 + number of stop ids) * k, ``num_candidates``)
    finished    a candidate among the best k that ends in a stop token, or any at s = max_new,
                joins the finished set with score f32(score / f32(s ** length_penalty)); the
                set keeps its k best
    running     the best k candidates that did not end: the next live beams, best first
    stop when   s = max_new (every candidate ends); or early_stopping "true" and k finished;
                or k finished and the best running score at length L can no longer beat the
                worst finished one: f32(cum_best / f32(L ** length_penalty)) <= min finished,
                L = s ("false"), or max_new when "never" and length_penalty > 0

Scores are float32 sums, rounded as transformers' float32 tensors round them (``_f32``), so
equal logprobs give equal rankings. A first step starts from one beam (the prompt), which is
what transformers' -1e9 initial scores of beams 1..k-1 amount to.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from services.common.finish_reason import FinishReason

EARLY_STOPPING = ("true", "false", "never")
_F32 = struct.Struct("f")


class Beam(Protocol):
    """What the search reads of a beam (the scheduler's ``Request``): its id, for errors, and
    the tokens it has generated."""

    request_id: str
    output_token_ids: list[int]


BeamT = TypeVar("BeamT", bound=Beam)


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (float32 arithmetic done in float64 and rounded
    once is exactly float32 arithmetic for + and /)."""
    return _F32.unpack(_F32.pack(x))[0]


def num_candidates(beam_width: int, num_stop_ids: int) -> int:
    """Candidates each beam proposes per step: max(2, 1 + num_stop_ids) * beam_width, so at
    least k candidates do not end (transformers' ``beams_to_keep``)."""
    return max(2, 1 + num_stop_ids) * beam_width


@dataclass(slots=True)
class BeamHypothesis:
    """One finished hypothesis.

    Attributes:
        token_ids: the generated tokens (a stop token that ended it included).
        score: ``cumulative_logprob / len(token_ids) ** length_penalty`` (float32).
        cumulative_logprob: sum of the tokens' raw logprobs (float32 sums).
        finish_reason: STOP (ended with a stop token) or LENGTH (at max_new_tokens).
    """

    token_ids: list[int]
    score: float
    cumulative_logprob: float
    finish_reason: FinishReason


@dataclass(slots=True)
class Continuation:
    """A live beam of the next step: ``parent`` (index into the current beams) + ``token_id``,
    with cumulative logprob ``score``."""

    parent: int
    token_id: int
    score: float


@dataclass(slots=True)
class BeamGroup(Generic[BeamT]):
    """The state of one beam search (see the module docstring), over beams of type ``BeamT``
    (the scheduler's ``Request``).

    Attributes:
        root: the submitted request; always one of ``beams`` (its object is reused, so the
            router's id stays live).
        beam_width: k.
        max_new_tokens: tokens a hypothesis may have (max_tokens, or up to max_model_len).
        stop_token_ids: tokens that end a hypothesis (EOS unless ignore_eos, and the request's
            stop_token_ids).
        num_candidates: C, the candidates each beam proposes and the step keeps
            (``num_candidates``, at most the vocabulary).
        length_penalty / early_stopping: as ``EngineSamplingParams``.
        beams: live beams, best cumulative logprob first; ``scores`` aligned with them.
        finished: the best (at most k) finished hypotheses, best first.
        proposals: each live beam's (token ids, logprobs) this step, once it has proposed.
        num_generated: tokens every live beam has generated.
    """

    root: BeamT
    beam_width: int
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    num_candidates: int
    length_penalty: float = 1.0
    early_stopping: str = "false"
    beams: list[BeamT] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    finished: list[BeamHypothesis] = field(default_factory=list)
    proposals: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    num_generated: int = 0

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Back to one beam (the root's prompt) and nothing finished: a preempted group
        recomputes its search from the prompt (the search is deterministic)."""
        self.beams, self.scores = [self.root], [0.0]
        self.finished, self.proposals, self.num_generated = [], {}, 0

    def propose(self, beam: BeamT, token_ids: list[int], logprobs: list[float]) -> bool:
        """Record ``beam``'s candidates (its top tokens and their raw logprobs, most likely
        first); True once every live beam has proposed (call ``select`` then).

        Raises:
            ValueError: ``beam`` is not a live beam, or the lists differ in length.
        """
        index = next((i for i, b in enumerate(self.beams) if b is beam), None)
        if index is None or len(token_ids) != len(logprobs):
            raise ValueError(f"beam {beam.request_id} is not live in its group, or sent "
                             f"{len(token_ids)} tokens with {len(logprobs)} logprobs")
        self.proposals[index] = (token_ids, logprobs)
        return len(self.proposals) == len(self.beams)

    def select(self) -> list[Continuation] | None:
        """One step of the search over every live beam's proposals (transformers' rule, see
        the module docstring): updates ``finished`` and returns the next live beams, best
        first, or None when the search is over (``finished`` then holds the result).

        Raises:
            ValueError: a live beam has not proposed.
        """
        if len(self.proposals) != len(self.beams):
            raise ValueError(f"{len(self.beams) - len(self.proposals)} beams have not proposed")
        k, stops = self.beam_width, self.stop_token_ids
        s = self.num_generated + 1
        candidates = sorted(
            ((_f32(self.scores[b] + lp), b, token)
             for b, (tokens, lps) in self.proposals.items()
             for token, lp in zip(tokens, lps, strict=True)),
            key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[:self.num_candidates]
        at_max = s >= self.max_new_tokens
        norm = _f32(s ** self.length_penalty)
        new = []
        for score, b, token in candidates[:k]:
            if at_max or token in stops:
                reason = FinishReason.STOP if token in stops else FinishReason.LENGTH
                new.append(BeamHypothesis([*self.beams[b].output_token_ids, token],
                                          _f32(score / norm), score, reason))
        if new:  # (stable: an earlier hypothesis wins a tie)
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:k]
        self.proposals = {}
        self.num_generated = s
        running = [Continuation(b, token, score) for score, b, token in candidates
                   if token not in stops][:k]
        if at_max or not running or self._cannot_improve(running[0].score):
            return None
        return running

    def _cannot_improve(self, best_running: float) -> bool:
        """k hypotheses are finished and the search may stop: at once with early_stopping
        "true", else when the best running beam's best possible score is no better than the
        worst finished one (transformers' ``_check_early_stop_heuristic``)."""
        if len(self.finished) < self.beam_width:
            return False
        if self.early_stopping == "true":
            return True
        length = (self.max_new_tokens if self.early_stopping == "never"
                  and self.length_penalty > 0 else self.num_generated)
        best = _f32(best_running / _f32(length ** self.length_penalty))
        return not best > self.finished[-1].score
