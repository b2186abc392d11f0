"""Logits processors that look at a request's tokens: repetition / presence / frequency
penalties and min_tokens, plus logit_bias and min_p (which look only at the logits).

Semantics (all on float32 ``logits [B, V]``, the model's raw scores, before temperature):

- repetition_penalty (transformers' ``RepetitionPenaltyLogitsProcessor``, from CTRL, Keskar et
  al. 2019): a token seen in the prompt or the output gets ``logit / p`` if ``logit > 0``, else
  ``logit * p``.
- presence / frequency penalty (OpenAI's API, as vLLM's ``apply_penalties``), output tokens
  only: ``logit -= frequency * count + presence * (count > 0)``.
- logit_bias (OpenAI's API, as vLLM's ``LogitBiasLogitsProcessor``): ``logit[id] += bias`` for
  the request's (id, bias) pairs, after the penalties.
- min_tokens (transformers' ``MinNewTokensLengthLogitsProcessor`` / vLLM's min_tokens):
  while fewer than min_tokens tokens were generated, the stop ids get ``-inf``.
- min_p (transformers' ``MinPLogitsWarper``; Nguyen et al., "Turning Up the Heat: Min-p
  Sampling", 2024): drop tokens whose probability is below ``min_p`` times the top one's.

A request that uses a penalty keeps a ``TokenCounts`` in the worker's per-request state; each
step folds in only the tokens appended since the last step, so nothing is rebuilt from scratch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class TokenCounts:
    """One request's tokens as dense ``[V]`` tensors on the device, updated incrementally.

    Attributes:
        prompt_mask: ``[V]`` bool, True for every token id in the prompt.
        output_counts: ``[V]`` int32, how often each token id was generated.
        num_counted: how many tokens of the request's token list are folded in already.
    """

    prompt_mask: torch.Tensor
    output_counts: torch.Tensor
    num_counted: int

    @classmethod
    def create(cls, prompt_token_ids: list[int], vocab_size: int,
               device: torch.device) -> TokenCounts:
        """Counts of a request whose token list is ``prompt_token_ids`` (no output yet)."""
        prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        prompt_mask[torch.tensor(prompt_token_ids, dtype=torch.int64, device=device)] = True
        return cls(prompt_mask, torch.zeros(vocab_size, dtype=torch.int32, device=device),
                   len(prompt_token_ids))

    def update(self, token_ids: Sequence[int] | np.ndarray) -> None:
        """Fold ``token_ids[num_counted:]`` (output tokens: usually the last sampled one) in;
        ``token_ids`` is the request's whole token list (a list or a 1-D int array)."""
        new = token_ids[self.num_counted:]
        if len(new):
            device = self.output_counts.device
            self.output_counts.index_put_(
                (torch.as_tensor(new, dtype=torch.int64, device=device),),
                torch.ones(len(new), dtype=torch.int32, device=device), accumulate=True)
            self.num_counted = len(token_ids)


@dataclass(slots=True)
class PenaltyTensors:
    """The penalised rows of one step (``P`` of the ``B`` rows).

    Attributes:
        rows: ``[P]`` int64, the rows of ``logits`` they are.
        prompt_mask: ``[P, V]`` bool; output_counts: ``[P, V]`` int32 (see ``TokenCounts``).
        repetition / presence / frequency: ``[P]`` float32 penalties (1, 0, 0 = off).
    """

    rows: torch.Tensor
    prompt_mask: torch.Tensor
    output_counts: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor

    @classmethod
    def build(cls, rows: list[int], counts: list[TokenCounts], repetition: list[float],
              presence: list[float], frequency: list[float],
              device: torch.device) -> PenaltyTensors:
        """Stack the per-request counts (already updated) of the penalised rows."""
        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(tensor(rows, torch.int64), torch.stack([c.prompt_mask for c in counts]),
                   torch.stack([c.output_counts for c in counts]),
                   tensor(repetition, torch.float32), tensor(presence, torch.float32),
                   tensor(frequency, torch.float32))


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> None:
    """Penalise ``logits [B, V]`` float32 in place on rows ``p.rows``: repetition penalty over
    prompt + output tokens, then frequency and presence penalties over output tokens (the order
    of vLLM's ``apply_penalties``; transformers has only the first)."""
    sub = logits[p.rows]  # [P, V]
    generated = p.output_counts > 0  # [P, V]
    rep = p.repetition.unsqueeze(1)  # [P, 1]
    sub = torch.where(p.prompt_mask | generated, torch.where(sub < 0, sub * rep, sub / rep), sub)
    sub -= p.frequency.unsqueeze(1) * p.output_counts + p.presence.unsqueeze(1) * generated
    logits[p.rows] = sub


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     bias: torch.Tensor) -> None:
    """``logits[rows[i], token_ids[i]] += bias[i]`` in place, one ``index_put_`` for the whole
    step: ``rows``, ``token_ids`` ``[N]`` int64 and ``bias`` ``[N]`` float32 list every (row, id,
    bias) of the biased rows (ids distinct within a row)."""
    logits.index_put_((rows, token_ids), bias, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Set ``logits[rows[i], token_ids[i]] = -inf`` in place: ``rows``, ``token_ids`` ``[M]``
    int64 list each (row, stop id) pair of the rows still under their min_tokens."""
    logits.index_put_((rows, token_ids), torch.tensor(float("-inf"), device=logits.device))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens with ``prob < min_p * max prob``; ``logits [B, V]`` float32,
    ``min_p [B]`` float32 in [0, 1] (0 = off). The top token always stays. Returns a new
    tensor."""
    probs = logits.softmax(dim=-1)  # [B, V]
    top = probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < min_p.unsqueeze(1) * top, float("-inf"))
