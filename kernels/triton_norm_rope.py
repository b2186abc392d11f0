"""Triton kernels: RMSNorm (plain, and fused with the residual add) and rotary embedding.

The same contracts and math order as ``kernels.torch_ops`` (the model's torch math), so on the
``"triton"`` backend each decoder layer does one launch per norm (add + norm fused) and one per
rotary embedding (query and key together).

- ``_rms_norm_kernel``: one program per token row; the row (``hidden_size`` padded to a power of
  2, masked) stays in registers: load ``x`` (+ ``residual``, store the sum in the residual's
  dtype: the models keep that stream in float32), sum of squares in float32, scale by
  ``rsqrt(mean + eps)``, cast to the weight's dtype, multiply by ``weight``.
  RMSNorm: Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019.
- ``_rotary_embedding_kernel``: one program per token; ``theta = position * inv_freq`` and its
  cos/sin are computed once in float32 (``[head_dim / 2]``), cast to the tensor dtype, and applied
  to every query and key head of the token, in place. Rotate-half ("neox") layout of RoFormer
  (Su et al., 2021); any frequency scaling (e.g. Meta's Llama 3.1 "llama3") is already folded
  into ``inv_freq``::

      head_dim:  [ x1 = x[0 : D/2]      | x2 = x[D/2 : D]      ]
      result:    [ x1*cos - x2*sin      | x2*cos + x1*sin      ]   cos/sin index i in 0..D/2-1
"""

import torch
import triton
import triton.language as tl

_MAX_HIDDEN = 1 << 16  # one row lives in registers


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_tokens, hidden_size]
    residual_out_ptr,  # [num_tokens, hidden_size], used iff HAS_RESIDUAL
    x_ptr,  # [num_tokens, hidden_size]
    residual_ptr,  # [num_tokens, hidden_size], used iff HAS_RESIDUAL
    weight_ptr,  # [hidden_size]
    stride_out, stride_res_out, stride_x, stride_res,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next power of 2 >= hidden_size
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden_size
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)  # [BLOCK_N] input dtype
    if HAS_RESIDUAL:
        h = h + tl.load(residual_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * stride_res_out + cols, h, mask=mask)
    h32 = h.to(tl.float32)
    mean_sq = tl.sum(h32 * h32, axis=0) / hidden_size  # padding columns are 0
    h32 = h32 * tl.rsqrt(mean_sq + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = w * h32.to(w.dtype)  # in the weight's dtype, like torch_rms_norm
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check(x.dim() == 2, f"x must be [num_tokens, hidden_size], got {tuple(x.shape)}")
    num_tokens, hidden_size = x.shape
    _check(weight.shape == (hidden_size,), f"weight {tuple(weight.shape)} != [{hidden_size}]")
    _check(hidden_size <= _MAX_HIDDEN, f"hidden_size {hidden_size} > {_MAX_HIDDEN}")
    tensors = [x, weight]
    if residual is not None:
        _check(residual.shape == x.shape and residual.dtype in (x.dtype, torch.float32),
               "residual must have x's shape, and x's dtype or float32")
        tensors.append(residual)
    _check(all(t.stride(-1) == 1 for t in tensors), "hidden_size must be contiguous")
    out = torch.empty_like(x, dtype=weight.dtype)
    residual_out = None if residual is None else torch.empty_like(x, dtype=residual.dtype)
    if num_tokens == 0:
        return out, residual_out
    block_n = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        out, out if residual_out is None else residual_out,
        x, x if residual is None else residual, weight,
        out.stride(0), out.stride(0) if residual_out is None else residual_out.stride(0),
        x.stride(0), x.stride(0) if residual is None else residual.stride(0),
        hidden_size, eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        num_warps=min(max(block_n // 512, 1), 16),
    )
    return out, residual_out


def triton_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2) + eps))``: normalised in float32, scaled in the weight's
    dtype.

    Returns a new ``[num_tokens, hidden_size]`` tensor in ``weight.dtype``; same math order as
    ``kernels.torch_ops.torch_rms_norm`` (RMSNorm, Zhang & Sennrich 2019). Raises
    ``ValueError`` if ``x`` is not 2-D, ``weight`` is not ``[hidden_size]``,
    ``hidden_size > 65536`` or the last dimension is not contiguous.
    """
    out, _ = _rms_norm(x, None, weight, eps)
    return out


def triton_fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    residual: torch.Tensor,  # [num_tokens, hidden_size], x's dtype or float32
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual_out = x + residual`` (``residual.dtype``), ``out = rms_norm(residual_out)``
    (``weight.dtype``): one launch.

    Returns NEW tensors ``(out, residual_out)``, both ``[num_tokens, hidden_size]``; the inputs
    are not modified (unlike vLLM's in-place ``fused_add_rms_norm``). Same math as
    ``kernels.torch_ops.torch_fused_add_rms_norm``. Raises ``ValueError`` as ``triton_rms_norm``
    does, and if ``residual`` differs from ``x`` in shape, or in dtype and is not float32.
    """
    out, residual_out = _rms_norm(x, residual, weight, eps)
    assert residual_out is not None  # made whenever there is a residual
    return out, residual_out


@triton.jit
def _rotate_heads(
    base_ptr,  # [num_heads, head_dim] of one token
    stride_head,
    num_heads,
    cos,  # [1, BLOCK_D] tensor dtype
    sin,  # [1, BLOCK_D] tensor dtype
    HALF_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """x1, x2 = halves of each head's vector -> x1*cos - x2*sin, x2*cos + x1*sin, in place."""
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (heads < num_heads) & (dims < HALF_DIM)
    x1_ptrs = base_ptr + heads * stride_head + dims
    x2_ptrs = x1_ptrs + HALF_DIM
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0)
    x2 = tl.load(x2_ptrs, mask=mask, other=0.0)
    tl.store(x1_ptrs, x1 * cos - x2 * sin, mask=mask)
    tl.store(x2_ptrs, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    positions_ptr,  # [num_tokens] int
    inv_freq_ptr,  # [head_dim // 2] float32
    stride_q_tok, stride_q_head,
    stride_k_tok, stride_k_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,  # head_dim // 2
    BLOCK_H: tl.constexpr,  # next power of 2 >= max(NUM_HEADS, NUM_KV_HEADS)
    BLOCK_D: tl.constexpr,  # next power of 2 >= HALF_DIM
):
    tok = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    pos = tl.load(positions_ptr + tok).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + dims, mask=dims < HALF_DIM, other=0.0)
    theta = pos * inv_freq  # [BLOCK_D] float32, the model's positions.float() * inv_freq
    dtype = query_ptr.dtype.element_ty
    cos = tl.cos(theta).to(dtype)[None, :]
    sin = tl.sin(theta).to(dtype)[None, :]
    _rotate_heads(query_ptr + tok * stride_q_tok, stride_q_head, NUM_HEADS, cos, sin,
                  HALF_DIM, BLOCK_H, BLOCK_D)
    _rotate_heads(key_ptr + tok * stride_k_tok, stride_k_head, NUM_KV_HEADS, cos, sin,
                  HALF_DIM, BLOCK_H, BLOCK_D)


def triton_rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    inv_freq: torch.Tensor,  # [head_dim // 2] float32
) -> None:
    """Rotate ``query`` and ``key`` in place by rotate-half RoPE at ``positions``, one launch.

    ``theta = positions * inv_freq`` in float32, cos/sin in float32 cast to ``query.dtype``, then
    ``x1*cos - x2*sin | x2*cos + x1*sin`` in ``query.dtype`` (the model's
    ``q * cos + rotate_half(q) * sin``; see ``kernels.torch_ops.torch_rotary_embedding``).
    RoPE: Su et al. 2021 (RoFormer); scalings such as Llama 3.1's are folded into ``inv_freq``.
    Any token/head strides are accepted (e.g. views into a fused qkv output).

    Raises ``ValueError`` if the shapes disagree (tokens, ``head_dim``,
    ``2 * len(inv_freq) != head_dim``), ``key`` and ``query`` dtypes differ, ``inv_freq`` is
    not float32, or ``head_dim`` is not contiguous.
    """
    _check(query.dim() == 3 and key.dim() == 3,
           "query and key must be [num_tokens, heads, head_dim]")
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, _ = key.shape
    _check(key.shape[0] == num_tokens and positions.shape == (num_tokens,),
           "query, key and positions disagree on num_tokens")
    _check(key.shape[2] == head_dim and inv_freq.shape == (head_dim // 2,) and head_dim % 2 == 0,
           f"inv_freq {tuple(inv_freq.shape)} does not fit head_dim {head_dim} / {key.shape[2]}")
    _check(key.dtype == query.dtype, "query and key dtypes differ")
    _check(inv_freq.dtype == torch.float32, "inv_freq must be float32")
    _check(query.stride(-1) == 1 and key.stride(-1) == 1, "head_dim must be contiguous")
    if num_tokens == 0:
        return
    _rotary_embedding_kernel[(num_tokens,)](
        query, key, positions.contiguous(), inv_freq.contiguous(),
        query.stride(0), query.stride(1),
        key.stride(0), key.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF_DIM=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        BLOCK_D=triton.next_power_of_2(head_dim // 2),
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
