"""GGUF quantized block bytes split into integer codes and per-group float32 scale and min.

A GGUF quantized tensor ``[N, K]`` is stored row by row as blocks along K (32 weights per
block for the legacy formats, 256 for the K-quants), each block a few fp16 fields and packed
integers. ``split_blocks`` unpacks them into

* ``codes [N, K]``: the integers, in the dequantized element order (not the nibble storage
  order), ``torch.uint8`` holding 0..15 for the 4-bit formats, ``torch.int8`` otherwise;
* ``scale [N, K / group]`` and ``min [N, K / group]`` float32 (``min`` None where the format
  has no offset), one per ``group`` weights along K,

WITHOUT multiplying them, such that for every element::

    weight = code * scale[group] + min[group]          (min absent: weight = code * scale)

is bit for bit what ``gguf.quants.dequantize`` (gguf-py ``quants.py``) gives, in float32 (up
to the sign of a zero: ``torch.equal`` / ``np.array_equal`` treat -0.0 == +0.0). The product
``code * scale`` is exact in float32 for every format (an fp16 ``d`` has 11 significant bits,
times a sub-scale of at most 7, times a code of at most 7: at most 24 bits), so only
the ``+ min`` rounds, once, as gguf's numpy code does; the scales and mins are computed here
with gguf's float32 operations in gguf's order (e.g. ``Q4_K``: ``scale = d * sc``, ``min =
-(dmin * m)``, and gguf's ``d*q - dm`` equals ``d*q + (-dm)`` exactly).

The layouts (llama.cpp ``ggml-common.h`` block structs, ``ggml-quants.c``
``dequantize_row_*``; gguf-py ``quants.py`` ``*.dequantize_blocks``), little-endian, ``d`` /
``m`` / ``dmin`` fp16:

======  =====  =====  ==============================================  ========================
type    block  bytes  fields, in order                                weight
======  =====  =====  ==============================================  ========================
Q4_0    32     18     d, qs[16] (nibbles)                             d * (q - 8)
Q4_1    32     20     d, m, qs[16]                                    d * q + m
Q5_0    32     22     d, qh[4] (bit i: element i's 5th bit), qs[16]   d * (q - 16)
Q5_1    32     24     d, m, qh[4], qs[16]                             d * q + m
Q8_0    32     34     d, qs[32] (int8)                                d * q
Q4_K    256    144    d, dmin, scales[12] (8 x 6-bit sc, m), qs[128]  d*sc_j * q - dmin*m_j
Q5_K    256    176    d, dmin, scales[12], qh[32], qs[128]            d*sc_j * q - dmin*m_j
Q6_K    256    210    ql[128], qh[64], scales[16] (int8), d           d*scale_j * (q - 32)
======  =====  =====  ==============================================  ========================

For the 32-weight formats the nibbles of ``qs[i]`` are elements ``i`` (low) and ``i + 16``
(high). The K-quants' sub-blocks are 32 weights (16 for ``Q6_K``), each with its own 6-bit
(``Q6_K``: int8) sub-scale; a 32-byte chunk ``c`` of ``Q4_K``/``Q5_K``'s ``qs`` holds
sub-block ``2c`` in its low nibbles and ``2c + 1`` in its high ones, and bit ``j`` of
``Q5_K``'s ``qh[i]`` is the 5th bit of element ``i`` of sub-block ``j``.

The codes chosen per format (the native kernel relies on them):

======  ===================  ================  ================
type    codes                scale             min
======  ===================  ================  ================
Q4_0    uint8 q, 0..15       d                 -8 * d (exact)
Q4_1    uint8 q, 0..15       d                 m
Q4_K    uint8 q, 0..15       d * sc_j          -(dmin * m_j)
Q5_0    int8 q - 16          d                 None
Q5_1    int8 q, 0..31        d                 m
Q5_K    int8 q, 0..31        d * sc_j          -(dmin * m_j)
Q6_K    int8 q - 32          d * scale_j       None
Q8_0    int8 q               d                 None
======  ===================  ================  ================

``Q4_0`` keeps the unsigned nibble with ``min = -8 * d``: ``q*d + (-8*d)`` is ``d*(q - 8)``
exactly (the exact sum has at most 15 significant bits), so it too matches gguf (zero's sign
aside: ``q = 8`` gives +0.0 where gguf gives ``d * 0``, -0.0 for a negative ``d``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SUPPORTED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

# type -> (weights per block, bytes per block); gguf.constants.GGML_QUANT_SIZES
_BLOCK = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}


@dataclass(frozen=True, slots=True)
class GroupCodes:
    """A quantized ``[N, K]`` weight as integer codes and per-group float32 scale and min.

    ``weight[n, k] = codes[n, k] * scale[n, k // group] + min[n, k // group]`` (``min``
    None: no ``+ min``), bit for bit the values of ``gguf.quants.dequantize``.

    Attributes:
        codes: ``[N, K]``; ``torch.int8`` (signed codes: ``Q8_0`` values, ``Q5_0``'s
            ``q - 16``, ``Q6_K``'s ``q - 32``, ``Q5_1`` / ``Q5_K``'s 0..31) or ``torch.uint8``
            holding 0..15 (the 4-bit formats ``Q4_0``, ``Q4_1``, ``Q4_K``).
        scale: ``[N, K // group]`` float32.
        min: ``[N, K // group]`` float32, or None where the format has no offset.
        group: weights per group along K: 32, or 16 (``Q6_K``).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    group: int

    def __post_init__(self) -> None:
        if self.codes.dim() != 2 or self.codes.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"codes must be int8 or uint8 [N, K], got {self.codes.dtype} "
                             f"{tuple(self.codes.shape)}")
        n, k = self.codes.shape
        if self.group <= 0 or k % self.group:
            raise ValueError(f"K={k} is not a multiple of the group {self.group}")
        want = (n, k // self.group)
        for name, t in (("scale", self.scale), ("min", self.min)):
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != want):
                raise ValueError(f"{name} must be float32 {want}, got {t.dtype} "
                                 f"{tuple(t.shape)}")

    @property
    def bits(self) -> int:
        """4 for ``torch.uint8`` nibble codes (0..15), else 8."""
        return 4 if self.codes.dtype == torch.uint8 else 8

    def dequantize(self) -> torch.Tensor:
        """The weight, float32 ``[N, K]``: ``codes * scale (+ min)``, each group's scale and
        min applied to its ``group`` codes; equal to ``gguf.quants.dequantize``."""
        n, k = self.codes.shape
        g = k // self.group
        w = self.codes.to(torch.float32).view(n, g, self.group) * self.scale.view(n, g, 1)
        if self.min is not None:
            w = w + self.min.view(n, g, 1)
        return w.view(n, k)


def split_blocks(raw: np.ndarray, qtype_name: str, shape: tuple[int, int]) -> GroupCodes:
    """Split a GGUF quantized tensor's block bytes into codes, scale and min.

    Args:
        raw: the tensor's bytes as the gguf reader gives them (``np.uint8``, ``[N, K / block
            * bytes]`` or flat; any array is read as its bytes in C order). Not modified and
            not aliased: the result owns its memory.
        qtype_name: the GGML type's name, one of ``SUPPORTED`` (a ``GGMLQuantizationType``
            is taken by its ``.name``).
        shape: ``(N, K)``: rows, elements per row (GGUF lists a tensor's dims the other way
            round: ``(K, N)``).

    Returns:
        ``GroupCodes`` with ``codes [N, K]``, ``scale`` / ``min [N, K // group]``; see the
        module docstring for each format's codes.

    Raises:
        ValueError: an unsupported type (named), ``K`` not a multiple of the block size (32,
            or 256 for the K-quants), or ``raw`` not exactly the expected byte count (named,
            e.g. a truncated tensor).
    """
    name = str(getattr(qtype_name, "name", qtype_name))
    if name not in _BLOCK:
        raise ValueError(f"unsupported GGUF quantization type {name!r} "
                         f"(supported: {', '.join(SUPPORTED)})")
    if len(shape) != 2:
        raise ValueError(f"{name}: shape must be (N, K), got {tuple(shape)}")
    n, k = (int(s) for s in shape)
    block, size = _BLOCK[name]
    if n < 0 or k < 0:
        raise ValueError(f"{name}: negative shape ({n}, {k})")
    if k % block:
        raise ValueError(f"{name}: row length K={k} is not a multiple of the block size "
                         f"{block}")
    n_blocks = n * (k // block)
    expected = n_blocks * size
    data = np.ascontiguousarray(raw)
    data = data.reshape(-1).view(np.uint8)
    if data.size != expected:
        raise ValueError(f"{name} tensor of shape ({n}, {k}) needs {expected} bytes "
                         f"({n_blocks} blocks of {size}), got {data.size}")
    blocks = data.reshape(n_blocks, size)
    codes, scale, mn, group = _SPLIT[name](blocks)
    return GroupCodes(
        codes=torch.from_numpy(codes.reshape(n, k)),
        scale=torch.from_numpy(scale.reshape(n, k // group)),
        min=None if mn is None else torch.from_numpy(mn.reshape(n, k // group)),
        group=group,
    )


# ---------------------------------------------------------------------------------------------
# per format: blocks [B, bytes] uint8 -> (codes [B, block], scale [B, G], min [B, G] | None,
# group) with G = block / group, all fresh arrays (never views of the input)

_Split = tuple[np.ndarray, np.ndarray, np.ndarray | None, int]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of each block, as float32 ``[B, 1]``."""
    return blocks[:, at:at + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """``qs [B, C * chunk]`` uint8 -> ``[B, 2 * C * chunk]`` uint8 0..15: for each ``chunk``
    bytes, their low nibbles then their high nibbles (gguf's ``>> [0, 4]`` order)."""
    b, size = qs.shape
    qs = qs.reshape(b, size // chunk, chunk)
    out = np.empty((b, size // chunk, 2, chunk), dtype=np.uint8)
    np.bitwise_and(qs, np.uint8(0x0F), out=out[:, :, 0])
    np.right_shift(qs, np.uint8(4), out=out[:, :, 1])
    return out.reshape(b, 2 * size)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """``Q5_0`` / ``Q5_1``'s ``qh [B, 4]`` (a little-endian uint32) -> ``[B, 32]`` uint8
    0 or 16: bit ``i`` is element ``i``'s 5th bit."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << np.uint8(4)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Q4_K`` / ``Q5_K``'s 12 scale bytes ``[B, 12]`` -> 6-bit ``(sc, m)``, each ``[B, 8]``
    uint8 (llama.cpp ``get_scale_min_k4``, gguf ``Q4_K.get_scale_min``)::

        0 EEAAAAAA   4 eeaaaaaa   8 eeeeEEEE      sc: A B C D E F G H
        1 FFBBBBBB   5 ffbbbbbb   9 ffffFFFF      m:  a b c d e f g h
        2 GGCCCCCC   6 ggcccccc  10 ggggGGGG
        3 HHDDDDDD   7 hhdddddd  11 hhhhHHHH
    """
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & np.uint8(0x3F), (m_d & np.uint8(0x0F)) | ((d >> 2) & np.uint8(0x30))],
                        axis=-1)
    mn = np.concatenate([m & np.uint8(0x3F), (m_d >> 4) | ((m >> 2) & np.uint8(0x30))], axis=-1)
    return sc, mn


def _q4_0(blocks: np.ndarray) -> _Split:
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 2:18], 16), d, d * np.float32(-8.0), 32


def _q4_1(blocks: np.ndarray) -> _Split:
    return _nibbles(blocks[:, 4:20], 16), _f16(blocks, 0), _f16(blocks, 2), 32


def _q5_0(blocks: np.ndarray) -> _Split:
    q = _nibbles(blocks[:, 6:22], 16) | _high_bits_32(blocks[:, 2:6])
    return q.view(np.int8) - np.int8(16), _f16(blocks, 0), None, 32


def _q5_1(blocks: np.ndarray) -> _Split:
    q = _nibbles(blocks[:, 8:24], 16) | _high_bits_32(blocks[:, 4:8])
    return q.view(np.int8), _f16(blocks, 0), _f16(blocks, 2), 32


def _q8_0(blocks: np.ndarray) -> _Split:
    codes = np.empty((blocks.shape[0], 32), dtype=np.int8)
    codes[:] = blocks[:, 2:34].view(np.int8)
    return codes, _f16(blocks, 0), None, 32


def _k_scale_min(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Q4_K`` / ``Q5_K``: ``(d * sc, -(dmin * m))`` float32 ``[B, 8]``, as gguf computes
    ``d`` and ``dm``."""
    sc, m = _scale_min_k4(blocks[:, 4:16])
    scale = _f16(blocks, 0) * sc.astype(np.float32)
    mn = -(_f16(blocks, 2) * m.astype(np.float32))
    return scale, mn


def _q4_k(blocks: np.ndarray) -> _Split:
    scale, mn = _k_scale_min(blocks)
    return _nibbles(blocks[:, 16:144], 32), scale, mn, 32


def _q5_k(blocks: np.ndarray) -> _Split:
    scale, mn = _k_scale_min(blocks)
    b = blocks.shape[0]
    qh = blocks[:, 16:48].reshape(b, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _nibbles(blocks[:, 48:176], 32) | ((qh & np.uint8(1)) << np.uint8(4)).reshape(b, 256)
    return q.view(np.int8), scale, mn, 32


def _q6_k(blocks: np.ndarray) -> _Split:
    b = blocks.shape[0]
    ql = _nibbles(blocks[:, 0:128], 64)  # [B, 256]: per 128-element half, 64 low then 64 high
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = blocks[:, 128:192].reshape(b, 2, 1, 32) >> shifts  # [B, 2, 4, 32]: same order as ql
    q = ql | ((qh & np.uint8(3)) << np.uint8(4)).reshape(b, 256)
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return q.view(np.int8) - np.int8(32), scale, None, 16


_SPLIT = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
