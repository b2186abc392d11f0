"""GGUF weights as stored on the native linear kernel (``kernels.cpu_linear``: int8 and 4-bit
codes with a scale and a min per group, factored per group as llama.cpp does) against float64
references computed from the gguf package's own dequantization, on every instruction-set step
this CPU runs:

- every format served as stored (``gguf_blocks.SUPPORTED``), random blocks split into codes,
  scales and mins, through ``GroupQuantLinear`` at float32, bf16 and fp16 activations:
  within the float32 accumulation's error of ``x @ dequantize(W)^T`` in float64, the stored
  weights taken exactly (not rounded to ``x``'s dtype): at 16-bit activations closer to it
  than the float copy of the model in that dtype (whose weights are rounded) comes; on the
  AMX path, which converts each block to bf16 for the tiles, bitwise that float copy;
- fused modules of mixed formats (4-bit with 6-bit, groups of 32 with 16);
- the SwiGLU epilogue, the float32-output LM head, and each row the same at any batch size;
- the embedding gathered from the packed codes equals the float table's rows;
- the 4-bit packing's layout, and bad input refused naming what is wrong.

Tolerance, float32 output, relative to ``|x| @ |W|^T`` (the float32 sum's error bound scales
with the sum of the magnitudes): 4e-6 (observed <= 3e-7 at K = 512 on every path here; the
4-bit codes on vdpbf16ps sum x (128 + q), 16x the magnitude, before taking 128 X off).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.cpu_linear import cpu_linear, pack_group_scale, pack_linear_weight, pack_uint4_weight
from services.worker.gguf_blocks import SUPPORTED, GroupCodes, split_blocks
from services.worker.gguf_weights import fuse
from services.worker.packed_linear import PackedLinear
from services.worker.quantized_linear import GroupQuantLinear, QuantizedEmbedding
from tests.helpers import random_gguf_blocks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = 4e-6


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """``[n, k]`` of ``qtype`` as raw GGUF bytes: weights ~N(0, 0.05) quantized by gguf-py,
    or, for the k-quants it cannot quantize, random blocks (``random_gguf_blocks``)."""
    import gguf

    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        return random_gguf_blocks(qtype, n, k, seed)
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def stored(qtype: str, n: int, k: int, seed: int = 0) -> tuple[GroupCodes, torch.Tensor]:
    """(codes, scales and mins; gguf's own dequantization, float32 [n, k])."""
    import gguf

    raw = random_blocks(qtype, n, k, seed)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))
    return split_blocks(raw, qtype, (n, k)), ref.reshape(n, k)


def _error(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> float:
    return ((out.double() - ref).abs() / (magnitude + 1e-6)).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", SUPPORTED)
def test_each_format_matches_float64_and_the_float_copy_bitwise(isa, qtype, dtype):
    n, k = 70, 512  # N not a multiple of 32; K two k-quant super-blocks
    w, ref_w = stored(qtype, n, k)
    assert torch.equal(w.dequantize(), ref_w)  # (the split's own contract, checked elsewhere)
    bias = torch.randn(n)
    x = torch.randn(19, k).to(dtype)
    layer = GroupQuantLinear(w.codes, w.scale, w.min, bias, out_dtype=torch.float32)
    assert layer.packed.dtype == (torch.uint8 if w.bits == 4 else torch.int8)
    out = layer(x)
    ref = x.double() @ ref_w.double().T + bias.double()  # the stored weights, exactly
    magnitude = x.double().abs() @ ref_w.double().abs().T + bias.double().abs()
    floats = PackedLinear(ref_w.to(dtype), bias, out_dtype=torch.float32)(x)  # weights rounded
    if isa == "amx" and dtype == torch.bfloat16:  # the tiles read a block converted to bf16
        assert torch.equal(out, floats)
    else:
        assert _error(out, ref, magnitude) <= TOL
        if dtype != torch.float32:
            assert _error(out, ref, magnitude) < _error(floats, ref, magnitude)
    assert GroupQuantLinear(w.codes, w.scale, w.min)(x).dtype == dtype  # default: x's dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_module_of_mixed_formats(isa, dtype):
    """Gemma's qkv (Q5_0 + Q8_0) and a Q4_K_M file's (Q4_K + Q6_K: groups of 32 and 16, a
    min on some rows only) each read as one module: every part's own values."""
    for types in (("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q4_1")):
        parts = [stored(t, 32 * (i + 1), 256, seed=i) for i, t in enumerate(types)]
        w = fuse([p for p, _ in parts])
        ref_w = torch.cat([r for _, r in parts])
        assert torch.equal(w.dequantize(), ref_w), types
        assert w.bits == (4 if all(t.startswith("Q4") for t in types) else 8)
        x = torch.randn(5, 256).to(dtype)
        out = GroupQuantLinear(w.codes, w.scale, w.min, out_dtype=torch.float32)(x)
        assert _error(out, x.double() @ ref_w.double().T,
                      x.double().abs() @ ref_w.double().abs().T) <= TOL, types


@pytest.mark.parametrize("dtype", DTYPES)
def test_4bit_gate_up_with_the_silu_mul_epilogue(isa, dtype):
    w, ref_w = stored("Q4_K", 128, 256, seed=4)
    bias = torch.randn(128)
    x = torch.randn(11, 256).to(dtype)
    fused = GroupQuantLinear(w.codes, w.scale, w.min, bias, silu_mul=True)
    gate, up = (x.double() @ ref_w.double().T + bias.double()).chunk(2, dim=-1)
    out = fused(x)
    assert out.shape == (11, 64) and out.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2  # (one rounding to x's dtype)
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, atol=tol, rtol=tol)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_at_any_batch_size(isa, qtype, dtype):
    w, _ = stored(qtype, 200, 256, seed=1)
    layer = GroupQuantLinear(w.codes, w.scale, w.min, out_dtype=torch.float32)
    x = torch.randn(300, 256).to(dtype)
    full = layer(x)
    for m in (1, 2, 5, 8, 17, 33, 255, 256, 257):
        assert torch.equal(layer(x[:m]), full[:m]), m
    for row in (0, 7, 256, 299):
        assert torch.equal(layer(x[row:row + 1])[0], full[row])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_embedding_reads_the_packed_codes(qtype, dtype):
    """Rows gathered from the LM head's packed codes: the float table's rows in ``dtype``."""
    w, ref_w = stored(qtype, 100, 256, seed=2)
    table = GroupQuantLinear(w.codes, w.scale, w.min, out_dtype=torch.float32)
    embed = QuantizedEmbedding(table, dtype)
    ids = torch.tensor([[0, 31, 32, 99], [5, 5, 64, 63]])
    rows = embed(ids)
    assert rows.shape == (2, 4, 256) and rows.dtype == dtype
    assert torch.equal(rows, ref_w.to(dtype)[ids])


def test_uint4_packing_layout():
    codes = torch.randint(0, 16, (40, 6), dtype=torch.uint8)
    packed = pack_uint4_weight(codes)
    assert packed.shape == (2, 3, 32) and packed.dtype == torch.uint8
    for n in (0, 31, 32, 39):
        for j in range(3):
            byte = int(packed[n // 32, j, n % 32])
            assert (byte & 15, byte >> 4) == (int(codes[n, 2 * j]), int(codes[n, 2 * j + 1]))
    assert int(packed[1, :, 8:].max()) == 0  # rows 40.. of the last block: zero padding


def test_bad_input_is_refused():
    w, _ = stored("Q4_1", 40, 64)
    packed = pack_uint4_weight(w.codes)
    scale, mn = pack_group_scale(w.scale), pack_group_scale(w.min)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="4-bit weights need weight_scale"):
        cpu_linear(x, packed, 40)
    with pytest.raises(ValueError, match="4-bit weights need a weight_scale per group"):
        cpu_linear(x, packed, 40, None, None, torch.ones(40))
    with pytest.raises(ValueError, match="weight_min must be"):
        cpu_linear(x, packed, 40, None, None, scale, False, mn[:, :1].contiguous())
    with pytest.raises(ValueError, match="weight_min must be"):  # min without group scales
        cpu_linear(x, pack_linear_weight(w.codes.to(torch.int8)), 40, None, None,
                   torch.ones(40), False, torch.ones(40))
    with pytest.raises(ValueError, match="weight_scale is for int8 weights"):
        cpu_linear(x, pack_linear_weight(torch.randn(40, 64)), 40, None, None, None, False, mn)
    with pytest.raises(ValueError, match="with 4-bit weights"):
        cpu_linear(x.double(), packed, 40, None, None, scale)
    with pytest.raises(ValueError, match=r"codes must be 0\.\.15"):
        pack_uint4_weight(torch.full((2, 4), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K even"):
        pack_uint4_weight(torch.zeros(2, 5, dtype=torch.uint8))
