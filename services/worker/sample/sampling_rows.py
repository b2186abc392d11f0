"""The sampling side of the InputBatch's rows (``services/worker/input_batch.py``): each
request's sampling parameters, written into its row once, and each step's sampling inputs
gathered from the sampled rows by numpy fancy indexing::

    row r   temperature / top_p / min_p[r]                   float32
            top_k[r]                                         int64 in [1, V] (V = off)
            seeded / penalized / biased / constrained[r]     bool (the row needs special work)
            min_tokens[r]                                    int64, 0 unless it has stop ids
            num_logprobs[r]                                  int64, -1 = none
            beam[r]                                          bool, beam_width > 0: its sample
                                                             is not its next token

Python loops run only over the rows that need special sampling work (seeded, penalised,
biased, under min_tokens, constrained by a grammar).
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.request_state import RequestState
from services.worker.sample.penalties import PenaltyTensors
from services.worker.sample.sampler import SamplingTensors
from services.worker.sample.structured_output_masks import RequestGrammar

# name -> dtype of the per-row arrays (see the module docstring)
_ARRAYS: dict[str, type] = {
    "temperature": np.float32, "top_p": np.float32, "top_k": np.int64, "min_p": np.float32,
    "seeded": bool, "penalized": bool, "biased": bool, "constrained": bool,
    "min_tokens": np.int64, "num_logprobs": np.int64, "beam": bool}


class SamplingRows:
    """Per-row sampling parameters of the InputBatch's rows.

    Args:
        vocab_size: logits width (top-k normalisation).
        device: where the step's sampling tensors go.
    """

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    seeded: np.ndarray
    penalized: np.ndarray
    biased: np.ndarray
    constrained: np.ndarray
    min_tokens: np.ndarray
    num_logprobs: np.ndarray
    beam: np.ndarray

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.num_rows = 0
        for name, dtype in _ARRAYS.items():
            setattr(self, name, np.zeros(0, dtype=dtype))

    def grow(self, rows: int) -> None:
        """Have at least ``rows`` rows (existing rows keep their values)."""
        if rows <= self.num_rows:
            return
        for name, dtype in _ARRAYS.items():
            grown: np.ndarray = np.zeros(rows, dtype=dtype)
            grown[:self.num_rows] = getattr(self, name)
            setattr(self, name, grown)
        self.num_rows = rows

    def write(self, row: int, state: RequestState) -> None:
        """Write ``state``'s sampling parameters into ``row``."""
        o = state.sampling
        self.temperature[row], self.top_p[row], self.min_p[row] = o.temperature, o.top_p, o.min_p
        self.top_k[row] = SamplingTensors.effective_top_k(o.top_k, self.vocab_size)
        self.seeded[row] = state.generator is not None
        self.penalized[row] = state.counts is not None
        self.biased[row] = state.logit_bias is not None
        self.constrained[row] = state.grammar is not None
        self.min_tokens[row] = o.min_tokens if state.min_tokens_stop_ids else 0
        self.num_logprobs[row] = -1 if o.logprobs is None else o.logprobs
        self.beam[row] = o.beam_width > 0

    def tensors(self, rows: np.ndarray, row_states: list[RequestState | None],
                token_ids: np.ndarray, num_tokens: np.ndarray,
                num_prompt_tokens: np.ndarray,
                positions_ahead: np.ndarray | None = None) -> SamplingTensors:
        """The sampling parameters of ``rows [S]`` by indexing; Python loops only over the rows
        that are seeded, penalised, biased or under min_tokens.

        ``row_states``, ``token_ids`` ``[rows, max_model_len]``, ``num_tokens`` and
        ``num_prompt_tokens`` ``[rows]`` are the InputBatch's: the penalised rows' counts are
        brought up to date from their token lists, and min_tokens counts their outputs.

        Speculative decoding: a row may be repeated, once per position it samples (its last
        token and its drafts); ``positions_ahead [S]`` int64 then says how many positions past
        its token list each entry is (0..d): min_tokens counts that many more outputs there.
        A seeded request's entries share its generator and draw in order (position order).
        Penalised rows are never repeated (no drafts: their counts follow the token list).
        """
        generators = {}
        for i in np.flatnonzero(self.seeded[rows]).tolist():
            state = row_states[rows[i]]
            record_draw(state, int(num_tokens[rows[i]]))  # (a resume may rewind to it)
            generators[i] = state.generator
        penalties, mask = None, None
        pen_rows = np.flatnonzero(self.penalized[rows]).tolist()
        if pen_rows:
            states = [row_states[rows[i]] for i in pen_rows]
            for s in states:
                s.counts.update(token_ids[s.row, :num_tokens[s.row]])
            penalties = PenaltyTensors.build(
                pen_rows, [s.counts for s in states],
                [s.sampling.repetition_penalty for s in states],
                [s.sampling.presence_penalty for s in states],
                [s.sampling.frequency_penalty for s in states], self.device)
        bias = None
        bias_rows = np.flatnonzero(self.biased[rows]).tolist()
        if bias_rows:
            pairs = [row_states[rows[i]].logit_bias for i in bias_rows]
            bias = (np.repeat(np.array(bias_rows, dtype=np.int64), [len(p[0]) for p in pairs]),
                    np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs]))
        num_outputs = num_tokens[rows] - num_prompt_tokens[rows]  # [S]
        if positions_ahead is not None:
            num_outputs += positions_ahead
        under_min = np.flatnonzero(num_outputs < self.min_tokens[rows]).tolist()
        if under_min:
            mask_rows, mask_ids = [], []
            for i in under_min:
                stop_ids = row_states[rows[i]].min_tokens_stop_ids
                mask_rows.extend([i] * len(stop_ids))
                mask_ids.extend(stop_ids)
            mask = (mask_rows, mask_ids)
        return SamplingTensors.from_arrays(
            self.temperature[rows], self.top_p[rows], self.top_k[rows], generators,
            self.vocab_size, self.device, min_p=self.min_p[rows], penalties=penalties,
            logit_bias=bias, min_tokens_mask=mask)

    def logprobs(self, rows: np.ndarray) -> list[int | None]:
        """Per row of ``rows [S]``, the top logprobs it asked for, or None for none."""
        num_logprobs = self.num_logprobs[rows]  # [S]
        if not (num_logprobs >= 0).any():
            return [None] * len(rows)
        return [None if k < 0 else k for k in num_logprobs.tolist()]

    def grammars(self, rows: np.ndarray, row_states: list[RequestState | None]
                 ) -> tuple[np.ndarray, list[RequestGrammar]]:
        """Which of ``rows [S]`` a grammar constrains (``[C]`` int64 indices into ``rows``),
        and their matchers (``row_states``: the InputBatch's)."""
        grammar_rows = np.flatnonzero(self.constrained[rows])  # [C]
        return grammar_rows, [row_states[r].grammar for r in rows[grammar_rows].tolist()]


RNG_HISTORY = 4  # samples remembered per seeded request (> the steps ever in flight)


def record_draw(state: RequestState, num_tokens: int) -> None:
    """Before a seeded request's draw at ``num_tokens`` tokens: remember its generator's state
    (``RNG_HISTORY`` draws back)."""
    assert state.generator is not None
    history = state.rng_history
    if history and history[-1][0] == num_tokens:
        return  # (speculative positions of one step: the state before the first draw)
    history.append((num_tokens, state.generator.get_state()))
    if len(history) > RNG_HISTORY:
        del history[0]


def rewind_generator(state: RequestState, num_tokens: int) -> None:
    """A seeded request resumes with ``num_tokens`` tokens: if its generator already drew at
    that count (a step in flight when it was preempted, whose result the scheduler dropped),
    put the generator back to just before that draw, so the resumed request draws what it
    would have drawn without the preemption (seeded output stays reproducible)."""
    assert state.generator is not None
    history = state.rng_history
    for i, (n, saved) in enumerate(history):
        if n == num_tokens:
            state.generator.set_state(saved)
            del history[i:]
            return
