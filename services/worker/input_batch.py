"""The worker's per-request state and the step's model inputs built from it.

``InputBatch.update`` applies a ``StepInput`` (drop finished, store new, apply diffs) and
``InputBatch.prepare`` turns the scheduled requests into flat tensors. Index arithmetic for one
scheduled request with ``c = num_computed_tokens``, ``n = num_scheduled_tokens``::

    token list   t0 t1 ... t(c-1) | tc ... t(c+n-1) | (nothing: the scheduler sends every token)
                 <- in KV cache -> <- this step  ->
    positions                       c ... c+n-1        (rows query_start_loc[i] .. [i+1]-1)
    slot(p)      = block_ids[p // block_size] * block_size + p % block_size
    seq_len      = c + n           (context including this step's tokens)
    sampled iff  c + n == len(token list): logits row = query_start_loc[i + 1] - 1

Everything is built with numpy over all tokens at once; the only Python loops run over requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from services.worker.attention import AttentionMetadata
from services.worker.logprobs import PromptChunk
from services.worker.penalties import PenaltyTensors, TokenCounts
from services.worker.sampler import SamplingTensors
from services.worker.step_input import SamplingOptions, StepInput


@dataclass(slots=True)
class RequestState:
    """What the worker remembers about a request between steps."""

    request_id: str
    token_ids: list[int]  # prompt + every token the scheduler has sent back
    block_ids: list[int]  # block table, logical order
    sampling: SamplingOptions
    generator: torch.Generator | None  # seeded once from sampling.seed, advanced per sample
    num_prompt_tokens: int = 0  # token_ids[num_prompt_tokens:] are outputs
    counts: TokenCounts | None = None  # only when a penalty is on
    min_tokens_stop_ids: tuple[int, ...] = ()  # masked while outputs < min_tokens


@dataclass(slots=True)
class ScheduledRequest:
    state: RequestState
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(slots=True)
class PreparedStep:
    """Device tensors of one step.

    Attributes:
        input_ids / positions: ``[T]`` int64.
        attn_metadata: the attention kernels' inputs.
        logits_indices: ``[S]`` int64 rows of the hidden states to sample from.
        sampled_request_ids: the ``S`` request ids, in row order.
        sampling: per-row sampling parameters of the ``S`` rows.
        num_logprobs: per row, the top logprobs it asked for (0..20), or None for none.
        prompt_chunks: the prompt positions scored this step (requests with prompt_logprobs).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampled_request_ids: list[str]
    sampling: SamplingTensors
    num_logprobs: list[int | None]
    prompt_chunks: list[PromptChunk]


class InputBatch:
    """Per-request state of a worker, and the builder of each step's inputs.

    Args:
        device: where the step tensors go.
        block_size: tokens per KV block.
        num_kv_blocks: blocks in the cache (block ids must be below it).
        vocab_size: logits width (for top-k normalisation).
        eos_token_ids: the model's EOS ids (masked under min_tokens unless ignore_eos).
    """

    def __init__(self, device: torch.device, block_size: int, num_kv_blocks: int,
                 vocab_size: int, eos_token_ids: tuple[int, ...] | list[int] = ()) -> None:
        self.device, self.block_size = device, block_size
        self.num_kv_blocks, self.vocab_size = num_kv_blocks, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        # Held requests that use penalties / min_tokens: 0 skips those per-row passes.
        self.num_token_aware = 0

    def update(self, step: StepInput) -> list[ScheduledRequest]:
        """Apply ``step``'s diffs; return the scheduled requests in order (new, then cached).

        Raises:
            KeyError: a cached request the worker does not hold.
        """
        for request_id in step.finished_request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None and _token_aware(state):
                self.num_token_aware -= 1
        scheduled = []
        for new in step.new_requests:
            state = self._new_state(new.request_id, new.prompt_token_ids, new.block_ids,
                                    new.sampling)
            old = self.requests.get(new.request_id)
            if old is not None and _token_aware(old):
                self.num_token_aware -= 1
            self.requests[new.request_id] = state
            self.num_token_aware += _token_aware(state)
            scheduled.append(ScheduledRequest(state, new.num_computed_tokens,
                                              new.num_scheduled_tokens))
        for cached in step.cached_requests:
            state = self.requests.get(cached.request_id)
            if state is None:
                raise KeyError(
                    f"step {step.step_id}: worker holds no request {cached.request_id!r}")
            state.token_ids.extend(cached.new_token_ids)
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            scheduled.append(ScheduledRequest(state, cached.num_computed_tokens,
                                              cached.num_scheduled_tokens))
        return [s for s in scheduled if s.num_scheduled_tokens > 0]

    def _new_state(self, request_id: str, token_ids: list[int], block_ids: list[int],
                   sampling: SamplingOptions) -> RequestState:
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        # NOTE: the scheduler sends a request in full only at its first schedule, before it has
        # any output, so every token of a NewRequest is a prompt token.
        counts = (TokenCounts.create(token_ids, self.vocab_size, self.device)
                  if sampling.uses_penalties else None)
        stop_ids = ()
        if sampling.min_tokens > 0:
            eos = () if sampling.ignore_eos else self.eos_token_ids
            stop_ids = tuple(dict.fromkeys(eos + tuple(sampling.stop_token_ids)))
        return RequestState(request_id, list(token_ids), list(block_ids), sampling, generator,
                            len(token_ids), counts, stop_ids)

    def _sampling_tensors(self, rows: list[ScheduledRequest]) -> SamplingTensors:
        """The per-row sampling parameters; penalties and min_tokens only when some held
        request uses them (then one pass over the rows picks the ones that do)."""
        states = [r.state for r in rows]
        options = [s.sampling for s in states]
        penalties, mask = None, None
        if self.num_token_aware:
            pen_rows = [i for i, s in enumerate(states) if s.counts is not None]
            if pen_rows:
                for i in pen_rows:
                    states[i].counts.update(states[i].token_ids)
                penalties = PenaltyTensors.build(
                    pen_rows, [states[i].counts for i in pen_rows],
                    [options[i].repetition_penalty for i in pen_rows],
                    [options[i].presence_penalty for i in pen_rows],
                    [options[i].frequency_penalty for i in pen_rows], self.device)
            mask_rows, mask_ids = [], []
            for i, s in enumerate(states):
                if (s.min_tokens_stop_ids and len(s.token_ids) - s.num_prompt_tokens
                        < s.sampling.min_tokens):
                    mask_rows.extend([i] * len(s.min_tokens_stop_ids))
                    mask_ids.extend(s.min_tokens_stop_ids)
            mask = (mask_rows, mask_ids)
        return SamplingTensors.build(
            [o.temperature for o in options], [o.top_p for o in options],
            [o.top_k for o in options],
            {i: s.generator for i, s in enumerate(states) if s.generator is not None},
            self.vocab_size, self.device, min_p=[o.min_p for o in options],
            penalties=penalties, min_tokens_mask=mask)

    def prepare(self, scheduled: list[ScheduledRequest]) -> PreparedStep:
        """Build the flat model inputs of ``scheduled`` (non-empty).

        Raises:
            ValueError: a request schedules tokens it does not have, lacks blocks for them, or
                names a block id outside ``[0, num_kv_blocks)``.
        """
        bs = self.block_size
        for s in scheduled:
            rid, start = s.state.request_id, s.num_computed_tokens
            end = start + s.num_scheduled_tokens
            if start < 0 or end > len(s.state.token_ids):
                raise ValueError(f"request {rid!r}: tokens [{start}, {end}) scheduled but it "
                                 f"holds {len(s.state.token_ids)}")
            if -(-end // bs) > len(s.state.block_ids):
                raise ValueError(f"request {rid!r}: {end} tokens need {-(-end // bs)} blocks, "
                                 f"block table has {len(s.state.block_ids)}")
        num_sched = np.array([s.num_scheduled_tokens for s in scheduled], dtype=np.int64)  # [B]
        computed = np.array([s.num_computed_tokens for s in scheduled], dtype=np.int64)  # [B]
        num_tokens = np.array([len(s.state.token_ids) for s in scheduled], dtype=np.int64)
        query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int64)  # [B + 1]
        np.cumsum(num_sched, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        req_idx = np.repeat(np.arange(len(scheduled)), num_sched)  # [T] request of each token
        positions = np.arange(total) - query_start_loc[req_idx] + computed[req_idx]  # [T]
        input_ids = np.fromiter(
            chain.from_iterable(s.state.token_ids[s.num_computed_tokens:s.num_computed_tokens
                                                  + s.num_scheduled_tokens] for s in scheduled),
            dtype=np.int64, count=total)  # [T]
        max_blocks = max(len(s.state.block_ids) for s in scheduled)
        block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)  # [B, max_blocks]
        for i, s in enumerate(scheduled):
            block_tables[i, :len(s.state.block_ids)] = s.state.block_ids
        if block_tables.min() < 0 or block_tables.max() >= self.num_kv_blocks:
            raise ValueError(f"block ids must be in [0, {self.num_kv_blocks}), got "
                             f"[{block_tables.min()}, {block_tables.max()}]")
        slot_mapping = (block_tables[req_idx, positions // bs].astype(np.int64) * bs
                        + positions % bs)  # [T]
        seq_lens = computed + num_sched  # [B]
        is_sampled = seq_lens == num_tokens  # [B]
        logits_indices = query_start_loc[1:][is_sampled] - 1  # [S]
        rows = [s for s, keep in zip(scheduled, is_sampled.tolist()) if keep]
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            block_tables=self._to_device(block_tables),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            query_start_loc=self._to_device(query_start_loc.astype(np.int32)),
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
        )
        sampling = self._sampling_tensors(rows)
        return PreparedStep(
            input_ids=self._to_device(input_ids), positions=self._to_device(positions),
            attn_metadata=meta, logits_indices=self._to_device(logits_indices),
            sampled_request_ids=[r.state.request_id for r in rows], sampling=sampling,
            num_logprobs=[r.state.sampling.logprobs for r in rows],
            prompt_chunks=_prompt_chunks(scheduled, query_start_loc))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor


def _prompt_chunks(scheduled: list[ScheduledRequest], query_start_loc: np.ndarray
                   ) -> list[PromptChunk]:
    """The prompt tokens each prompt_logprobs request scores this step.

    Position p (hidden row ``query_start_loc[i] + p - num_computed``) predicts token p + 1, so a
    chunk computing positions [c, c + n) scores prompt tokens [c + 1, min(c + n, P - 1) + 1)::

        prompt  t0 t1 t2 t3 t4 | outputs        P = 5, chunk c = 2, n = 3
        rows          p2 p3 p4                  p2 -> t3, p3 -> t4; p4 -> output (sampled)
    """
    chunks = []
    for i, s in enumerate(scheduled):
        k, state = s.state.sampling.prompt_logprobs, s.state
        start = s.num_computed_tokens
        end = min(start + s.num_scheduled_tokens, state.num_prompt_tokens - 1)
        if k is None or end <= start:
            continue
        chunks.append(PromptChunk(state.request_id, k, int(query_start_loc[i]), start + 1,
                                  state.token_ids[start + 1:end + 1]))
    return chunks


def _token_aware(state: RequestState) -> bool:
    """The request's sampling looks at its tokens (a penalty or min_tokens)."""
    return state.counts is not None or bool(state.min_tokens_stop_ids)
