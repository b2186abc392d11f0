"""Batched token sampling: penalties, logit_bias, min_tokens, the grammar mask, greedy,
temperature, top-k, top-p, min-p, per-request seeds.

Everything is vectorised over the batch except one loop over the *seeded* rows, each of which
draws its noise from its own ``torch.Generator`` so that a seeded request's tokens do not depend
on what else is in the batch. The recipe follows vLLM V1's sampler
(``vllm/v1/sample/ops/topk_topp_sampler.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu_argmax import row_argmax
from services.worker.sample.penalties import (
    PenaltyTensors,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
)
from services.worker.sample.structured_output_masks import GrammarMask, apply_grammar_mask

_SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's threshold)


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one step, on the logits' device.

    Attributes:
        temperature: ``[B]`` float32; ``< 1e-5`` means greedy for that row.
        top_p: ``[B]`` float32 in (0, 1]; 1 = off.
        top_k: ``[B]`` int64 in [1, V]; V = off.
        generators: row index -> that request's generator (seeded rows only).
        all_greedy / no_top_k / no_top_p: batch-wide flags that skip work.
        min_p: ``[B]`` float32 in [0, 1], or None when no row uses min-p.
        penalties: the penalised rows, or None when no row uses a penalty.
        logit_bias: ``(rows [N], token_ids [N])`` int64 and ``bias [N]`` float32: what to add
            to the biased rows' logits, or None.
        min_tokens_mask: ``(rows [M], token_ids [M])`` int64 pairs to set to -inf (stop ids of
            the rows still under min_tokens), or None.
        grammar: the constrained rows' allowed tokens, or None; set by the runner once the
            mask job is done (after the forward), not by ``build`` / ``from_arrays``.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    generators: dict[int, torch.Generator]
    all_greedy: bool
    no_top_k: bool
    no_top_p: bool
    min_p: torch.Tensor | None = None
    penalties: PenaltyTensors | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    grammar: GrammarMask | None = None

    @staticmethod
    def effective_top_k(top_k: int, vocab_size: int) -> int:
        """``top_k`` in [1, V]: V when it is off (-1, the router's; any k outside [1, V) reads
        as off, so no int can index outside the vocabulary)."""
        return vocab_size if top_k <= 0 or top_k >= vocab_size else top_k

    @classmethod
    def build(cls, temperature: list[float], top_p: list[float], top_k: list[int],
              generators: dict[int, torch.Generator], vocab_size: int,
              device: torch.device, *, min_p: list[float] | None = None,
              penalties: PenaltyTensors | None = None,
              logit_bias: dict[int, list[tuple[int, float]]] | None = None,
              min_tokens_mask: tuple[list[int], list[int]] | None = None) -> SamplingTensors:
        """From per-row Python lists (the tests' and benchmarks' way in; a worker gathers its
        rows' arrays, ``from_arrays``). ``logit_bias`` maps a row to its (token id, bias)
        pairs; ``min_tokens_mask`` lists (row, token id) pairs to mask.
        """
        bias = None
        if logit_bias:
            pairs = [(row, t, b) for row, items in logit_bias.items() for t, b in items]
            bias = (np.array([p[0] for p in pairs], dtype=np.int64),
                    np.array([p[1] for p in pairs], dtype=np.int64),
                    np.array([p[2] for p in pairs], dtype=np.float32))
        return cls.from_arrays(
            np.asarray(temperature, dtype=np.float32), np.asarray(top_p, dtype=np.float32),
            np.asarray([cls.effective_top_k(k, vocab_size) for k in top_k], dtype=np.int64),
            generators, vocab_size, device,
            min_p=None if min_p is None else np.asarray(min_p, dtype=np.float32),
            penalties=penalties, logit_bias=bias, min_tokens_mask=min_tokens_mask)

    @classmethod
    def from_arrays(cls, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray,
                    generators: dict[int, torch.Generator], vocab_size: int,
                    device: torch.device, *, min_p: np.ndarray | None = None,
                    penalties: PenaltyTensors | None = None,
                    logit_bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                    min_tokens_mask: tuple[list[int], list[int]] | None = None
                    ) -> SamplingTensors:
        """From per-row numpy arrays ``[B]``: temperature, top_p, min_p float32, top_k int64
        in [1, V] (``effective_top_k``); ``logit_bias`` as ``(rows [N], token_ids [N])`` int64
        and ``bias [N]`` float32. Not copied on CPU: pass arrays the caller will not modify
        (e.g. the result of fancy indexing).
        """
        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(device, non_blocking=True)

        def index_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        return cls(
            temperature=tensor(temperature),
            top_p=tensor(top_p),
            top_k=tensor(top_k),
            generators=generators,
            all_greedy=bool(((temperature < _SAMPLING_EPS) | (top_k == 1)).all()),
            no_top_k=bool((top_k == vocab_size).all()),
            no_top_p=bool((top_p >= 1.0).all()),
            min_p=tensor(min_p) if min_p is not None and (min_p > 0).any() else None,
            penalties=penalties,
            logit_bias=(None if logit_bias is None or not len(logit_bias[0]) else
                        (tensor(logit_bias[0]), tensor(logit_bias[1]), tensor(logit_bias[2]))),
            min_tokens_mask=(None if not min_tokens_mask or not min_tokens_mask[0] else
                             (index_tensor(min_tokens_mask[0]),
                              index_tensor(min_tokens_mask[1]))),
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k and top-p sets; one sort for both.

    ``logits [B, V]`` float32, ``top_k [B]`` int64 in [1, V] or None, ``top_p [B]`` in (0, 1]
    or None. Top-p is nucleus sampling (Holtzman et al., "The Curious Case of Neural Text
    Degeneration", ICLR 2020): keep the smallest set of most likely tokens whose mass reaches
    ``p``, always at least one token. Applied after top-k, on the top-k renormalised probs.
    """
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [B, V] ascending
    if top_k is not None:
        kth_largest = logits_sort.gather(1, (logits.shape[1] - top_k).unsqueeze(1))  # [B, 1]
        logits_sort.masked_fill_(logits_sort < kth_largest, float("-inf"))
    if top_p is not None:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
        tail = probs_sum <= 1 - top_p.unsqueeze(1)
        tail[:, -1] = False  # the most likely token always stays
        logits_sort.masked_fill_(tail, float("-inf"))
    return logits_sort.scatter(1, logits_idx, logits_sort)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row of ``probs [B, V]``: ``argmax(probs / E)`` with ``E ~ Exp(1)``.

    The "exponential race" (Gumbel-max in another form): the token whose exponential clock
    ``E_i / p_i`` rings first is distributed as ``p``. No CPU sync and no cumsum. Seeded rows
    draw ``E`` from their own generator, one row at a time; the rest share one draw.
    Returns ``[B]`` int64.
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # NOTE: exponential_ may return exactly 0; a tiny floor keeps 0/0 out of masked tokens and
    # still lets a positive-probability token with a zero clock win, as it should.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return row_argmax(probs.div(noise))


class Sampler:
    """``logits [B, V]`` float32 -> next token ids ``[B]`` int64.

    Per row, in transformers' / vLLM's order, on the raw logits (greedy rows too): penalties,
    logit_bias, min_tokens, the grammar mask (structured outputs); then greedy (argmax) when
    temperature < 1e-5 or top_k == 1; otherwise logits / temperature, top-k, top-p, min-p,
    softmax, and the exponential race. ``logits`` is not modified (logprobs are computed from
    it: raw).
    """

    def __call__(self, logits: torch.Tensor, sampling_tensors: SamplingTensors) -> torch.Tensor:
        st = sampling_tensors  # (short: read on every line below)
        if (st.penalties is not None or st.logit_bias is not None
                or st.min_tokens_mask is not None or st.grammar is not None):
            logits = logits.clone()
            if st.penalties is not None:
                apply_penalties(logits, st.penalties)
            if st.logit_bias is not None:
                apply_logit_bias(logits, *st.logit_bias)
            if st.min_tokens_mask is not None:
                apply_min_tokens(logits, *st.min_tokens_mask)
            if st.grammar is not None:
                apply_grammar_mask(logits, st.grammar)
        greedy = row_argmax(logits)  # [B] (logits.argmax(dim=-1))
        if st.all_greedy:
            return greedy
        # top_k=1 is greedy at any temperature: the same token as argmax even on a tie, which
        # the threshold mask of apply_top_k_top_p would keep both sides of
        is_greedy = (st.temperature < _SAMPLING_EPS) | (st.top_k == 1)  # [B]
        temperature = torch.where(is_greedy, 1.0, st.temperature)
        logits = logits / temperature.unsqueeze(1)  # [B, V]
        if not (st.no_top_k and st.no_top_p):
            logits = apply_top_k_top_p(logits, None if st.no_top_k else st.top_k,
                                       None if st.no_top_p else st.top_p)
        if st.min_p is not None:
            logits = apply_min_p(logits, st.min_p)
        probs = logits.softmax(dim=-1, dtype=torch.float32)  # [B, V]
        sampled = exponential_race(probs, st.generators)
        return torch.where(is_greedy, greedy, sampled)
