"""How a paged KV cache orders the values inside a block: ``"rows"`` or ``"pairs"``.

Both are the same dense ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensor (same
shape, bytes and block ids, so allocation, copy-on-write block copies and the block manager
never see a difference); only the order of the values inside one block differs:

- ``"rows"``: one ``head_dim`` row per (token, KV head), ``cache[block, offset, head, :]``
  (vLLM's layout; every backend reads it, and it is the only one for float32, float16 and
  quantized caches).
- ``"pairs"``: for bfloat16 on the native CPU kernels (``kernels.cpu_attention``), each
  (block, KV head) holds its ``block_size`` keys as the two operands of the attention's bf16
  products in VNNI-2 order (pairs of bf16 values in one 32-bit word, the operand format of
  AMX's ``tdpbf16ps`` and AVX512-BF16's ``vdpbf16ps``):

      K^T  [head_dim / 2][block_size][2]   word (j, t) = (K[t][2j], K[t][2j + 1])
      V    [block_size / 2][head_dim][2]   word (i, e) = (V[2i][e], V[2i + 1][e])

  ``reshape_and_cache`` writes a token's K/V there once, and attention then copies whole
  64-byte rows into its tiles instead of transposing every key at every layer call (on the
  rows layout that packing was ~30 % of a bf16 decode step's CPU time). vLLM's CPU backend
  keeps its cache in a layout of its own for the same reason.

``to_pairs`` / ``to_rows`` convert a whole cache (tests, benchmarks, debugging).
"""

from __future__ import annotations

import torch

KV_LAYOUTS = {"rows": 0, "pairs": 1}  # name -> the native ops' kv_layout argument


def layout_code(kv_layout: str) -> int:
    """The native ops' ``kv_layout`` integer of a layout name.

    Raises:
        ValueError: not one of ``KV_LAYOUTS``.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {sorted(KV_LAYOUTS)}, got {kv_layout!r}")
    return KV_LAYOUTS[kv_layout]


def pairs_fit(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether a cache of this dtype and shape can take the ``"pairs"`` layout: bfloat16 with
    an even ``block_size`` and ``head_dim`` (the native kernels' bf16 products also need
    ``head_dim % 32 == 0`` to use it without unpacking rows)."""
    return dtype == torch.bfloat16 and block_size % 2 == 0 and head_dim % 2 == 0


def to_pairs(k_rows: torch.Tensor, v_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``"rows"`` cache pair ``[num_blocks, block_size, num_kv_heads, head_dim]`` as new
    tensors of the same shape and dtype in the ``"pairs"`` order (block ids unchanged)."""
    nb, bs, hkv, d = k_rows.shape
    k = k_rows.reshape(nb, bs, hkv, d // 2, 2).permute(0, 2, 3, 1, 4).contiguous()
    v = v_rows.reshape(nb, bs // 2, 2, hkv, d).permute(0, 3, 1, 4, 2).contiguous()
    return k.view(nb, bs, hkv, d), v.view(nb, bs, hkv, d)


def to_rows(k_pairs: torch.Tensor, v_pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``to_pairs``: a ``"pairs"`` cache as new ``"rows"`` tensors."""
    nb, bs, hkv, d = k_pairs.shape
    k = k_pairs.reshape(nb, hkv, d // 2, bs, 2).permute(0, 3, 1, 2, 4).reshape(nb, bs, hkv, d)
    v = v_pairs.reshape(nb, hkv, bs // 2, d, 2).permute(0, 2, 4, 1, 3).reshape(nb, bs, hkv, d)
    return k, v
