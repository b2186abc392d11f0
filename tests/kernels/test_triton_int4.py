"""The Triton 4-bit-code linear kernel (``kernels.triton_int4``) against its float64 reference.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in tests/conftest.py before triton is
imported), so shapes are small and cases few; with CUDA bfloat16 and a larger case with the
default (CUDA) tiles are added. Errors are measured against the magnitude of the sum,
``|x| @ |W|^T + |bias|``, so the bound does not depend on cancellation in the product.
"""

import pytest
import torch

from kernels.triton_int4 import (
    dequantize_int4,
    int4_linear_reference,
    pack_int4,
    triton_int4_linear,
    unpack_int4,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# max |y - reference| / (|x| @ |W|^T + |bias|), by x's dtype (float64 reference, no rounding)
TOLERANCES = {
    torch.float32: 1e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}

# (M, N, K, G, has_min, has_bias, x dtype, out dtype, block_k); block_k None: the launcher's.
# Ragged M and N edges in every case; G = 64 with block_k 32 puts two K steps in one group;
# G = 16 with block_k 32 (and K = 80, not a multiple of it) takes the per-element dequantize
# form (a step holding two groups) and a masked K tail; float16 in, float32 out once.
CASES = [
    pytest.param(1, 48, 64, 32, True, True, torch.float32, None, None, id="m1-g32-min-bias-fp32"),
    pytest.param(5, 40, 128, 64, False, True, torch.float16, None, None, id="m5-g64-bias-fp16"),
    pytest.param(17, 32, 64, 16, True, False, torch.float32, None, None, id="m17-g16-min-fp32"),
    pytest.param(3, 24, 80, 16, True, True, torch.float16, torch.float32, 32,
                 id="m3-g16-bk32-dequant-fp16-out-fp32"),
]
if CUDA:  # NOTE: the interpreter multiplies bf16 bits raw in tl.dot (test_paged_attention.py)
    CASES += [
        pytest.param(7, 72, 128, 32, True, True, torch.bfloat16, None, None, id="m7-g32-bf16"),
        pytest.param(70, 200, 512, 128, True, True, torch.float16, None, None, id="m70-cuda-tiles"),
    ]


def make_weight(n: int, k: int, group: int, has_min: bool, seed: int = 0):
    """Random codes 0..15, scales in [0.01, 0.1), mins -scale * zero with zero in [0, 15) (an
    AWQ / GPTQ zero point): (codes [N, K], qweight, scale, min or None), on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = 0.01 + 0.09 * torch.rand(n, k // group, generator=gen)
    weight_min = -scale * 15 * torch.rand(n, k // group, generator=gen) if has_min else None
    qweight = pack_int4(codes)
    weight_min = None if weight_min is None else weight_min.to(DEVICE)
    return codes.to(DEVICE), qweight.to(DEVICE), scale.to(DEVICE), weight_min


def magnitude(x, qweight, scale, weight_min, group, bias):
    """``|x| @ |W|^T + |bias|`` in float64: the scale of the sum's rounding errors."""
    out = x.double().abs() @ dequantize_int4(qweight, scale, weight_min, group).abs().T
    return out if bias is None else out + bias.double().abs()


def relative_error(out, expected, scale) -> float:
    return float(((out.double() - expected).abs() / scale).max())


@pytest.mark.parametrize("m,n,k,group,has_min,has_bias,dtype,out_dtype,block_k", CASES)
def test_matches_the_float64_reference(m, n, k, group, has_min, has_bias, dtype, out_dtype,
                                       block_k):
    _, qweight, scale, weight_min = make_weight(n, k, group, has_min)
    torch.manual_seed(1)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    if m == 17:  # the same values column-major: the kernel takes x's strides
        x = x.T.contiguous().T
    bias = torch.randn(n, device=DEVICE) if has_bias else None
    out = triton_int4_linear(x, qweight, scale, weight_min, group, bias, out_dtype,
                             block_k=block_k)
    assert out.shape == (m, n) and out.dtype == (out_dtype or dtype)
    expected = int4_linear_reference(x, qweight, scale, weight_min, group, bias)
    bound = magnitude(x, qweight, scale, weight_min, group, bias)
    assert relative_error(out, expected, bound) <= TOLERANCES[dtype]

    # The check can fail: a wrong min of one group (or none where there is one), or the two
    # nibbles of each byte swapped, is far outside the tolerance.
    wrong_min = (torch.zeros_like(scale) if weight_min is None else weight_min.clone())
    wrong_min[:, 0] += 0.05
    wrong = int4_linear_reference(x, qweight, scale, wrong_min, group, bias)
    assert relative_error(out, wrong, bound) > 10 * TOLERANCES[dtype]
    swapped = (qweight >> 4) | (qweight << 4)
    wrong = int4_linear_reference(x, swapped, scale, weight_min, group, bias)
    assert relative_error(out, wrong, bound) > 10 * TOLERANCES[dtype]


def test_pack_int4_layout():
    """k = 2j in the low nibble of byte j, 2j + 1 in the high one; unpack_int4 inverts it."""
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0xF0]]
    assert torch.equal(unpack_int4(packed), codes)
    with pytest.raises(ValueError, match=r"must be 0\.\.15"):
        pack_int4(torch.full((2, 4), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


def test_launcher_errors_name_the_argument():
    _, qweight, scale, weight_min = make_weight(8, 64, 32, True)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"K \(x.shape\[1\]\) = 63 must be positive and even"):
        triton_int4_linear(torch.randn(2, 63, device=DEVICE), qweight, scale, None, 32)
    with pytest.raises(ValueError, match="group_size 24 must be even and divide K"):
        triton_int4_linear(x, qweight, scale, None, 24)
    with pytest.raises(ValueError, match="group_size 5 must be even"):
        triton_int4_linear(x, qweight, scale, None, 5)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        triton_int4_linear(x, qweight.to(torch.int8), scale, None, 32)
    with pytest.raises(ValueError, match="scale must be float32"):
        triton_int4_linear(x, qweight, scale[:, :1], None, 32)
    with pytest.raises(ValueError, match="weight_min must be float32"):
        triton_int4_linear(x, qweight, scale, weight_min.half(), 32)
    with pytest.raises(ValueError, match="bias must be"):
        triton_int4_linear(x, qweight, scale, None, 32, torch.zeros(9, device=DEVICE))
    with pytest.raises(ValueError, match="block_k 8 must be a power of 2 >= 16"):
        triton_int4_linear(x, qweight, scale, None, 32, block_k=8)
