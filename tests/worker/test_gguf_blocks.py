"""GGUF block bytes split into codes, scale and min (services/worker/gguf_blocks.py), checked
bit for bit against gguf-py's own ``gguf.quants.dequantize``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from services.worker.gguf_blocks import SUPPORTED, GroupCodes, split_blocks  # noqa: E402

SHAPES = [(3, 256), (5, 512), (1, 1024)]
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")

# byte offsets of each block's fp16 fields (d, then m / dmin where the format has one)
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}

# per format: codes dtype, smallest and largest code, group, has a min
EXPECT = {
    "Q4_0": (torch.uint8, 0, 15, 32, True),
    "Q4_1": (torch.uint8, 0, 15, 32, True),
    "Q5_0": (torch.int8, -16, 15, 32, False),
    "Q5_1": (torch.int8, 0, 31, 32, True),
    "Q8_0": (torch.int8, -128, 127, 32, False),
    "Q4_K": (torch.uint8, 0, 15, 32, True),
    "Q5_K": (torch.int8, 0, 31, 32, True),
    "Q6_K": (torch.int8, -32, 31, 16, False),
}

# fp16 bit patterns always mixed in: +-0, the smallest and largest subnormals, the largest
# finite value, 1.0, -2.0
SPECIAL_F16 = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x7BFF, 0xFBFF,
                        0x3C00, 0xC000], dtype=np.uint16)


def _qtype(name: str):
    return gguf.GGMLQuantizationType[name]


def _random_f16(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` finite fp16 bit patterns, uniform over sign, exponent (subnormals included)
    and mantissa, with ``SPECIAL_F16`` placed at random positions."""
    bits = rng.integers(0, 0x7C00, count, dtype=np.uint16)  # exponent < 31: finite
    bits |= rng.integers(0, 2, count, dtype=np.uint16) << np.uint16(15)
    at = rng.choice(count, size=min(count, len(SPECIAL_F16)), replace=False)
    bits[at] = SPECIAL_F16[:len(at)]
    return bits


def _random_raw(rng: np.random.Generator, name: str, n: int, k: int) -> np.ndarray:
    """Random block bytes ``[N, K / block * bytes]`` uint8 for an ``[n, k]`` ``name`` tensor,
    its fp16 fields finite."""
    block, size = gguf.GGML_QUANT_SIZES[_qtype(name)]
    raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in FP16_FIELDS[name]:
        blocks[:, at:at + 2] = _random_f16(rng, blocks.shape[0]).view(np.uint8).reshape(-1, 2)
    return raw


def _reference(raw: np.ndarray, name: str, n: int, k: int) -> torch.Tensor:
    ref = gguf.quants.dequantize(raw, _qtype(name))
    assert ref.dtype == np.float32
    return torch.from_numpy(np.ascontiguousarray(ref).reshape(n, k))


def test_sizes_match_gguf():
    for name in SUPPORTED:
        block, size = gguf.GGML_QUANT_SIZES[_qtype(name)]
        raw = np.zeros(2 * size, dtype=np.uint8)
        assert split_blocks(raw, name, (1, 2 * block)).codes.shape == (1, 2 * block)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", SUPPORTED)
def test_random_blocks_dequantize_bit_exactly(name, shape):
    n, k = shape
    rng = np.random.default_rng([SUPPORTED.index(name), n, k])
    raw = _random_raw(rng, name, n, k)
    got = split_blocks(raw, name, (n, k))
    want = _reference(raw, name, n, k)
    w = got.dequantize()
    assert w.dtype == torch.float32 and w.shape == (n, k)
    assert torch.equal(w, want)
    # the same bytes, flat
    assert torch.equal(split_blocks(raw.reshape(-1), name, (n, k)).dequantize(), want)


@pytest.mark.parametrize("name", LEGACY)
def test_gguf_quantized_floats_dequantize_bit_exactly(name):
    rng = np.random.default_rng(7 + LEGACY.index(name))
    n, k = 6, 512
    x = rng.standard_normal((n, k)).astype(np.float32)
    x *= np.array([1.0, 1e-3, 300.0, 1e-6, 0.0, 1.0], dtype=np.float32)[:, None]
    x[5] = np.abs(x[5])  # an all-positive row (Q4_1 / Q5_1: min > 0)
    raw = gguf.quants.quantize(x, _qtype(name))
    assert raw.dtype == np.uint8 and raw.shape == gguf.quants.quant_shape_to_byte_shape(
        (n, k), _qtype(name))
    got = split_blocks(raw, name, (n, k))
    assert torch.equal(got.dequantize(), _reference(raw, name, n, k))


@pytest.mark.parametrize("name", SUPPORTED)
def test_codes_dtype_range_group_and_min(name):
    dtype, lo, hi, group, has_min = EXPECT[name]
    n, k = 4, 1024
    raw = _random_raw(np.random.default_rng(100 + SUPPORTED.index(name)), name, n, k)
    got = split_blocks(raw, name, (n, k))
    assert isinstance(got, GroupCodes)
    assert got.codes.dtype == dtype and got.codes.shape == (n, k)
    assert got.bits == (4 if dtype == torch.uint8 else 8)
    # 4096 random codes: every value in the range shows up
    assert int(got.codes.min()) == lo and int(got.codes.max()) == hi
    assert got.group == group
    assert got.scale.dtype == torch.float32 and got.scale.shape == (n, k // group)
    assert (got.min is not None) == has_min
    if got.min is not None:
        assert got.min.dtype == torch.float32 and got.min.shape == (n, k // group)
    assert got.codes.is_contiguous() and got.scale.is_contiguous()


def test_q4_0_element_order_and_offset():
    # one block: d = 1.0, qs[i] = i | (15 - i) << 4 -> elements 0..15 then 15..0
    qs = np.arange(16, dtype=np.uint8) | ((15 - np.arange(16, dtype=np.uint8)) << 4)
    raw = np.concatenate([np.array([1.0], dtype=np.float16).view(np.uint8), qs])
    got = split_blocks(raw, "Q4_0", (1, 32))
    assert got.codes.tolist() == [[*range(16), *range(15, -1, -1)]]
    assert got.scale.tolist() == [[1.0]] and got.min is not None and got.min.tolist() == [[-8.0]]
    assert got.dequantize().tolist() == [[float(c - 8) for c in got.codes[0].tolist()]]


def test_q6_k_scales_are_per_16():
    raw = _random_raw(np.random.default_rng(5), "Q6_K", 2, 512)
    got = split_blocks(raw, "Q6_K", (2, 512))
    blocks = raw.reshape(-1, 210)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    want = d * blocks[:, 192:208].view(np.int8).astype(np.float32)
    assert torch.equal(got.scale, torch.from_numpy(want.reshape(2, 32)))


@pytest.mark.parametrize("name", SUPPORTED)
def test_truncated_bytes_raise_naming_the_counts(name):
    n, k = 2, 512
    raw = _random_raw(np.random.default_rng(1), name, n, k).reshape(-1)
    expected = raw.size
    with pytest.raises(ValueError, match=rf"{name}.*needs {expected} bytes.*got {expected - 1}"):
        split_blocks(raw[:-1], name, (n, k))
    with pytest.raises(ValueError, match=rf"needs {expected} bytes.*got {expected + 1}"):
        split_blocks(np.concatenate([raw, raw[:1]]), name, (n, k))


@pytest.mark.parametrize(("name", "k", "block"), [("Q4_0", 48, 32), ("Q8_0", 16, 32),
                                                  ("Q4_K", 128, 256), ("Q6_K", 288, 256)])
def test_row_length_not_a_multiple_of_the_block_raises(name, k, block):
    with pytest.raises(ValueError, match=rf"{name}.*K={k}.*block size {block}"):
        split_blocks(np.zeros(1000, dtype=np.uint8), name, (1, k))


@pytest.mark.parametrize("name", ["Q2_K", "IQ4_NL", "F16", "bogus"])
def test_unsupported_type_raises_naming_it(name):
    with pytest.raises(ValueError, match=name):
        split_blocks(np.zeros(1000, dtype=np.uint8), name, (1, 256))


def test_takes_a_gguf_type_enum_too():
    raw = _random_raw(np.random.default_rng(2), "Q5_K", 1, 256)
    got = split_blocks(raw, _qtype("Q5_K"), (1, 256))
    assert torch.equal(got.dequantize(), _reference(raw, "Q5_K", 1, 256))


@pytest.mark.parametrize("name", SUPPORTED)
def test_read_only_input_is_copied_not_aliased(name):
    # the gguf reader hands out read-only memory maps; torch.from_numpy warns on those
    n, k = 1, 256  # one block (Q4_K / Q5_K / Q6_K): the case where a slice could be a view
    raw = _random_raw(np.random.default_rng(3), name, n, k)
    raw.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = split_blocks(raw, name, (n, k))
    for t in (got.codes, got.scale, got.min):
        assert t is None or not np.shares_memory(t.numpy(), raw)
    assert torch.equal(got.dequantize(), _reference(raw, name, n, k))


@pytest.mark.parametrize("name", SUPPORTED)
def test_empty_tensor(name):
    for n, k in ((0, 512), (3, 0)):
        got = split_blocks(np.zeros(0, dtype=np.uint8), name, (n, k))
        assert got.codes.shape == (n, k) and got.scale.shape == (n, k // got.group)
        assert got.dequantize().shape == (n, k)
