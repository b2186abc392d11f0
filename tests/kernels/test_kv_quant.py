"""The quantized KV cache (``--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2``, ``kernels.kv_quant``).

- the quantization itself: int8 per (token, head) within half a step of its scale, float8
  saturated and exact where representable;
- the KV write: the native kernel writes bitwise what the reference and the torch backend
  write, for every key dtype and both cache layouts;
- attention over a quantized cache against the float64 reference of the dequantized math
  (the reference reads each value as the kernels do: dequantized in float32 and rounded once
  to the query's dtype), within the per-dtype tolerance table, on every instruction-set path
  this CPU has and in the torch backend; row invariance kept; whole-block copies (copy-on-write)
  carry int8 scales and float8 bytes.
"""

from __future__ import annotations

import pytest
import torch

from kernels import (
    copy_blocks,
    reference_paged_attention,
    reference_reshape_and_cache,
    torch_paged_attention,
    torch_reshape_and_cache,
)
from kernels.cpu_attention import cpu_paged_attention, cpu_reshape_and_cache
from kernels.kv_quant import (
    KV_CACHE_DTYPES,
    cache_head_dim,
    cache_row_size,
    code_scale,
    dequantize_kv,
    quantize_kv,
    scale_code,
)
from kernels.triton_attention import triton_paged_attention, triton_reshape_and_cache
from tests.kernels import test_paged_attention
from tests.kernels.test_cpu_paged_attention import SPLITS, make_batch
from tests.kernels.test_paged_attention import CASES, CUDA, TOLERANCES

CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_flag_values_are_vllms():
    assert set(KV_CACHE_DTYPES) == {"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"}
    assert KV_CACHE_DTYPES["fp8"] == KV_CACHE_DTYPES["fp8_e4m3"] == torch.float8_e4m3fn


def test_scale_codes_are_an_unsigned_8_bit_float_rounded_up():
    codes = torch.arange(256).to(torch.uint8)
    table = code_scale(codes).double()
    expected = [0.0] + [(1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 21) for c in range(1, 256)]
    assert table.tolist() == expected
    assert torch.equal(scale_code(table.float()), codes)  # every scale is its own code
    wanted = torch.rand(20000) * 10 ** torch.empty(20000).uniform_(-7, 4)
    code = scale_code(wanted)
    # the smallest code at or above the wanted scale, else the largest (saturated)
    smallest = torch.searchsorted(table[1:].float(), wanted).clamp(max=254) + 1
    assert torch.equal(code.long(), smallest)
    tiny, huge = torch.tensor([1e-30, 5e-7]), torch.tensor([1920.5, 1e30])
    assert scale_code(tiny).tolist() == [1, 1] and scale_code(huge).tolist() == [255, 255]


def test_int8_rows_within_half_a_step_of_a_scale_at_most_an_eighth_above_ideal():
    x = torch.randn(200, 3, 64) * torch.logspace(-3, 3, 200)[:, None, None]
    x[0] = 0.0  # an all-zero row: scale 0, values 0
    q = quantize_kv(x, torch.int8)
    assert q.shape == (200, 3, 65) and q.dtype == torch.int8
    assert cache_head_dim(q) == 64 and cache_row_size(64, torch.int8) == 65
    scale = code_scale(q[..., 64:].view(torch.uint8)).double()  # [200, 3, 1]
    ideal = (x.abs().amax(-1, keepdim=True) / 127).double()
    assert (scale >= ideal).all() and (scale <= ideal * 1.125).all()
    back = dequantize_kv(q, torch.float64)
    assert (back[0] == 0).all()
    err = (back - x.double()).abs()
    assert (err <= scale * 0.5 * (1 + 1e-6)).all()
    assert q[..., :64].abs().max() <= 127


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_fp8_saturates_and_keeps_representable_values(cache_dtype):
    limit = 448.0 if cache_dtype == torch.float8_e4m3fn else 57344.0
    x = torch.tensor([1e9, -1e9, limit, 0.5, -0.125, 0.0])
    back = dequantize_kv(quantize_kv(x, cache_dtype), torch.float32)
    assert torch.equal(back, torch.tensor([limit, -limit, limit, 0.5, -0.125, 0.0]))


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
@pytest.mark.parametrize("layout", ["separate", "combined"])
def test_native_write_is_bitwise_the_references(cache, key_dtype, layout):
    """Every written row (values and int8 scale bytes) equals the reference's and the torch
    backend's; slot -1 writes nothing; unwritten slots keep their bytes."""
    cache_dtype = CACHE_DTYPES[cache]
    num_blocks, block_size, hkv, d = 8, 16, 3, 64
    key = (torch.randn(40, hkv, d) * 5).to(key_dtype)
    value = torch.randn(40, hkv, d).to(key_dtype)
    key[3] = 0.0  # an all-zero row
    slots = torch.randperm(num_blocks * block_size)[:40]
    slots[7] = -1
    shape = (num_blocks, block_size, hkv, cache_row_size(d, cache_dtype))
    caches = []
    for write in (cpu_reshape_and_cache, reference_reshape_and_cache, torch_reshape_and_cache):
        if layout == "combined":
            kv = torch.zeros((num_blocks, 2, *shape[1:]), dtype=cache_dtype)
            k_cache, v_cache = kv[:, 0], kv[:, 1]
        else:
            k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(
                shape, dtype=cache_dtype)
        write(key, value, k_cache, v_cache, slots)
        caches.append((k_cache.view(torch.uint8), v_cache.view(torch.uint8)))
    for other in caches[1:]:
        assert torch.equal(caches[0][0], other[0]) and torch.equal(caches[0][1], other[1])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert (caches[0][0].reshape(num_blocks * block_size, -1)[~written] == 0).all()


def quantized(batch: dict, cache_dtype: torch.dtype) -> dict:
    """``batch`` with both caches quantized (every slot, so unused ones stay finite)."""
    return {**batch, "k_cache": quantize_kv(batch["k_cache"], cache_dtype),
            "v_cache": quantize_kv(batch["v_cache"], cache_dtype)}


def check(out: torch.Tensor, batch: dict) -> None:
    expected = reference_paged_attention(**batch)
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
@pytest.mark.parametrize(("case", "num_queries_per_kv", "block_size"),
                         [("mixed", 3, 16), ("prefix_hits", 1, 32), ("vllm_mix", 8, 64)])
def test_native_matches_reference_of_dequantized_cache(isa, case, num_queries_per_kv,
                                                       block_size, cache, dtype, splits):
    batch = quantized(make_batch(CASES[case], num_heads=2 * num_queries_per_kv, num_kv_heads=2,
                                 block_size=block_size, dtype=dtype), CACHE_DTYPES[cache])
    check(cpu_paged_attention(**batch, split_keys=SPLITS[splits]), batch)


@pytest.mark.parametrize("sliding_window", [5, 40])
@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_native_sliding_window_over_quantized_cache(isa, cache, sliding_window):
    batch = quantized(make_batch(CASES["mixed"], num_heads=6, num_kv_heads=2,
                                 dtype=torch.bfloat16), CACHE_DTYPES[cache])
    batch["sliding_window"] = sliding_window
    check(cpu_paged_attention(**batch), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_torch_backend_matches_reference_of_dequantized_cache(cache, dtype):
    batch = quantized(make_batch(CASES["mixed"], dtype=dtype), CACHE_DTYPES[cache])
    check(torch_paged_attention(**batch), batch)


# NOTE: the Triton interpreter multiplies bfloat16 operands' raw bits in tl.dot (see
# test_paged_attention.DTYPE_PARAMS): float16 stands for the 16-bit path off a GPU.
TRITON_DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if CUDA else [])]


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_triton_matches_reference_of_dequantized_cache(cache, dtype, num_splits):
    batch = quantized(test_paged_attention.make_batch(CASES["mixed"], num_heads=6,
                                                      num_kv_heads=2, dtype=dtype),
                      CACHE_DTYPES[cache])
    check(triton_paged_attention(**batch, num_splits=num_splits), batch)


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_triton_sliding_window_over_quantized_cache(cache):
    batch = quantized(test_paged_attention.make_batch(CASES["decode"], num_heads=6,
                                                      num_kv_heads=2, dtype=torch.float16),
                      CACHE_DTYPES[cache])
    check(triton_paged_attention(**batch, sliding_window=7), {**batch, "sliding_window": 7})


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_triton_write_is_bitwise_the_references(cache):
    cache_dtype = CACHE_DTYPES[cache]
    key, value = torch.randn(2, 20, 2, 64).to(torch.float16) * 3
    slots = torch.randperm(6 * 16)[:20]
    slots[4] = -1
    shape = (6, 16, 2, cache_row_size(64, cache_dtype))
    caches = []
    for write in (triton_reshape_and_cache, reference_reshape_and_cache):
        k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(
            shape, dtype=cache_dtype)
        write(key, value, k_cache, v_cache, slots)
        caches.append(torch.cat([k_cache.view(torch.uint8), v_cache.view(torch.uint8)]))
    assert torch.equal(caches[0], caches[1]) and caches[0].any()


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_a_row_is_the_same_as_a_prefix_hit_tail_and_in_chunks(isa, cache):
    """Row invariance over a quantized cache: the whole prompt, a prefix-hit tail and chunks
    give bitwise the same rows (the dequantization is per row, whatever the step)."""
    seq_len = 700
    batch = quantized(make_batch([(seq_len, seq_len)], num_heads=9, num_kv_heads=3,
                                 dtype=torch.bfloat16), CACHE_DTYPES[cache])
    whole = cpu_paged_attention(**batch)

    def rows(begin: int, end: int) -> torch.Tensor:
        return cpu_paged_attention(
            **{**batch, "query": batch["query"][begin:end],
               "seq_lens": torch.tensor([end], dtype=torch.int32),
               "query_start_loc": torch.tensor([0, end - begin], dtype=torch.int32),
               "max_query_len": end - begin, "max_seq_len": end})

    for begin, end in [(513, 700), (1, 700), (0, 64), (64, 300), (699, 700)]:
        assert torch.equal(rows(begin, end), whole[begin:end]), (begin, end)


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_copy_blocks_carries_quantized_rows(cache):
    cache_dtype = CACHE_DTYPES[cache]
    k = quantize_kv(torch.randn(6, 16, 2, 64), cache_dtype)
    before = k.clone()
    copy_blocks([k], torch.tensor([0, 3]), torch.tensor([4, 5]))
    assert torch.equal(k[4].view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(k[5].view(torch.uint8), before[3].view(torch.uint8))


def test_rejects_mismatched_caches_and_widths():
    batch = quantized(make_batch(CASES["decode"]), torch.int8)
    with pytest.raises(ValueError, match=r"k_cache .* and v_cache .* differ"):
        cpu_paged_attention(**{**batch, "v_cache": batch["v_cache"][..., :64].clone()})
    with pytest.raises(ValueError, match="head_dim"):  # int8 rows without their scale bytes
        cpu_paged_attention(**{**batch, "k_cache": batch["k_cache"][..., :64].contiguous(),
                               "v_cache": batch["v_cache"][..., :64].contiguous()})
    fp8 = quantized(make_batch(CASES["decode"]), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="dtype"):
        cpu_paged_attention(**{**fp8, "v_cache": fp8["v_cache"].view(torch.float8_e5m2)})
