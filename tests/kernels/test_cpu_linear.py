"""The native row-invariant linear (``kernels.cpu_linear``) against a float64 reference, on
every instruction-set step this CPU can run (``PAGEDSERVE_CPU_ISA``): float32 / bfloat16 /
float16 weights, float32 or same-dtype output, bias, odd K and N; each row's result bitwise the
same at any number of rows, at any place in the batch and with any thread count; the module
that wraps it (``services/worker/packed_linear.py``) and its use as a float32 LM head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.cpu_linear import cpu_linear, gate_up_blocks, pack_linear_weight, write_packed
from services.worker.packed_linear import PackedLinear, pack_model_linears

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (N, K): SmolLM2's qkv and LM head, odd sizes (N not a multiple of 32, K odd), a tiny one
SHAPES = [(960, 576), (5003, 576), (37, 77), (3, 5)]
# float32 accumulation over K products of 16-bit or float32 inputs: a few ulps of the sum;
# a 16-bit output adds one rounding to its dtype
ACC_TOL = (2e-5, 2e-5)
OUT_TOL = {torch.float32: ACC_TOL, torch.bfloat16: (1e-2, 8e-3), torch.float16: (1e-3, 1e-3)}


def _problem(n: int, k: int, m: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    return x, w, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64(isa, dtype, shape):
    n, k = shape
    x, w, bias = _problem(n, k, 67, dtype)
    packed = pack_linear_weight(w)
    ref = x.double() @ w.double().T
    out = cpu_linear(x, packed, n, out_dtype=torch.float32)
    assert out.shape == (67, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=ACC_TOL[0], rtol=ACC_TOL[1])
    out = cpu_linear(x, packed, n, bias)  # x's dtype, bias added before the rounding
    assert out.dtype == dtype
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(out.double(), ref + bias.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_at_any_batch_size_place_and_thread_count(isa, dtype):
    n, k = 200, 96
    x, w, bias = _problem(n, k, 300, dtype, seed=1)
    packed = pack_linear_weight(w)
    full = cpu_linear(x, packed, n, bias, torch.float32)
    for m in (1, 2, 3, 5, 8, 9, 17, 33, 255, 256, 257):
        assert torch.equal(cpu_linear(x[:m], packed, n, bias, torch.float32), full[:m]), m
    for row in (0, 7, 255, 256, 299):  # alone, and at another place in a smaller batch
        assert torch.equal(cpu_linear(x[row:row + 1], packed, n, bias, torch.float32)[0],
                           full[row])
        start = max(0, row - 4)
        assert torch.equal(cpu_linear(x[start:row + 3], packed, n, bias, torch.float32),
                           full[start:row + 3])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = cpu_linear(x, packed, n, bias, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, full)


def test_non_contiguous_x_and_empty_batch():
    x, w, _ = _problem(40, 33, 12, torch.bfloat16)
    packed = pack_linear_weight(w)
    wide = torch.cat([x, x], dim=1)[:, :33]  # rows strided
    assert torch.equal(cpu_linear(wide, packed, 40, out_dtype=torch.float32),
                       cpu_linear(x, packed, 40, out_dtype=torch.float32))
    assert cpu_linear(x[:0], packed, 40).shape == (0, 40)


def test_bad_input_is_refused():
    x, w, _ = _problem(40, 32, 4, torch.bfloat16)
    packed = pack_linear_weight(w)
    with pytest.raises(ValueError, match="x is Float"):
        cpu_linear(x.float(), packed, 40)
    with pytest.raises(ValueError, match="K = 29"):
        cpu_linear(x[:, :29], packed, 40)
    with pytest.raises(ValueError, match="out_features 70"):
        cpu_linear(x, packed, 70)
    with pytest.raises(ValueError, match="bias must be"):
        cpu_linear(x, packed, 40, torch.zeros(39))
    with pytest.raises(ValueError, match="float32, bfloat16, float16 and int8"):
        pack_linear_weight(torch.zeros(4, 4, dtype=torch.float64))


def test_packed_linear_module_with_reduce_and_leading_dims():
    x, w, bias = _problem(24, 16, 6, torch.float32)
    calls = []

    def reduce(y: torch.Tensor) -> torch.Tensor:  # stands in for the tp all-reduce
        calls.append(y.shape)
        return 2 * y
    layer = PackedLinear(w, bias, reduce=reduce)
    out = layer(x.view(2, 3, 16))
    assert out.shape == (2, 3, 24) and calls == [(6, 24)]
    torch.testing.assert_close(out.view(6, 24), 2 * (x @ w.T) + bias, atol=1e-5, rtol=1e-5)


def test_packed_linear_reduces_16_bit_partial_sums_in_float32():
    """A row-parallel bf16 layer all-reduces float32 partial sums and rounds once, after the
    bias, as one rank computing the whole sum does."""
    x, w, bias = _problem(24, 16, 6, torch.bfloat16)
    seen = []

    def reduce(y: torch.Tensor) -> torch.Tensor:
        seen.append(y.dtype)
        return 2 * y
    out = PackedLinear(w, bias, reduce=reduce)(x)
    assert seen == [torch.float32] and out.dtype == torch.bfloat16
    full = cpu_linear(x, pack_linear_weight(w), 24, out_dtype=torch.float32)
    assert torch.equal(out, (2 * full + bias).to(torch.bfloat16))


def test_pack_model_linears_swaps_the_decoder_and_gives_a_float32_lm_head():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 8)
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.lm_head = None  # tied

    model = Model().to(torch.bfloat16)
    embed = model.embed_tokens.weight.clone()
    pack_model_linears(model, lm_head=True, decoder=False)
    assert isinstance(model.lm_head, PackedLinear) and type(model.layers[0].proj) is nn.Linear
    h = torch.randn(3, 8).bfloat16()
    logits = model.lm_head(h)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), h.double() @ embed.double().T,
                               atol=ACC_TOL[0], rtol=ACC_TOL[1])
    assert torch.equal(model.embed_tokens.weight, embed)  # the embedding keeps its table
    pack_model_linears(model, lm_head=False, decoder=True)
    assert all(isinstance(layer.proj, PackedLinear) for layer in model.layers)


def _silu_mul_reference(x, w, bias):
    """float64 ``silu(gate) * up`` of a gate-then-up layer (w ``[2I, K]``, bias ``[2I]``)."""
    gate, up = (x.double() @ w.double().T + bias.double()).chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_epilogue_matches_float64_and_is_row_invariant(isa, dtype):
    """SwiGLU's gate in the epilogue (``silu_mul``): the rows in ``gate_up_blocks``' order,
    ``silu(gate) * up`` from the float32 sums, one rounding; each row the same in any batch."""
    i, k = 96, 64
    x, w, bias = _problem(2 * i, k, 70, dtype, seed=3)
    packed = pack_linear_weight(gate_up_blocks(w))
    out = cpu_linear(x, packed, 2 * i, gate_up_blocks(bias), torch.float32, silu_mul=True)
    assert out.shape == (70, i)
    torch.testing.assert_close(out.double(), _silu_mul_reference(x, w, bias), atol=5e-5,
                               rtol=5e-5)
    low = cpu_linear(x, packed, 2 * i, gate_up_blocks(bias), silu_mul=True)
    assert low.dtype == dtype
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(low.double(), _silu_mul_reference(x, w, bias), atol=atol,
                               rtol=rtol)
    for m in (1, 3, 9, 33):
        assert torch.equal(cpu_linear(x[m:2 * m], packed, 2 * i, gate_up_blocks(bias),
                                      torch.float32, silu_mul=True), out[m:2 * m]), m
    # the module: the same layer from the gate-then-up weight, and large |gate| (exp's clamps)
    layer = PackedLinear(w, bias, out_dtype=torch.float32, silu_mul=True)
    assert torch.equal(layer(x.view(7, 10, k)).view(70, i), out)
    big = (x * 40).to(dtype)
    torch.testing.assert_close(layer(big).double(), _silu_mul_reference(big, w, bias),
                               atol=1e-3, rtol=2e-4)
    assert torch.isfinite(layer(big)).all()


def test_silu_mul_is_refused_where_it_does_not_fit():
    x, w, _ = _problem(48, 32, 4, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear(x, pack_linear_weight(w), 48, silu_mul=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        gate_up_blocks(w)


def test_pack_model_linears_fuses_swiglu_and_keeps_the_output():
    """A bf16 SwiGLU MLP gets the fused gate_up (``act`` an identity); its output stays within
    a bf16 rounding or two of the unfused MLP's (which rounds gate and up to bf16 before the
    SiLU)."""
    from services.worker.models.llama import MLP, LlamaConfig, SiluAndMul

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, mlp_bias=True)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP(cfg)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer()])

    torch.manual_seed(0)
    model = Model().to(torch.bfloat16)
    plain = model.layers[0].mlp
    x = torch.randn(5, 64).to(torch.bfloat16)
    expected = plain(x)
    assert isinstance(plain.act, SiluAndMul)
    pack_model_linears(model, lm_head=False, decoder=True)
    mlp = model.layers[0].mlp
    assert isinstance(mlp.gate_up_proj, PackedLinear) and mlp.gate_up_proj.silu_mul
    assert isinstance(mlp.act, nn.Identity) and isinstance(mlp.down_proj, PackedLinear)
    torch.testing.assert_close(mlp(x).float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_packed_equals_packing_the_written_weight(dtype):
    """A block written into a packed weight (a LoRA slot swap) leaves exactly what packing
    the weight with that block gives: odd and even first rows and columns, the last column of
    an odd K, a whole column; outside the weight it is refused."""
    n, k = 70, 37
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=gen).to(dtype)
    packed = pack_linear_weight(w)
    for row, col, r, c in ((3, 5, 20, 7), (0, 36, 70, 1), (33, 0, 1, 37), (64, 10, 6, 2)):
        block = torch.randn(r, c, generator=gen).to(dtype)
        write_packed(packed, row, col, block)
        w[row:row + r, col:col + c] = block
        assert torch.equal(packed, pack_linear_weight(w)), (row, col, r, c)
    with pytest.raises(ValueError, match="cannot write"):
        write_packed(packed, 95, 0, torch.zeros(3, 3))  # (rows padded to 96)
    with pytest.raises(ValueError, match="cannot write"):
        write_packed(packed, 0, 37 if dtype == torch.float32 else 38, torch.zeros(3, 1))


def test_packed_linear_write_keeps_the_gate_up_order():
    """``PackedLinear.write`` of a SwiGLU layer takes whole columns in gate-then-up order and
    computes what a layer packed from the written weight computes; a partial column is
    refused."""
    x, w, bias = _problem(64, 40, 9, torch.bfloat16, seed=7)
    layer = PackedLinear(w, bias, silu_mul=True)
    columns = torch.randn(64, 6).to(torch.bfloat16)
    layer.write(0, 30, columns)
    w[:, 30:36] = columns
    assert torch.equal(layer(x), PackedLinear(w, bias, silu_mul=True)(x))
    with pytest.raises(ValueError, match="whole columns"):
        layer.write(1, 0, columns[1:])
