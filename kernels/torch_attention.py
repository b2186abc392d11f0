"""Paged attention and KV-cache write in batched torch: the CPU production path.

No Python loop over requests. A step's attention is planned once per sliding window
(``plan_paged_attention``, all the index arithmetic) and every layer with that window reuses
the plan:

1. split the sequences into decode (``query_len == 1``) and prefill (``query_len > 1``: prompts,
   chunked-prefill chunks, prefix-cache hits), and bucket each so that padding stays bounded:
   decode by number of keys (at most ``DECODE_PADDING_FACTOR`` times the real keys), prefill by
   ``query_len`` (at most ``MAX_PADDING_FACTOR`` times the real query rows);
2. per layer and bucket, gather the K/V through the block tables into padded
   ``[b, S, Hkv, D]`` tensors with one ``index_select`` each, into a reused workspace (keys
   past ``seq_len`` read the sequence's first gathered key, which is always written, so
   padding is finite and masked); with a sliding window only the keys some query's window
   holds are gathered;
3. run ONE ``scaled_dot_product_attention`` call per bucket: decode with a key-padding mask,
   prefill with key padding plus causal with per-row offset ``context_len`` (and the sliding
   window, if any); GQA by ``enable_gqa`` (or, for 16-bit decode, by packing the G query heads
   of a KV head as G query rows);
4. write the rows back into the flat ``[num_tokens, num_heads, head_dim]`` output.

The index arithmetic (context_len / query_len / seq_len) is drawn in ``kernels/__init__.py``.

NOTE: SDPA is used, not hand-written matmul + softmax, so the numbers are those of
transformers' own SDPA attention: on CPU both land in the same fused flash kernel. For a batch of
one sequence the result is bitwise identical to ``sdpa(q, k, v, is_causal=True)``; padding the
keys of shorter sequences in a bucket can move results by about 1 ulp.

NOTE: on CPU the gather and SDPA of a decode step are memory-bound: the time follows the padded
K/V size, ``sum over buckets of b * S``, which bucketing keeps near the real one.
"""

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.kv_quant import dequantize_kv, is_quantized, quantize_kv


def torch_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write each token's K/V into its slot ``block_id * block_size + offset``; slot < 0 = skip.

    Values are cast to the cache dtype, or quantized for an int8 / float8 cache
    (``kernels.kv_quant``; an int8 cache's rows are ``head_dim + 1`` wide). Slots must be unique
    (the scheduler guarantees it). The caches may have any strides (e.g. halves of one combined
    K/V tensor).
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    valid = slots >= 0
    # NOTE: boolean indexing only when padding is present: the common step has none.
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    blocks, offsets = slots // block_size, slots % block_size
    if is_quantized(k_cache.dtype):
        key, value = quantize_kv(key, k_cache.dtype), quantize_kv(value, v_cache.dtype)
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


_workspaces = threading.local()


def _workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of ``numel`` elements, reused across calls per (thread, name, dtype).

    NOTE: the padded K/V gathers are tens of MB per layer and step. Fresh CPU allocations of that
    size are new mmap pages that the kernel must fault in and zero on every call, which cost
    several times the copy itself; reusing one buffer (grown, never shrunk; about
    ``2 * max_num_seqs * max_seq_len * num_kv_heads * head_dim`` elements at most, which is
    the transient peak anyway) avoids that. Per thread, so concurrent forwards don't share.
    Callers must not return views of it. CPU only: CUDA's caching allocator needs no help, and
    a buffer shared across CUDA streams would race.
    """
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    if not hasattr(_workspaces, "buffers"):
        _workspaces.buffers = {}
    # NOTE: keyed by inference mode too: a buffer made under torch.inference_mode() is an
    # inference tensor, which may not be written in place outside it (a test calling the kernel
    # directly after a forward under inference mode in the same thread failed that way).
    key = (name, dtype, torch.is_inference_mode_enabled())
    buf = _workspaces.buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = _workspaces.buffers[key] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _gather_kv(
    name: str,  # workspace name ("k" or "v")
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim(+2)]
    slots: torch.Tensor,  # [n, max_seq_len] int64 slot of every key position
    dtype: torch.dtype,  # the query's: a quantized cache's rows are dequantized to it
) -> torch.Tensor:
    """Padded K or V of n sequences: ``[n, num_kv_heads, max_seq_len, head_dim]`` in ``dtype``,
    a strided view of the workspace ``name`` (or, for an int8 / float8 cache, of a new
    dequantized tensor), valid until the next gather into it."""
    num_blocks, block_size, num_kv_heads, row = cache.shape
    n, seq_len = slots.shape
    out = _workspace(name, n * seq_len * num_kv_heads * row, cache.dtype, cache.device)
    out = out.view(n * seq_len, num_kv_heads, row)
    if cache.stride(0) == block_size * cache.stride(1):
        # NOTE: one index_select over [num_slots, Hkv, D] rows is several times faster on CPU
        # than advanced indexing with (block, offset) pairs; the latter serves any other layout.
        flat = cache.view(num_blocks * block_size, num_kv_heads, row)
        torch.index_select(flat, 0, slots.flatten(), out=out)
    else:
        flat_slots = slots.flatten()
        out.copy_(cache[flat_slots // block_size, flat_slots % block_size])
    if is_quantized(cache.dtype):
        out = dequantize_kv(out, dtype)
    return out.view(n, seq_len, num_kv_heads, out.shape[-1]).transpose(1, 2)


def torch_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context + query tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    plan: "AttentionPlan | None" = None,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Causal paged attention of each sequence's query tokens over its context.

    ``sliding_window`` ``W``: 0 = full causal attention (the query at position ``p`` attends
    keys ``0 .. p``); ``W > 0`` = sliding-window attention (Beltagy et al. 2020, "Longformer";
    Jiang et al. 2023, "Mistral 7B"): keys ``max(0, p - W + 1) .. p`` (W keys, itself
    included; transformers' ``kv_idx > q_idx - W``). Only keys from ``max(0, context_len - W +
    1)`` on are gathered, so block-table entries of blocks wholly before every query's window
    (block ``j`` with ``(j + 1) * block_size <= context_len - W + 1``) are never read: they may
    hold -1 or any id.

    Returns ``out: [num_tokens, num_heads, head_dim]`` in ``query.dtype`` (SDPA accumulates in
    fp32 for bf16/fp16 inputs). Rows of tokens past ``query_start_loc[-1]`` (padding) are zero.

    ``plan`` is ``plan_paged_attention``'s result for these same metadata tensors and this
    ``sliding_window``; the model builds it once per step and window, and every layer with that
    window reuses it (built here when None).

    Requires ``max_query_len >= max(query_len)``, ``max_seq_len >= max(seq_len)``,
    ``block_tables.shape[1] * block_size >= max_seq_len``, every ``seq_len >= query_len >= 1``
    for sequences in the batch; unused block-table entries may hold anything. Raises
    ``ValueError`` if ``num_heads`` is not a multiple of ``num_kv_heads``, ``sliding_window <
    0`` or ``plan`` was made for another window.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if plan is None:
        plan = plan_paged_attention(block_tables, seq_lens, query_start_loc, max_query_len,
                                    max_seq_len, k_cache.shape[1], sliding_window)
    elif plan.sliding_window != sliding_window:
        raise ValueError(f"plan made for sliding_window {plan.sliding_window}, "
                         f"called with {sliding_window}")
    gqa = num_heads != num_kv_heads
    # NOTE: rows of padding tokens (past query_start_loc[-1]) are zeroed; a pure-decode step
    # without padding writes every row and skips the fill.
    full_decode = max_query_len == 1 and num_tokens == seq_lens.shape[0]
    out = torch.empty_like(query) if full_decode else torch.zeros_like(query)
    for group in plan.decode:
        # Decode group: one query row per sequence against all its keys; mask = key padding.
        k = _gather_kv("k", k_cache, group.slots, query.dtype)  # [b, Hkv, S, D]
        v = _gather_kv("v", v_cache, group.slots, query.dtype)
        q = query[group.rows]  # [b, H, D]
        if gqa and query.dtype != torch.float32:
            # NOTE: 16-bit: the G query heads of a KV head become G query rows of that head
            # ("pack GQA", as transformers does for batched decode): CPU flash attention then
            # reads each K/V head once instead of G times, ~4x faster in bf16. At fp32 the speed
            # is the same and enable_gqa matches transformers' unbatched decode bit for bit.
            q = q.view(q.shape[0], num_kv_heads, num_heads // num_kv_heads, head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
        else:
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), k, v, attn_mask=group.mask, scale=scale, enable_gqa=gqa
            )  # [b, H, 1, D]
        out[group.rows] = o.reshape(q.shape[0], num_heads, head_dim)
    for group in plan.prefill:
        # Prefill group: ONE SDPA call over padded [b, H, max_query_len, D] query rows.
        k = _gather_kv("k", k_cache, group.slots, query.dtype)  # [b, Hkv, S, D]
        v = _gather_kv("v", v_cache, group.slots, query.dtype)
        o = F.scaled_dot_product_attention(
            query[group.rows].transpose(1, 2), k, v, attn_mask=group.mask, scale=scale,
            enable_gqa=gqa,
        )  # [b, H, Lq, D]
        out[group.rows[group.q_valid]] = o.transpose(1, 2)[group.q_valid]
    return out


@dataclass(slots=True)
class AttentionGroup:
    """Sequences that share one SDPA call: their rows padded to a common shape.

    Attributes:
        rows: decode ``[b]`` int64, the token row of each sequence's query; prefill ``[b, Lq]``
            int64, the token row of each padded query row (padding repeats the first row).
        slots: ``[b, S]`` int64, the KV-cache slot of each gathered key: key ``k`` of a
            sequence is position ``first + k`` (``first`` = its first query's window start, 0
            without a sliding window); keys past its ``seq_len`` read position ``first``
            (always written, so finite, and masked).
        mask: ``[b, 1, 1, S]`` (decode: key padding) or ``[b, 1, Lq, S]`` (prefill: causal with
            the row's ``context_len`` offset, the sliding window if any, plus key padding)
            bool, True = attend.
        q_valid: prefill ``[b, Lq]`` bool, the real query rows; None for decode.
    """

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    q_valid: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionPlan:
    """A step's attention work for ``torch_paged_attention``, computed once per step (all the
    index arithmetic; only the K/V gathers and SDPA calls are left per layer).

    Attributes:
        decode: groups of sequences with ``query_len == 1``, bucketed by their number of keys.
        prefill: groups of sequences with ``query_len > 1``, bucketed by ``query_len``.
        sliding_window: the window the plan was made for (0 = full causal attention); the
            plan's key ranges and masks hold for that window only.
    """

    decode: list[AttentionGroup]
    prefill: list[AttentionGroup]
    sliding_window: int = 0


# A bucket of decode sequences gathers and attends at most this many times its real keys.
DECODE_PADDING_FACTOR = 1.25
# A prefill bucket computes at most this many times its real query rows.
MAX_PADDING_FACTOR = 2


def plan_paged_attention(
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    block_size: int,
    sliding_window: int = 0,
) -> AttentionPlan:
    """Split a step's sequences into SDPA groups and compute their rows, key slots and masks.

    Each sequence gathers only the keys some query of it attends: positions ``first ..
    seq_len - 1`` with ``first = max(0, context_len - sliding_window + 1)`` for a sliding
    window (``0`` = full causal attention, ``first = 0``); see ``torch_paged_attention``.
    Block-table entries of blocks wholly before ``first`` are never read.

    Decode sequences (``query_len == 1``) are bucketed by their number of keys: one padded call
    over a batch whose contexts run from 32 to 800 tokens would gather and attend ~1.8x the real
    keys (the K/V gather and SDPA are memory-bound on CPU, so time follows the padded size).
    Prefill sequences are bucketed by ``query_len`` (``_buckets`` with ``MAX_PADDING_FACTOR``).
    Each group's keys are cut to its member with the most keys.

    NOTE: the lengths are read on the host (``tolist``), a sync on CUDA and free on CPU; this is
    the CPU path.

    Raises:
        ValueError: ``sliding_window < 0``.
    """
    if sliding_window < 0:
        raise ValueError(f"sliding_window {sliding_window} < 0")
    device = block_tables.device
    seq_lens = seq_lens.long()
    qsl = query_start_loc.long()
    query_lens = qsl[1:] - qsl[:-1]  # [num_seqs]
    context_lens = seq_lens - query_lens
    if sliding_window:
        first = (context_lens - sliding_window + 1).clamp(min=0)  # [num_seqs]
    else:
        first = torch.zeros_like(seq_lens)
    num_keys = seq_lens - first  # [num_seqs]
    # Key k of sequence i sits at position first[i] + k, slot block_tables[i, pos // block_size]
    # * block_size + pos % block_size. Keys k >= num_keys (padding) read the sequence's position
    # first[i] (always written, in its window, so finite) instead of whatever an unused or
    # out-of-window table entry or an unwritten slot holds.
    max_keys = min(max_seq_len, max_query_len + sliding_window - 1) if sliding_window \
        else max_seq_len
    k = torch.arange(max(max_keys, 1), device=device)  # [S]
    key_valid = k[None, :] < num_keys[:, None]  # [num_seqs, S]
    key_pos = first[:, None] + torch.where(key_valid, k[None, :], 0)  # [num_seqs, S]
    key_slots = (block_tables.gather(1, key_pos // block_size).long() * block_size
                 + key_pos % block_size)  # [num_seqs, S]

    n_keys, q_lens = num_keys.tolist(), query_lens.tolist()
    decode_idx = [i for i, q in enumerate(q_lens) if q == 1]
    prefill_idx = [i for i, q in enumerate(q_lens) if q > 1]
    starts = qsl[:-1]
    decode = []
    for members in _buckets(decode_idx, n_keys, DECODE_PADDING_FACTOR):
        # a decode query at position seq_len - 1 attends every gathered key: mask = key padding
        idx = torch.tensor(members, device=device)
        s = max(n_keys[i] for i in members)
        decode.append(AttentionGroup(rows=starts[idx], slots=key_slots[idx, :s],
                                     mask=key_valid[idx, None, None, :s]))
    prefill = []
    for members in _buckets(prefill_idx, q_lens, MAX_PADDING_FACTOR):
        idx = torch.tensor(members, device=device)
        lq, s = max(q_lens[i] for i in members), max(n_keys[i] for i in members)
        j = torch.arange(lq, device=device)  # [Lq]
        q_valid = j[None, :] < query_lens[idx, None]  # [b, Lq]
        # Padded query rows j >= query_len read the row's first token and sit at the row's last
        # position, so they see valid keys (no all-masked row, no NaN); their output is dropped.
        rows = starts[idx, None] + torch.where(q_valid, j, 0)  # [b, Lq]
        q_pos = context_lens[idx, None] + torch.minimum(j[None, :], query_lens[idx, None] - 1)
        kp = key_pos[idx, None, :s]  # [b, 1, S] position of each key
        mask = (kp <= q_pos[:, :, None]) & key_valid[idx, None, :s]  # [b, Lq, S]
        if sliding_window:
            mask &= kp > q_pos[:, :, None] - sliding_window
        prefill.append(AttentionGroup(rows=rows, slots=key_slots[idx, :s], mask=mask[:, None],
                                      q_valid=q_valid))
    return AttentionPlan(decode, prefill, sliding_window)


def _buckets(indices: list[int], lengths: list[int], factor: float) -> list[list[int]]:
    """Group ``indices`` into buckets padded to their longest member's length.

    Sorted by ``lengths[i]`` (longest first), an index joins the current bucket while
    ``longest * members <= factor * sum(member lengths)``, i.e. the padded work stays within
    ``factor`` times the real work.

    Returns:
        the buckets, each a list of indices (every index exactly once).
    """
    order = sorted(indices, key=lambda i: -lengths[i])
    out, start = [], 0
    while start < len(order):
        longest, total, end = lengths[order[start]], 0, start
        while end < len(order) and longest * (end - start + 1) <= factor * (
                total + lengths[order[end]]):
            total += lengths[order[end]]
            end += 1
        out.append(order[start:end])
        start = end
    return out
