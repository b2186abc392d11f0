"""Triton kernels: KV-cache write and ONE varlen paged-attention kernel for decode and prefill.

The contract (context_len / query_len / seq_len, cache layout) is drawn in ``kernels/__init__.py``.
Algorithms: PagedAttention (Kwon et al., SOSP 2023) for reading K/V through the block table;
FlashAttention-2 (Dao, 2023) online softmax: one pass over the keys, a running row max ``m``
and row sum ``l``, the output accumulator rescaled by ``exp(m_old - m_new)`` whenever the max
grows, one division by ``l`` at the end; scores in base 2 (``exp2``, scale folded with log2 e).

Work split of ``_paged_attention_kernel``, grid ``(num_q_tiles, num_kv_heads, num_splits)``::

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

    the keys of a tile, TILE_N positions per iteration, each key's block looked up on its own
    (so one iteration gathers TILE_N / BLOCK_SIZE cache blocks, or part of one):

        key pos  0 ......... context_len ......... last_pos         seq_len
                 [ tile 0 ][ tile 1 ] ... [tile n-1]  ->  n = last_pos // TILE_N + 1
        last_pos = context_len + min((q_tile + 1) * BLOCK_Q, query_len) - 1
        block of key k_pos = block_table[k_pos // BLOCK_SIZE], slot offset k_pos % BLOCK_SIZE
        score of (row at q_pos, key at k_pos) kept iff k_pos <= q_pos (causal) and k_pos < seq_len

    sliding window W > 0 (Longformer, Beltagy et al. 2020; Mistral 7B, Jiang et al. 2023): a
    row also needs k_pos > q_pos - W, and the tiles start at the one holding
    first_key = max(0, context_len + q_tile * BLOCK_Q - W + 1), the window start of the tile's
    first row; keys before first_key are masked out of the loads, so the block-table entries of
    blocks wholly before every window are never read (they may be -1 or any id):

                 ... skipped ... [tile f]...[tile n-1]    f = first_key // TILE_N

    split-KV (flash-decoding), when num_splits > 1: program (tile, head, s) covers only the
    key tiles [s * tiles_per_split, (s + 1) * tiles_per_split) and stores its unnormalised
    (acc, m, l) as partials; ``_reduce_splits_kernel`` merges them. A small decode batch then
    still fills the GPU: batch 1 x 8 KV heads is 8 programs unsplit, 256 with 32 splits.

        tile 0  tile 1  tile 2  tile 3 | tile 4  tile 5  tile 6  tile 7 | ...
        <------- split 0 (m0, l0, acc0)-><------- split 1 (m1, l1, acc1)-> ...
        out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s

Block ids are cast to int64 before multiplying by the block stride, so caches with more than
2**31 elements index correctly.

A quantized cache (``--kv-cache-dtype``, formats in ``kernels/kv_quant.py``) is dequantized
tile by tile after the load, as every backend reads it: an int8 row times the scale its last
byte encodes (read through a uint8 view of the same memory), float8 bytes bitcast and widened;
then rounded once to the query dtype, so the products see the dequantized values.
"""

import functools

import torch
import triton
import triton.language as tl

from kernels.kv_quant import cache_head_dim, is_quantized
from kernels.torch_attention import torch_reshape_and_cache


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
    k_dst = (k_cache_ptr + block * stride_kc_block + offset * stride_kc_tok
             + heads * stride_kc_head + dims)
    v_dst = (v_cache_ptr + block * stride_vc_block + offset * stride_vc_tok
             + heads * stride_vc_head + dims)
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
    contiguous. An int8 / float8 cache (``--kv-cache-dtype``) is written by
    ``kernels.torch_attention.torch_reshape_and_cache``'s quantizer (``kernels/kv_quant.py``),
    bitwise what every backend writes. Raises ``ValueError`` on mismatched shapes, a
    non-power-of-2 ``head_dim`` or ``block_size``, or a non-contiguous ``head_dim``.
    """
    if is_quantized(k_cache.dtype):
        # NOTE: torch ops, not a Triton kernel: the interpreter's float32 -> float8 cast does
        # not round to nearest (2.11 became 0.25 in one try), so a Triton quantizer could not
        # be tested off a GPU; the write is one token per sequence in a decode step.
        torch_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    num_tokens, num_kv_heads, head_dim = key.shape
    _, block_size, _, _ = k_cache.shape
    _check(value.shape == key.shape, "key and value shapes differ")
    _check(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    _check(k_cache.shape[2:] == key.shape[1:],
           "cache [.., num_kv_heads, head_dim] differs from key's")
    _check(_is_pow2(head_dim) and _is_pow2(block_size),
           "head_dim and block_size must be powers of 2")
    _check(all(t.stride(-1) == 1 for t in (key, value, k_cache, v_cache)),
           "head_dim must be contiguous")
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
def _code_scale(code):
    """int8 rows' scale codes (uint8) -> float32 scales: bits (c << 20) + 0x35000000, 0 for 0."""
    c = code.to(tl.int32)
    bits = tl.where(c > 0, (c << 20) + 0x35000000, 0)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _find_seq_idx(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    tile_idx,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """The sequence i owning global tile ``tile_idx``: the last i with
    qsl[i] // BLOCK_Q + i <= tile_idx."""
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
    out_ptr,  # [num_tokens, num_heads, head_dim]              (NUM_SPLITS == 1)
    part_out_ptr,  # [NUM_SPLITS, num_tokens, num_heads, head_dim] fp32 (NUM_SPLITS > 1)
    part_ml_ptr,  # [NUM_SPLITS, num_tokens, num_heads, 2] fp32: running max m, sum l
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim (+ 2 bytes for int8)]
    v_cache_ptr,  # same as k_cache_ptr
    k_code_ptr,  # KV_QUANT == 1: k_cache's bytes as uint8 (the row scale codes); else unused
    v_code_ptr,  # KV_QUANT == 1: v_cache's bytes as uint8
    block_tables_ptr,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    num_tokens,
    tiles_per_split,  # key tiles of one split (NUM_SPLITS > 1)
    scale,  # float: softmax scale, usually head_dim ** -0.5
    sliding_window,  # int: 0 = full causal; W > 0 = the row at q_pos sees q_pos - W + 1 .. q_pos
    stride_q_tok, stride_q_head,
    stride_o_tok, stride_o_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    stride_bt_seq,
    NUM_HEADS: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,  # G = num_heads // num_kv_heads
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size (tokens)
    TILE_N: tl.constexpr,  # keys of one iteration, gathered from TILE_N / BLOCK_SIZE blocks
    BLOCK_M: tl.constexpr,  # rows of a program: BLOCK_Q tokens x G heads, padded to a power of 2
    BLOCK_Q: tl.constexpr,  # query tokens of a program
    NUM_SPLITS: tl.constexpr,  # 1 = whole context per program; > 1 = split-KV partials
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), else the default
    KV_QUANT: tl.constexpr,  # 0 = float cache, 1 = int8 + float16 row scale, 2 = e4m3, 3 = e5m2
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

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
    q_ptrs = (query_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head
              + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_valid[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scaled scores (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of exp2(score - m_i) * v
    qk_scale = scale * 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))

    last_pos = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, query_len) - 1
    # Sliding window: the tile's first row sees keys from first_key on, every later row from
    # later on; keys (and the table entries of blocks) before first_key are never read.
    windowed = sliding_window > 0
    first_key = tl.where(
        windowed, tl.maximum(context_len + q_tile * BLOCK_Q - sliding_window + 1, 0), 0)
    q_lo = tl.where(windowed, q_pos - sliding_window + 1, 0)  # [BLOCK_M] first key a row sees
    tile_lo = first_key // TILE_N
    tile_hi = last_pos // TILE_N + 1
    if NUM_SPLITS > 1:
        tile_lo = tile_lo + split * tiles_per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + tiles_per_split)
    offs_n = tl.arange(0, TILE_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kc_head = k_cache_ptr + kv_head * stride_kc_head
    vc_head = v_cache_ptr + kv_head * stride_vc_head
    for j in range(tile_lo, tile_hi):
        k_pos = j * TILE_N + offs_n  # [TILE_N]
        k_valid = (k_pos < seq_len) & (k_pos >= first_key)
        # int64: block_id * stride may pass 2**31; table entries past seq_len (or of blocks
        # before the window) are never read.
        block_id = tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        k_off = block_id * stride_kc_block + (k_pos % BLOCK_SIZE) * stride_kc_tok  # [TILE_N]
        v_off = block_id * stride_vc_block + (k_pos % BLOCK_SIZE) * stride_vc_tok
        k = tl.load(kc_head + k_off[None, :] + offs_d[:, None], mask=k_valid[None, :], other=0)
        v = tl.load(vc_head + v_off[:, None] + offs_d[None, :], mask=k_valid[:, None], other=0)
        if KV_QUANT == 1:  # int8 rows end in their scale code (kernels/kv_quant.py)
            k_scale = _code_scale(tl.load(k_code_ptr + kv_head * stride_kc_head + k_off
                                          + HEAD_DIM, mask=k_valid, other=0))  # [TILE_N]
            v_scale = _code_scale(tl.load(v_code_ptr + kv_head * stride_vc_head + v_off
                                          + HEAD_DIM, mask=k_valid, other=0))
            k = (k.to(tl.float32) * k_scale[None, :]).to(q.dtype)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        elif KV_QUANT == 2:  # float8 bytes, scale 1.0: exact in every query dtype
            k = k.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(q.dtype)
            v = v.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(q.dtype)
        elif KV_QUANT == 3:
            k = k.to(tl.float8e5, bitcast=True).to(tl.float32).to(q.dtype)
            v = v.to(tl.float8e5, bitcast=True).to(tl.float32).to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        keep = ((k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= q_lo[:, None])
                & k_valid[None, :])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no key yet (a split that starts past its position) keeps m = -inf; shift
        # by 0 then, so exp2 sees -inf - 0 (= 0 weight), never -inf - -inf (NaN).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_shift[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        acc = acc / l_i[:, None]
        o_ptrs = (out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head
                  + offs_d[None, :])
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        row = (split * num_tokens + tok) * NUM_HEADS + head  # [BLOCK_M] int64
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [NUM_SPLITS, num_tokens, num_heads, head_dim] fp32
    part_ml_ptr,  # [NUM_SPLITS, num_tokens, num_heads, 2] fp32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    num_tokens,
    stride_o_tok, stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads of one program (power of 2)
):
    """One program per (token, group of BLOCK_H heads): merge the splits' partial softmaxes.

    With m_s, l_s, acc_s the running max, sum and weighted value sum of split s, and
    M = max_s m_s: out = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s. A split that
    saw no key has m_s = -inf and weighs 0; the splits together cover every key a row sees
    (its own position included), so M is finite.
    """
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_ok = heads < NUM_HEADS
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = out_ptr + tok * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
    if tok >= tl.load(query_start_loc_ptr + num_seqs):  # padding token: zero rows
        zeros = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        tl.store(o_ptrs, zeros.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
        return
    splits = tl.arange(0, NUM_SPLITS)
    row = (splits[:, None] * num_tokens + tok) * NUM_HEADS + heads[None, :]  # [NUM_SPLITS, BLOCK_H]
    ok = head_ok[None, :]
    m = tl.load(part_ml_ptr + row * 2, mask=ok, other=0.0)
    l_sum = tl.load(part_ml_ptr + row * 2 + 1, mask=ok, other=1.0)
    w = tl.exp2(m - tl.max(m, 0)[None, :])  # [NUM_SPLITS, BLOCK_H]
    acc = tl.load(part_out_ptr + row[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                  mask=ok[:, :, None], other=0.0)  # [NUM_SPLITS, BLOCK_H, HEAD_DIM]
    out = tl.sum(acc * w[:, :, None], 0) / tl.sum(l_sum * w, 0)[:, None]  # [BLOCK_H, HEAD_DIM]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


# Split-KV heuristic: split only when the grid leaves SMs idle, keep >= MIN_TILES_PER_SPLIT key
# tiles per split (the reduce pass is not free), and cap the partial buffers at MAX_SPLITS.
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64


def choose_num_splits(num_programs: int, max_seq_len: int, tile_n: int, num_sms: int) -> int:
    """How many key ranges each (query tile, KV head) is split over (flash-decoding).

    ``num_programs`` is the number of (query tile, KV head) programs doing real work; when it
    already fills ``num_sms`` streaming multiprocessors, splitting only adds a reduce pass.
    Otherwise the context (``max_seq_len`` tokens, in tiles of ``tile_n`` keys) is split so
    that about 2 programs run per SM, each with at least ``MIN_TILES_PER_SPLIT`` tiles.
    Returns a power of 2 in [1, MAX_SPLITS]; ``num_sms == 0`` (no GPU) returns 1.

    Algorithm: Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
    inference", 2023): parallelise over the keys, then merge the partial softmaxes.
    """
    if num_sms <= 0 or num_programs >= num_sms:
        return 1
    max_tiles = triton.cdiv(max_seq_len, tile_n)
    splits = min(triton.cdiv(2 * num_sms, num_programs), max_tiles // MIN_TILES_PER_SPLIT,
                 MAX_SPLITS)
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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
    num_splits: int | None = None,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Causal paged attention of each sequence's query tokens over its context.

    ``sliding_window`` ``W``: 0 = full causal attention (the query at position ``p`` attends
    keys ``0 .. p``); ``W > 0`` = sliding-window attention (Beltagy et al. 2020, "Longformer";
    Jiang et al. 2023, "Mistral 7B"): keys ``max(0, p - W + 1) .. p`` (W keys, itself included;
    transformers' ``kv_idx > q_idx - W``). A program's key loop then starts at its first row's
    window, so block-table entries of blocks wholly before every query's window (block ``j``
    with ``(j + 1) * block_size <= context_len - W + 1``) are never read: they may hold -1 or
    any id, and the work per row is O(W).

    ``k_cache`` / ``v_cache`` may be int8 (``head_dim + 1`` bytes a row) or float8
    (``kernels/kv_quant.py``): read dequantized to ``query.dtype``.

    Returns ``out: [num_tokens, num_heads, head_dim]`` in ``query.dtype``, accumulated in fp32
    (fp32 inputs use IEEE fp32 dots, not TF32). Rows of tokens past ``query_start_loc[-1]``
    (padding) are zero. ``max_query_len`` picks the tile shape (decode or prefill);
    ``max_seq_len`` (tokens) sizes the split-KV ranges.

    ``num_splits``: key ranges per (query tile, KV head), merged by a second kernel
    (flash-decoding); ``None`` lets ``choose_num_splits`` decide from the GPU's SM count (long
    contexts at small batch split; no split on CPU); else a power of 2.

    Raises ``ValueError`` if ``num_heads`` is not a multiple of ``num_kv_heads``, the cache
    rows hold another ``head_dim``, ``head_dim`` or ``block_size`` is not a power of 2 >= 16,
    ``num_splits`` is not a power of 2, ``head_dim`` is not contiguous, or
    ``sliding_window < 0``.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    _check(cache_head_dim(k_cache) == head_dim,
           f"the cache rows hold head_dim {cache_head_dim(k_cache)}, the query {head_dim}")
    _check(
        num_heads % num_kv_heads == 0,
        f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    _check(_is_pow2(head_dim) and head_dim >= 16, f"head_dim {head_dim} must be a power of 2 >= 16")
    _check(_is_pow2(block_size) and block_size >= 16,
           f"block_size {block_size} must be a power of 2 >= 16")
    _check(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    _check(all(t.stride(-1) == 1 for t in (query, k_cache, v_cache)), "head_dim must be contiguous")
    _check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    _check(num_splits is None or _is_pow2(num_splits),
           f"num_splits {num_splits} must be a power of 2")
    _check(sliding_window >= 0, f"sliding_window {sliding_window} must be >= 0")

    full_decode = max_query_len == 1 and num_tokens == num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return torch.zeros_like(query)
    group = num_heads // num_kv_heads
    # NOTE: decode tiles hold one token x G heads; 16 rows is the smallest tl.dot tile.
    block_m = max(16 if max_query_len == 1 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    tile_n = 64 if head_dim <= 128 else 32  # keys per iteration: 4 blocks of 16 at head_dim 128
    grid0 = num_tokens // block_q + num_seqs
    # key tiles one program walks at most: the whole context, or with a sliding window the
    # tiles from its first row's window start to its last row (block_q + W - 1 positions)
    span_tiles = triton.cdiv(max(max_seq_len, 1), tile_n)
    if sliding_window:
        span_tiles = min(span_tiles, (block_q + sliding_window - 2) // tile_n + 2)
    if num_splits is None:
        busy = max(num_seqs, triton.cdiv(num_tokens, block_q)) * num_kv_heads
        sms = _num_sms(query.device.index or 0) if query.is_cuda else 0
        num_splits = choose_num_splits(busy, span_tiles * tile_n, tile_n, sms)
    tiles_per_split = triton.cdiv(span_tiles, num_splits)
    split = num_splits > 1
    out = torch.empty_like(query) if (full_decode or split) else torch.zeros_like(query)
    if split:
        part_out = torch.empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty(num_splits, num_tokens, num_heads, 2, dtype=torch.float32,
                              device=query.device)
    else:
        part_out = part_ml = out  # unused
    kv_quant = _KV_QUANT.get(k_cache.dtype, 0)
    k_codes, v_codes = ((k_cache.view(torch.uint8), v_cache.view(torch.uint8))
                        if kv_quant == 1 else (k_cache, v_cache))  # unused unless int8
    if kv_quant >= 2:  # float8 read as bytes and bitcast in the kernel
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _paged_attention_kernel[(grid0, num_kv_heads, num_splits)](
        out, part_out, part_ml, query, k_cache, v_cache, k_codes, v_codes,
        block_tables, seq_lens, query_start_loc,
        num_seqs, num_tokens, tiles_per_split, scale, sliding_window,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_QUERIES_PER_KV=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_QUANT=kv_quant,
        num_warps=4,
    )
    if split:
        # heads per program: at most 8192 partial values (32 KiB of fp32) in registers
        block_h = min(triton.next_power_of_2(num_heads),
                      max(1, 8192 // (num_splits * head_dim)))
        block_h = 1 << (block_h.bit_length() - 1)
        _reduce_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            out, part_out, part_ml, query_start_loc, num_seqs, num_tokens,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_H=block_h,
            num_warps=4,
        )
    return out


# A quantized cache's dtype -> the kernel's KV_QUANT (``kernels/kv_quant.py`` has the formats).
_KV_QUANT = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
