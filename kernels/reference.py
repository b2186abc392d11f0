"""Reference paged attention and KV-cache write: slow, obvious, float64.

The spec the production paths (``torch_attention``, ``triton_attention``) are tested against; never
used to serve. One Python loop per sequence: gather that sequence's K/V through its block table,
build the causal (optionally sliding-window) mask, repeat K/V heads for GQA, softmax in float64,
cast back. The index arithmetic (context_len / query_len / seq_len) is drawn in
``kernels/__init__.py``.
"""

import torch

from kernels.kv_quant import dequantize_kv, is_quantized, quantize_kv


def reference_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write each token's K/V into its slot; ``slot = block_id * block_size + offset``, < 0 = skip.

    Values are cast to the cache dtype, or quantized for an int8 / float8 cache
    (``kernels.kv_quant``; an int8 cache's rows are ``head_dim + 1`` wide). One token at a time.
    """
    block_size = k_cache.shape[1]
    quantized = is_quantized(k_cache.dtype)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k, v = key[t], value[t]
        if quantized:
            k, v = quantize_kv(k, k_cache.dtype), quantize_kv(v, v_cache.dtype)
        k_cache[slot // block_size, slot % block_size] = k
        v_cache[slot // block_size, slot % block_size] = v


def reference_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context + query tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Causal paged attention of each sequence's query tokens over its context.

    ``sliding_window`` ``W``: 0 = full causal attention (the query at position ``p`` attends
    keys ``0 .. p``); ``W > 0`` = sliding-window attention (Beltagy et al. 2020, "Longformer";
    Jiang et al. 2023, "Mistral 7B"): keys ``max(0, p - W + 1) .. p``, W keys with itself
    included (transformers' sliding mask ``kv_idx > q_idx - W``). Only the positions from the
    first query's window start ``max(0, context_len - W + 1)`` on are gathered, so block-table
    entries of blocks wholly before it are never read (they may hold -1 or any id).

    Returns ``out: [num_tokens, num_heads, head_dim]`` in ``query.dtype``; rows of tokens past
    ``query_start_loc[-1]`` (padding) are zero. An int8 / float8 cache (``kernels.kv_quant``)
    is read as its dequantized values, each rounded once to ``query.dtype`` (as the kernels
    read it). ``max_query_len``/``max_seq_len`` are only
    checked, as bounds. Raises ``ValueError`` if ``num_heads`` is not a multiple of
    ``num_kv_heads``, a sequence has ``query_len > seq_len`` or ``sliding_window < 0``.
    """
    if sliding_window < 0:
        raise ValueError(f"sliding_window {sliding_window} < 0")
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    block_size = k_cache.shape[1]
    out = torch.zeros_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        query_len = end - start
        if query_len > seq_len or query_len > max_query_len or seq_len > max_seq_len:
            raise ValueError(
                f"sequence {i}: query_len {query_len}, seq_len {seq_len} out of bounds")
        if query_len == 0:
            continue
        first = max(0, seq_len - query_len - sliding_window + 1) if sliding_window else 0
        pos = torch.arange(first, seq_len, device=query.device)  # the key positions read
        blocks = block_tables[i, pos // block_size].long()
        k = k_cache[blocks, pos % block_size]  # [num_keys, num_kv_heads, head_dim(+2)]
        v = v_cache[blocks, pos % block_size]
        if is_quantized(k_cache.dtype):
            k, v = dequantize_kv(k, query.dtype), dequantize_kv(v, query.dtype)
        k, v = k.double(), v.double()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [num_keys, ...]
        q = query[start:end].double()  # [query_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, query_len, num_keys]
        q_pos = seq_len - query_len + torch.arange(query_len, device=query.device)
        causal = pos[None, :] <= q_pos[:, None]  # [query_len, num_keys]
        if sliding_window:
            causal &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def reference_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm (Zhang & Sennrich 2019) in float64, optionally after the residual add.

    Returns ``(out, residual_out)`` in float64: ``residual_out = x + residual`` (None without a
    residual), ``out = weight * h / sqrt(mean(h**2) + eps)`` where ``h`` is the residual stream
    as the model keeps it, in the wider of ``x``'s and ``residual``'s dtypes (``residual_out``
    rounded once to it).
    """
    residual_out = None if residual is None else x.double() + residual.double()
    stream = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    h = (x if residual_out is None else residual_out.to(stream)).double()
    out = weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return out, residual_out


def reference_rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    inv_freq: torch.Tensor,  # [head_dim // 2] float32
) -> torch.Tensor:
    """Rotate-half RoPE (Su et al. 2021, RoFormer) of ``x``, returned in float64.

    The angle ``theta = positions * inv_freq`` is the float32 product the model computes (part of
    the spec: at position 8192 its rounding moves cos by ~1e-4, far above float32 tolerance);
    cos, sin and the rotation are then exact in float64::

        [x1 | x2] -> [x1 * cos(theta) - x2 * sin(theta) | x2 * cos(theta) + x1 * sin(theta)]
    """
    theta = (positions.float()[:, None] * inv_freq.float()[None, :]).double()[:, None, :]
    cos, sin = theta.cos(), theta.sin()  # [T, 1, D/2]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
