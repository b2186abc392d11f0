"""The native W8A8 op (``kernels/csrc/cpu_int8_linear.cpp``) on every body this CPU runs:
bit for bit ``kernels.int8_linear.w8a8_linear`` (torch._int_mm, itself checked against float64
in test_int8_linear.py) and within float32 rounding of the float64 reference; a row's result
the same at any batch size; the SiLU-gated epilogue; packing and bad input.

Bodies (``PAGEDSERVE_CPU_ISA`` caps them, ``PAGEDSERVE_CPU_VNNI=0`` turns VNNI off): brgemm
(items of 16+ rows on ATen's ``cpublas::brgemm``, oneDNN's ukernel: AMX-INT8 tiles on an AMX
CPU, where it is the default, oneDNN's VNNI code on any other AVX512-VNNI CPU under
``PAGEDSERVE_CPU_W8A8_BRGEMM=1``), vnni512 (AVX512-VNNI), avxvnni (AVX-VNNI), avx2
(vpmaddubsw), scalar. Each is probed: one this CPU cannot run is not listed (the op never
picks it here).
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_attention import ISA_ENV
from kernels.cpu_linear import (
    BRGEMM_ENV,
    VNNI_ENV,
    cpu_w8a8_linear,
    gate_up_blocks,
    pack_w8a8_weight,
    w8a8_linear_body,
)
from kernels.int8_linear import quantize_symmetric, reference_w8a8, w8a8_linear
from tests.kernels.cpu_isas import RUNNABLE_ISAS

# body -> (PAGEDSERVE_CPU_ISA, PAGEDSERVE_CPU_VNNI, PAGEDSERVE_CPU_W8A8_BRGEMM)
SETTINGS = {"brgemm": (RUNNABLE_ISAS[-1], "1", "1"), "vnni512": (RUNNABLE_ISAS[-1], "1", "0"),
            "avxvnni": ("avx2", "1", "0"), "avx2": ("avx2", "0", "0"),
            "scalar": ("scalar", "1", "0")}


def set_body(mp: pytest.MonkeyPatch, body: str) -> None:
    for env, value in zip((ISA_ENV, VNNI_ENV, BRGEMM_ENV), SETTINGS[body], strict=True):
        mp.setenv(env, value)


def _runnable() -> list[str]:
    found = []
    with pytest.MonkeyPatch.context() as mp:
        for body in SETTINGS:
            if SETTINGS[body][0] not in RUNNABLE_ISAS:
                continue
            set_body(mp, body)
            if w8a8_linear_body() == body:
                found.append(body)
    return found


BODIES = _runnable()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (M, N, K): SmolLM2's qkv / gate_up / down at decode and prefill sizes, N not a multiple of
# 32, K not a multiple of 4, tiles of every row count of the widest body (12) and a remainder
# (brgemm: 300 rows = a chunk of 256 and one of 44 rows, 270 = 256 + 14 rows on the tiles)
SHAPES = [(1, 960, 576), (8, 3072, 576), (300, 576, 1536), (13, 37, 98), (25, 3, 5), (2, 64, 1),
          (270, 40, 64)]


@pytest.fixture(params=BODIES)
def body(request, monkeypatch) -> str:
    set_body(monkeypatch, request.param)
    assert w8a8_linear_body() == request.param
    return request.param


def test_the_best_body_runs_by_default(monkeypatch):
    for env in (ISA_ENV, VNNI_ENV, BRGEMM_ENV):
        monkeypatch.delenv(env, raising=False)
    # brgemm is the default on an AMX CPU only (AMX-INT8 tiles); elsewhere the best tiles
    best = next(b for b in BODIES if b != "brgemm" or RUNNABLE_ISAS[-1] == "amx")
    assert w8a8_linear_body() == best
    assert "avx2" in BODIES or RUNNABLE_ISAS == ["scalar"]


def _layer(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize_symmetric(torch.randn(n, k, generator=gen))
    return q, scale, torch.randn(n, generator=gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_the_torch_form_bit_for_bit(body, dtype, shape):
    m, n, k = shape
    q, scale, bias = _layer(n, k, seed=m + n + k)
    x = (torch.randn(m, k) * 3).to(dtype)
    x[0, 0] = 0.0  # and a row of zeros (scale 1) where there are two rows
    if m > 1:
        x[1] = 0.0
    packed, comp = pack_w8a8_weight(q)
    for b, out_dtype in ((None, None), (bias, torch.float32), (bias.bfloat16(), torch.bfloat16)):
        out = cpu_w8a8_linear(x, packed, comp, n, scale, b, out_dtype)
        if k == 1:  # torch 2.13's CPU _int_mm returns uninitialized memory for K = 1
            continue
        ref = w8a8_linear(x, q, scale, b, out_dtype)
        assert out.dtype == ref.dtype and out.shape == (m, n)
        assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()
    out = cpu_w8a8_linear(x, packed, comp, n, scale, bias, torch.float32)
    magnitude = reference_w8a8(x.abs(), q.abs(), scale, bias.abs())
    err = ((out.double() - reference_w8a8(x, q, scale, bias)).abs() / (magnitude + 1e-6)).max()
    assert err <= 1e-5


def test_a_row_is_the_same_at_any_batch_size(body):
    q, scale, _ = _layer(200, 96, seed=1)
    packed, comp = pack_w8a8_weight(q)
    x = torch.randn(300, 96).bfloat16()
    full = cpu_w8a8_linear(x, packed, comp, 200, scale, None, torch.float32)
    for rows in (1, 5, 12, 13, 255, 257):
        assert torch.equal(cpu_w8a8_linear(x[:rows], packed, comp, 200, scale, None,
                                           torch.float32), full[:rows])
    assert torch.equal(cpu_w8a8_linear(x[7:8], packed, comp, 200, scale, None, torch.float32),
                       full[7:8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_epilogue(body, dtype):
    """SwiGLU from the float32 sums, rounded once: silu(gate + b) * (up + b)."""
    n, k = 2 * 96, 64
    q, scale, bias = _layer(n, k, seed=3)
    x = torch.randn(17, k).to(dtype)
    packed, comp = pack_w8a8_weight(gate_up_blocks(q))
    out = cpu_w8a8_linear(x, packed, comp, n, gate_up_blocks(scale), gate_up_blocks(bias),
                          None, True)
    sums = reference_w8a8(x, q, scale, bias)
    gate, up = sums[:, : n // 2], sums[:, n // 2:]
    ref = torch.nn.functional.silu(gate) * up
    assert out.shape == (17, n // 2) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_packing():
    q = torch.arange(-60, 60, dtype=torch.int8).view(40, 3)  # N = 40: two blocks, K = 3 -> 4
    packed, comp = pack_w8a8_weight(q)
    assert packed.shape == (2, 1, 32, 4) and packed.dtype == torch.int8
    assert comp.shape == (64,) and comp.dtype == torch.int32
    for n in (0, 31, 32, 39):
        assert packed[n // 32, 0, n % 32, :3].tolist() == q[n].tolist()
        assert packed[n // 32, 0, n % 32, 3] == 0 and comp[n] == 128 * int(q[n].sum())
    assert (packed[1, 0, 8:] == 0).all() and (comp[40:] == 0).all()


def test_bad_input_is_refused():
    q, scale, _ = _layer(40, 64, seed=4)
    packed, comp = pack_w8a8_weight(q)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        pack_w8a8_weight(torch.full((4, 8), -128, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8"):
        pack_w8a8_weight(q.float())
    with pytest.raises(ValueError, match="x has K = 60"):
        cpu_w8a8_linear(x[:, :60], packed, comp, 40, scale)
    with pytest.raises(ValueError, match=r"weight_scale must be a contiguous float32 \[40\]"):
        cpu_w8a8_linear(x, packed, comp, 40, scale[:39].clone())
    with pytest.raises(ValueError, match="compensation"):
        cpu_w8a8_linear(x, packed, comp[:32].clone(), 40, scale)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        cpu_w8a8_linear(x.double(), packed, comp, 40, scale)
    with pytest.raises(ValueError, match="silu_mul needs out_features a multiple of 32"):
        cpu_w8a8_linear(x, packed, comp, 40, scale, None, None, True)
    assert cpu_w8a8_linear(x[:0], packed, comp, 40, scale).shape == (0, 40)
