"""The worker's persistent input batch: per-request rows written once, and each step's model
inputs gathered from them (vLLM V1's ``vllm/v1/worker/gpu_input_batch.py`` idea).

A request gets a row when it arrives and gives it back when it finishes. Its row holds its token
list, block table and sampling parameters, written once, then updated from each step's diff and
from its own samples (``append_sampled``; not a beam's, whose next token the scheduler sends:
docs/architecture.md, "The step protocol"). Copy-on-write rewrites a request's tables from
``first_new_block`` (the KV copy is the model runner's)::

    row r   token_ids[r, :num_tokens[r]]       [max_num_seqs, max_model_len]  int32
            block_table[g, r, :num_blocks[r]]  [groups, max_num_seqs, max_blocks]  int32, 0 after
            sampling parameters                ``sampling_rows``
            (services/worker/sample/sampling_rows.py)
            max_blocks = ceil(max_model_len / block_size)

One block table per KV cache group, all ``num_blocks[r]`` long (block j of each covers tokens
``j * block_size .. (j + 1) * block_size - 1``); the wire's ids come group by group, and -1 is
stored as 0 (docs/architecture.md, "KV cache groups").

``InputBatch.update`` applies a ``StepInput`` (drop finished, store new, apply diffs) and
``InputBatch.prepare`` gathers the scheduled rows with numpy fancy indexing into preallocated
step buffers (``[max_num_batched_tokens]`` per token, ``[max_num_seqs + 1]`` per request; both
grow once if a step is larger than the worker was told, so the worker's flags need not match
the scheduler's). Index arithmetic for scheduled request i in row r with
``c = num_computed_tokens``, ``n = num_scheduled_tokens``::

    token_ids[r]  t0 t1 ... t(c-1) | tc ... t(c+n-1) | (nothing: a sample is appended after)
                  <- in KV cache -> <- this step  ->
    positions                        c ... c+n-1        (rows query_start_loc[i] .. [i+1]-1)
    slot_g(p)     = block_table[g, r, p // block_size] * block_size + p % block_size
    seq_len       = c + n           (context including this step's tokens)
    sampled iff   c + n == num_tokens[r]: logits row = query_start_loc[i + 1] - 1

Speculative decoding: a request verifying d drafts (``CachedRequest.spec_token_ids``) has them
written after its token list, NOT counted in ``num_tokens`` (N below), and is scheduled
``c = N - 1, n = 1 + d``; it samples all 1 + d positions (``spec_decode/verify.py`` keeps the
accepted prefix, ``append_sampled`` appends it)::

    token_ids[r]  t0 ... t(N-2) | t(N-1) d0 ... d(d-1) | (dead after verification)
    positions                      N-1    N  ...  N+d-1
    sampled iff   c + n == N + d: logits rows query_start_loc[i + 1] - 1 - d .. [i + 1] - 1,
                  each with the request's sampling parameters (row j counts j more outputs
                  for min_tokens; a seeded row draws from its generator in position order)

Python loops run only over the step's diffs (one small write per request) and the rows that
need special sampling work (``SamplingRows``; prompt logprobs); the rest is numpy.

NOTE: the worker is not told about preemptions (it only sees the resume), so it may hold more
requests than ``max_num_seqs``. When every row is taken and a request of the step needs one, a
held request not in the step gives its row up: its tokens and block ids are parked in its
``RequestState`` (``request_state.py``) and written back when it is scheduled again.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, StepInput
from services.worker.attention import AttentionMetadata
from services.worker.ragged import ragged_arange
from services.worker.request_state import RequestState
from services.worker.sample.compute_logprobs import PromptChunk
from services.worker.sample.penalties import TokenCounts
from services.worker.sample.sampling_rows import SamplingRows, rewind_generator
from services.worker.sample.structured_output_masks import RequestGrammar, StructuredOutputs
from services.worker.step_batch import PreparedStep, ScheduledBatch


class InputBatch:
    """Per-request state of a worker in preallocated rows, and the builder of each step's inputs.

    Args:
        device: where the step tensors go.
        block_size: tokens per KV block.
        num_kv_blocks: blocks in the cache (block ids must be below it; may be set later).
        vocab_size: logits width (for top-k normalisation).
        eos_token_ids: the model's EOS ids (masked under min_tokens unless ignore_eos).
        max_num_seqs: rows at start (requests of one step; grows if a step has more).
        max_model_len: tokens of one request (a hard limit).
        max_num_batched_tokens: step buffer tokens at start (grows if a step has more).
        num_kv_cache_groups: block tables per request (the wire's block ids are cut into this
            many equal parts).
        structured: the sampling rank's structured-output state; None = grammars are ignored
            (a rank that does not sample).
    """

    # The persistent rows and per-request step buffers (set by _grow_rows, see _row_arrays)
    token_ids: np.ndarray
    num_tokens: np.ndarray
    block_table: np.ndarray
    num_blocks: np.ndarray
    num_prompt_tokens: np.ndarray
    num_prompt_logprobs: np.ndarray
    _seq_lens: np.ndarray
    _query_start_loc: np.ndarray
    _logits_indices: np.ndarray

    def __init__(self, device: torch.device, block_size: int, num_kv_blocks: int,
                 vocab_size: int, eos_token_ids: tuple[int, ...] | list[int] = (), *,
                 max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 num_kv_cache_groups: int = 1,
                 structured: StructuredOutputs | None = None) -> None:
        if num_kv_cache_groups < 1:
            raise ValueError(f"num_kv_cache_groups must be >= 1, got {num_kv_cache_groups}")
        self.device, self.block_size = device, block_size
        self.num_groups = num_kv_cache_groups
        self.num_kv_blocks, self.vocab_size = num_kv_blocks, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.structured = structured
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.requests: dict[str, RequestState] = {}
        self.free_rows: list[int] = []  # pop() gives the lowest free row first
        self.row_states: list[RequestState | None] = []
        self.max_num_seqs = self.max_num_batched_tokens = 0
        self.sampling_rows = SamplingRows(vocab_size, device)  # the rows' sampling parameters
        self.block_table = np.zeros((self.num_groups, 0, self.max_blocks), dtype=np.int32)
        self._grow_rows(max_num_seqs)
        self._grow_tokens(max_num_batched_tokens)
        self._step_ids: set[str] | None = None  # the current step's request ids (evictions)

    # Persistent rows (see the module docstring): name -> (per-row shape, dtype), rows first
    # (block_table, rows second, and the sampling parameters, ``sampling_rows``, are grown
    # beside them). A free row has num_tokens = num_blocks = 0 and all-zero block tables.
    def _row_arrays(self) -> dict[str, tuple[tuple[int, ...], type]]:
        return {"token_ids": ((self.max_model_len,), np.int32), "num_tokens": ((), np.int64),
                "num_blocks": ((), np.int64), "num_prompt_tokens": ((), np.int64),
                "num_prompt_logprobs": ((), np.int64),  # -1 none
                # step buffers per request, sliced per step ([0] of query_start_loc stays 0)
                "_seq_lens": ((), np.int32), "_query_start_loc": ((), np.int32),
                "_logits_indices": ((), np.int64)}

    def _grow_rows(self, rows: int) -> None:
        """Have at least ``rows`` rows (existing rows keep their data; new ones are free).

        NOTE: sized for ``max_num_seqs`` at start; a scheduler configured for more requests per
        step than this worker was told grows it once instead of failing the step.
        """
        old = self.max_num_seqs
        if rows <= old:
            return
        for name, (shape, dtype) in self._row_arrays().items():
            extra = 1 if name == "_query_start_loc" else 0
            grown: np.ndarray = np.zeros((rows + extra, *shape), dtype=dtype)
            if old:
                grown[:old + extra] = getattr(self, name)
            setattr(self, name, grown)
        table = np.zeros((self.num_groups, rows, self.max_blocks), dtype=np.int32)
        table[:, :old] = self.block_table
        self.block_table = table
        self.sampling_rows.grow(rows)
        self.row_states.extend([None] * (rows - old))
        self.free_rows = list(range(rows - 1, old - 1, -1)) + self.free_rows
        self.max_num_seqs = rows

    def _grow_tokens(self, tokens: int) -> None:
        """Have step buffers for at least ``tokens`` tokens (``[tokens]`` int64 each).

        NOTE: step N+1 overwrites what step N's tensors view (on CPU they share memory; on
        CUDA each is copied to the device through a fresh pinned buffer). Steps run one at a
        time, the pipeline-parallel worker's too, and nothing keeps a PreparedStep past its
        step.
        """
        if tokens <= self.max_num_batched_tokens:
            return
        self._input_ids, self._positions = (np.zeros(tokens, dtype=np.int64) for _ in range(2))
        self._slot_mapping = np.zeros((self.num_groups, tokens), dtype=np.int64)  # [groups, T]
        self.max_num_batched_tokens = tokens

    def update(self, step: StepInput) -> ScheduledBatch:
        """Apply ``step``'s diffs; return the scheduled requests in order (new, then cached).

        Raises:
            KeyError: a cached request the worker does not hold.
            ValueError: a token list longer than ``max_model_len``, a block table longer than
                ``max_blocks``, a block id outside ``[-1, num_kv_blocks)``, a count of block
                ids that the number of KV cache groups does not divide, or a first_new_block
                past the end of the request's block table.
        """
        self._grow_rows(len(step.new_requests) + len(step.cached_requests))
        self._step_ids = None
        for request_id in step.finished_request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self._free(state)
        new, cached = step.new_requests, step.cached_requests
        rows = []
        for r in new:
            old = self.requests.pop(r.request_id, None)
            if old is not None:
                self._free(old)
            rows.append(self._add(r.request_id, r.prompt_token_ids, r.block_ids, r.sampling_params,
                                  step))
        append_rows, append_ids = [], []  # new token ids, written all at once below
        spec_at = []  # indices into cached of the requests with drafts
        for i, c in enumerate(cached):  # NOTE: the one Python loop over a decode step's
            # requests: keep it lean
            state = self.requests.get(c.request_id)
            if state is None:
                raise KeyError(f"step {step.step_id}: worker holds no request {c.request_id!r}")
            row = state.row if state.row >= 0 else self._unpark(state, step)
            rows.append(row)
            if c.spec_token_ids:
                spec_at.append(i)
            if c.resumed_from_preemption:
                self._replace_tokens(state, row, c.new_token_ids)
                self._write_blocks(c.request_id, row, 0, c.new_block_ids)
                continue
            if c.new_token_ids:
                append_rows.append(row)
                append_ids.append(c.new_token_ids)
            if c.first_new_block >= 0:  # copy-on-write: the tables from there are replaced
                self._write_blocks(c.request_id, row, c.first_new_block, c.new_block_ids)
            elif c.new_block_ids:
                self._write_blocks(c.request_id, row, int(self.num_blocks[row]), c.new_block_ids)
        if append_rows:
            self._append_tokens(np.array(append_rows, dtype=np.int64), append_ids)
        both = new + cached
        batch = ScheduledBatch(
            [r.request_id for r in both], np.array(rows, dtype=np.int64),
            np.array([r.num_computed_tokens for r in both], dtype=np.int64),
            np.array([r.num_scheduled_tokens for r in both], dtype=np.int64))
        if spec_at:
            batch.num_spec = self._write_drafts([cached[i] for i in spec_at],
                                                batch.rows[len(new) + np.array(spec_at)],
                                                len(new) + np.array(spec_at), len(both))
        keep = batch.num_scheduled_tokens > 0
        if not keep.all():
            kept = [i for i, k in zip(batch.request_ids, keep.tolist(), strict=True) if k]
            batch = ScheduledBatch(kept, batch.rows[keep], batch.num_computed_tokens[keep],
                                   batch.num_scheduled_tokens[keep],
                                   None if batch.num_spec is None else batch.num_spec[keep])
        return batch

    def _write_drafts(self, requests: list[CachedRequest], rows: np.ndarray, at: np.ndarray,
                      batch_size: int) -> np.ndarray:
        """Write each request's ``spec_token_ids`` after its token list (``rows [N]``, its
        rows; ``at [N]``, its indices in the step's batch), NOT counting them in
        ``num_tokens``; returns ``num_spec [batch_size]`` int64 (0 for the requests without).

        Raises:
            ValueError: drafts for a request resumed in this step, or one whose sampling
                cannot verify them (a beam, a grammar, a penalty: its tokens depend on the
                token list the drafts are not part of; the driver never proposes for those),
                or drafts that would pass ``max_model_len``.
        """
        for c in requests:
            s = self.requests[c.request_id].sampling
            if c.resumed_from_preemption or s.beam_width > 0 or s.structured_output or (
                    s.uses_penalties):
                raise ValueError(f"request {c.request_id!r}: draft tokens for a request that "
                                 "cannot verify them (resumed, a beam, a grammar or a penalty)")
        counts = np.fromiter((len(c.spec_token_ids) for c in requests), dtype=np.int64,
                             count=len(requests))  # [N]
        starts = self.num_tokens[rows]  # [N]
        too_long = np.flatnonzero(starts + counts > self.max_model_len)
        if len(too_long):
            i = too_long[0]
            raise ValueError(f"request {requests[i].request_id!r}: {counts[i]} drafts after "
                             f"{starts[i]} tokens pass max_model_len={self.max_model_len}")
        self.token_ids[np.repeat(rows, counts), ragged_arange(starts, counts)] = list(
            chain.from_iterable(c.spec_token_ids for c in requests))
        num_spec = np.zeros(batch_size, dtype=np.int64)
        num_spec[at] = counts
        return num_spec

    # ---- rows ----------------------------------------------------------------------------

    def _add(self, request_id: str, token_ids: list[int], block_ids: list[int],
             sampling: EngineSamplingParams, step: StepInput) -> int:
        """Store a new request in a row; returns the row. ``sampling`` is trusted (the router
        validated it; the servicer refuses what the sampler cannot use, ``check_sampling``)."""
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"request {request_id!r}: {len(token_ids)} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        self._check_blocks(request_id, 0, block_ids)
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        # NOTE: the scheduler sends a request in full only at its first schedule, before it has
        # any output, so every token of a NewRequest is a prompt token.
        counts = (TokenCounts.create(token_ids, self.vocab_size, self.device)
                  if sampling.uses_penalties else None)
        stop_ids: tuple[int, ...] = ()
        if sampling.min_tokens > 0:
            eos = () if sampling.ignore_eos else self.eos_token_ids
            stop_ids = tuple(dict.fromkeys(eos + sampling.stop_token_ids))
        state = RequestState(request_id, sampling, generator, len(token_ids), counts, stop_ids)
        if sampling.logit_bias:
            state.logit_bias = (np.array([t for t, _ in sampling.logit_bias], dtype=np.int64),
                                np.array([b for _, b in sampling.logit_bias], dtype=np.float32))
        if self.structured is not None and sampling.structured_output:
            state.grammar = RequestGrammar(request_id, sampling.structured_output,
                                           reasoning_end=sampling.reasoning_end_token_id)
        self.requests[request_id] = state
        row = self._bind(state, step)
        self.token_ids[row, :len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self._write_blocks(request_id, row, 0, block_ids)
        return row

    def _bind(self, state: RequestState, step: StepInput) -> int:
        """Give ``state`` a row (parking a request outside ``step`` if none is free) and write
        its sampling parameters there; returns the row."""
        if not self.free_rows:
            if self._step_ids is None:
                self._step_ids = ({r.request_id for r in step.new_requests}
                                  | {r.request_id for r in step.cached_requests})
            victim = next(s for s in self.requests.values()
                          if s.row >= 0 and s.request_id not in self._step_ids)
            row = victim.row
            victim.parked = (self.token_ids[row, :self.num_tokens[row]].copy(),
                             self.block_table[:, row, :self.num_blocks[row]].copy())
            self._free(victim)
        row = state.row = self.free_rows.pop()
        self.row_states[row] = state
        self.sampling_rows.write(row, state)
        self.num_prompt_tokens[row] = state.num_prompt_tokens
        prompt_logprobs = state.sampling.prompt_logprobs
        self.num_prompt_logprobs[row] = -1 if prompt_logprobs is None else prompt_logprobs
        return row

    def _unpark(self, state: RequestState, step: StepInput) -> int:
        """Give a parked request a row again, with its tokens and block table."""
        assert state.parked is not None  # a request without a row is parked
        token_ids, block_ids = state.parked
        row = self._bind(state, step)
        state.parked = None
        self.token_ids[row, :len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.block_table[:, row, :block_ids.shape[1]] = block_ids
        self.num_blocks[row] = block_ids.shape[1]
        return row

    def _free(self, state: RequestState) -> None:
        """Give ``state``'s row back (a no-op for a parked request), leaving it clean."""
        row, state.row = state.row, -1
        if row < 0:
            return
        self.block_table[:, row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = self.num_tokens[row] = 0
        self.row_states[row] = None
        self.free_rows.append(row)

    def _check_blocks(self, request_id: str, start: int, block_ids: list[int]
                      ) -> tuple[int, bool]:
        """Blocks per group in ``block_ids`` (the wire's group-by-group layout), checked, and
        whether any is -1."""
        n, rest = divmod(len(block_ids), self.num_groups)
        if rest:
            raise ValueError(f"request {request_id!r}: {len(block_ids)} block ids for "
                             f"{self.num_groups} KV cache groups (the same number per group, "
                             "group by group, is expected)")
        if start + n > self.max_blocks:
            raise ValueError(
                f"request {request_id!r}: {start + n} blocks, more than "
                f"ceil(max_model_len / block_size) = {self.max_blocks} (max_model_len="
                f"{self.max_model_len})")
        if not block_ids:
            return 0, False
        lo, hi = min(block_ids), max(block_ids)
        if lo < -1 or hi >= self.num_kv_blocks:
            raise ValueError(f"request {request_id!r}: block ids must be in "
                             f"[0, {self.num_kv_blocks}) or -1 (no block), got [{lo}, {hi}]")
        return n, lo < 0

    def append_sampled(self, rows: np.ndarray, token_ids: list[int] | np.ndarray,
                       counts: np.ndarray | None = None) -> None:
        """Append the tokens sampled for each of ``rows [S]`` (a step's ``sampled_rows``) to
        its token list: the next step computes them (the scheduler does not send them back).
        ``token_ids`` holds one per row, or ``counts [S]`` int64 (>= 1) per row, concatenated
        (speculative decoding: the accepted drafts and the token after them; the drafts
        beyond, still written after the list, are dead). A beam's row is skipped: the
        scheduler picks its next token among the step's candidates and sends it
        (``new_token_ids``) to every rank.

        Raises:
            ValueError: a token list would pass ``max_model_len`` (the scheduler never
                schedules that).
        """
        beams = self.sampling_rows.beam[rows]  # [S]
        if beams.any():  # (a beam never has drafts: one token each)
            keep = ~beams if counts is None else np.repeat(~beams, counts)
            rows, token_ids = rows[~beams], np.asarray(token_ids)[keep]
            counts = None if counts is None else counts[~beams]
        if not len(rows):
            return
        starts = self.num_tokens[rows]  # [S]
        ends = starts + (1 if counts is None else counts)  # [S]
        full = np.flatnonzero(ends > self.max_model_len)
        if len(full):
            raise ValueError(f"request {self.row_states[rows[full[0]]].request_id!r}: a token "
                             f"past max_model_len={self.max_model_len} was sampled")
        if counts is None:
            self.token_ids[rows, starts] = token_ids
        else:
            self.token_ids[np.repeat(rows, counts), ragged_arange(starts, counts)] = token_ids
        self.num_tokens[rows] = ends

    def _replace_tokens(self, state: RequestState, row: int, token_ids: list[int]) -> None:
        """A resumed request's whole token list (its outputs may differ from this worker's: a
        step whose result the scheduler dropped still appended here).

        Raises:
            ValueError: fewer tokens than its prompt, or more than ``max_model_len``.
        """
        if not state.num_prompt_tokens <= len(token_ids) <= self.max_model_len:
            raise ValueError(f"request {state.request_id!r} resumed with {len(token_ids)} "
                             f"tokens; it has {state.num_prompt_tokens} prompt tokens "
                             f"(max_model_len={self.max_model_len})")
        self.token_ids[row, :len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        if state.counts is not None:  # recount the outputs from scratch
            state.counts.output_counts.zero_()
            state.counts.num_counted = state.num_prompt_tokens
        if state.grammar is not None:  # its matcher replays the resumed outputs
            state.grammar.reset(token_ids[state.num_prompt_tokens:])
        if state.generator is not None:
            rewind_generator(state, len(token_ids))

    def _append_tokens(self, rows: np.ndarray, token_ids: list[list[int]]) -> None:
        """Append ``token_ids[i]`` to the token list of row ``rows[i]`` (``rows [N]`` int64)."""
        flat = list(chain.from_iterable(token_ids))
        one_each = len(flat) == len(rows)  # a decode step
        counts = 1 if one_each else np.fromiter(map(len, token_ids), dtype=np.int64,
                                                count=len(rows))  # [N]
        starts = self.num_tokens[rows]  # [N]
        ends = starts + counts
        too_long = np.flatnonzero(ends > self.max_model_len)
        if len(too_long):
            i = too_long[0]
            raise ValueError(f"request {self.row_states[rows[i]].request_id!r}: {ends[i]} tokens, "
                             f"more than max_model_len={self.max_model_len}")
        if one_each:
            self.token_ids[rows, starts] = flat
        else:
            assert isinstance(counts, np.ndarray)  # an int only when one_each
            self.token_ids[np.repeat(rows, counts), ragged_arange(starts, counts)] = flat
        self.num_tokens[rows] = ends

    def _write_blocks(self, request_id: str, row: int, start: int, block_ids: list[int]) -> None:
        """Write ``block_ids`` (``n`` per group, group by group) at ``start`` of the row's
        block tables, which end after them (``start = 0`` replaces the tables, ``start`` below
        their end replaces their tail, as copy-on-write asks; what lay beyond is zeroed). -1 is
        stored as 0.

        Raises:
            ValueError: ``start`` past the tables' end (a gap), or ``_check_blocks``' errors.
        """
        if start > self.num_blocks[row]:
            raise ValueError(f"request {request_id!r}: blocks written from table index {start}, "
                             f"past the end of its block table ({self.num_blocks[row]} blocks)")
        n, has_none = self._check_blocks(request_id, start, block_ids)
        end = start + n
        if self.num_groups == 1:
            self.block_table[0, row, start:end] = block_ids
        else:
            self.block_table[:, row, start:end] = np.reshape(block_ids, (self.num_groups, n))
        if has_none:
            tables = self.block_table[:, row, start:end]  # (a view)
            tables[tables < 0] = 0
        self.block_table[:, row, end:self.num_blocks[row]] = 0
        self.num_blocks[row] = end

    # ---- the step --------------------------------------------------------------------------

    def prepare(self, scheduled: ScheduledBatch) -> PreparedStep:
        """Gather the flat model inputs of ``scheduled`` (non-empty) from its rows.

        Raises:
            ValueError: a request schedules tokens it does not have or lacks blocks for them.
                (A step of more than ``max_num_batched_tokens`` tokens grows the buffers.)
        """
        rows, computed = scheduled.rows, scheduled.num_computed_tokens  # [B] each
        num_sched = scheduled.num_scheduled_tokens  # [B]
        ends = computed + num_sched  # [B] seq_lens
        held = scheduled.check_held(self.num_tokens[rows], self.num_blocks[rows],  # [B]
                                    self.block_size)  # (tokens and drafts)
        cu = np.cumsum(num_sched)  # [B]
        total, batch_size = int(cu[-1]), len(rows)
        self._grow_tokens(total)
        query_start_loc = self._query_start_loc[:batch_size + 1]  # [B + 1]
        query_start_loc[1:] = cu
        positions = self._positions[:total]  # [T]
        positions[:] = ragged_arange(computed, num_sched)
        token_rows = np.repeat(rows, num_sched)  # [T] the row of each token
        input_ids = self._input_ids[:total]  # [T]
        input_ids[:] = self.token_ids[token_rows, positions]
        seq_lens = self._seq_lens[:batch_size]  # [B]
        seq_lens[:] = ends
        sampled = np.flatnonzero(ends == held)  # [S] indices of the sampled requests
        sampled_rows = rows[sampled]  # [S]
        num_drafts = None if scheduled.num_spec is None else scheduled.num_spec[sampled]  # [S]
        logits_indices, logits_rows, positions_ahead, drafts = self._logits_rows(
            cu[sampled], sampled_rows, num_drafts)
        ids = scheduled.request_ids
        sr = self.sampling_rows
        grammar_rows, grammars = sr.grammars(logits_rows, self.row_states)
        return PreparedStep(
            input_ids=self._to_device(input_ids), positions=self._to_device(positions),
            attn_metadata=self._attn_metadata(scheduled, positions, token_rows, seq_lens,
                                              query_start_loc),
            logits_indices=self._to_device(logits_indices),
            sampled_request_ids=(list(ids) if len(sampled) == len(ids)
                                 else [ids[i] for i in sampled.tolist()]),
            sampled_rows=sampled_rows,
            sampling_tensors=sr.tensors(logits_rows, self.row_states, self.token_ids,
                                        self.num_tokens, self.num_prompt_tokens,
                                        positions_ahead),
            num_logprobs=sr.logprobs(logits_rows),
            prompt_chunks=self._prompt_chunks(scheduled, query_start_loc),
            grammar_rows=grammar_rows, grammars=grammars, num_drafts=num_drafts, drafts=drafts)

    def _logits_rows(self, ends: np.ndarray, sampled_rows: np.ndarray,
                     num_drafts: np.ndarray | None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """The hidden-state rows the sampled requests sample from (``ends [S]``: each one's
        query rows' end, ``cu[sampled]``): ``(logits_indices [L], logits_rows [L] (their
        InputBatch rows), positions_ahead [L] (None without drafts), drafts [D])``."""
        if num_drafts is None:  # (the plain decode / prefill step: one logits row each)
            logits_indices = self._logits_indices[:len(sampled_rows)]  # [S]
            np.subtract(ends, 1, out=logits_indices)
            return logits_indices, sampled_rows, None, np.zeros(0, np.int64)
        # a request with d drafts samples its last 1 + d positions
        per_request = num_drafts + 1  # [S]
        drafts = self.token_ids[np.repeat(sampled_rows, num_drafts), ragged_arange(
            self.num_tokens[sampled_rows], num_drafts)].astype(np.int64)  # [D]
        return (ragged_arange(ends - per_request, per_request),  # [L]
                np.repeat(sampled_rows, per_request),  # [L]
                ragged_arange(np.zeros_like(per_request), per_request), drafts)  # [L], [D]

    def _attn_metadata(self, scheduled: ScheduledBatch, positions: np.ndarray,
                       token_rows: np.ndarray, seq_lens: np.ndarray,
                       query_start_loc: np.ndarray) -> list[AttentionMetadata]:
        """One ``AttentionMetadata`` per KV cache group (``positions``, ``token_rows [T]``:
        each token's position and row), sharing ``seq_lens`` and ``query_start_loc``."""
        bs, rows, total = self.block_size, scheduled.rows, len(positions)
        seq_lens_t, query_start_loc_t = self._to_device(seq_lens), self._to_device(query_start_loc)
        max_query_len = int(scheduled.num_scheduled_tokens.max())
        max_seq_len = int(seq_lens.max())
        width = int(self.num_blocks[rows].max())
        block_index, offset = positions // bs, positions % bs  # [T] each
        metas = []
        for g in range(self.num_groups):  # (one group: the whole model's one table)
            table = self.block_table[g]  # [max_num_seqs, max_blocks]
            slot_mapping = self._slot_mapping[g, :total]  # [T]
            np.multiply(table[token_rows, block_index], bs, out=slot_mapping)
            slot_mapping += offset
            metas.append(AttentionMetadata(
                slot_mapping=self._to_device(slot_mapping),
                block_tables=self._to_device(table[rows, :width]),  # [B, width]
                seq_lens=seq_lens_t, query_start_loc=query_start_loc_t,
                max_query_len=max_query_len, max_seq_len=max_seq_len))
        return metas

    def _prompt_chunks(self, scheduled: ScheduledBatch, query_start_loc: np.ndarray
                       ) -> list[PromptChunk]:
        """The prompt tokens each prompt_logprobs request scores this step.

        Position p (hidden row ``query_start_loc[i] + p - num_computed``) predicts token p + 1,
        so a chunk computing positions [c, c + n) scores prompt tokens
        [c + 1, min(c + n, P - 1) + 1)::

            prompt  t0 t1 t2 t3 t4 | outputs        P = 5, chunk c = 2, n = 3
            rows          p2 p3 p4                  p2 -> t3, p3 -> t4; p4 -> output (sampled)
        """
        chunks = []
        for i in np.flatnonzero(self.num_prompt_logprobs[scheduled.rows] >= 0).tolist():
            row = int(scheduled.rows[i])
            start = int(scheduled.num_computed_tokens[i])
            end = min(start + int(scheduled.num_scheduled_tokens[i]),
                      int(self.num_prompt_tokens[row]) - 1)
            if end > start:
                chunks.append(PromptChunk(scheduled.request_ids[i],
                                          int(self.num_prompt_logprobs[row]),
                                          int(query_start_loc[i]), start + 1,
                                          self.token_ids[row, start + 1:end + 1].tolist()))
        return chunks

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

