"""Paged attention and KV-cache write in batched torch: the CPU production path.

No Python loop over requests. One step of ``torch_paged_attention``:

1. gather every sequence's K/V through its block table into padded ``[B, max_seq_len, Hkv, D]``
   tensors with one ``index_select`` each, into a reused workspace (positions past ``seq_len``
   read the sequence's own token 0, which is always written, so padding is finite and masked);
2. split the sequences into the decode group (``query_len == 1``) and the prefill group
   (``query_len > 1``: prompts, chunked-prefill chunks, prefix-cache hits);
3. run the decode group as ONE ``scaled_dot_product_attention`` call with a boolean key-padding
   mask, and the prefill group as one such call per bucket of similar query lengths (padding
   at most doubles a bucket's query rows; mask = key padding plus causal with per-row offset
   ``context_len``); GQA by ``enable_gqa``
   (or, for 16-bit decode, by packing the G query heads of a KV head as G query rows);
4. write the rows back into the flat ``[num_tokens, num_heads, head_dim]`` output.

The index arithmetic (context_len / query_len / seq_len) is drawn in ``kernels/__init__.py``.

NOTE: SDPA is used, not hand-written matmul + softmax, so the numbers are those of
transformers' own SDPA attention: on CPU both land in the same fused flash kernel. For a batch of
one sequence the result is bitwise identical to ``sdpa(q, k, v, is_causal=True)``; padding the
keys of shorter sequences in a mixed batch can move results by about 1 ulp.

NOTE: splitting the groups uses ``nonzero`` (a host sync on CUDA, free on CPU). A pure-decode
step (``max_query_len == 1``) skips the split. The padded gather costs
``num_seqs * max_seq_len`` K/V rows, so one long sequence makes the gather of a decode batch
proportionally larger; that is the price of a single fused call per group.
"""

import threading

import torch
import torch.nn.functional as F


def torch_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write each token's K/V into its slot ``block_id * block_size + offset``; slot < 0 = skip.

    Values are cast to the cache dtype. Slots must be unique (the scheduler guarantees it).
    The caches may have any strides (e.g. halves of one combined K/V tensor).
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    valid = slots >= 0
    # NOTE: boolean indexing only when padding is present: the common step has none.
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    blocks, offsets = slots // block_size, slots % block_size
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
    key = (name, dtype)
    buf = _workspaces.buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = _workspaces.buffers[key] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _gather_kv(
    name: str,  # workspace name ("k" or "v")
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slots: torch.Tensor,  # [n, max_seq_len] int64 slot of every key position
) -> torch.Tensor:
    """Padded K or V of n sequences: ``[n, num_kv_heads, max_seq_len, head_dim]``, a strided view
    of the workspace ``name``, valid until the next gather into it."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    n, seq_len = slots.shape
    out = _workspace(name, n * seq_len * num_kv_heads * head_dim, cache.dtype, cache.device)
    out = out.view(n * seq_len, num_kv_heads, head_dim)
    if cache.stride(0) == block_size * cache.stride(1):
        # NOTE: one index_select over [num_slots, Hkv, D] rows is several times faster on CPU
        # than advanced indexing with (block, offset) pairs; the latter serves any other layout.
        flat = cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        torch.index_select(flat, 0, slots.flatten(), out=out)
    else:
        flat_slots = slots.flatten()
        out.copy_(cache[flat_slots // block_size, flat_slots % block_size])
    return out.view(n, seq_len, num_kv_heads, head_dim).transpose(1, 2)


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
) -> torch.Tensor:
    """Causal paged attention of each sequence's query tokens over its whole context.

    Returns ``out: [num_tokens, num_heads, head_dim]`` in ``query.dtype`` (SDPA accumulates in
    fp32 for bf16/fp16 inputs). Rows of tokens past ``query_start_loc[-1]`` (padding) are zero.

    Requires ``max_query_len >= max(query_len)``, ``max_seq_len >= max(seq_len)``,
    ``block_tables.shape[1] * block_size >= max_seq_len``, every ``seq_len >= query_len >= 1``
    for sequences in the batch; unused block-table entries may hold anything. Raises
    ``ValueError`` if ``num_heads`` is not a multiple of ``num_kv_heads``.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    device = query.device
    gqa = num_heads != num_kv_heads

    seq_lens = seq_lens.long()
    qsl = query_start_loc.long()
    query_lens = qsl[1:] - qsl[:-1]  # [num_seqs]

    # Key position p of sequence i has slot block_tables[i, p // block_size] * block_size +
    # p % block_size. Positions past seq_len read the sequence's token 0 (always written, so
    # finite) instead of whatever an unused table entry or an unwritten slot holds.
    key_pos = torch.arange(max_seq_len, device=device)  # [S]
    key_valid = key_pos[None, :] < seq_lens[:, None]  # [num_seqs, S]
    key_slots = block_tables[:, key_pos // block_size].long() * block_size + key_pos % block_size
    key_slots = torch.where(key_valid, key_slots, key_slots[:, :1])  # [num_seqs, S]

    # NOTE: rows of padding tokens (past query_start_loc[-1]) are zeroed; a pure-decode step
    # without padding writes every row and skips the fill.
    full_decode = max_query_len == 1 and num_tokens == num_seqs
    out = torch.empty_like(query) if full_decode else torch.zeros_like(query)
    if max_query_len == 1:
        decode, prefill = slice(None), None  # pure decode step: no split, no sync
    else:
        is_decode = query_lens == 1
        decode = is_decode.nonzero().squeeze(1)  # [Bd]
        prefill = (~is_decode).nonzero().squeeze(1)  # [Bp]

    if prefill is None or decode.numel() > 0:
        # Decode group: one query row per sequence against all its keys; mask = key padding.
        rows = qsl[:-1][decode]  # [Bd] token index of each decode row
        k = _gather_kv("k", k_cache, key_slots[decode])  # [Bd, Hkv, S, D]
        v = _gather_kv("v", v_cache, key_slots[decode])
        mask = key_valid[decode][:, None, None, :]  # [Bd, 1, 1, S]
        q = query[rows]  # [Bd, H, D]
        if gqa and query.dtype != torch.float32:
            # NOTE: 16-bit: the G query heads of a KV head become G query rows of that head
            # ("pack GQA", as transformers does for batched decode): CPU flash attention then
            # reads each K/V head once instead of G times, ~4x faster in bf16. At fp32 the speed
            # is the same and enable_gqa matches transformers' unbatched decode bit for bit.
            q = q.view(q.shape[0], num_kv_heads, num_heads // num_kv_heads, head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [Bd, Hkv, G, D]
        else:
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=gqa
            )  # [Bd, H, 1, D]
        out[rows] = o.reshape(q.shape[0], num_heads, head_dim)
    if prefill is not None and prefill.numel() > 0:
        for group, group_query_len, group_seq_len in _prefill_buckets(
                prefill, query_lens, seq_lens):
            _prefill_group(
                out, query, k_cache, v_cache, group, qsl, query_lens, seq_lens,
                key_pos[:group_seq_len], key_valid[:, :group_seq_len],
                key_slots[:, :group_seq_len], group_query_len, scale, gqa,
            )
    return out


MAX_PADDING_FACTOR = 2  # a prefill bucket computes at most this many times its real query rows


def _prefill_buckets(prefill: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor):
    """Split the prefill sequences into buckets of similar query length.

    One padded SDPA call over all of them would compute ``Bp * max_query_len`` query rows: a
    step with one 512-token chunk and thirty 32-token prompts (prefix-cache hits) would do 8x the
    work. Sequences sorted by query length (longest first) go into a bucket while its padded rows
    stay within ``MAX_PADDING_FACTOR`` times its real rows. Keys are cut to the bucket's longest
    sequence.

    Yields:
        (indices ``[b]`` int64, the bucket's max query length, its max seq_len), in tokens.
    """
    q_lens = query_lens[prefill].tolist()  # NOTE: a host sync on CUDA; free on CPU
    s_lens = seq_lens[prefill].tolist()
    order = sorted(range(len(q_lens)), key=lambda i: -q_lens[i])
    start = 0
    while start < len(order):
        longest, total, end = q_lens[order[start]], 0, start
        while end < len(order) and longest * (end - start + 1) <= MAX_PADDING_FACTOR * (
                total + q_lens[order[end]]):
            total += q_lens[order[end]]
            end += 1
        members = order[start:end]
        yield (prefill[torch.tensor(members, device=prefill.device)], longest,
               max(s_lens[i] for i in members))
        start = end


def _prefill_group(
    out, query, k_cache, v_cache, prefill, qsl, query_lens, seq_lens,
    key_pos, key_valid, key_slots, max_query_len, scale, gqa,
) -> None:
    """Rows with ``query_len > 1``: ONE SDPA call over padded ``[Bp, H, max_query_len, D]``.

    Padded query rows ``j >= query_len`` read the row's first token and sit at a position past
    the row's keys, so they see every valid key (no all-masked row, no NaN); they are discarded.
    """
    j = torch.arange(max_query_len, device=query.device)  # [Lq]
    starts = qsl[:-1][prefill]  # [Bp]
    q_lens = query_lens[prefill]  # [Bp]
    q_valid = j[None, :] < q_lens[:, None]  # [Bp, Lq]
    rows = starts[:, None] + torch.where(q_valid, j, 0)  # [Bp, Lq] token index of each query row
    q_pos = (seq_lens[prefill] - q_lens)[:, None] + j  # [Bp, Lq] position of each query row
    # causal with per-row offset context_len, plus key padding: [Bp, 1, Lq, S]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & key_valid[prefill][:, None, :]
    k = _gather_kv("k", k_cache, key_slots[prefill])  # [Bp, Hkv, S, D]
    v = _gather_kv("v", v_cache, key_slots[prefill])
    o = F.scaled_dot_product_attention(
        query[rows].transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=gqa
    )  # [Bp, H, Lq, D]
    out[rows[q_valid]] = o.transpose(1, 2)[q_valid]
