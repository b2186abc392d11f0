"""Quantized KV caches in the "pairs" layout (``kernels/kv_layout.py``), read as stored.

An int8 cache by the native kernels' integer products (``kernels/csrc/cpu_attention_i8.h``): Q
and P carried as int16 per row, each cache row's scale folded into the products' epilogue.

- attention matches the float64 reference over the dequantized cache on every body the CPU
  runs (scalar, AVX2, AVX512-VNNI), within float16's tolerance at float32 / float16 queries
  (the products keep 15 bits of Q and P, against float32's 24) and bf16's at bf16;
- the vector bodies give the same bits (exact int32 sums, the same float epilogue);
- a row is bitwise the same alone, as a prefix-hit tail, in chunks and in a batch of many;
- the native write is ``to_pairs`` of the rows write, and ``to_rows`` inverts ``to_pairs``;
- caches that do not fit the layout are refused, naming the limit.

A float8 cache by the ``vdpbf16ps`` body, its pairs widened to bf16 in registers: bitwise the
rows cache's result (the same products in the same order), bf16 queries on an AVX512-BF16 / AMX
step only (refused elsewhere).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference_paged_attention
from kernels.cpu_attention import ISA_ENV, cpu_paged_attention, cpu_reshape_and_cache
from kernels.kv_layout import pairs_fit, to_pairs, to_rows
from kernels.kv_quant import quantize_kv
from tests.kernels.cpu_isas import ISA_ORDER, RUNNABLE_ISAS
from tests.kernels.test_cpu_paged_attention import SPLITS, make_batch
from tests.kernels.test_paged_attention import CASES, TOLERANCES

# the integer products carry Q and P in 15 bits: float16's tolerance below bf16
TOLERANCE = {torch.float32: TOLERANCES[torch.float16], torch.float16: TOLERANCES[torch.float16],
             torch.bfloat16: TOLERANCES[torch.bfloat16]}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def quantized(batch: dict, cache_dtype: torch.dtype = torch.int8) -> tuple[dict, dict]:
    """``batch`` with quantized caches: rows (for the reference) and pairs (for the kernel)."""
    rows = {**batch, "k_cache": quantize_kv(batch["k_cache"], cache_dtype),
            "v_cache": quantize_kv(batch["v_cache"], cache_dtype)}
    k, v = to_pairs(rows["k_cache"], rows["v_cache"])
    return rows, {**rows, "k_cache": k, "v_cache": v}


def attend(batch: dict, **kw) -> torch.Tensor:
    return cpu_paged_attention(**batch, **kw, kv_layout="pairs")


def check(out: torch.Tensor, rows: dict) -> None:
    expected = reference_paged_attention(**rows)
    atol, rtol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def test_the_body_follows_the_isa(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "scalar")
    assert torch.ops.pagedserve.attention_int8_body() == "scalar"
    if "avx2" in RUNNABLE_ISAS:
        monkeypatch.setenv(ISA_ENV, "avx2")
        assert torch.ops.pagedserve.attention_int8_body() == "avx2"
    if "avx512" in RUNNABLE_ISAS:
        monkeypatch.setenv(ISA_ENV, "avx512")
        monkeypatch.setenv("PAGEDSERVE_CPU_VNNI", "0")
        assert torch.ops.pagedserve.attention_int8_body() == "avx2"


@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(("case", "num_queries_per_kv", "block_size", "head_dim"),
                         [("mixed", 3, 16, 64), ("prefix_hits", 1, 32, 128),
                          ("vllm_mix", 8, 64, 64), ("decode", 2, 16, 48)])
def test_matches_reference_of_dequantized_cache(isa, case, num_queries_per_kv, block_size,
                                                head_dim, dtype, splits):
    rows, pairs = quantized(make_batch(CASES[case], num_heads=2 * num_queries_per_kv,
                                       num_kv_heads=2, block_size=block_size, dtype=dtype,
                                       head_dim=head_dim))
    check(attend(pairs, split_keys=SPLITS[splits]), rows)


@pytest.mark.parametrize("sliding_window", [5, 40])
def test_sliding_window(isa, sliding_window):
    rows, pairs = quantized(make_batch(CASES["mixed"], num_heads=6, num_kv_heads=2,
                                       dtype=torch.bfloat16))
    rows["sliding_window"] = pairs["sliding_window"] = sliding_window
    check(attend(pairs), rows)


@pytest.mark.skipif("avx2" not in RUNNABLE_ISAS, reason="needs AVX2 (and AVX512-VNNI) bodies")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vector_bodies_give_the_same_bits(monkeypatch, dtype):
    _, pairs = quantized(make_batch(CASES["vllm_mix"], num_heads=8, num_kv_heads=2,
                                    dtype=dtype))
    outs = {}
    for isa, vnni in [("avx2", "1"), ("avx512", "1"), ("avx512", "0")]:
        if isa not in RUNNABLE_ISAS:
            continue
        monkeypatch.setenv(ISA_ENV, isa)
        monkeypatch.setenv("PAGEDSERVE_CPU_VNNI", vnni)
        outs[torch.ops.pagedserve.attention_int8_body()] = attend(pairs)
    first = next(iter(outs.values()))
    for body, out in outs.items():
        assert torch.equal(out, first), body


def test_a_row_is_the_same_as_a_prefix_hit_tail_and_in_chunks(isa):
    seq_len = 700
    _, batch = quantized(make_batch([(seq_len, seq_len)], num_heads=9, num_kv_heads=3,
                                    dtype=torch.bfloat16))
    whole = attend(batch)

    def rows(begin: int, end: int) -> torch.Tensor:
        return attend({**batch, "query": batch["query"][begin:end],
                       "seq_lens": torch.tensor([end], dtype=torch.int32),
                       "query_start_loc": torch.tensor([0, end - begin], dtype=torch.int32),
                       "max_query_len": end - begin, "max_seq_len": end})

    for begin, end in [(513, 700), (1, 700), (0, 64), (64, 300), (699, 700)]:
        assert torch.equal(rows(begin, end), whole[begin:end]), (begin, end)


@pytest.mark.parametrize("split_keys", [0, 64])
def test_a_decode_row_is_the_same_in_a_batch_of_many(isa, split_keys):
    _, batch = quantized(make_batch([(1, 40 + 37 * i) for i in range(12)], num_heads=9,
                                    num_kv_heads=3, dtype=torch.float32))
    many = attend(batch, split_keys=split_keys)
    qsl = batch["query_start_loc"].tolist()
    for i in (0, 5, 11):
        alone = attend({**batch, "query": batch["query"][qsl[i]:qsl[i + 1]],
                        "block_tables": batch["block_tables"][i:i + 1],
                        "seq_lens": batch["seq_lens"][i:i + 1],
                        "query_start_loc": torch.tensor([0, 1], dtype=torch.int32)},
                       split_keys=split_keys)
        assert torch.equal(alone, many[qsl[i]:qsl[i + 1]]), i


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_native_write_is_to_pairs_of_the_rows_write(key_dtype):
    nb, bs, hkv, d, n = 9, 16, 3, 64, 50
    key = (torch.randn(n, hkv, d) * 3).to(key_dtype)
    value = torch.randn(n, hkv, 2 * d).to(key_dtype)[..., ::2]  # strided rows
    slots = torch.randperm(nb * bs)[:n]
    slots[::7] = -1  # padding tokens: no slot
    k_rows = quantize_kv(torch.randn(nb, bs, hkv, d), torch.int8)
    v_rows = quantize_kv(torch.randn(nb, bs, hkv, d), torch.int8)
    k_pairs, v_pairs = to_pairs(k_rows, v_rows)
    cpu_reshape_and_cache(key, value, k_rows, v_rows, slots)
    cpu_reshape_and_cache(key, value, k_pairs, v_pairs, slots, kv_layout="pairs")
    k_exp, v_exp = to_pairs(k_rows, v_rows)
    assert torch.equal(k_pairs, k_exp) and torch.equal(v_pairs, v_exp)
    k_back, v_back = to_rows(k_pairs, v_pairs)
    assert torch.equal(k_back, k_rows) and torch.equal(v_back, v_rows)


def test_refused_where_it_does_not_fit():
    assert pairs_fit(torch.int8, 16, 64) and pairs_fit(torch.int8, 32, 48)
    assert not pairs_fit(torch.int8, 8, 64) and not pairs_fit(torch.int8, 16, 40)
    assert not pairs_fit(torch.int8, 16, 1024)
    key = torch.zeros(1, 2, 64)
    for shape in [(4, 8, 2, 65), (4, 16, 2, 41)]:
        cache = torch.zeros(shape, dtype=torch.int8)
        with pytest.raises(ValueError, match="block_size and head_dim multiples of 16"):
            cpu_reshape_and_cache(key[..., :shape[3] - 1], key[..., :shape[3] - 1], cache,
                                  cache.clone(), torch.zeros(1, dtype=torch.long),
                                  kv_layout="pairs")


FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
BF16_ISAS = [i for i in RUNNABLE_ISAS if ISA_ORDER.index(i) >= ISA_ORDER.index("avx512_bf16")]


@pytest.mark.skipif(not BF16_ISAS, reason="the float8 pairs need the bf16 products")
@pytest.mark.parametrize("isa_name", BF16_ISAS)
@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize("cache", list(FP8))
@pytest.mark.parametrize(("case", "block_size", "head_dim"),
                         [("mixed", 16, 64), ("prefix_hits", 32, 128), ("vllm_mix", 64, 64)])
def test_float8_pairs_are_bitwise_the_rows_read(monkeypatch, isa_name, case, block_size,
                                                head_dim, cache, splits):
    monkeypatch.setenv(ISA_ENV, isa_name)
    rows, pairs = quantized(make_batch(CASES[case], num_heads=6, num_kv_heads=2,
                                       block_size=block_size, head_dim=head_dim,
                                       dtype=torch.bfloat16), FP8[cache])
    kw = {"split_keys": SPLITS[splits]}
    out = attend(pairs, **kw)
    assert torch.equal(out, cpu_paged_attention(**rows, **kw))
    check(out, rows)


@pytest.mark.parametrize("cache", list(FP8))
def test_float8_pairs_write_is_to_pairs_of_the_rows_write(cache):
    nb, bs, hkv, d, n = 6, 16, 2, 64, 40
    key, value = (torch.randn(2, n, hkv, d) * 30).to(torch.bfloat16)
    slots = torch.randperm(nb * bs)[:n]
    slots[::5] = -1
    k_rows = quantize_kv(torch.randn(nb, bs, hkv, d), FP8[cache])
    v_rows = quantize_kv(torch.randn(nb, bs, hkv, d), FP8[cache])
    k_pairs, v_pairs = to_pairs(k_rows, v_rows)
    cpu_reshape_and_cache(key, value, k_rows, v_rows, slots)
    cpu_reshape_and_cache(key, value, k_pairs, v_pairs, slots, kv_layout="pairs")
    k_exp, v_exp = to_pairs(k_rows, v_rows)
    assert torch.equal(k_pairs.view(torch.uint8), k_exp.view(torch.uint8))
    assert torch.equal(v_pairs.view(torch.uint8), v_exp.view(torch.uint8))


def test_float8_pairs_are_refused_where_the_bf16_products_cannot_read_them(monkeypatch):
    assert pairs_fit(torch.float8_e4m3fn, 16, 64) and not pairs_fit(torch.float8_e5m2, 16, 48)
    assert not pairs_fit(torch.float8_e5m2, 8, 64) and not pairs_fit(torch.float8_e4m3fn, 16, 512)
    _, pairs = quantized(make_batch(CASES["decode"], dtype=torch.float32), torch.float8_e5m2)
    with pytest.raises(ValueError, match="float8 cache needs bfloat16 queries"):
        attend(pairs)
    _, pairs = quantized(make_batch(CASES["decode"], dtype=torch.bfloat16), torch.float8_e5m2)
    monkeypatch.setenv(ISA_ENV, "scalar")
    with pytest.raises(ValueError, match="float8 cache needs bfloat16 queries"):
        attend(pairs)
    odd = torch.zeros(4, 16, 2, 48, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="head_dim multiple of 32"):
        cpu_reshape_and_cache(torch.zeros(1, 2, 48), torch.zeros(1, 2, 48), odd, odd.clone(),
                              torch.zeros(1, dtype=torch.long), kv_layout="pairs")
