"""The pooling runner (vLLM's ``--runner pooling``): embeddings from a decoder's hidden states.

A pooling server runs every request as its prompt's forward only: the scheduler schedules the
prompt (chunked within the token budget, batched with others), the model's final norm output
(no LM head) is pooled per request into one vector when the chunk that computes the last prompt
token runs, and nothing is sampled. ``Pooler`` keeps what a request's pooling needs between its
chunks: the running float32 sum for MEAN, the first token's state for CLS, nothing for LAST
(the last chunk's last row). The flags' parsing: ``pooler_config.py``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from services.common.step import StepInput, StepOutput
from services.worker.pooler_config import PoolerConfig


def make_pooler(runner: str, pooler_config: str | None,
                default: PoolerConfig | None) -> Pooler | None:
    """The ``Pooler`` of a ``pooling`` runner (``--pooler-config`` over the checkpoint's
    ``default``), None for ``generate``.

    Raises:
        ValueError: a bad ``--pooler-config`` (checked whatever the runner), naming the field.
    """
    config = PoolerConfig.parse(pooler_config, default)
    return Pooler(config) if runner == "pooling" else None


class Pooler:
    """Pools each pooling request's hidden states across its prompt's chunks.

    Args:
        config: the pooling type and normalization.
    """

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._partial: dict[str, torch.Tensor] = {}  # MEAN: float32 sum; CLS: first state

    def step_output(self, step: StepInput, hidden: torch.Tensor, request_ids: list[str],
                    num_computed: np.ndarray, num_scheduled: np.ndarray,
                    num_tokens: np.ndarray, driver: bool) -> StepOutput:
        """The step's result: the pooled vector of every request whose chunk computed its last
        prompt token.

        Args:
            step: the step (its finished requests' partial state is dropped first).
            hidden: ``[T, E]`` the final norm's output, rows request by request in
                ``request_ids`` order, ``num_scheduled[i]`` each.
            request_ids: the ``B`` scheduled requests, in compute order.
            num_computed / num_scheduled / num_tokens: ``[B]`` int64: tokens cached before the
                step, computed in it, in the prompt.
            driver: this rank answers the step (a tp peer answers an empty result).
        Returns:
            ``StepOutput`` with ``embeddings`` (float32 ``[E]`` each) and no tokens.
        """
        for request_id in step.finished_request_ids:
            self._partial.pop(request_id, None)
        done: list[str] = []
        vectors: list[torch.Tensor] = []
        kind, start = self.config.pooling_type, 0
        for rid, c, n, total in zip(request_ids, num_computed.tolist(), num_scheduled.tolist(),
                                    num_tokens.tolist(), strict=True):
            rows = hidden[start:start + n]  # [n, E]
            start += n
            if c == 0:  # first chunk (or a recompute after preemption): start over
                self._partial.pop(rid, None)
            if kind == "MEAN":
                s = rows.float().sum(0)
                self._partial[rid] = s if c == 0 else self._partial[rid] + s
            elif kind == "CLS" and c == 0:
                self._partial[rid] = rows[0].float()
            if c + n < total:
                continue
            done.append(rid)
            vectors.append(rows[-1].float() if kind == "LAST"
                           else self._partial.pop(rid) / total if kind == "MEAN"
                           else self._partial.pop(rid))
        if not driver or not done:
            return StepOutput(step.step_id, [], [])
        pooled = torch.stack(vectors)  # [D, E] float32
        if self.config.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return StepOutput(step.step_id, done, [], embeddings=pooled.cpu().tolist())
