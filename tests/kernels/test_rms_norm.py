"""RMSNorm and fused residual-add + RMSNorm (torch and Triton) against the float64 reference.

Hidden sizes include non-powers of 2 (576 is SmolLM2's) so the Triton kernel's masked padding
columns are exercised. On CPU the Triton kernel runs under TRITON_INTERPRET=1 (conftest.py).
"""

import pytest
import torch

from kernels import (
    reference_rms_norm,
    torch_fused_add_rms_norm,
    torch_rms_norm,
    triton_fused_add_rms_norm,
    triton_rms_norm,
)
from tests.kernels.test_paged_attention import TOLERANCES

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-5

BACKENDS = {
    "torch": (torch_rms_norm, torch_fused_add_rms_norm),
    "triton": (triton_rms_norm, triton_fused_add_rms_norm),
}
# NOTE: the Triton interpreter computes bfloat16 arithmetic on the raw bits (see
# test_paged_attention.py), so Triton bfloat16 runs on CUDA only.
DTYPE_PARAMS = [
    pytest.param(backend, dtype, id=f"{backend}-{str(dtype)[6:]}")
    for backend in BACKENDS
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    if backend == "torch" or dtype != torch.bfloat16 or CUDA
]
HIDDEN_SIZES = [576, 64, 1000] + ([4096, 8192] if CUDA else [])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_inputs(num_tokens: int, hidden_size: int, dtype: torch.dtype):
    """x ~ N(0, 1), the residual stream ~ N(0, 16) (it grows with depth), weight ~ 1 + N(0, 0.1)."""
    x = torch.randn(num_tokens, hidden_size, device=DEVICE).to(dtype)
    residual = (torch.randn(num_tokens, hidden_size, device=DEVICE) * 4).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden_size, device=DEVICE)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("hidden_size", HIDDEN_SIZES)
@pytest.mark.parametrize("backend,dtype", DTYPE_PARAMS)
def test_rms_norm_of_the_float32_stream(backend, dtype, hidden_size):
    """The final norm reads the float32 residual stream and answers in the weight's dtype."""
    x, _, weight = make_inputs(5, hidden_size, torch.float32)
    weight = weight.to(dtype)
    out = BACKENDS[backend][0](x, weight, EPS)
    expected, _ = reference_rms_norm(x, weight, EPS)
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("hidden_size", HIDDEN_SIZES)
@pytest.mark.parametrize("backend,dtype", DTYPE_PARAMS)
def test_rms_norm(backend, dtype, hidden_size):
    x, _, weight = make_inputs(5, hidden_size, dtype)
    x_before = x.clone()
    out = BACKENDS[backend][0](x, weight, EPS)
    expected, _ = reference_rms_norm(x, weight, EPS)
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("stream", ["model_dtype", "float32"])
@pytest.mark.parametrize("hidden_size", HIDDEN_SIZES)
@pytest.mark.parametrize("backend,dtype", DTYPE_PARAMS)
def test_fused_add_rms_norm(backend, dtype, hidden_size, stream):
    """``stream="float32"``: the models' residual stream, float32 beside a narrower branch."""
    x, residual, weight = make_inputs(5, hidden_size, dtype)
    if stream == "float32":
        residual = residual.float() + 0.01 * torch.randn_like(residual, dtype=torch.float32)
    x_before, residual_before = x.clone(), residual.clone()
    out, residual_out = BACKENDS[backend][1](x, residual, weight, EPS)
    expected, expected_residual = reference_rms_norm(x, weight, EPS, residual)
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype and residual_out.dtype == residual.dtype
    if stream == "float32":  # one float32 rounding of the exact sum, not one of x's dtype
        assert torch.equal(residual_out, (x.double() + residual.double()).float())
    torch.testing.assert_close(residual_out.double(), expected_residual, atol=atol, rtol=rtol)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
    # out of place: the inputs are untouched
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_torch_path(dtype):
    """The CUDA path against the CPU production path, row strides and a zero row included."""
    x, residual, weight = make_inputs(6, 576, dtype)
    x[2] = 0  # rsqrt(0 + eps): finite
    wide = torch.zeros(6, 1000, device=DEVICE, dtype=dtype)
    wide[:, :576] = residual
    residual = wide[:, :576]  # row stride 1000
    out, res = triton_fused_add_rms_norm(x, residual, weight, EPS)
    ref_out, ref_res = torch_fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(res, ref_res)  # one rounding of the same sum
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    assert torch.isfinite(out).all()


def test_empty_batch():
    x, residual, weight = make_inputs(0, 576, torch.float32)
    assert triton_rms_norm(x, weight, EPS).shape == (0, 576)
    out, res = triton_fused_add_rms_norm(x, residual, weight, EPS)
    assert out.shape == res.shape == (0, 576)


def test_triton_rejects_bad_inputs():
    x, residual, weight = make_inputs(3, 64, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        triton_rms_norm(x, weight[:32], EPS)
    with pytest.raises(ValueError, match="residual"):
        triton_fused_add_rms_norm(x, residual.half(), weight, EPS)
    with pytest.raises(ValueError, match="num_tokens, hidden_size"):
        triton_rms_norm(x[None], weight, EPS)
    with pytest.raises(ValueError, match="contiguous"):
        triton_rms_norm(x.t(), weight[:3], EPS)
