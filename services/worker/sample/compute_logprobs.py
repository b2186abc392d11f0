"""Logprobs of sampled tokens: the sampled token's and the top-k of the raw distribution.

NOTE: as vLLM V1's default (``logprobs_mode="raw_logprobs"``), logprobs are ``log_softmax`` of
the model's raw logits, before penalties, min_tokens, temperature, top-k, top-p and min-p: they
describe the model, not the sampling transform, and greedy and sampled requests get the same
numbers for the same prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.step import Logprobs, SampledLogprobs


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_logprobs: list[int | None]) -> SampledLogprobs | None:
    """The sampled tokens' logprobs and each asking row's top-k, vectorised over those rows.

    Args:
        logits: ``[S, V]`` the raw logits of the step's sampled rows (any float dtype; the
            log_softmax is taken in float32).
        token_ids: ``[S]`` int64, the token sampled for each row.
        num_logprobs: per row, k >= 0 top logprobs to return, or None for none. The router
            caps a client's k at 20; a beam asks for its candidates, up to the vocabulary (a
            k past ``V`` returns ``V``).
    Returns:
        The columnar ``SampledLogprobs`` (natural logs), or None when no row asked.
        One ``topk`` with the batch's largest k; each row keeps its first k.
    """
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return None
    ks = [min(k, logits.shape[1]) for k in num_logprobs if k is not None]  # row by row
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [R, V]
    sampled = logprobs.gather(1, token_ids.index_select(0, index).unsqueeze(1))  # [R, 1]
    max_k = max(ks)
    top_ids: list[int] = []
    top_lps: list[float] = []
    if max_k > 0:
        top_values, top_indices = logprobs.topk(max_k, dim=-1)  # [R, max_k], sorted
        ids_rows, lps_rows = top_indices.tolist(), top_values.tolist()
        for j, k in enumerate(ks):
            top_ids.extend(ids_rows[j][:k])
            top_lps.extend(lps_rows[j][:k])
    counts = [-1] * len(num_logprobs)
    for i, k in zip(rows, ks, strict=True):
        counts[i] = k
    return SampledLogprobs(counts, sampled.squeeze(1).tolist(), top_ids, top_lps)


def compute_prompt_logprobs(logits: torch.Tensor, chunks: list[PromptChunk]
                            ) -> list[Logprobs]:
    """The raw logprobs of the prompt tokens scored this step, one topk for all of them.

    Args:
        logits: ``[P, V]`` the raw logits of every scoring position of ``chunks``, in order
            (chunk c owns ``len(c.target_token_ids)`` consecutive rows).
        chunks: what each request's rows score.
    Returns:
        One ``Logprobs`` per chunk (natural logs).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [P, V]
    targets = torch.tensor([t for c in chunks for t in c.target_token_ids], dtype=torch.int64,
                           device=logits.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()  # [P]
    max_k = min(max(c.k for c in chunks), logits.shape[1])
    if max_k > 0:
        top_values, top_indices = logprobs.topk(max_k, dim=-1)  # [P, max_k]
        values, indices = top_values.tolist(), top_indices.tolist()
    out, row = [], 0
    for c in chunks:
        n, k = len(c.target_token_ids), min(c.k, max_k)
        ids = [i for r in range(row, row + n) for i in indices[r][:k]] if k else []
        lps = [v for r in range(row, row + n) for v in values[r][:k]] if k else []
        out.append(Logprobs(c.request_id, c.first_position, chosen[row:row + n], ids,
                                       lps))
        row += n
    return out


@dataclass(slots=True)
class PromptChunk:
    """The prompt positions one request scores in a step.

    Attributes:
        request_id: the request.
        k: top logprobs per scored token (0..20).
        hidden_start: the flat batch row of the first scoring position.
        first_position: the prompt index of the first scored token (>= 1): row
            ``hidden_start + j`` (position ``first_position + j - 1``) scores prompt token
            ``first_position + j``.
        target_token_ids: the scored prompt tokens.
    """

    request_id: str
    k: int
    hidden_start: int
    first_position: int
    target_token_ids: list[int]
