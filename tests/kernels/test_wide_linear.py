"""The LM head matmul (``kernels.torch_ops.torch_wide_linear``: oneDNN on a CPU at float32)
against a float64 reference, and its fallback when the oneDNN op fails."""

import pytest
import torch

from kernels import torch_ops
from kernels.torch_ops import torch_wide_linear
from tests.kernels.test_paged_attention import TOLERANCES


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_linear_matches_float64(num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 576, generator=gen).to(dtype)
    weight = (torch.randn(5003, 576, generator=gen) * 0.05).to(dtype)  # odd width
    out = torch_wide_linear(x, weight)
    assert out.shape == (num_tokens, 5003) and out.dtype == dtype
    ref = x.double() @ weight.double().T
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def test_wide_linear_falls_back_to_f_linear_when_onednn_fails(monkeypatch):
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("no oneDNN here")
    monkeypatch.setattr(torch_ops, "_ONEDNN_LINEAR_OK", True)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken, raising=False)
    x, weight = torch.randn(4, 8), torch.randn(16, 8)
    torch.testing.assert_close(torch_wide_linear(x, weight), x @ weight.T)
    assert calls and torch_ops._ONEDNN_LINEAR_OK is False
    torch_wide_linear(x, weight)
    assert len(calls) == 1  # not tried again
