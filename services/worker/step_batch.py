"""One step's batch as the InputBatch hands it out: ``ScheduledBatch``, the requests
``InputBatch.update`` scheduled, and ``PreparedStep``, the device tensors ``InputBatch.prepare``
gathered for them from their rows (what ``model_runner`` runs the model and samples on).

Shapes: ``B`` requests scheduled, ``T`` tokens computed, ``S`` requests sampled, ``L`` logits
rows sampled (``S`` plus each sampled request's drafts), ``C`` of them constrained by a
grammar, ``D`` drafts in all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.worker.attention import AttentionMetadata
from services.worker.sample.compute_logprobs import PromptChunk
from services.worker.sample.sampler import SamplingTensors
from services.worker.sample.structured_output_masks import RequestGrammar


@dataclass(slots=True)
class ScheduledBatch:
    """The requests one step computes, in order (new, then cached), as parallel arrays.

    Attributes:
        request_ids: the ``B`` request ids.
        rows: ``[B]`` int64, their rows of the InputBatch.
        num_computed_tokens / num_scheduled_tokens: ``[B]`` int64 (every one > 0 scheduled).
        num_spec: ``[B]`` int64, the draft tokens each verifies (speculative decoding), written
            after its token list; None when no request of the step has drafts.
    """

    request_ids: list[str]
    rows: np.ndarray
    num_computed_tokens: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_spec: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.request_ids)

    def check_held(self, num_tokens: np.ndarray, num_blocks: np.ndarray, block_size: int
                   ) -> np.ndarray:
        """Check that each request holds the tokens it schedules (one verifying drafts: its
        last token and every draft) and the blocks for them, given what its row holds
        (``num_tokens``, ``num_blocks [B]`` int64); returns ``[B]`` int64, the tokens each
        holds, its drafts included.

        Raises:
            ValueError: a request schedules tokens it does not have or lacks blocks for them.
        """
        computed, spec = self.num_computed_tokens, self.num_spec  # [B], [B] or None
        ends = computed + self.num_scheduled_tokens  # [B]
        held = num_tokens if spec is None else num_tokens + spec  # [B] tokens and drafts
        bad = np.flatnonzero((computed < 0) | (ends > held))
        if len(bad):
            i = bad[0]
            raise ValueError(f"request {self.request_ids[i]!r}: tokens [{computed[i]}, "
                             f"{ends[i]}) scheduled but it holds {held[i]}")
        if spec is not None:
            bad = np.flatnonzero((spec > 0) & ((computed != num_tokens - 1) | (ends != held)))
            if len(bad):
                i = bad[0]
                raise ValueError(f"request {self.request_ids[i]!r}: {spec[i]} drafts need "
                                 f"its last token and the drafts scheduled ([{num_tokens[i] - 1},"
                                 f" {held[i]})), got [{computed[i]}, {ends[i]})")
        need = -(-ends // block_size)  # [B] blocks
        bad = np.flatnonzero(need > num_blocks)
        if len(bad):
            i = bad[0]
            raise ValueError(f"request {self.request_ids[i]!r}: {ends[i]} tokens need "
                             f"{need[i]} blocks, block table has {num_blocks[i]}")
        return held


@dataclass(slots=True)
class PreparedStep:
    """Device tensors of one step.

    Attributes:
        input_ids / positions: ``[T]`` int64.
        attn_metadata: the attention kernels' inputs, one per KV cache group (each its own
            ``slot_mapping`` and ``block_tables``; ``seq_lens`` / ``query_start_loc`` shared).
        logits_indices: ``[L]`` int64 rows of the hidden states to sample from: one per
            sampled request, ``1 + d`` for one verifying ``d`` drafts (``L = S`` without).
        sampled_request_ids: the ``S`` request ids, in row order.
        sampled_rows: ``[S]`` int64, their rows of the InputBatch (``append_sampled``).
        sampling_tensors: per-logits-row sampling parameters of the ``L`` rows (``grammar`` not yet
            set); a request's row repeated per position.
        grammar_rows: ``[C]`` int64, which of the ``L`` logits rows a grammar constrains
            (those requests never have drafts).
        grammars: their ``C`` matchers' states.
        num_logprobs: per logits row, the top logprobs it asked for (0..20 from a client, up
            to the vocabulary for a beam's candidates), or None for none.
        prompt_chunks: the prompt positions scored this step (requests with prompt_logprobs).
        num_drafts: ``[S]`` int64, drafts each sampled request verifies; None when none does
            (then ``L = S`` and logits row i is request i's).
        drafts: ``[D]`` int64, those drafts, request by request (empty when none).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[AttentionMetadata]
    logits_indices: torch.Tensor
    sampled_request_ids: list[str]
    sampled_rows: np.ndarray
    sampling_tensors: SamplingTensors
    num_logprobs: list[int | None]
    prompt_chunks: list[PromptChunk]
    grammar_rows: np.ndarray
    grammars: list[RequestGrammar]
    num_drafts: np.ndarray | None = None
    drafts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
