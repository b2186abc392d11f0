"""AWQ / GPTQ 4-bit checkpoints read as GroupCodes (services/worker/int4_checkpoints.py).

The checkpoints are made here: a small random float weight quantized per group (min/max,
zero point), packed by packers written after the published packing code (AutoAWQ
``WQLinear_GEMM.from_linear``, AutoGPTQ ``QuantLinear.pack``), then read back. The float32
weights read are compared with ``torch.equal`` (EXACT, no ulp allowance: ``q*s`` and ``z*s``
are exact in float32 and so is their difference, see the module docstring) to the float32
reference ``(q - z) * s``, and, rounded to fp16, with ``torch.equal`` to the fp16 reference
``(q - z).half() * s.half()`` that AutoAWQ / AutoGPTQ compute.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.gguf_blocks import GroupCodes
from services.worker.int4_checkpoints import (
    Int4Config,
    Int4Layer,
    dequantize_reference,
    quant_config,
    read_awq,
    read_gptq,
)

N, K = 64, 256
GROUPS = (32, 64, 128)

# AutoAWQ WQLinear_GEMM.from_linear's order_map, written out here (not imported)
ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


# ---------------------------------------------------------------------------------------------
# packers, after the published code


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def pack_awq(intweight: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` ints 0..15 -> int32 ``[R, N/8]``, AutoAWQ ``WQLinear_GEMM.from_linear``:
    ``for i in range(8): qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)``
    (used for qweight ``[K, N]`` and qzeros ``[K/G, N]`` alike)."""
    iw = intweight.numpy().astype(np.uint32)
    q = np.zeros((iw.shape[0], iw.shape[1] // 8), dtype=np.uint32)
    for col in range(iw.shape[1] // 8):
        for i in range(8):
            q[:, col] |= iw[:, col * 8 + ORDER_MAP[i]] << np.uint32(i * 4)
    return _to_int32(q)


def pack_gptq_weight(intweight: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` ints 0..15 -> int32 ``[K/8, N]``, AutoGPTQ ``pack``: ``for j in range(i,
    i + 8): qweight[row] |= intweight[j] << (4 * (j - i))``."""
    iw = intweight.numpy().astype(np.uint32)
    q = np.zeros((iw.shape[0] // 8, iw.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < q.shape[0]:
        for j in range(i, i + 8):
            q[row] |= iw[j] << np.uint32(4 * (j - i))
        i += 8
        row += 1
    return _to_int32(q)


def pack_gptq_zeros(zeros: torch.Tensor, v1: bool = True) -> torch.Tensor:
    """``[K/G, N]`` zeros 0..15 -> int32 ``[K/G, N/8]``, AutoGPTQ ``pack``: ``zeros -= 1``
    (v1; not for gptq_v2), then ``qzeros[:, col] |= zeros[:, j] << (4 * (j - i))``.

    One deviation: ``zeros - 1`` is masked to 4 bits, so a zero of 0 is stored as nibble 15
    alone (AutoGPTQ ORs the uint32 0xFFFFFFFF shifted, setting the higher nibbles too)."""
    z = zeros.numpy().astype(np.int64)
    if v1:
        z = z - 1
    z = (z & 0xF).astype(np.uint32)
    q = np.zeros((z.shape[0], z.shape[1] // 8), dtype=np.uint32)
    i = col = 0
    while col < q.shape[1]:
        for j in range(i, i + 8):
            q[:, col] |= z[:, j] << np.uint32(4 * (j - i))
        i += 8
        col += 1
    return _to_int32(q)


# ---------------------------------------------------------------------------------------------
# quantizers (AutoAWQ pseudo_quantize_tensor / GPTQ Quantizer style, per group)


def quantize(w: torch.Tensor, g_idx: torch.Tensor, ngroups: int, sym: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` float32, groups by ``g_idx [K]`` -> ``q [K, N]``, ``z [K/G, N]`` int64
    and ``s [K/G, N]`` fp16 with ``w ~ (q - z) * s``."""
    n, k = w.shape
    q = torch.empty(k, n, dtype=torch.int64)
    z = torch.empty(ngroups, n, dtype=torch.int64)
    s = torch.empty(ngroups, n, dtype=torch.float16)
    for j in range(ngroups):
        cols = torch.nonzero(g_idx == j).flatten()
        wg = w[:, cols]
        if sym:
            sj = (wg.abs().amax(1).clamp(min=1e-5) * 2 / 15).half()
            zj = torch.full((n,), 8, dtype=torch.int64)
        else:
            mx, mn = wg.amax(1), wg.amin(1)
            sj = ((mx - mn).clamp(min=1e-5) / 15).half()
            zj = (-torch.round(mn / sj.float())).clamp(0, 15).to(torch.int64)
        qj = (torch.round(wg / sj.float()[:, None]) + zj[:, None]).clamp(0, 15)
        q[cols] = qj.to(torch.int64).t()
        z[j], s[j] = zj, sj
    return q, z, s


def _weight(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g) * 0.05


def _check_quantization(w: torch.Tensor, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
                        g_idx: torch.Tensor) -> None:
    """The test quantizer is sane: ``(q - z) * s`` within a scale step of the float weight."""
    deq = ((q - z[g_idx]).float() * s.float()[g_idx]).t()
    assert ((deq - w).abs() <= s.float()[g_idx].t()).all()


def _edge_zeros(z: torch.Tensor) -> torch.Tensor:
    """Zero points 0 and 15 mixed in (the quantizer rarely makes them)."""
    z = z.clone()
    z[0, :8] = 0
    z[-1, 8:16] = 15
    return z


def _check_layer(layer: Int4Layer, group: int) -> None:
    w = layer.weight
    assert isinstance(w, GroupCodes)
    assert w.codes.dtype == torch.uint8 and tuple(w.codes.shape) == (N, K)
    assert w.bits == 4 and w.group == group and int(w.codes.max()) <= 15
    assert w.min is not None and w.scale.dtype == w.min.dtype == torch.float32
    assert tuple(w.scale.shape) == tuple(w.min.shape) == (N, K // group)


def _check_values(got: torch.Tensor, ref32: torch.Tensor, ref16: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    assert torch.equal(got, ref32)  # exact; -0.0 == +0.0
    assert torch.equal(got.half(), ref16)  # fp16 rounding of the exact value


# ---------------------------------------------------------------------------------------------
# AWQ


def test_awq_pack_order_one_word():
    """Columns 0..7 holding 0..7: nibble i is column order_map[i] -> word 0x75316420."""
    q = torch.arange(8).repeat(2, 1)  # [K=2, N=8]
    qweight = pack_awq(q)
    assert qweight[0, 0].item() == np.uint32(0x75316420).view(np.int32)
    layer = read_awq(qweight, pack_awq(torch.zeros(1, 8, dtype=torch.int64)),
                     torch.ones(1, 8, dtype=torch.float16), 2)
    assert layer.weight.codes.tolist() == [[c, c] for c in range(8)]


@pytest.mark.parametrize("group", GROUPS)
def test_awq_round_trip(group):
    w = _weight(group)
    g_idx = torch.arange(K) // group
    q, z, s = quantize(w, g_idx, K // group)
    _check_quantization(w, q, z, s, g_idx)
    z = _edge_zeros(z)
    qweight, qzeros = pack_awq(q), pack_awq(z)
    layer = read_awq(qweight, qzeros, s, group)
    _check_layer(layer, group)
    assert layer.perm is None
    assert torch.equal(layer.weight.codes, q.t().to(torch.uint8))
    ref32 = dequantize_reference("awq", qweight, qzeros, s, group)
    ref16 = dequantize_reference("awq", qweight, qzeros, s, group, dtype=torch.float16)
    # the reference itself: (q - z) * s over the quantizer's own q, z, s
    direct = (q - z.repeat_interleave(group, 0)).float() * s.float().repeat_interleave(group, 0)
    assert torch.equal(ref32, direct.t())
    _check_values(layer.weight.dequantize(), ref32, ref16)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_awq_random_codes_and_scales_exact(scale_dtype):
    """Every code and zero, scales of any sign and exponent (subnormals, the largest finite):
    still exact in float32, and the fp16 rounding of AutoAWQ's fp16 product."""
    gen = torch.Generator().manual_seed(7)
    group = 32
    q = torch.randint(0, 16, (K, N), generator=gen)
    z = torch.randint(0, 16, (K // group, N), generator=gen)
    # finite bit patterns of any exponent (subnormals included), either sign
    inf_bits, specials = ((0x7C00, [0x0001, 0x03FF, 0x7BFF, 0x3C00])
                          if scale_dtype == torch.float16 else
                          (0x7D80, [0x0001, 0x007F, 0x7D7F, 0x3F80]))  # < 2**124
    bits = torch.randint(0, inf_bits, (K // group, N), generator=gen, dtype=torch.int32)
    bits[0, :4] = torch.tensor(specials)
    bits |= torch.randint(0, 2, bits.shape, generator=gen, dtype=torch.int32) << 15
    s = bits.to(torch.int16).view(scale_dtype)
    qweight, qzeros = pack_awq(q), pack_awq(z)
    layer = read_awq(qweight, qzeros, s, group)
    ref32 = dequantize_reference("awq", qweight, qzeros, s, group)
    got = layer.weight.dequantize()
    assert torch.equal(got, ref32)
    if scale_dtype == torch.float16:
        ref16 = dequantize_reference("awq", qweight, qzeros, s, group, dtype=torch.float16)
        assert torch.equal(got.half(), ref16)
        assert torch.isinf(ref16).any()  # the fp16 product overflows somewhere; ours is finite
    assert torch.isfinite(got).all()


# ---------------------------------------------------------------------------------------------
# GPTQ


def test_gptq_pack_one_word():
    """k = 0..7 of a column holding 0..7 -> word 0x76543210; zeros sequential too."""
    q = torch.arange(8)[:, None].repeat(1, 8)  # [K=8, N=8]
    qweight = pack_gptq_weight(q)
    assert qweight[0, 0].item() == 0x76543210
    qzeros = pack_gptq_zeros(torch.arange(1, 9)[None, :])  # zeros 1..8 -> stored 0..7
    assert qzeros[0, 0].item() == 0x76543210
    layer = read_gptq(qweight, qzeros, torch.ones(1, 8, dtype=torch.float16), 8, sym=False)
    assert layer.weight.codes.tolist() == [list(range(8))] * 8
    assert layer.weight.min is not None
    assert layer.weight.min.flatten().tolist() == [-float(c) for c in range(1, 9)]


@pytest.mark.parametrize("group", (*GROUPS, -1))
def test_gptq_round_trip(group):
    g = K if group == -1 else group
    w = _weight(100 + g)
    g_idx = torch.arange(K, dtype=torch.int32) // g
    q, z, s = quantize(w, g_idx.long(), K // g)
    _check_quantization(w, q, z, s, g_idx.long())
    z = _edge_zeros(z)
    qweight, qzeros = pack_gptq_weight(q), pack_gptq_zeros(z)
    ref32 = dequantize_reference("gptq", qweight, qzeros, s, group, sym=False)
    ref16 = dequantize_reference("gptq", qweight, qzeros, s, group, sym=False,
                                 dtype=torch.float16)
    direct = (q - z[g_idx.long()]).float() * s.float()[g_idx.long()]
    assert torch.equal(ref32, direct.t())
    for gi in (None, g_idx, g_idx.long()):  # a trivial g_idx: no permutation
        layer = read_gptq(qweight, qzeros, s, group, g_idx=gi, sym=False)
        _check_layer(layer, g)
        assert layer.perm is None
        assert torch.equal(layer.weight.codes, q.t().to(torch.uint8))
        _check_values(layer.weight.dequantize(), ref32, ref16)


def test_gptq_v1_zero_nibble_15_is_zero_0():
    """v1 stores zero - 1: a zero of 0 is nibble 15, read back as (15 + 1) & 0xF = 0 (as
    AutoGPTQ's dequantization does)."""
    q = torch.randint(0, 16, (K, N), generator=torch.Generator().manual_seed(3))
    z = torch.zeros(K // 32, N, dtype=torch.int64)
    qzeros = pack_gptq_zeros(z)
    assert (qzeros == -1).all()  # 0xFFFFFFFF
    s = torch.full((K // 32, N), 0.5, dtype=torch.float16)
    layer = read_gptq(pack_gptq_weight(q), qzeros, s, 32, sym=False)
    assert layer.weight.min is not None and (layer.weight.min == 0).all()
    assert torch.equal(layer.weight.dequantize(), q.t().float() * 0.5)


@pytest.mark.parametrize("group", (*GROUPS, -1))
def test_gptq_act_order(group):
    g = K if group == -1 else group
    gen = torch.Generator().manual_seed(200 + g)
    w = _weight(200 + g)
    g_idx = (torch.arange(K) // g)[torch.randperm(K, generator=gen)].to(torch.int32)
    q, z, s = quantize(w, g_idx.long(), K // g)
    _check_quantization(w, q, z, s, g_idx.long())
    qweight, qzeros = pack_gptq_weight(q), pack_gptq_zeros(z)
    layer = read_gptq(qweight, qzeros, s, group, g_idx=g_idx, sym=False)
    _check_layer(layer, g)
    ref32 = dequantize_reference("gptq", qweight, qzeros, s, group, g_idx=g_idx, sym=False)
    ref16 = dequantize_reference("gptq", qweight, qzeros, s, group, g_idx=g_idx, sym=False,
                                 dtype=torch.float16)
    got = layer.weight.dequantize()
    if group == -1:  # one group: g_idx all 0, already sorted
        assert layer.perm is None
        _check_values(got, ref32, ref16)
        return
    perm = layer.perm
    assert perm is not None and perm.dtype == torch.int64 and tuple(perm.shape) == (K,)
    assert torch.equal(perm.sort().values, torch.arange(K))
    assert torch.equal(g_idx.long()[perm], torch.arange(K) // g)  # groups contiguous, in order
    _check_values(got, ref32[:, perm], ref16[:, perm])
    inv = torch.argsort(perm)
    assert torch.equal(got[:, inv], ref32)
    x = torch.randn(5, K, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(x[:, perm] @ got.double().t(), x @ ref32.double().t(),
                               rtol=1e-12, atol=1e-12)


def test_gptq_sym_and_v2():
    group = 64
    w = _weight(300)
    g_idx = torch.arange(K) // group
    q, z, s = quantize(w, g_idx, K // group, sym=True)
    assert (z == 8).all()
    qweight = pack_gptq_weight(q)
    ref32 = dequantize_reference("gptq", qweight, None, s, group, sym=True)
    ref16 = dequantize_reference("gptq", qweight, None, s, group, sym=True, dtype=torch.float16)
    v1 = pack_gptq_zeros(z)
    v2 = pack_gptq_zeros(z, v1=False)
    assert (v1 == 0x77777777).all()
    assert (v2 == np.uint32(0x88888888).view(np.int32)).all()
    for qzeros, fmt in ((None, "gptq"), (None, "gptq_v2"), (v1, "gptq"), (v2, "gptq_v2")):
        layer = read_gptq(qweight, qzeros, s, group, sym=True, checkpoint_format=fmt)
        _check_layer(layer, group)
        _check_values(layer.weight.dequantize(), ref32, ref16)
        # asymmetric reading of the same tensors agrees where qzeros are stored
        if qzeros is not None:
            asym = read_gptq(qweight, qzeros, s, group, sym=False, checkpoint_format=fmt)
            assert torch.equal(asym.weight.dequantize(), ref32)
    # v1 zeros read as v2 (7, not 8) disagree with sym
    with pytest.raises(ValueError, match="qzeros"):
        read_gptq(qweight, v1, s, group, sym=True, checkpoint_format="gptq_v2")
    with pytest.raises(ValueError, match="qzeros"):
        read_gptq(qweight, None, s, group, sym=False)


def test_gptq_v2_asymmetric():
    group = 32
    w = _weight(400)
    q, z, s = quantize(w, torch.arange(K) // group, K // group)
    z = _edge_zeros(z)
    qweight, v2 = pack_gptq_weight(q), pack_gptq_zeros(z, v1=False)
    layer = read_gptq(qweight, v2, s, group, sym=False, checkpoint_format="gptq_v2")
    ref32 = dequantize_reference("gptq", qweight, v2, s, group, sym=False,
                                 checkpoint_format="gptq_v2")
    ref16 = dequantize_reference("gptq", qweight, v2, s, group, sym=False,
                                 checkpoint_format="gptq_v2", dtype=torch.float16)
    _check_values(layer.weight.dequantize(), ref32, ref16)
    direct = (q - z.repeat_interleave(group, 0)).float() * s.float().repeat_interleave(group, 0)
    assert torch.equal(ref32, direct.t())
    # the same words read as v1 are off by one zero step
    v1_read = read_gptq(qweight, v2, s, group, sym=False, checkpoint_format="gptq")
    assert not torch.equal(v1_read.weight.dequantize(), ref32)


# ---------------------------------------------------------------------------------------------
# errors


def _awq_tensors(k: int = K, n: int = N, group: int = 32):
    return (torch.zeros(k, n // 8, dtype=torch.int32),
            torch.zeros(k // group, n // 8, dtype=torch.int32),
            torch.ones(k // group, n, dtype=torch.float16))


def _gptq_tensors(k: int = K, n: int = N, group: int = 32):
    return (torch.zeros(k // 8, n, dtype=torch.int32),
            torch.zeros(k // group, n // 8, dtype=torch.int32),
            torch.ones(k // group, n, dtype=torch.float16))


def test_awq_bad_shapes():
    qw, qz, s = _awq_tensors()
    with pytest.raises(ValueError, match=r"qweight must be int32 \[K, N/8\]"):
        read_awq(torch.zeros(K, N // 4, dtype=torch.int32), qz, s, 32)
    with pytest.raises(ValueError, match="qweight must be int32"):
        read_awq(qw.float(), qz, s, 32)
    with pytest.raises(ValueError, match=r"qzeros must be int32 \[K/G, N/8\]"):
        read_awq(qw, qz[:-1], s, 32)
    with pytest.raises(ValueError, match=r"scales must be float16/bfloat16 \[K/G, N\]"):
        read_awq(qw, qz, s.float(), 32)
    with pytest.raises(ValueError, match="group_size 48"):
        read_awq(qw, qz, s, 48)
    with pytest.raises(ValueError, match="even"):
        read_awq(*_awq_tensors(k=33, group=1), 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        read_awq(qw, qz, torch.ones(K // 32, N + 4, dtype=torch.float16), 32)
    with pytest.raises(ValueError, match="scales must be 2-D"):
        read_awq(qw, qz, s.flatten(), 32)
    for bad, dtype in ((float("inf"), torch.float16), (float("nan"), torch.float16),
                       (2.0**124, torch.bfloat16)):  # the last: code * scale overflows
        s_bad = s.to(dtype)
        s_bad[1, 3] = bad
        with pytest.raises(ValueError, match="scales must be finite"):
            read_awq(qw, qz, s_bad, 32)


def test_gptq_bad_shapes():
    qw, qz, s = _gptq_tensors()
    with pytest.raises(ValueError, match=r"qweight must be int32 \[K/8, N\]"):
        read_gptq(qw.to(torch.int64), qz, s, 32, sym=False)
    with pytest.raises(ValueError, match=r"qzeros must be int32 \[K/G, N/8\]"):
        read_gptq(qw, qz[:, :-1], s, 32, sym=False)
    with pytest.raises(ValueError, match=r"scales must be float16/bfloat16 \[K/G, N\]"):
        read_gptq(qw, qz, s[:, :-8], 32, sym=False)
    with pytest.raises(ValueError, match="multiple of 8"):
        read_gptq(torch.zeros(K // 8, 12, dtype=torch.int32), None, s, 32)
    with pytest.raises(ValueError, match="group_size 96"):
        read_gptq(qw, qz, s, 96, sym=False)
    with pytest.raises(ValueError, match=r"g_idx must be int32/int64 \[K\]"):
        read_gptq(qw, qz, s, 32, g_idx=torch.zeros(K - 1, dtype=torch.int32), sym=False)
    unbalanced = torch.arange(K, dtype=torch.int32) // 32
    unbalanced[0] = 1
    with pytest.raises(ValueError, match="g_idx: group 0 has 31"):
        read_gptq(qw, qz, s, 32, g_idx=unbalanced, sym=False)
    with pytest.raises(ValueError, match=r"g_idx values must be in \[0, 8\)"):
        read_gptq(qw, qz, s, 32, g_idx=torch.full((K,), 8, dtype=torch.int32), sym=False)
    with pytest.raises(ValueError, match="checkpoint_format 'marlin'"):
        read_gptq(qw, qz, s, 32, sym=False, checkpoint_format="marlin")


# ---------------------------------------------------------------------------------------------
# config.json


def test_quant_config_parses():
    assert quant_config({"model_type": "llama"}) is None
    awq = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                   "zero_point": True, "version": "gemm"}}
    assert quant_config(awq) == Int4Config("awq", 4, 128)
    autoawq_keys = {"quantization_config": {"quant_method": "awq", "w_bit": 4,
                                            "q_group_size": 64, "version": "GEMM"}}
    assert quant_config(autoawq_keys) == Int4Config("awq", 4, 64)
    gptq = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1,
                                    "desc_act": True, "sym": False,
                                    "checkpoint_format": "gptq_v2"}}
    assert quant_config(gptq) == Int4Config("gptq", 4, -1, desc_act=True, sym=False,
                                            checkpoint_format="gptq_v2")
    minimal = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}
    assert quant_config(minimal) == Int4Config("gptq", 4, 32, sym=True)


@pytest.mark.parametrize("qc,field", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "bits"),
    ({"quant_method": "bitsandbytes", "bits": 4, "group_size": 128}, "quant_method"),
    ({"quant_method": "fp8"}, "quant_method"),
    ({"bits": 4, "group_size": 128}, "quant_method"),
    ({"quant_method": "awq", "bits": 4, "group_size": -1}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 256}, "group_size"),
    ({"quant_method": "gptq", "bits": 4}, "group_size"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv_fast"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "backend": "llm-awq"}, "backend"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True},
     "checkpoint_format"),
])
def test_quant_config_rejects(qc, field):
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        quant_config({"quantization_config": qc})
