"""The native CPU kernels (``kernels.cpu_attention``) against the float64 reference.

Same batches, cases and per-dtype tolerances as ``test_paged_attention.py`` (imported from it),
on every instruction-set path this CPU can run (forced with ``PAGEDSERVE_CPU_ISA``; the
AVX-512 path is compiled everywhere but runs only on a CPU that has AVX-512), with KV splits
at every block, at the default 512 keys and none. Row invariance: a query row's output is
bitwise the same whatever step it is computed in (whole prompt, prefix-hit tail, chunks, beside
other sequences, one thread). Plus the KV-cache write, 64-bit offsets, custom-op schemas, and a
tiny Llama whose greedy tokens with ``--attention-backend cpu`` equal transformers' at float32.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kernels import reference_paged_attention, reference_reshape_and_cache
from kernels.cpu_attention import ISA_ENV, cpu_isa, cpu_paged_attention, cpu_reshape_and_cache
from tests.kernels.cpu_isas import BEST_ISA, ISA_ORDER
from tests.kernels.test_paged_attention import (
    CASES,
    TOLERANCES,
    WINDOW_CASES,
    WINDOWS,
    poison_out_of_window,
)
from tests.kernels.test_paged_attention import make_batch as _make_batch

NO_SPLIT = 1 << 30  # split_keys past every context: one range per row
SPLITS = {"nosplit": NO_SPLIT, "default": 0, "every_block": 1}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_batch(pairs, **kwargs) -> dict:
    """``test_paged_attention.make_batch`` on the CPU (it builds on CUDA when there is one)."""
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v
            for k, v in _make_batch(pairs, **kwargs).items()}


def garble_unused(batch: dict) -> None:
    """Unused block-table entries hold huge and negative ids, unwritten cache slots NaN."""
    block_size = batch["k_cache"].shape[1]
    in_use = torch.zeros(batch["k_cache"].shape[:2], dtype=torch.bool)
    for i, seq_len in enumerate(batch["seq_lens"].tolist()):
        for pos in range(seq_len):
            in_use[batch["block_tables"][i, pos // block_size], pos % block_size] = True
        n = math.ceil(seq_len / block_size)
        batch["block_tables"][i, n:] = torch.tensor([2**30, -7, 2**31 - 1])[
            torch.arange(batch["block_tables"].shape[1] - n) % 3]
    batch["k_cache"][~in_use] = float("nan")
    batch["v_cache"][~in_use] = float("nan")


def check(out: torch.Tensor, batch: dict) -> None:
    expected = reference_paged_attention(**batch)
    assert out.shape == batch["query"].shape and out.dtype == batch["query"].dtype
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


GQA_BLOCK_SIZES = [(g, b) for g in (1, 3, 8) for b in (16, 32, 64)]


@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize(("num_queries_per_kv", "block_size"), GQA_BLOCK_SIZES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_fp32(isa, case, num_queries_per_kv, block_size, splits):
    batch = make_batch(CASES[case], num_heads=2 * num_queries_per_kv, num_kv_heads=2,
                       block_size=block_size)
    garble_unused(batch)
    check(cpu_paged_attention(**batch, split_keys=SPLITS[splits]), batch)


@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("num_queries_per_kv", "block_size"), [(1, 16), (3, 32), (8, 64)])
@pytest.mark.parametrize("case", ["mixed", "prefix_hits", "vllm_mix"])
def test_matches_reference_low_precision(isa, case, num_queries_per_kv, block_size, dtype,
                                         splits):
    batch = make_batch(CASES[case], num_heads=2 * num_queries_per_kv, num_kv_heads=2,
                       block_size=block_size, dtype=dtype)
    check(cpu_paged_attention(**batch, split_keys=SPLITS[splits]), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
def test_head_dims(isa, head_dim, block_size, dtype):
    batch = make_batch(CASES["vllm_mix"], num_heads=9, num_kv_heads=3, head_dim=head_dim,
                       block_size=block_size, dtype=dtype)
    check(cpu_paged_attention(**batch), batch)


@pytest.mark.parametrize("split_keys", [1, 16, 40, 48, 512, 1000])
def test_split_kv_matches_reference_and_no_split(isa, split_keys):
    """Flash-decoding splits at fixed key positions, merged by (max, sum): a long decode beside
    short ones, where small splits leave ranges of a single block (rounded to whole blocks),
    and a prefill tile spanning splits leaves ranges some of its rows see nothing of."""
    batch = make_batch([(1, 1328), (1, 17), (1, 1), (33, 300), (4, 20)], num_heads=9,
                       num_kv_heads=3)
    out = cpu_paged_attention(**batch, split_keys=split_keys)
    check(out, batch)
    torch.testing.assert_close(out, cpu_paged_attention(**batch, split_keys=NO_SPLIT),
                               atol=1e-6, rtol=1e-5)


def _one_sequence(seq_len: int, dtype: torch.dtype, num_heads: int = 9, num_kv_heads: int = 3,
                  block_size: int = 16):
    """A sequence's filled cache (blocks in a shuffled order, spare blocks for other
    sequences) and a query row for every position: ``(query [L, H, D], k_cache, v_cache,
    table [1, n] int32)``."""
    gen = torch.Generator().manual_seed(seq_len)
    n = math.ceil(seq_len / block_size)
    num_blocks = n + 64
    shape = (num_blocks, block_size, num_kv_heads, 64)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:n].to(torch.int32)[None]
    query = torch.randn(seq_len, num_heads, 64, generator=gen).to(dtype)
    return query, k_cache, v_cache, table


def _rows(query, k_cache, v_cache, tables, seq_lens, query_lens, **kwargs):
    qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    return cpu_paged_attention(query, k_cache, v_cache, tables,
                               torch.tensor(seq_lens, dtype=torch.int32), qsl, max(query_lens),
                               max(seq_lens), 0.125, **kwargs)


@pytest.mark.parametrize("sliding_window", [0, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_is_the_same_in_any_step(isa, dtype, sliding_window):
    """Query rows of one sequence (1,300 keys: three default splits) computed as the whole
    prompt, as prefix-hit tails of many lengths, in chunks of 1, 5, 64 and 300 tokens, beside
    other sequences, and on one thread: bitwise the same rows every time."""
    seq_len = 1300
    query, k_cache, v_cache, table = _one_sequence(seq_len, dtype)
    kw = {"sliding_window": sliding_window}
    whole = _rows(query, k_cache, v_cache, table, [seq_len], [seq_len], **kw)
    check(whole, {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": table,
                  "seq_lens": torch.tensor([seq_len], dtype=torch.int32),
                  "query_start_loc": torch.tensor([0, seq_len], dtype=torch.int32),
                  "max_query_len": seq_len, "max_seq_len": seq_len, "scale": 0.125, **kw})
    for start in (1, 5, 16, 511, 512, 513, 700, 1024, 1299):  # prefix hit of `start` tokens
        tail = _rows(query[start:], k_cache, v_cache, table, [seq_len], [seq_len - start], **kw)
        assert torch.equal(tail, whole[start:]), start
    for chunk in (1, 5, 64, 300):  # chunked prefill: each chunk sees the keys up to its end
        for begin in range(0, seq_len, chunk * 37 if chunk < 64 else chunk):
            end = min(seq_len, begin + chunk)
            part = _rows(query[begin:end], k_cache, v_cache, table, [end], [end - begin], **kw)
            assert torch.equal(part, whole[begin:end]), (chunk, begin)
    # beside other sequences (a decode and a prefill of their own) in one step
    other_q, _, _, _ = _one_sequence(40, dtype)
    tables = table.expand(3, -1).contiguous()  # (the others read this one's first blocks)
    mixed = _rows(torch.cat([other_q[:7], query[1000:], other_q[:1]]), k_cache, v_cache,
                  tables, [40, seq_len, 33], [7, seq_len - 1000, 1], **kw)
    assert torch.equal(mixed[7:7 + seq_len - 1000], whole[1000:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_rows(query, k_cache, v_cache, table, [seq_len], [seq_len], **kw),
                           whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("num_kv_heads", [1, 3])
@pytest.mark.parametrize("split_keys", [0, 48, NO_SPLIT], ids=["default", "48", "nosplit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_decode_row_is_the_same_in_a_batch_of_many(isa, dtype, split_keys, num_kv_heads):
    """A decode step of many sequences (enough that the float32 body runs each sequence's KV
    heads as one unit reading whole blocks, and prefetches the next unit's while it computes)
    beside a prefill: each row matches the reference and is bitwise the row its sequence gives
    alone in a step, on two threads and on one."""
    ctx = [700, 1, 16, 17, 513, 1300, 40, 300, 129, 1024, 64, 5]
    step = [(1, c) for c in ctx] + [(33, 90)]
    batch = make_batch(step, num_heads=3 * num_kv_heads, num_kv_heads=num_kv_heads, dtype=dtype)
    garble_unused(batch)
    out = cpu_paged_attention(**batch, split_keys=split_keys)
    check(out, batch)
    qsl = batch["query_start_loc"].tolist()
    for i, (q, c) in enumerate(step):
        alone = {**batch, "query": batch["query"][qsl[i]:qsl[i + 1]],
                 "block_tables": batch["block_tables"][i:i + 1],
                 "seq_lens": batch["seq_lens"][i:i + 1],
                 "query_start_loc": torch.tensor([0, q], dtype=torch.int32),
                 "max_query_len": q, "max_seq_len": c}
        assert torch.equal(cpu_paged_attention(**alone, split_keys=split_keys),
                           out[qsl[i]:qsl[i + 1]]), i
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_paged_attention(**batch, split_keys=split_keys), out)
    finally:
        torch.set_num_threads(threads)


def test_padding_tokens_give_zero_rows(isa):
    batch = make_batch(CASES["mixed"])
    garble_unused(batch)
    num_real = batch["query"].shape[0]
    batch["query"] = torch.cat([batch["query"], torch.randn_like(batch["query"][:4])])
    out = cpu_paged_attention(**batch)
    assert torch.isfinite(out).all()
    assert (out[num_real:] == 0).all()
    check(out[:num_real], {**batch, "query": batch["query"][:num_real]})


def test_strided_query_and_combined_kv_cache(isa):
    """Query a view of a fused QKV tensor; K and V the two halves of one combined cache."""
    pairs = [(1, 37), (5, 18), (17, 40)]
    batch = make_batch(pairs, num_heads=6, num_kv_heads=2, block_size=16)
    k, v = batch["k_cache"], batch["v_cache"]
    combined = torch.stack([k, v], dim=1)  # [num_blocks, 2, block_size, Hkv, D]
    batch["k_cache"], batch["v_cache"] = combined[:, 0], combined[:, 1]
    qkv = torch.randn(batch["query"].shape[0], 10, 64)
    batch["query"] = qkv[:, 2:8]  # token stride 10 * 64
    check(cpu_paged_attention(**batch), batch)


def test_empty_query_sequences_and_wide_tables(isa):
    """A sequence with no query rows this step, and block tables wider than needed."""
    batch = make_batch([(3, 20), (1, 9)], num_heads=4, num_kv_heads=2)
    batch["seq_lens"] = torch.tensor([20, 7, 9], dtype=torch.int32)
    batch["query_start_loc"] = torch.tensor([0, 3, 3, 4], dtype=torch.int32)
    batch["block_tables"] = torch.cat([batch["block_tables"],
                                       batch["block_tables"][1:]])[[0, 1, 2]]
    check(cpu_paged_attention(**batch), batch)


def test_cache_past_2_31_elements_uses_64_bit_offsets(isa):
    """bfloat16 K/V halves of one combined cache of more than 2**31 elements (4 GiB of virtual
    memory: ``torch.empty`` commits only the pages the test touches, well under 1 MiB), with
    blocks near both ends; written and read through the native ops."""
    num_kv_heads, head_dim, block_size = 1, 64, 16
    per_block = 2 * block_size * num_kv_heads * head_dim
    num_blocks = 2**31 // per_block + 8
    try:
        kv_cache = torch.empty(num_blocks, 2, block_size, num_kv_heads, head_dim,
                               dtype=torch.bfloat16)
    except (RuntimeError, MemoryError) as e:  # address space refused
        pytest.skip(f"cannot reserve a >2**31-element cache here: {e}")
    assert kv_cache.numel() > 2**31
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
    block_tables = torch.tensor([[num_blocks - 1, 3, num_blocks - 5],
                                 [num_blocks - 2, num_blocks - 7, 0]], dtype=torch.int32)
    pairs = [(5, 40), (1, 20)]
    seq_lens = torch.tensor([s for _, s in pairs], dtype=torch.int32)
    for i, seq_len in enumerate(seq_lens.tolist()):
        pos = torch.arange(seq_len)
        blocks = block_tables[i, pos // block_size].long()
        key = torch.randn(seq_len, num_kv_heads, head_dim, dtype=torch.bfloat16)
        value = torch.randn_like(key)
        cpu_reshape_and_cache(key, value, k_cache, v_cache, blocks * block_size + pos % block_size)
        assert torch.equal(k_cache[blocks, pos % block_size], key)
        assert torch.equal(v_cache[blocks, pos % block_size], value)
    batch = {"query": torch.randn(6, 3, head_dim, dtype=torch.bfloat16), "k_cache": k_cache,
             "v_cache": v_cache, "block_tables": block_tables, "seq_lens": seq_lens,
             "query_start_loc": torch.tensor([0, 5, 6], dtype=torch.int32),
             "max_query_len": 5, "max_seq_len": 40, "scale": head_dim**-0.5}
    for split_keys in (NO_SPLIT, 16):
        check(cpu_paged_attention(**batch, split_keys=split_keys), batch)


# --- sliding window: query p sees keys p - W + 1 .. p; blocks before every window unread ---


@pytest.mark.parametrize("entry", [-1, 2**30, None], ids=["minus1", "huge", "nan_blocks"])
@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_sliding_window_matches_reference_and_skips_out_of_window_blocks(
        isa, case, sliding_window, splits, entry):
    """Blocks wholly before every window hold NaN K/V and (minus1, huge) a table entry that is
    no block id (the kernel validates the entries it reads, so reading one would raise)."""
    batch = make_batch(WINDOW_CASES[case], num_heads=6, num_kv_heads=2)
    garble_unused(batch)
    poison_out_of_window(batch, sliding_window, entry)
    out = cpu_paged_attention(**batch, split_keys=SPLITS[splits], sliding_window=sliding_window)
    assert torch.isfinite(out).all()
    check(out, {**batch, "sliding_window": sliding_window})


@pytest.mark.parametrize("sliding_window", [1, 7, 16, 40, 100])
@pytest.mark.parametrize(("num_queries_per_kv", "block_size"), GQA_BLOCK_SIZES)
def test_sliding_window_gqa_and_block_sizes(isa, num_queries_per_kv, block_size,
                                            sliding_window):
    """Decode-sized tiles (one item for every KV head) and tiles of >= 16 rows per KV head (one
    item each) with windows inside a block, across a block boundary and over several blocks."""
    batch = make_batch(WINDOW_CASES["mixed"] + [(70, 150), (2, 130)],
                       num_heads=2 * num_queries_per_kv, num_kv_heads=2, block_size=block_size)
    poison_out_of_window(batch, sliding_window, -1)
    out = cpu_paged_attention(**batch, sliding_window=sliding_window)
    check(out, {**batch, "sliding_window": sliding_window})


@pytest.mark.parametrize("split_keys", [0, 1, 48, NO_SPLIT])
@pytest.mark.parametrize("sliding_window", [100, 256, 600, 5000])
def test_sliding_window_split_kv(isa, sliding_window, split_keys):
    """Long contexts split over KV ranges of the window only (the splits start at the window's
    first block), beside a 130-row prefill tile whose rows' windows start in different splits."""
    batch = make_batch([(1, 1328), (1, 17), (130, 900), (4, 700)], num_heads=9, num_kv_heads=3)
    assert poison_out_of_window(batch, sliding_window, 2**30) or sliding_window == 5000
    out = cpu_paged_attention(**batch, split_keys=split_keys, sliding_window=sliding_window)
    check(out, {**batch, "sliding_window": sliding_window})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("sliding_window", [5, 40])
def test_sliding_window_low_precision(isa, sliding_window, dtype):
    batch = make_batch(WINDOW_CASES["mixed"] + [(40, 100)], num_heads=6, num_kv_heads=2,
                       dtype=dtype)
    poison_out_of_window(batch, sliding_window, -1)
    out = cpu_paged_attention(**batch, sliding_window=sliding_window)
    check(out, {**batch, "sliding_window": sliding_window})


def test_sliding_window_still_checks_in_window_blocks_and_rejects_negative():
    batch = make_batch([(1, 37)])
    batch["block_tables"][0, 0] = -1  # out of a 5-token window: fine
    cpu_paged_attention(**batch, sliding_window=5)
    batch["block_tables"][0, 2] = -1  # the block holding position 36: read, so checked
    with pytest.raises(IndexError, match="block_tables"):
        cpu_paged_attention(**batch, sliding_window=5)
    with pytest.raises(ValueError, match="sliding_window"):
        cpu_paged_attention(**make_batch([(1, 37)]), sliding_window=-1)


# --- reshape_and_cache -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["separate", "combined"])
def test_reshape_and_cache_matches_reference_and_skips_negative_slots(dtype, layout):
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 7, 16, 3, 64, 40
    if layout == "combined":  # K and V halves of one [num_blocks, 2, ...] tensor
        kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim).to(dtype)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
        v_cache = torch.randn_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim)  # float32: cast to the cache dtype
    value = torch.randn(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::5] = -1  # padding tokens
    reference_reshape_and_cache(key.to(dtype), value.to(dtype), expected_k, expected_v, slots)
    cpu_reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_reshape_and_cache_strided_key_and_int32_slots():
    k_cache = torch.zeros(4, 16, 2, 64)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.randn(5, 2, 2, 64)  # key and value interleaved: token stride 256
    slots = torch.tensor([3, 17, -1, 63, 40], dtype=torch.int32)
    cpu_reshape_and_cache(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference_reshape_and_cache(kv[:, 0], kv[:, 1], expected_k, expected_v, slots.long())
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_reshape_and_cache_rejects_slot_past_cache():
    k_cache = torch.zeros(2, 16, 1, 64)
    with pytest.raises(IndexError, match="slot_mapping"):
        cpu_reshape_and_cache(torch.zeros(1, 1, 64), torch.zeros(1, 1, 64), k_cache,
                              torch.zeros_like(k_cache), torch.tensor([32]))


# --- errors, ISA choice, op registration -----------------------------------------------------


def test_rejects_num_heads_not_multiple_of_num_kv_heads():
    batch = make_batch([(1, 5)], num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="multiple"):
        cpu_paged_attention(**batch)


def test_rejects_used_block_id_out_of_range():
    batch = make_batch([(1, 37)])
    batch["block_tables"][0, 1] = batch["k_cache"].shape[0]
    with pytest.raises(IndexError, match="block_tables"):
        cpu_paged_attention(**batch)


def test_rejects_query_longer_than_sequence():
    batch = make_batch([(5, 18)])
    batch["seq_lens"][0] = 4
    with pytest.raises(ValueError, match="query_len"):
        cpu_paged_attention(**batch)


def test_isa_env_var(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert cpu_isa() == BEST_ISA
    monkeypatch.setenv(ISA_ENV, "auto")
    assert cpu_isa() == BEST_ISA
    monkeypatch.setenv(ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ISA"):
        cpu_isa()
    if ISA_ORDER[-1] != BEST_ISA:  # a step above what the CPU has is refused
        monkeypatch.setenv(ISA_ENV, ISA_ORDER[ISA_ORDER.index(BEST_ISA) + 1])
        with pytest.raises(ValueError, match="supports at most"):
            cpu_paged_attention(**make_batch([(1, 5)]))


def test_ops_are_registered_with_mutation_schemas():
    """Custom ops with mutation annotations and meta kernels, as torch.compile needs them."""
    ops = torch.ops.pagedserve
    attn, write = ops.paged_attention.default, ops.reshape_and_cache.default
    assert [a.name for a in attn._schema.arguments if a.is_write] == ["out"]
    assert [a.name for a in write._schema.arguments if a.is_write] == ["k_cache", "v_cache"]
    batch = make_batch([(1, 37), (5, 18)])
    args = (torch.empty_like(batch["query"]), batch["query"], batch["k_cache"],
            batch["v_cache"], batch["block_tables"], batch["seq_lens"],
            batch["query_start_loc"], batch["scale"], 0)
    torch.library.opcheck(attn, args, test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(attn, (*args, 5), test_utils=("test_schema", "test_faketensor"))
    slots = torch.tensor([3, -1, 40])
    write_args = (torch.randn(3, 2, 64), torch.randn(3, 2, 64), batch["k_cache"],
                  batch["v_cache"], slots)
    torch.library.opcheck(write, write_args, test_utils=("test_schema", "test_faketensor"))


# --- the model with the cpu backend ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-cpu"))


def test_greedy_batch_with_cpu_backend_equals_transformers_generate(tiny_llama):
    """Continuous batching (late arrival, chunked prefill next to decodes, preemption) with the
    native kernels: exactly transformers' greedy tokens at float32."""
    from transformers import LlamaForCausalLM as HFLlamaForCausalLM

    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner
    from tests.worker.test_model import NEW_TOKENS, drive_greedy, hf_greedy

    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, attention_backend="cpu"))
    assert runner.attention_backend_name == "cpu"
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 9, 40, 300)]
    outputs = drive_greedy(runner, prompts, NEW_TOKENS, token_budget=64,
                           arrivals=[3, 0, 0, 0], preempt=(8, 2))
    ref = HFLlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert outputs == [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]


def test_auto_picks_the_native_kernels_on_cpu_and_falls_back_to_torch(monkeypatch):
    from kernels import cpu_build
    from services.worker.attention import select_backend

    assert select_backend("auto", "cpu").name == "cpu"

    def broken():
        raise RuntimeError("no compiler")
    monkeypatch.setattr(cpu_build, "load", broken)
    assert select_backend("auto", "cpu").name == "torch"
    assert select_backend("cpu", "cpu").name == "cpu"  # asked for by name: no fallback, and
    with pytest.raises(RuntimeError, match="no compiler"):  # its ops fail on first use
        cpu_isa()
