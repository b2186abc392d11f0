"""Triton kernels: KV-cache write and ONE varlen paged-attention kernel for decode and prefill.

The contract (context_len / query_len / seq_len, cache layout) is drawn in ``kernels/__init__.py``.
Algorithms: PagedAttention (Kwon et al., SOSP 2023) for reading K/V through the block table;
FlashAttention-2 (Dao, 2023) online softmax: one pass over the keys, a running row max ``m``
and row sum ``l``, the output accumulator rescaled by ``exp(m_old - m_new)`` whenever the max
grows, one division by ``l`` at the end; scores in base 2 (``exp2``, scale folded with log2 e).

Work split of ``_paged_attention_kernel``, grid ``(num_q_tiles, num_kv_heads)``::

    one program = one tile of BLOCK_Q query tokens of ONE sequence x the NUM_QUERIES_PER_KV
    query heads that share one KV head (GQA), packed as BLOCK_M = BLOCK_Q * G rows (G = 3 here):

        row m:      0    1    2    3    4    5   ...  BLOCK_Q*G-1   (rest: padding rows)
        query tok:  t0   t0   t0   t1   t1   t1  ...               q_idx = q_tile*BLOCK_Q + m // G
        head:       h0   h1   h2   h0   h1   h2  ...               head  = kv_head*G  + m % G

    so every K/V block loaded from the cache serves all G heads of the group at once.

    tiles of all sequences, numbered globally: sequence i owns the tiles
        [query_start_loc[i] // BLOCK_Q + i,  query_start_loc[i+1] // BLOCK_Q + i + 1)
    (at least cdiv(query_len_i, BLOCK_Q) of them; a program past its sequence's last tile
    returns at once); total <= num_tokens // BLOCK_Q + num_seqs, and a program finds its
    sequence by binary search over query_start_loc (the scheme of vLLM's unified attention).

    the keys of a tile, one KV-cache block (BLOCK_SIZE positions) per iteration:

        key pos  0 ......... context_len ......... last_pos         seq_len
                 [blk 0][blk 1] ... [blk n-1]  ->  n = last_pos // BLOCK_SIZE + 1
        last_pos = context_len + min((q_tile + 1) * BLOCK_Q, query_len) - 1
        score of (row at q_pos, key at k_pos) kept iff k_pos <= q_pos (causal) and k_pos < seq_len

Block ids are cast to int64 before multiplying by the block stride, so caches with more than
2**31 elements index correctly.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of 2 >= NUM_KV_HEADS
):
    """One program per token: copy its [num_kv_heads, head_dim] K and V into its slot."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dims = tl.arange(0, HEAD_DIM)[None, :]  # [1, HEAD_DIM]
    mask = heads < NUM_KV_HEADS

    k = tl.load(key_ptr + tok * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_tok + heads * stride_kc_head + dims
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_tok + heads * stride_vc_head + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def triton_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write each token's K/V into its slot ``block_id * block_size + offset``; slot < 0 = skip.

    Values are cast to the cache dtype; any strides are accepted as long as ``head_dim`` is
    contiguous. Raises ``ValueError`` on mismatched shapes, a non-power-of-2 ``head_dim``
    or ``block_size``, or a non-contiguous ``head_dim``.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    _, block_size, _, _ = k_cache.shape
    _check(value.shape == key.shape, "key and value shapes differ")
    _check(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    _check(k_cache.shape[2:] == key.shape[1:], "cache [.., num_kv_heads, head_dim] differs from key's")
    _check(_is_pow2(head_dim) and _is_pow2(block_size), "head_dim and block_size must be powers of 2")
    _check(all(t.stride(-1) == 1 for t in (key, value, k_cache, v_cache)), "head_dim must be contiguous")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
    )


@triton.jit
def _find_seq_idx(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    tile_idx,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """The sequence i owning global tile ``tile_idx``: the last i with qsl[i] // BLOCK_Q + i <= tile_idx."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    scale,  # float: softmax scale, usually head_dim ** -0.5
    stride_q_tok, stride_q_head,
    stride_o_tok, stride_o_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    stride_bt_seq,
    NUM_QUERIES_PER_KV: tl.constexpr,  # G = num_heads // num_kv_heads
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size = key tile of one iteration
    BLOCK_M: tl.constexpr,  # rows of a program: BLOCK_Q tokens x G heads, padded to a power of 2
    BLOCK_Q: tl.constexpr,  # query tokens of a program
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), else the default
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile_idx - (q_start // BLOCK_Q + seq)  # tile index within the sequence
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # Rows: (query token, head of the GQA group), see the module docstring.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = q_tile * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # [BLOCK_M] token within the chunk
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV  # [BLOCK_M]
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < query_len)
    q_pos = context_len + q_idx  # [BLOCK_M] position in the sequence
    tok = (q_start + q_idx).to(tl.int64)  # [BLOCK_M] row of the flat query
    q_ptrs = query_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]

    # NOTE: m starts at -inf; every row (padding rows too: q_pos >= 0) keeps key 0 of block 0,
    # so after the first block m is finite and exp2(m_old - m_new) never sees -inf - -inf.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scaled scores (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of exp2(score - m_i) * v
    qk_scale = scale * 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))

    last_pos = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, query_len) - 1
    num_kv_blocks = last_pos // BLOCK_SIZE + 1
    offs_n = tl.arange(0, BLOCK_SIZE)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kc_head = k_cache_ptr + kv_head * stride_kc_head
    vc_head = v_cache_ptr + kv_head * stride_vc_head
    for j in range(0, num_kv_blocks):
        block_id = tl.load(block_table + j).to(tl.int64)  # int64: block_id * stride may pass 2**31
        k_pos = j * BLOCK_SIZE + offs_n  # [BLOCK_SIZE]
        k_valid = k_pos < seq_len
        k_ptrs = kc_head + block_id * stride_kc_block + offs_n[None, :] * stride_kc_tok + offs_d[:, None]
        k = tl.load(k_ptrs, mask=k_valid[None, :], other=0.0)  # [HEAD_DIM, BLOCK_SIZE]
        v_ptrs = vc_head + block_id * stride_vc_block + offs_n[:, None] * stride_vc_tok + offs_d[None, :]
        v = tl.load(v_ptrs, mask=k_valid[:, None], other=0.0)  # [BLOCK_SIZE, HEAD_DIM]

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_SIZE]
        keep = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_SIZE]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def triton_paged_attention(
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

    Returns ``out: [num_tokens, num_heads, head_dim]`` in ``query.dtype``, accumulated in fp32
    (fp32 inputs use IEEE fp32 dots, not TF32). Rows of tokens past ``query_start_loc[-1]``
    (padding) are zero. ``max_query_len`` picks the tile shape (decode or prefill);
    ``max_seq_len`` is not needed (each program reads its own seq_len).

    Raises ``ValueError`` if ``num_heads`` is not a multiple of ``num_kv_heads``, ``head_dim``
    or ``block_size`` is not a power of 2 >= 16, or ``head_dim`` is not contiguous.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    _check(
        num_heads % num_kv_heads == 0,
        f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    _check(_is_pow2(head_dim) and head_dim >= 16, f"head_dim {head_dim} must be a power of 2 >= 16")
    _check(_is_pow2(block_size) and block_size >= 16, f"block_size {block_size} must be a power of 2 >= 16")
    _check(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    _check(all(t.stride(-1) == 1 for t in (query, k_cache, v_cache)), "head_dim must be contiguous")
    _check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")

    full_decode = max_query_len == 1 and num_tokens == num_seqs
    out = torch.empty_like(query) if full_decode else torch.zeros_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    # NOTE: decode tiles hold one token x G heads; 16 rows is the smallest tl.dot tile.
    block_m = max(16 if max_query_len == 1 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        num_seqs, scale,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
