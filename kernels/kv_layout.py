"""How a paged KV cache orders the values inside a block: ``"rows"`` or ``"pairs"``.

Both are the same dense ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensor (same
shape, bytes and block ids, so allocation, copy-on-write block copies and the block manager
never see a difference); only the order of the values inside one block differs:

- ``"rows"``: one ``head_dim`` row per (token, KV head), ``cache[block, offset, head, :]``
  (vLLM's layout; every backend reads it, and it is the only one for float32, float16 and
  float8 caches).
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

  For an int8 cache (``kernels/kv_quant.py``: rows of ``head_dim`` values and a scale code) the
  same orders hold int8 values, followed by the block's ``block_size`` scale codes, one per key
  in order, so each (block, KV head) is ``block_size * (head_dim + 1)`` bytes:

      K^T  [head_dim / 2][block_size][2] int8, codes [block_size]
      V    [block_size / 2][head_dim][2] int8, codes [block_size]

  the operands of the native kernels' int16 pair products (``csrc/cpu_attention_i8.h``): the
  cache is read as stored, each row's scale folded into the products' epilogue. A float8
  cache takes the bf16 orders with a byte a value, widened to bf16 pairs in registers by the
  ``vdpbf16ps`` body (bf16 queries on an AVX512-BF16 or AMX CPU only).

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
    ``head_dim % 32 == 0`` to use it without unpacking rows), or int8 with both multiples of
    16 and ``head_dim <= 512`` (the int16 products' runs and their int32 bound), or float8
    with a ``block_size`` multiple of 16 and a ``head_dim`` multiple of 32 up to 256 (read by
    the bf16 pair products only, widened in registers)."""
    if dtype == torch.int8:
        return block_size % 16 == 0 and head_dim % 16 == 0 and head_dim <= 512
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return block_size % 16 == 0 and head_dim % 32 == 0 and head_dim <= 256
    return dtype == torch.bfloat16 and block_size % 2 == 0 and head_dim % 2 == 0


def _split_codes(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An int8 cache's values ``[..., head_dim]`` and scale codes ``[...]``; other dtypes'
    rows and None."""
    if rows.dtype != torch.int8:
        return rows, None
    return rows[..., :-1], rows[..., -1]


def _with_codes(values: torch.Tensor, codes: torch.Tensor | None,
                shape: torch.Size) -> torch.Tensor:
    """Pair-ordered values ``[nb, hkv, ...]`` (+ int8 codes ``[nb, hkv, bs]``) as a cache of
    ``shape``: each (block, KV head) its values, then its codes."""
    nb, hkv = values.shape[:2]
    parts = [values.reshape(nb, hkv, -1)] + ([codes.reshape(nb, hkv, -1)] if codes is not None
                                             else [])
    return torch.cat(parts, dim=2).reshape(shape)


def to_pairs(k_rows: torch.Tensor, v_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``"rows"`` cache pair ``[num_blocks, block_size, num_kv_heads, head_dim]`` (int8:
    ``head_dim + 1``) as new tensors of the same shape and dtype in the ``"pairs"`` order
    (block ids unchanged)."""
    shape = k_rows.shape
    (k, kc), (v, vc) = _split_codes(k_rows), _split_codes(v_rows)
    nb, bs, hkv, d = k.shape
    k = k.reshape(nb, bs, hkv, d // 2, 2).permute(0, 2, 3, 1, 4)
    v = v.reshape(nb, bs // 2, 2, hkv, d).permute(0, 3, 1, 4, 2)
    if kc is not None and vc is not None:  # [nb, bs, hkv] -> [nb, hkv, bs]
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    return _with_codes(k, kc, shape), _with_codes(v, vc, shape)


def to_rows(k_pairs: torch.Tensor, v_pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``to_pairs``: a ``"pairs"`` cache as new ``"rows"`` tensors."""
    shape = k_pairs.shape
    nb, bs, hkv, row = shape
    d = row - (1 if k_pairs.dtype == torch.int8 else 0)
    k_all, v_all = k_pairs.reshape(nb, hkv, bs * row), v_pairs.reshape(nb, hkv, bs * row)
    k = k_all[..., :bs * d].reshape(nb, hkv, d // 2, bs, 2).permute(0, 3, 1, 2, 4)
    v = v_all[..., :bs * d].reshape(nb, hkv, bs // 2, d, 2).permute(0, 2, 4, 1, 3)
    k, v = k.reshape(nb, bs, hkv, d), v.reshape(nb, bs, hkv, d)
    if d == row:
        return k, v
    kc = k_all[..., bs * d:].transpose(1, 2).unsqueeze(-1)  # [nb, bs, hkv, 1]
    vc = v_all[..., bs * d:].transpose(1, 2).unsqueeze(-1)
    return torch.cat([k, kc], dim=3), torch.cat([v, vc], dim=3)
