"""int8 linear layers against float64 references: the native kernel with int8 weights
(``kernels.cpu_linear``, per output channel and per group of 32 as GGUF Q8_0) on every
instruction-set step this CPU runs, and W8A8 (``kernels.int8_linear.w8a8_linear``,
``torch._int_mm``); each row's result bitwise the same at any batch size; the symmetric
quantizer; the modules (``services/worker/quantized_linear.py``) with a tensor-parallel reduce.

Tolerances, float32 output, relative to ``|x| @ |W|^T + |b|`` (the float32 sum's error bound
scales with the sum of the magnitudes, not with the result):
- weight-only, per channel: the int8 values are exact in bf16 and float32, so the error is the
  float32 accumulation's, as for float weights: 2e-5;
- weight-only, per group: the sums are factored per group (``s * sum(x q)``, llama.cpp's
  form), each weight ``q * d`` taken exactly (not rounded to ``x``'s dtype; on the AMX path,
  which converts blocks to bf16 for its tiles, rounded as a bf16 model's), the reference the
  same weights: 2e-5;
- W8A8: the reference quantizes ``x`` the same way and sums in float64 (the int32 sum is exact;
  float32 rounds it and the two scale products): 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_linear import cpu_linear, pack_group_scale, pack_linear_weight
from kernels.int8_linear import (
    dequantize,
    quantize_symmetric,
    reference_linear,
    reference_w8a8,
    w8a8_linear,
)
from services.worker.quantized_linear import GroupQuantLinear, Int8Linear, W8A8Linear

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (N, K): SmolLM2's qkv and down, N not a multiple of 32, K odd (per channel only), tiny
SHAPES = [(960, 576), (576, 1536), (37, 96), (3, 5)]
TOL = {"channel": 2e-5, "group": 2e-5, "w8a8": 1e-5}


def _weights(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    q, scale = quantize_symmetric(w)
    # GGUF Q8_0's: fp16 scales per 32 weights (any even group size works; 32 where it divides)
    group = 32 if k % 32 == 0 else 2 if k % 2 == 0 else None
    gscale = None if group is None else (
        torch.rand(n, k // group, generator=gen) * 0.02).half().float()
    return q, scale, group, gscale


def _close(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, tol: float) -> None:
    err = ((out.double() - ref).abs() / (magnitude + 1e-6)).max().item()
    assert err <= tol, err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_weight_only_matches_float64(isa, dtype, shape):
    n, k = shape
    q, scale, group, gscale = _weights(n, k)
    bias = torch.randn(n)
    x = torch.randn(19, k).to(dtype)
    packed = pack_linear_weight(q)
    assert packed.dtype == torch.int8
    out = cpu_linear(x, packed, n, bias, torch.float32, scale)
    magnitude = reference_linear(x.abs(), q.abs(), scale, bias=bias.abs())
    _close(out, reference_linear(x, q, scale, bias=bias), magnitude, TOL["channel"])
    assert cpu_linear(x, packed, n, None, None, scale).dtype == dtype  # default: x's dtype
    if gscale is None:
        return
    out = cpu_linear(x, packed, n, bias, torch.float32, pack_group_scale(gscale))
    if isa == "amx" and dtype == torch.bfloat16:  # each q * d rounded to bf16 for the tiles
        w = dequantize(q, gscale, group).to(dtype).double()
        ref = x.double() @ w.T + bias.double()
    else:
        ref = reference_linear(x, q, gscale, group, bias)
    magnitude = reference_linear(x.abs(), q.abs(), gscale, group, bias.abs())
    _close(out, ref, magnitude, TOL["group"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_scales_take_the_stored_weights(isa, dtype):
    """Q8_0 served as int8 takes its weights as stored: at 16-bit activations nearer the exact
    product than the float copy of the model in that dtype (its weights rounded) comes; on the
    AMX path, whose tiles read a block converted to bf16, bitwise that float copy."""
    q, _, group, gscale = _weights(70, 64, seed=3)
    x = torch.randn(9, 64).to(dtype)
    ours = cpu_linear(x, pack_linear_weight(q), 70, None, torch.float32, pack_group_scale(gscale))
    floats = cpu_linear(x, pack_linear_weight(dequantize(q, gscale, group).to(dtype)), 70, None,
                        torch.float32)
    if isa == "amx" and dtype == torch.bfloat16:
        assert torch.equal(ours, floats)
        return
    exact = reference_linear(x, q, gscale, group)
    magnitude = reference_linear(x.abs(), q.abs(), gscale, group)
    _close(ours, exact, magnitude, TOL["group"])
    if dtype != torch.float32:
        assert (ours.double() - exact).abs().max() < (floats.double() - exact).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_gate_up_with_the_silu_mul_epilogue(isa, dtype):
    """A SwiGLU gate_up layer on int8 weights with the gate in its epilogue: per channel, the
    float32 silu(gate) * up of the dequantized product (its scales reordered with its rows);
    per group, the same of the stored weights."""
    q, scale, group, gscale = _weights(128, 64, seed=4)
    bias = torch.randn(128)
    x = torch.randn(11, 64).to(dtype)
    fused = Int8Linear(q, scale, bias, silu_mul=True)
    gate, up = reference_linear(x, q, scale, bias=bias).chunk(2, dim=-1)
    out = fused(x).double()
    assert out.shape == (11, 64) and fused(x).dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, gate * torch.sigmoid(gate) * up, atol=tol, rtol=tol)
    grouped = GroupQuantLinear(q, gscale, bias=bias, silu_mul=True)
    gate, up = reference_linear(x, q, gscale, group, bias).chunk(2, dim=-1)
    torch.testing.assert_close(grouped(x).double(), gate * torch.sigmoid(gate) * up, atol=tol,
                               rtol=tol)


def _rows_are_batch_invariant(run, x: torch.Tensor) -> None:
    full = run(x)
    for m in (1, 2, 5, 8, 17, 33, 255, 256, 257):
        assert torch.equal(run(x[:m]), full[:m]), m
    for row in (0, 7, 256, 299):
        assert torch.equal(run(x[row:row + 1])[0], full[row])


@pytest.mark.parametrize("per", ["channel", "group"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_at_any_batch_size(isa, per, dtype):
    n, k = 200, 96
    q, scale, _, gscale = _weights(n, k, seed=1)
    packed = pack_linear_weight(q)
    weight_scale = scale if per == "channel" else pack_group_scale(gscale)
    _rows_are_batch_invariant(
        lambda rows: cpu_linear(rows, packed, n, None, torch.float32, weight_scale),
        torch.randn(300, k).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_w8a8_row_is_the_same_at_any_batch_size(dtype):
    """Per-token activation scales and exact int32 sums: oneDNN's blocking cannot show."""
    q, scale, _, _ = _weights(200, 96, seed=1)
    _rows_are_batch_invariant(lambda rows: w8a8_linear(rows, q, scale, out_dtype=torch.float32),
                              torch.randn(300, 96).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_w8a8_matches_float64(dtype, shape):
    n, k = shape
    q, scale, _, _ = _weights(n, k, seed=2)
    bias = torch.randn(n)
    x = torch.randn(23, k).to(dtype)
    out = w8a8_linear(x, q, scale, bias, torch.float32)
    magnitude = reference_w8a8(x.abs(), q.abs(), scale, bias.abs())
    _close(out, reference_w8a8(x, q, scale, bias), magnitude, TOL["w8a8"])
    assert w8a8_linear(x, q, scale).dtype == dtype
    # and within the activation quantization's error of the weight-only product: |x| / 254 per
    # element, summed over k against |W| (a bound, far from tight)
    bound = (x.double().abs().amax(1, keepdim=True) / 254
             * dequantize(q, scale).double().abs().sum(1))
    assert ((out.double() - reference_linear(x, q, scale, bias=bias)).abs() <= bound + 1e-4).all()


def test_int_mm_is_exact():
    gen = torch.Generator().manual_seed(4)
    a = torch.randint(-127, 128, (33, 1536), dtype=torch.int8, generator=gen)
    b = torch.randint(-127, 128, (576, 1536), dtype=torch.int8, generator=gen)
    assert torch.equal(torch._int_mm(a, b.t()).long(), a.long() @ b.long().T)


def test_quantize_symmetric():
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5, -254.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_symmetric(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.tolist() == [2.0, 1.0]  # amax / 127; an all-zero row gets 1
    assert q[0].tolist() == [64, -32, 0, 1, -127]  # 63.5 -> 64, -31.75 -> -32, half to even
    assert q[1].tolist() == [0] * 5
    w = torch.randn(64, 80)
    q, scale = quantize_symmetric(w.bfloat16())
    assert q.abs().max() == 127 and (q == -128).sum() == 0
    assert ((dequantize(q, scale) - w.bfloat16().float()).abs()
            <= scale[:, None] / 2 + 1e-6).all()


def test_bad_input_is_refused():
    q, scale, _, _ = _weights(40, 64)
    packed = pack_linear_weight(q)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="int8 weights need weight_scale"):
        cpu_linear(x, packed, 40)
    with pytest.raises(ValueError, match="weight_scale is for int8 weights"):
        cpu_linear(x, pack_linear_weight(torch.randn(40, 64)), 40, None, None, scale)
    with pytest.raises(ValueError, match=r"per output channel must be \[40\]"):
        cpu_linear(x, packed, 40, None, None, scale[:39].clone())
    with pytest.raises(ValueError, match="per group must be"):
        cpu_linear(x, packed, 40, None, None, pack_group_scale(torch.ones(40, 3)))  # 64 / 3
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 with int8 weights"):
        cpu_linear(x.double(), packed, 40, None, None, scale)


@pytest.mark.parametrize("cls", [Int8Linear, GroupQuantLinear, W8A8Linear])
def test_modules_reduce_in_float32_then_add_the_bias(cls, isa):
    """A row-parallel layer: the float32 product is all-reduced (here: doubled), the bias
    added once, the sum rounded once to the model dtype."""
    q, scale, group, gscale = _weights(24, 64, seed=5)
    bias = torch.randn(24).bfloat16()
    x = torch.randn(2, 3, 64).bfloat16()
    seen = []

    def reduce(y: torch.Tensor) -> torch.Tensor:
        seen.append(y.dtype)
        return 2 * y
    s = gscale if cls is GroupQuantLinear else scale
    out = cls(q, s, bias=bias, reduce=reduce)(x)
    plain = cls(q, s)(x.view(6, 64).float())  # float32 x, no reduce: float32 products
    assert seen == [torch.float32] and out.shape == (2, 3, 24) and out.dtype == torch.bfloat16
    if cls is W8A8Linear:
        ref = reference_w8a8(x.view(6, 64), q, scale)
    elif cls is GroupQuantLinear and isa == "amx":  # the AMX tiles: weights rounded to bf16
        ref = x.view(6, 64).double() @ dequantize(q, gscale, group).bfloat16().double().T
    elif cls is GroupQuantLinear:  # the stored weights, exactly
        ref = reference_linear(x.view(6, 64), q, gscale, group)
    else:
        ref = reference_linear(x.view(6, 64), q, scale)
    torch.testing.assert_close(out.view(6, 24).double(), 2 * ref + bias.double(),
                               atol=3e-2, rtol=1e-2)  # one bf16 rounding of the result
    assert plain.dtype == torch.float32
