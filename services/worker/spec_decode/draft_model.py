"""Draft-model proposer for speculative decoding: a small model of the target's vocabulary
guesses the next k tokens of each request, greedily, from its own paged KV cache.

The method is speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling"): a cheap draft proposes, the target scores all proposals in one step and
keeps the longest prefix its own sampling agrees with. The draft here proposes by argmax, a
point-mass proposal ``q = delta(d)``, so lossless verification (the driver's) needs no ``q``:
accepting ``d`` with probability ``p(d) / q(d) = p(d)`` and otherwise resampling from the
residual ``(p - q)+`` is "sample ``x ~ p``, accept while ``x == d``".

KV cache: per draft layer a ``(k, v)`` pair ``[num_blocks, block_size, kv_heads, head_dim]``
(zeroed), indexed by the SAME block ids as the target's full-attention group, so the draft
lives in the blocks the scheduler already gave the request (plus ``num_lookahead_slots = k``
slots past its tokens). A request's state is what it fed itself: the token at each position
whose draft K/V is in the cache, and the block ids they went into.

One ``propose`` call for a request of ``M`` tokens ``t0 .. t(M-1)`` (``c`` = the valid prefix,
``m`` = drafts it gets, ``bs`` = block_size, table ``[W]``)::

    position      0 ... c-1 | c ... M-1      | M     M+1   ...  M+m-2  | M+m-1
    round 0       (cached)  | t_c ... t(M-1)  ->  d0 (argmax of the last row)
    round j>=1                                 | d(j-1) fed at M+j-1 -> dj
    fed?          yes       | yes            | d0 .. d(m-2)           | d(m-1): never fed
    slot(p)       = table[p // bs] * bs + p % bs      (all p <= M+m-2 <= W*bs-1)
    seq_len       round 0: M;  round j: M + j          (context including the fed token)
    m             = min(k, W*bs - M + 1)               (0: the table ends before t(M-1); skip)

Every request's round-0 chunk goes in one forward (a mixed prefill/decode batch cut by
``query_start_loc``), then round j batches the requests with ``m > j``, one token each: at most
``k`` forwards a call, whatever the batch. The drafts stay on the device between rounds (the
host reads them once, at the end).

The valid prefix ``c`` is derived at the next call, not told: the leading positions where the
fed token equals the request's token there now and the block id is unchanged (so accepted
drafts are kept, a rejected draft and all after it are recomputed), capped at ``M - 1`` so the
last token is always fed (its logits give ``d0``)::

    last call   fed  t0 .. t(M-1) d0 d1 d2          (m = 4: d3 not fed)
    verified    now  t0 .. t(M-1) d0 d1 x           (2 accepted, x != d2 sampled)
    this call   c = M + 2; feed [x] at M+2          (d2's K/V at M+2 is overwritten)

NOTE: a new or resumed request starts from 0 (``drop``): a prefix-cache hit gives it blocks
whose target K/V is there but whose draft K/V may not be (the request that computed them may
never have drafted), so the draft recomputes its whole prompt; rewriting a shared block's
draft K/V writes the same values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from services.common.step import StepInput
from services.worker.attention import AttentionBackend, AttentionMetadata
from services.worker.loader import load_model

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _DraftState:
    """What one request fed the draft so far.

    Attributes:
        fed: ``[L]`` int32, the token fed at each position ``0 .. L-1`` (real tokens, then the
            drafts ``d0 .. d(m-2)`` of the last call): their draft K/V is in the cache.
        table: ``[ceil(L / block_size)]`` int32, the block ids they were written into.
    """

    fed: np.ndarray
    table: np.ndarray


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class DraftModelProposer:
    """Greedy drafts from a small model with its own paged KV cache (module docstring).

    Args:
        model: the draft's transformers folder or ``.gguf`` file (``load_model``).
        dtype / device / backend / batch_invariant: as the target's (the draft runs
            eagerly, on one rank; ``load_model``).
        block_size: tokens per KV block (the target's).
        target_vocab_size: the target's logits width; the draft's must equal it.

    Attributes:
        bytes_per_block: the draft's K + V bytes per KV block over all its layers,
            ``2 * layers * block_size * kv_heads * head_dim * itemsize``.
        kv_caches: per draft layer its ``(k, v)`` pair (empty until ``allocate_kv_cache``).

    Raises:
        ValueError: the draft's vocabulary size is not ``target_vocab_size``, it has
            sliding-window layers (full attention only), or ``load_model``'s errors.
        FileNotFoundError: no such model.
    """

    def __init__(self, model: str, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, block_size: int, target_vocab_size: int,
                 batch_invariant: bool = False) -> None:
        self.model, _, info = load_model(model, dtype, device, backend,
                                         batch_invariant=batch_invariant)
        if info.vocab_size != target_vocab_size:
            raise ValueError(f"draft model {info.name}: vocabulary of {info.vocab_size} tokens, "
                             f"the target's has {target_vocab_size}; speculative decoding "
                             "needs the same vocabulary")
        cfg = self.model.config
        windows = list(cfg.sliding_windows)
        if any(windows):
            raise ValueError(f"draft model {info.name}: sliding-window layers (windows "
                             f"{sorted(set(windows))}, 0 = full); a draft model must use full "
                             "attention on every layer")
        self.device, self.dtype, self.block_size = torch.device(device), dtype, block_size
        self.vocab_size = info.vocab_size
        self.num_layers = len(self.model.layers)
        self.num_kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        self.bytes_per_block = (2 * self.num_layers * block_size * self.num_kv_heads
                                * self.head_dim * dtype.itemsize)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._states: dict[str, _DraftState] = {}
        log.info("draft model %s: %d layers, %d KV heads x %d, %d bytes per KV block",
                 info.name, self.num_layers, self.num_kv_heads, self.head_dim,
                 self.bytes_per_block)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Zeroed K and V ``[num_blocks, block_size, kv_heads, head_dim]`` per draft layer
        (zeros: kernels that load whole blocks must not meet NaN garbage). Forgets every
        request's state (their K/V is gone)."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.num_layers)]
        self._states.clear()

    def drop(self, request_id: str) -> None:
        """Forget ``request_id``'s state (finished, or new/resumed: recomputed from 0)."""
        self._states.pop(request_id, None)

    def drop_stale(self, step: StepInput) -> None:
        """Forget the state of the requests ``step`` invalidates: finished, sent anew, or
        resumed from preemption (their blocks were freed and given out again)."""
        for request_id in [*step.finished_request_ids, *(r.request_id for r in step.new_requests),
                           *(c.request_id for c in step.cached_requests
                             if c.resumed_from_preemption)]:
            self.drop(request_id)

    def _valid_prefix(self, request_id: str, tokens: np.ndarray, table: np.ndarray) -> int:
        """Leading positions of ``tokens`` whose draft K/V is in the cache: fed with the same
        token into the same block; at most ``len(tokens) - 1``."""
        state = self._states.get(request_id)
        if state is None:
            return 0
        valid = _common_prefix(state.fed, tokens)
        blocks = _common_prefix(state.table, table)
        return min(valid, blocks * self.block_size, len(tokens) - 1)

    @torch.inference_mode()
    def propose(self, request_ids: list[str], token_ids: list[np.ndarray],
                block_tables: list[np.ndarray], k: int) -> list[list[int]]:
        """Up to ``k`` greedy drafts following each request's tokens.

        Args:
            request_ids: the ``B`` requests.
            token_ids: per request its whole token list, ``[M_i]`` int32 (``M_i >= 1``).
            block_tables: per request ``[W_i]`` int32, the block ids covering its positions
                (the target's full-attention group's table, lookahead blocks included).
            k: drafts wanted per request (>= 0).
        Returns:
            Per request its ``m_i = min(k, W_i * block_size - M_i + 1)`` drafts (``[]`` when
            ``m_i <= 0``: no slot for them); no K/V is written past a request's table.
        Raises:
            RuntimeError: ``allocate_kv_cache`` was not called.
        """
        out: list[list[int]] = [[] for _ in request_ids]
        if k <= 0 or not request_ids:
            return out
        if not self.kv_caches:
            raise RuntimeError("DraftModelProposer.propose before allocate_kv_cache")
        bs = self.block_size
        live, lens, starts, counts, tables, seqs = [], [], [], [], [], []
        for i, (rid, tokens, table) in enumerate(
                zip(request_ids, token_ids, block_tables, strict=True)):
            tokens = np.asarray(tokens, dtype=np.int32)
            table = np.asarray(table, dtype=np.int32)
            m = min(k, len(table) * bs - len(tokens) + 1)
            if len(tokens) == 0 or m <= 0:
                continue
            live.append(i)
            seqs.append(tokens)
            lens.append(len(tokens))
            starts.append(self._valid_prefix(rid, tokens, table))
            counts.append(m)
            tables.append(table)
        if not live:
            return out
        n = len(live)
        seq_lens = np.array(lens, dtype=np.int64)  # [N] M_i
        start = np.array(starts, dtype=np.int64)  # [N] c_i
        m_i = np.array(counts, dtype=np.int64)  # [N]
        width = max(len(t) for t in tables)
        table_np = np.zeros((n, width), dtype=np.int32)  # [N, width] zero padded
        for r, t in enumerate(tables):
            table_np[r, :len(t)] = t
        table_t = self._to_device(table_np)
        drafts = torch.zeros((n, int(m_i.max())), dtype=torch.int64, device=self.device)

        # round 0: each request's unseen real tokens [c_i, M_i) as one chunk
        chunk = seq_lens - start  # [N] >= 1
        cu = np.cumsum(chunk)
        rows = np.repeat(np.arange(n), chunk)  # [T] the request of each token
        positions = np.arange(int(cu[-1])) - np.repeat(cu - chunk, chunk) + start[rows]  # [T]
        input_ids = np.concatenate([t[c:] for t, c in zip(seqs, starts, strict=True)]
                                   ).astype(np.int64)  # [T]
        drafts[:, 0] = self._step(self._to_device(input_ids), rows, positions, table_np, table_t,
                                  seq_lens, chunk, cu - 1)
        # rounds j >= 1: d(j-1) at position M_i + j - 1, for the requests with m_i > j
        for j in range(1, int(m_i.max())):
            act = np.flatnonzero(m_i > j)  # [A]
            act_t = self._to_device(act)
            ones = np.ones(len(act), dtype=np.int64)
            drafts[act_t, j] = self._step(
                drafts[act_t, j - 1], np.arange(len(act)), seq_lens[act] + j - 1,
                table_np[act], table_t[act_t], seq_lens[act] + j, ones, np.arange(len(act)))

        result = drafts.tolist()
        for r, i in enumerate(live):
            m = counts[r]
            out[i] = result[r][:m]
            fed_len = lens[r] + m - 1  # real tokens, then d0 .. d(m-2)
            fed = np.empty(fed_len, dtype=np.int32)
            fed[:lens[r]] = seqs[r]
            fed[lens[r]:] = out[i][:m - 1]
            self._states[request_ids[i]] = _DraftState(fed, tables[r][:-(-fed_len // bs)].copy())
        return out

    def _step(self, input_ids: torch.Tensor, rows: np.ndarray, positions: np.ndarray,
              table_np: np.ndarray, table_t: torch.Tensor, seq_lens: np.ndarray,
              query_lens: np.ndarray, last_rows: np.ndarray) -> torch.Tensor:
        """One draft forward over ``T`` tokens of ``R`` requests; argmax at ``last_rows``.

        Args:
            input_ids: ``[T]`` int64 on the device.
            rows / positions: ``[T]`` int64, each token's request (0..R-1) and position.
            table_np / table_t: ``[R, width]`` int32 block tables (host / device).
            seq_lens / query_lens: ``[R]`` int64, context incl. this step / tokens this step.
            last_rows: ``[R]`` int64, the hidden row of each request's last token.
        Returns:
            ``[R]`` int64 argmax token ids, on the device.
        """
        bs = self.block_size
        slots = table_np[rows, positions // bs].astype(np.int64) * bs + positions % bs  # [T]
        query_start_loc = np.zeros(len(seq_lens) + 1, dtype=np.int32)
        query_start_loc[1:] = np.cumsum(query_lens)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots), block_tables=table_t,
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            query_start_loc=self._to_device(query_start_loc),
            max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()))
        hidden = self.model(input_ids, self._to_device(positions.astype(np.int64)),
                            self.kv_caches, [meta] * self.num_layers)  # [T, E]
        logits = self.model.compute_logits(hidden[self._to_device(last_rows)])  # [R, V] fp32
        return logits.argmax(dim=-1)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.to(self.device) if self.device.type != "cpu" else tensor
