"""The quantized KV cache (``--kv-cache-dtype``): how a cache row stores K or V, in torch.

The math the native kernels (``csrc/cpu_paged_attention.cpp``, ``KvQuant``) implement, bit for
bit, and the torch backend and the tests use:

- ``int8``: per (token, KV head) symmetric, the scale kept in the row. A cache is
  ``[num_blocks, block_size, num_kv_heads, head_dim + 1]`` int8: ``head_dim`` values ``q``, then
  one byte, the row's scale code ``c``, an unsigned 8-bit float (5 exponent bits, 3 mantissa
  bits): ``scale(c) = (1 + (c & 7) / 8) * 2^((c >> 3) - 21)`` (float32 bits
  ``(c << 20) + 0x35000000``), and ``scale(0) = 0``: ``5.4e-7 .. 1920``. ``c`` is the smallest
  code with ``scale(c) >= amax / 127`` (float32 division; clamped to ``1 .. 255``, 0 for an
  all-zero row), so no value is clipped below ``amax = 243840``, and the step is at most 1/8
  above the ideal ``amax / 127``. Then ``q = clamp(round_half_even(x / scale), -127, 127)``,
  ``x ~ q * scale`` in float32. The scale travels with its row, so whole-block copies
  (copy-on-write) and every layout need nothing else. One byte per row costs 1.5 % of a 64-dim
  int8 row: 1.97x the rows of a bf16 cache in the same bytes, 3.94x float32's (a float16
  scale, 2 bytes, gave 1.94x / 3.88x and a step exactly ``amax / 127``).
- ``fp8`` / ``fp8_e4m3`` (``float8_e4m3fn``) and ``fp8_e5m2`` (``float8_e5m2``):
  ``[..., head_dim]``, a per-tensor scale of 1.0 (vLLM's ``k_scale`` / ``v_scale`` without
  calibration), written saturated to the finite range (±448, ±57344), read exactly.

Rows are dequantized to the query's dtype before the products (the float32 value rounded once
to it), so attention over a quantized cache is attention over its dequantized values; except
an int8 cache in the ``"pairs"`` layout on the native CPU kernels (``kernels/kv_layout.py``),
read as stored by integer products (``csrc/cpu_attention_i8.h``: Q and P as int16, the row
scales in the epilogues), within float16's tolerance of that; a float8 ``"pairs"`` cache is
widened in registers to the same bf16 values the rows read gives.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype -> the cache tensor's dtype (None = the model's compute dtype), vLLM's names.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

# Bytes after the head_dim values of an int8 row: its scale code.
INT8_SCALE_BYTES = 1
# float32 bits of scale code c > 0: (c << 20) + SCALE_CODE_BIAS_BITS (the exponent offset).
SCALE_CODE_BIAS_BITS = 0x35000000
SCALE_CODE_MAX = 255

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def is_quantized(cache_dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds quantized K/V (int8 or float8)."""
    return cache_dtype in QUANTIZED_DTYPES


def cache_row_size(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of a cache: ``head_dim``, + 1 for int8's scale."""
    return head_dim + (INT8_SCALE_BYTES if cache_dtype == torch.int8 else 0)


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head_dim a cache's rows hold (an int8 row ends in its scale byte)."""
    return cache.shape[-1] - (INT8_SCALE_BYTES if cache.dtype == torch.int8 else 0)


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows as a quantized cache stores them.

    Args:
        x: ``[..., head_dim]`` float32 / bfloat16 / float16.
        cache_dtype: int8, float8_e4m3fn or float8_e5m2.

    Returns:
        ``[..., head_dim + 1]`` int8 (values, then the scale code) or ``[..., head_dim]``
        float8.

    Raises:
        ValueError: ``cache_dtype`` is not a quantized cache dtype.
    """
    xf = x.float()
    if cache_dtype in _FP8_MAX:
        limit = _FP8_MAX[cache_dtype]
        return xf.clamp(-limit, limit).to(cache_dtype)
    if cache_dtype != torch.int8:
        raise ValueError(f"{cache_dtype} is not a quantized KV cache dtype")
    code = scale_code(xf.abs().amax(-1, keepdim=True) / 127)  # [..., 1] uint8
    scale = code_scale(code)
    q = torch.where(scale > 0, (xf / scale).round().clamp(-127, 127), 0).to(torch.int8)
    return torch.cat([q, code.view(torch.int8)], dim=-1)


def scale_code(scale: torch.Tensor) -> torch.Tensor:
    """The int8 rows' scale codes: for float32 ``scale >= 0``, the smallest code ``c`` with
    ``code_scale(c) >= scale`` (exact, on the float32 bits), clamped to ``1 .. 255``; 0 for 0.
    Returns uint8, ``scale``'s shape."""
    t = scale.float().view(torch.int32) - SCALE_CODE_BIAS_BITS
    code = (t >> 20) + ((t & 0xFFFFF) != 0).int()  # round the 3-bit mantissa up
    return torch.where(scale > 0, code.clamp(1, SCALE_CODE_MAX), 0).to(torch.uint8)


def code_scale(code: torch.Tensor) -> torch.Tensor:
    """Scale codes (uint8) -> their float32 scales (exact): ``(c << 20) + 0x35000000`` as float
    bits, 0 for code 0."""
    c = code.int()
    return torch.where(c > 0, (c << 20) + SCALE_CODE_BIAS_BITS, 0).view(torch.float32)


def dequantize_kv(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The K or V values quantized rows stand for: ``[..., head_dim(+2)]`` -> ``[..., head_dim]``
    in ``dtype`` (computed in float32, rounded once). A float cache is returned cast."""
    if cache.dtype != torch.int8:
        return cache.to(dtype)
    d = cache.shape[-1] - INT8_SCALE_BYTES
    scale = code_scale(cache[..., d:].view(torch.uint8))  # [..., 1]
    return (cache[..., :d].float() * scale).to(dtype)
