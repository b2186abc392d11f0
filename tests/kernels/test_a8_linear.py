"""The native A8 op (``kernels/csrc/cpu_a8_linear.cpp``: 4-bit or int8 codes with a scale and
min per group, activations quantized per group of 32 in the op) on every body this CPU runs,
against a float64 reference of its formula; a row's result the same at any batch size; the
SiLU-gated epilogue; packing and bad input.

The reference quantizes x as the op does (float32 ``amax / 127`` and ``x / s``, round half to
even), then sums ``(xq s_x) . (q s + m)`` in float64. Tolerance, relative to the same sums
over magnitudes: 2e-6 (float32 rounding of K / 32 group terms; measured <= 1e-7).
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_linear import (
    cpu_a8_linear,
    gate_up_blocks,
    pack_a8_weight,
    pack_group_scale,
    w8a8_linear_body,
)
from tests.kernels.test_w8a8_linear import BODIES as W8A8_BODIES
from tests.kernels.test_w8a8_linear import set_body

# the int8 bodies (cpu_vnni.h) the A8 op shares with W8A8; W8A8's brgemm is its own
BODIES = [b for b in W8A8_BODIES if b != "brgemm"]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (M, N, K, G): SmolLM2's qkv / gate_up / down at decode and prefill sizes with GGUF's 32,
# AWQ / GPTQ's 64 and 128 and a whole-row group, N not a multiple of 32, every tile remainder
SHAPES = [(1, 960, 576, 32), (8, 3072, 576, 32), (300, 576, 1536, 128), (13, 37, 128, 64),
          (6, 3, 96, 96)]
TOL = 2e-6


@pytest.fixture(params=BODIES)
def body(request, monkeypatch) -> str:
    set_body(monkeypatch, request.param)
    assert w8a8_linear_body() == request.param  # (the same choice, cpu_vnni.h)
    return request.param


CODES = ["4-bit", "int8"]


def _layer(n: int, k: int, group: int, seed: int, codes: str = "4-bit"):
    gen = torch.Generator().manual_seed(seed)
    codes = (torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen) if codes == "4-bit"
             else torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen))
    scale = (torch.rand(n, k // group, generator=gen) * 0.02).half().float()
    mins = -(torch.rand(n, k // group, generator=gen) * 0.1).half().float()
    return codes, scale, mins, torch.randn(n, generator=gen)


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
              mins: torch.Tensor | None, group: int) -> torch.Tensor:
    """float64 ``cpu_a8_linear`` (no bias): x quantized per 32 as the op does, then the
    weight-only product of those dequantized activations."""
    m, k = x.shape
    xg = x.float().view(m, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xd = (torch.round(xg / s).clamp(-127, 127).double() * s.double()).view(m, k)
    w = codes.double() * scale.double().repeat_interleave(group, 1)
    if mins is not None:
        w = w + mins.double().repeat_interleave(group, 1)
    return xd @ w.T


@pytest.mark.parametrize("kind", CODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64(body, dtype, shape, kind):
    m, n, k, group = shape
    codes, scale, mins, bias = _layer(n, k, group, seed=m + n + k, codes=kind)
    x = (torch.randn(m, k) * 2).to(dtype)
    x[0, :32] = 0.0  # a group of zeros (scale 1)
    packed = pack_a8_weight(codes)
    for mn in (mins, None):
        packed_min = None if mn is None else pack_group_scale(mn)
        out = cpu_a8_linear(x, packed, n, pack_group_scale(scale), packed_min, bias,
                              torch.float32)
        ref = reference(x, codes, scale, mn, group) + bias.double()
        magnitude = reference(x.abs(), codes.abs(), scale, None if mn is None else mn.abs(),
                              group)
        err = ((out.double() - ref).abs() / (magnitude + bias.double().abs() + 1e-6)).max()
        assert out.shape == (m, n) and err <= TOL, err
    out = cpu_a8_linear(x, packed, n, pack_group_scale(scale), pack_group_scale(mins))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(x, codes, scale, mins, group),
                               atol=1e-2, rtol=1e-2)  # one rounding to x's dtype


@pytest.mark.parametrize("kind", CODES)
def test_a_row_is_the_same_at_any_batch_size(body, kind):
    codes, scale, mins, _ = _layer(200, 128, 32, seed=1, codes=kind)
    packed, s, mn = pack_a8_weight(codes), pack_group_scale(scale), pack_group_scale(mins)
    x = torch.randn(300, 128).bfloat16()
    full = cpu_a8_linear(x, packed, 200, s, mn, None, torch.float32)
    for rows in (1, 3, 4, 5, 255, 257):
        assert torch.equal(cpu_a8_linear(x[:rows], packed, 200, s, mn, None, torch.float32),
                           full[:rows])
    assert torch.equal(cpu_a8_linear(x[7:8], packed, 200, s, mn, None, torch.float32),
                       full[7:8])


@pytest.mark.parametrize("kind", CODES)
def test_silu_mul_epilogue(body, kind):
    n, k = 2 * 64, 64
    codes, scale, mins, bias = _layer(n, k, 32, seed=3, codes=kind)
    x = torch.randn(9, k)
    out = cpu_a8_linear(x, pack_a8_weight(gate_up_blocks(codes)), n,
                          pack_group_scale(gate_up_blocks(scale)),
                          pack_group_scale(gate_up_blocks(mins)), gate_up_blocks(bias), None,
                          True)
    sums = reference(x, codes, scale, mins, 32) + bias.double()
    ref = torch.nn.functional.silu(sums[:, : n // 2]) * sums[:, n // 2:]
    assert out.shape == (9, n // 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_packing():
    codes = (torch.arange(40 * 32) % 16).to(torch.uint8).view(40, 32)
    packed = pack_a8_weight(codes)
    assert packed.shape == (2, 4, 32, 4) and packed.dtype == torch.uint8
    for n in (0, 31, 32, 39):
        for j in range(4):
            lane = packed[n // 32, j, n % 32]
            assert (lane & 0x0F).tolist() == codes[n, 8 * j: 8 * j + 4].tolist()
            assert (lane >> 4).tolist() == codes[n, 8 * j + 4: 8 * j + 8].tolist()
    assert (packed[1, :, 8:] == 0).all()
    int8 = (torch.arange(40 * 32) % 255 - 127).to(torch.int8).view(40, 32)
    packed = pack_a8_weight(int8)
    assert packed.shape == (2, 8, 32, 4) and packed.dtype == torch.int8
    for n in (0, 31, 32, 39):
        assert packed[n // 32, :, n % 32].flatten().tolist() == int8[n].tolist()


def test_bad_input_is_refused():
    codes, scale, _, _ = _layer(40, 64, 32, seed=4)
    packed, s = pack_a8_weight(codes), pack_group_scale(scale)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_a8_weight(codes[:, :48].contiguous())
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_a8_weight(codes | 0x10)
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        pack_a8_weight(torch.full((4, 32), -128, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"uint8 \(4-bit\) or int8"):
        pack_a8_weight(codes.float())
    with pytest.raises(ValueError, match="x has K = 32"):
        cpu_a8_linear(x[:, :32], packed, 40, s)
    with pytest.raises(ValueError, match="G a multiple of 32"):
        cpu_a8_linear(x, packed, 40, pack_group_scale(torch.ones(40, 4)))  # G = 16
    with pytest.raises(ValueError, match="weight_min"):
        cpu_a8_linear(x, packed, 40, s, s[:1].clone())
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        cpu_a8_linear(x.double(), packed, 40, s)
    assert cpu_a8_linear(x[:0], packed, 40, s).shape == (0, 40)
