"""Paged attention (torch and Triton) against the float64 per-sequence reference.

Batches are lists of (query_len, seq_len) pairs: ``seq_len`` counts the cached context AND the
query tokens, so (1, 37) is a decode step at position 36, (5, 18) a 5-token prefill chunk after
13 cached tokens, (9, 9) a whole prompt. Block tables are random permutations of the block ids.
On CPU the Triton kernel runs under TRITON_INTERPRET=1 (see conftest.py), so shapes are small;
with CUDA the larger vLLM-style cases are added.
"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from kernels import (
    cpu_paged_attention,
    cpu_reshape_and_cache,
    reference_paged_attention,
    torch_paged_attention,
    torch_reshape_and_cache,
    triton_paged_attention,
    triton_reshape_and_cache,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# (atol, rtol) against the float64 reference, by input dtype; one table for every backend.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

BACKENDS = {
    "torch": torch_paged_attention,
    "triton": functools.partial(triton_paged_attention, num_splits=1),
    # split-KV (flash-decoding) forced on, so every case also runs the partial + merge path
    "triton_split4": functools.partial(triton_paged_attention, num_splits=4),
}

CASES = {
    "decode": [(1, 37), (1, 16), (1, 17)],
    "chunked_prefill": [(5, 18)],
    "prefill": [(17, 40)],
    "single_token_prompt": [(1, 1)],
    "mixed": [(1, 37), (5, 18), (17, 40), (1, 1), (9, 9), (1, 33)],
    # one long chunk beside short prefix-cache-hit tails: the torch path splits the prefill
    # group into buckets of similar query length (more than one bucket here)
    "prefix_hits": [(64, 96), (4, 68), (3, 67), (1, 50), (5, 69), (2, 30)],
    # vLLM's kernel-test mix: a long decode, a short chunk after a prefix, a long chunk
    "vllm_mix": [(1, 1328), (5, 18), (129, 463)],
}
if CUDA:  # full size on a GPU
    CASES["decode_long"] = [(1, 1328), (1, 1), (1, 4097)] * 4
    CASES["mixed_long"] = [(129, 463), (1, 1328), (5, 18), (256, 256), (1, 3)] * 3
    CASES["decode_32k"] = [(1, 32768), (1, 17)]

# NOTE: the Triton interpreter multiplies the raw bits of bfloat16 operands in tl.dot
# (triton-lang/triton#11584, not supported upstream), so Triton bfloat16 runs on CUDA only;
# float16 exercises the same low-precision path on CPU.
DTYPE_PARAMS = [
    pytest.param("torch", torch.bfloat16, id="torch-bf16"),
    pytest.param("torch", torch.float16, id="torch-fp16"),
    pytest.param("triton", torch.float16, id="triton-fp16"),
    pytest.param("triton_split4", torch.float16, id="triton-split4-fp16"),
    *([pytest.param("triton", torch.bfloat16, id="triton-bf16")] if CUDA else []),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_batch(
    pairs: list[tuple[int, int]],
    num_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
) -> dict:
    """Random query, filled caches and the metadata of one step, as attention keyword args."""
    num_seqs = len(pairs)
    blocks_per_seq = max(math.ceil(seq_len / block_size) for _, seq_len in pairs) + 1
    num_blocks = num_seqs * blocks_per_seq + spare_blocks
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=DEVICE)
    # random physical blocks; entries past a sequence's last block stay 0 (unused)
    perm = torch.randperm(num_blocks, device=DEVICE)
    block_tables = torch.zeros(num_seqs, blocks_per_seq, dtype=torch.int32, device=DEVICE)
    used = 0
    for i, (_, seq_len) in enumerate(pairs):
        n = math.ceil(seq_len / block_size)
        block_tables[i, :n] = perm[used : used + n]
        used += n
    query_lens = torch.tensor([q for q, _ in pairs], dtype=torch.int32)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    num_tokens = int(query_start_loc[-1])
    return {
        "query": torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=DEVICE),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "seq_lens": torch.tensor([s for _, s in pairs], dtype=torch.int32, device=DEVICE),
        "query_start_loc": query_start_loc.to(DEVICE),
        "max_query_len": max(q for q, _ in pairs),
        "max_seq_len": max(s for _, s in pairs),
        "scale": head_dim**-0.5,
    }


def assert_matches_reference(out: torch.Tensor, batch: dict) -> None:
    expected = reference_paged_attention(**batch)
    assert out.shape == batch["query"].shape and out.dtype == batch["query"].dtype
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


# GQA ratio x block size: every pairing on a GPU, a diagonal under the (slow) interpreter
GQA_BLOCK_SIZES = (
    [(g, b) for g in (1, 3, 8) for b in (16, 32, 64)] if CUDA
    else [(1, 16), (3, 32), (8, 64), (8, 16)]
)


FP32_PARAMS = [
    (backend, case, g, b)
    for backend in BACKENDS
    for case in CASES
    # under the interpreter the split path runs every case at one GQA ratio and block size
    for g, b in (GQA_BLOCK_SIZES if CUDA or backend != "triton_split4" else [(3, 32)])
]


@pytest.mark.parametrize(("backend", "case", "num_queries_per_kv", "block_size"), FP32_PARAMS)
def test_matches_reference_fp32(backend, case, num_queries_per_kv, block_size):
    batch = make_batch(CASES[case], num_heads=2 * num_queries_per_kv, num_kv_heads=2,
                       block_size=block_size)
    assert_matches_reference(BACKENDS[backend](**batch), batch)


@pytest.mark.parametrize("num_queries_per_kv", [1, 8])
@pytest.mark.parametrize(("case", "num_splits"),
                         [("decode", 32), ("mixed", 2), ("single_token_prompt", 8)])
def test_split_kv_matches_reference(case, num_queries_per_kv, num_splits):
    """Flash-decoding: each (query tile, KV head) over ``num_splits`` key ranges, then merged.
    32 splits of a 37-token context leave most ranges empty (they must weigh nothing)."""
    batch = make_batch(CASES[case], num_heads=2 * num_queries_per_kv, num_kv_heads=2)
    assert_matches_reference(triton_paged_attention(**batch, num_splits=num_splits), batch)


@pytest.mark.parametrize("dtype", [torch.float16, *([torch.bfloat16] if CUDA else [])])
def test_split_kv_low_precision(dtype):
    batch = make_batch(CASES["vllm_mix"], num_heads=6, num_kv_heads=2, dtype=dtype)
    assert_matches_reference(triton_paged_attention(**batch, num_splits=8), batch)


def test_choose_num_splits_splits_long_contexts_at_small_batch_only():
    from kernels.triton_attention import MAX_SPLITS, choose_num_splits

    h200_sms = 132
    # batch 1, 8 KV heads, 32k context: the grid would use 8 of 132 SMs -> split
    assert choose_num_splits(8, 32768, 64, h200_sms) == 32
    # batch 64 x 8 KV heads already fills the GPU -> no split
    assert choose_num_splits(512, 4096, 64, h200_sms) == 1
    # a short context is not worth a reduce pass, however small the batch
    assert choose_num_splits(1, 200, 64, h200_sms) == 1
    # capped, a power of 2, and never on CPU
    assert choose_num_splits(1, 10**6, 64, h200_sms) == MAX_SPLITS
    for programs in range(1, 140, 7):
        n = choose_num_splits(programs, 8192, 64, h200_sms)
        assert n & (n - 1) == 0 and 1 <= n <= MAX_SPLITS
    assert choose_num_splits(1, 32768, 64, 0) == 1


def test_split_kv_rejects_non_power_of_2():
    batch = make_batch(CASES["decode"])
    with pytest.raises(ValueError, match="num_splits"):
        triton_paged_attention(**batch, num_splits=3)


@pytest.mark.parametrize(("backend", "dtype"), DTYPE_PARAMS)
def test_matches_reference_low_precision(backend, dtype):
    batch = make_batch(CASES["mixed"], num_heads=6, num_kv_heads=2, dtype=dtype)
    assert_matches_reference(BACKENDS[backend](**batch), batch)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_head_dims(backend, head_dim, block_size):
    batch = make_batch(CASES["mixed"], num_heads=3, num_kv_heads=1, head_dim=head_dim,
                       block_size=block_size)
    assert_matches_reference(BACKENDS[backend](**batch), batch)


@pytest.mark.parametrize("case", ["decode", "mixed"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_ignores_unused_blocks_padding_slots_and_padding_tokens(backend, case):
    """Unused table entries hold garbage, unwritten slots hold NaN, padding tokens trail."""
    batch = make_batch(CASES[case])
    block_size = batch["k_cache"].shape[1]
    in_use = torch.zeros(batch["k_cache"].shape[:2], dtype=torch.bool, device=DEVICE)
    for i, seq_len in enumerate(batch["seq_lens"].tolist()):
        for pos in range(seq_len):
            in_use[batch["block_tables"][i, pos // block_size], pos % block_size] = True
        batch["block_tables"][i, math.ceil(seq_len / block_size) :] = 2**30  # out of range
    batch["k_cache"][~in_use] = float("nan")
    batch["v_cache"][~in_use] = float("nan")
    num_real = batch["query"].shape[0]
    batch["query"] = torch.cat([batch["query"], torch.randn_like(batch["query"][:4])])

    out = BACKENDS[backend](**batch)

    assert torch.isfinite(out).all()
    assert (out[num_real:] == 0).all()
    expected = reference_paged_attention(**batch)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out[:num_real], expected[:num_real], atol=atol, rtol=rtol)


def test_torch_path_is_bitwise_sdpa_for_one_sequence():
    """For a batch of one sequence the torch path is exactly transformers' SDPA call:
    ``sdpa(q, k, v, is_causal=True, enable_gqa=True)`` for a prompt, no mask for a decode step."""
    batch = make_batch([(23, 23)], num_heads=9, num_kv_heads=3)
    block_size = batch["k_cache"].shape[1]
    pos = torch.arange(23, device=DEVICE)
    slots = batch["block_tables"][0, pos // block_size].long(), pos % block_size
    k = batch["k_cache"][slots].transpose(0, 1)[None]  # [1, Hkv, S, D]
    v = batch["v_cache"][slots].transpose(0, 1)[None]
    q = batch["query"].transpose(0, 1)[None]  # [1, H, S, D]
    sdpa = F.scaled_dot_product_attention
    prompt = sdpa(q, k, v, is_causal=True, scale=batch["scale"], enable_gqa=True)[0].transpose(0, 1)
    assert torch.equal(torch_paged_attention(**batch), prompt)

    decode = {**batch, "query": batch["query"][-1:], "max_query_len": 1}
    decode["query_start_loc"] = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    step = sdpa(q[:, :, -1:], k, v, scale=batch["scale"], enable_gqa=True)[0].transpose(0, 1)
    assert torch.equal(torch_paged_attention(**decode), step)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_chunked_prefill_then_decode_equals_dense_causal_attention(backend):
    """The engine's use: write each step's K/V, then attend; chunks + decodes = one dense pass.
    ``cpu``: the native kernels (on their best ISA path here; tests/kernels/
    test_cpu_paged_attention.py runs every path)."""
    if backend == "cpu" and CUDA:
        pytest.skip("the native kernels run on the CPU only")
    attention = {**BACKENDS, "cpu": cpu_paged_attention}[backend]
    reshape_and_cache = {"torch": torch_reshape_and_cache, "triton": triton_reshape_and_cache,
                         "cpu": cpu_reshape_and_cache}[backend]
    num_heads, num_kv_heads, head_dim, block_size, total = 6, 2, 64, 16, 21
    q = torch.randn(total, num_heads, head_dim, device=DEVICE)
    k = torch.randn(total, num_kv_heads, head_dim, device=DEVICE)
    v = torch.randn(total, num_kv_heads, head_dim, device=DEVICE)
    k_cache = torch.zeros(8, block_size, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.tensor([[5, 2, 7]], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(total, device=DEVICE)
    slots = block_table[0, pos // block_size].long() * block_size + pos % block_size

    outs, start = [], 0
    for chunk in [8, 8, 3, 1, 1]:  # chunked prefill of a 19-token prompt, then 2 decode steps
        end = start + chunk
        reshape_and_cache(k[start:end], v[start:end], k_cache, v_cache, slots[start:end])
        outs.append(attention(
            q[start:end], k_cache, v_cache, block_table,
            seq_lens=torch.tensor([end], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE),
            max_query_len=chunk, max_seq_len=end, scale=head_dim**-0.5,
        ))
        start = end

    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(torch.cat(outs), dense, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_large_num_blocks_do_not_overflow_int32_offsets(backend):
    """K/V in blocks whose element offset is past 2**31 (one combined K/V cache of 4 GiB
    virtual memory; only the touched pages are ever allocated)."""
    num_kv_heads, head_dim, block_size = 1, 64, 16
    per_block = 2 * block_size * num_kv_heads * head_dim
    num_blocks = 2**31 // per_block + 8
    try:
        kv_cache = torch.empty(
            num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=torch.float16, device=DEVICE
        )
    except (RuntimeError, MemoryError) as e:  # address space refused
        pytest.skip(f"cannot reserve a >2**31-element cache here: {e}")
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]  # block stride 2 * block_size * H * D
    block_tables = torch.tensor(
        [[num_blocks - 1, 3, num_blocks - 5], [num_blocks - 2, num_blocks - 7, 0]],
        dtype=torch.int32, device=DEVICE,
    )
    pairs = [(5, 40), (1, 20)]
    seq_lens = torch.tensor([s for _, s in pairs], dtype=torch.int32, device=DEVICE)
    for i, seq_len in enumerate(seq_lens.tolist()):  # fill the used slots through the write kernel
        pos = torch.arange(seq_len, device=DEVICE)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        key = torch.randn(seq_len, num_kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
        value = torch.randn_like(key)
        write = torch_reshape_and_cache if backend == "torch" else triton_reshape_and_cache
        write(key, value, k_cache, v_cache, slots)
        at = block_tables[i, pos // block_size].long(), pos % block_size
        assert torch.equal(k_cache[at], key)
        assert torch.equal(v_cache[at], value)
    batch = {
        "query": torch.randn(6, 3, head_dim, dtype=torch.float16, device=DEVICE),
        "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
        "seq_lens": seq_lens,
        "query_start_loc": torch.tensor([0, 5, 6], dtype=torch.int32, device=DEVICE),
        "max_query_len": 5, "max_seq_len": 40, "scale": head_dim**-0.5,
    }
    assert_matches_reference(BACKENDS[backend](**batch), batch)


@pytest.mark.parametrize(
    "attention", [reference_paged_attention, torch_paged_attention, triton_paged_attention]
)
def test_rejects_num_heads_not_multiple_of_num_kv_heads(attention):
    batch = make_batch([(1, 5)], num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="multiple"):
        attention(**batch)


@pytest.mark.parametrize("factor", [1.25, 2])
def test_buckets_bound_padding_and_cover_every_index(factor):
    from kernels.torch_attention import _buckets

    lengths = [64, 4, 3, 1, 5, 2, 300, 33, 31, 770, 512, 129, 128, 40]
    indices = [i for i, n in enumerate(lengths) if n > 1]
    buckets = _buckets(indices, lengths, factor)
    assert 1 < len(buckets) < len(indices)
    seen = []
    for members in buckets:
        lens = [lengths[i] for i in members]
        assert max(lens) * len(lens) <= factor * sum(lens)
        seen += members
    assert sorted(seen) == indices


def test_plan_buckets_decode_by_seq_len_and_prefill_by_query_len():
    """A mixed step: decode rows of very different context lengths go to several groups, each
    cut to its own longest context; every sequence lands in exactly one group."""
    from kernels.torch_attention import plan_paged_attention

    pairs = [(1, 700), (1, 20), (1, 690), (64, 64), (1, 25), (3, 300), (2, 40)]
    batch = make_batch(pairs, num_heads=4, num_kv_heads=2)
    plan = plan_paged_attention(batch["block_tables"], batch["seq_lens"],
                                batch["query_start_loc"], batch["max_query_len"],
                                batch["max_seq_len"], batch["k_cache"].shape[1])
    starts = batch["query_start_loc"][:-1].tolist()
    decode_rows = sorted(r for g in plan.decode for r in g.rows.tolist())
    assert decode_rows == sorted(starts[i] for i, (q, _) in enumerate(pairs) if q == 1)
    assert sorted(g.slots.shape[1] for g in plan.decode) == [25, 700]
    assert sorted(g.rows.shape[1] for g in plan.prefill) == [2, 64]  # 64 + 3, then 2
    assert_matches_reference(torch_paged_attention(**batch, plan=plan), batch)


# --- sliding-window attention (Longformer / Mistral 7B): query p attends keys p - W + 1 .. p ---

# block_size 16: windows of 1 and 5 tokens (inside a block), one block, several blocks, and
# one longer than every sequence (= full causal attention)
WINDOWS = [1, 5, 16, 40, 1000]
WINDOW_CASES = {
    "decode": [(1, 37), (1, 16), (1, 17), (1, 5), (1, 64), (1, 65)],
    "chunked_prefill": [(5, 18), (17, 40), (3, 67), (16, 48)],
    "mixed": [(1, 37), (5, 18), (17, 40), (1, 1), (9, 9), (1, 33), (2, 70)],
}


def out_of_window_blocks(batch: dict, sliding_window: int) -> list[list[int]]:
    """Per sequence, the logical blocks wholly before every query's window (the contract's
    ``(j + 1) * block_size <= context_len - W + 1``): their table entries may be anything."""
    block_size = batch["k_cache"].shape[1]
    qsl, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    out = []
    for i, seq_len in enumerate(lens):
        first = seq_len - (qsl[i + 1] - qsl[i]) - sliding_window + 1
        out.append([j for j in range(math.ceil(seq_len / block_size))
                    if (j + 1) * block_size <= first])
    return out


def poison_out_of_window(batch: dict, sliding_window: int, entry: int | None) -> int:
    """NaN the K/V of every block wholly before its sequence's windows and, unless ``entry`` is
    None, overwrite their block-table entries with ``entry`` (-1, or an id past the cache).
    Returns how many blocks were poisoned (the case must have some)."""
    n = 0
    for i, blocks in enumerate(out_of_window_blocks(batch, sliding_window)):
        for j in blocks:
            physical = int(batch["block_tables"][i, j])
            batch["k_cache"][physical] = float("nan")
            batch["v_cache"][physical] = float("nan")
            if entry is not None:
                batch["block_tables"][i, j] = entry
            n += 1
    return n


def dense_sliding_window_attention(batch: dict, sliding_window: int) -> torch.Tensor:
    """The spec written out a second way, independent of the reference: per query row, a plain
    float64 softmax over exactly the keys ``max(0, p - W + 1) .. p`` (all keys ``0 .. p`` for
    W = 0), read through the block table one position at a time."""
    q_all, k_cache, v_cache = batch["query"].double(), batch["k_cache"], batch["v_cache"]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_all.shape[1] // num_kv_heads
    out = torch.zeros_like(q_all)
    qsl, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    for i, seq_len in enumerate(lens):
        context_len = seq_len - (qsl[i + 1] - qsl[i])
        for row in range(qsl[i], qsl[i + 1]):
            p = context_len + row - qsl[i]
            keys = range(max(0, p - sliding_window + 1) if sliding_window else 0, p + 1)
            at = [(int(batch["block_tables"][i, t // block_size]), t % block_size) for t in keys]
            k = torch.stack([k_cache[b, o] for b, o in at]).double()  # [len(keys), Hkv, D]
            v = torch.stack([v_cache[b, o] for b, o in at]).double()
            for h in range(q_all.shape[1]):
                scores = k[:, h // group] @ q_all[row, h] * batch["scale"]  # [len(keys)]
                out[row, h] = torch.softmax(scores, 0) @ v[:, h // group]
    return out


@pytest.mark.parametrize("sliding_window", [0, *WINDOWS])
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_reference_sliding_window_is_dense_masked_softmax(case, sliding_window):
    batch = make_batch(WINDOW_CASES[case], num_heads=4, num_kv_heads=2, head_dim=16)
    out = reference_paged_attention(**batch, sliding_window=sliding_window)
    expected = dense_sliding_window_attention(batch, sliding_window).to(out.dtype)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_reference_sliding_window_bounds():
    batch = make_batch(WINDOW_CASES["mixed"])
    full = reference_paged_attention(**batch)
    # a window covering every sequence is full causal attention; W = 1 attends only itself
    assert torch.equal(reference_paged_attention(**batch, sliding_window=70), full)
    own = reference_paged_attention(**batch, sliding_window=1)
    block_size = batch["k_cache"].shape[1]
    qsl, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    for i, seq_len in enumerate(lens):
        for row in range(qsl[i], qsl[i + 1]):
            p = seq_len - qsl[i + 1] + row
            physical = int(batch["block_tables"][i, p // block_size])
            v = batch["v_cache"][physical, p % block_size]  # [Hkv, D]
            expected = v.repeat_interleave(3, dim=0)  # 6 heads over 2 KV heads
            torch.testing.assert_close(own[row], expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="sliding_window"):
        reference_paged_attention(**batch, sliding_window=-1)


WINDOW_BACKENDS = ["torch", "triton", "triton_split4"]


@pytest.mark.parametrize("entry", [-1, 2**30, None], ids=["minus1", "huge", "nan_blocks"])
@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.parametrize("case", list(WINDOW_CASES))
@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
def test_sliding_window_matches_reference_and_skips_out_of_window_blocks(
        backend, case, sliding_window, entry):
    """Blocks wholly before every window hold NaN K/V and (minus1, huge) a table entry that is
    no block: the kernels must not read them. The reference reads none either."""
    if backend.startswith("triton") and not CUDA and (
            entry == 2**30 or case == "mixed" or (backend == "triton_split4" and entry == -1)):
        pytest.skip("interpreter: one or two poisonings per window and case are enough")
    batch = make_batch(WINDOW_CASES[case], num_heads=6, num_kv_heads=2, head_dim=32)
    poisoned = poison_out_of_window(batch, sliding_window, entry)
    assert poisoned or sliding_window >= 16 or (case == "mixed" and sliding_window > 5)
    if poisoned and entry is None:  # the poison is seen by whatever reads those blocks
        assert not torch.isfinite(reference_paged_attention(**batch)).all()
    out = BACKENDS[backend](**batch, sliding_window=sliding_window)
    assert torch.isfinite(out).all()
    assert_matches_reference(out, {**batch, "sliding_window": sliding_window})


@pytest.mark.parametrize("num_splits", [2, 8])
@pytest.mark.parametrize("sliding_window", [40, 100])
def test_triton_split_kv_sliding_window(sliding_window, num_splits):
    """Split-KV over the window only: the splits start at each program's first window tile
    (a long decode, and a 20-row chunk whose rows' windows start in different splits)."""
    batch = make_batch([(1, 300), (1, 17), (20, 200)], num_heads=4, num_kv_heads=2)
    assert poison_out_of_window(batch, sliding_window, -1)
    out = triton_paged_attention(**batch, num_splits=num_splits, sliding_window=sliding_window)
    assert_matches_reference(out, {**batch, "sliding_window": sliding_window})


def test_triton_rejects_negative_sliding_window():
    with pytest.raises(ValueError, match="sliding_window"):
        triton_paged_attention(**make_batch([(1, 5)]), sliding_window=-1)


@pytest.mark.parametrize(("backend", "dtype"), [p for p in DTYPE_PARAMS
                                                 if p.values[0] in WINDOW_BACKENDS])
def test_sliding_window_low_precision(backend, dtype):
    batch = make_batch(WINDOW_CASES["mixed"], num_heads=6, num_kv_heads=2, dtype=dtype)
    poison_out_of_window(batch, 5, -1)
    out = BACKENDS[backend](**batch, sliding_window=5)
    assert_matches_reference(out, {**batch, "sliding_window": 5})


@pytest.mark.parametrize("backend", [*WINDOW_BACKENDS, "cpu"])
def test_chunked_prefill_then_decode_equals_dense_sliding_window_attention(backend):
    """The engine's use with a window of 6 over 16-token blocks: chunks + decodes = one dense
    SDPA pass with transformers' sliding mask; blocks that fall out of every window are
    released (table entry -1) as the scheduler does."""
    if backend == "cpu" and CUDA:
        pytest.skip("the native kernels run on the CPU only")
    attention = {**BACKENDS, "cpu": cpu_paged_attention}[backend]
    reshape_and_cache = {"torch": torch_reshape_and_cache, "triton": triton_reshape_and_cache,
                         "triton_split4": triton_reshape_and_cache,
                         "cpu": cpu_reshape_and_cache}[backend]
    num_heads, num_kv_heads, head_dim, block_size, total, window = 4, 2, 32, 16, 41, 6
    q = torch.randn(total, num_heads, head_dim, device=DEVICE)
    k = torch.randn(total, num_kv_heads, head_dim, device=DEVICE)
    v = torch.randn(total, num_kv_heads, head_dim, device=DEVICE)
    k_cache = torch.zeros(8, block_size, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    table = [5, 2, 7]
    pos = torch.arange(total, device=DEVICE)
    slots = torch.tensor(table, device=DEVICE)[pos // block_size] * block_size + pos % block_size

    outs, start = [], 0
    for chunk in [8, 12, 13, 3, 1, 1, 1, 1, 1]:  # chunked prefill of 36 tokens, 5 decodes
        end = start + chunk
        freed = [-1 if (j + 1) * block_size <= start - window + 1 else b
                 for j, b in enumerate(table)]
        reshape_and_cache(k[start:end], v[start:end], k_cache, v_cache, slots[start:end])
        outs.append(attention(
            q[start:end], k_cache, v_cache,
            torch.tensor([freed], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE),
            max_query_len=chunk, max_seq_len=end, scale=head_dim**-0.5, sliding_window=window,
        ))
        start = end
    assert freed[:2] == [-1, -1]

    sliding = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=sliding,
        enable_gqa=True,
    ).transpose(0, 1)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(torch.cat(outs), dense, atol=atol, rtol=rtol)


def test_torch_plan_gathers_only_window_keys_and_checks_its_window():
    from kernels.torch_attention import plan_paged_attention

    pairs = [(1, 700), (1, 20), (3, 300), (2, 40)]
    batch = make_batch(pairs, num_heads=4, num_kv_heads=2)
    args = (batch["block_tables"], batch["seq_lens"], batch["query_start_loc"],
            batch["max_query_len"], batch["max_seq_len"], batch["k_cache"].shape[1])
    plan = plan_paged_attention(*args, sliding_window=16)
    assert plan.sliding_window == 16
    # decode: W keys (or the whole sequence); prefill: query_len + W - 1
    assert sorted(g.slots.shape[1] for g in plan.decode) == [16]
    assert max(g.slots.shape[1] for g in plan.prefill) == 3 + 16 - 1
    assert_matches_reference(torch_paged_attention(**batch, plan=plan, sliding_window=16),
                             {**batch, "sliding_window": 16})
    with pytest.raises(ValueError, match="sliding_window"):
        torch_paged_attention(**batch, plan=plan)  # a plan is for its own window only
    with pytest.raises(ValueError, match="sliding_window"):
        plan_paged_attention(*args, sliding_window=-2)


@pytest.mark.parametrize("name", ["torch", "triton", "cpu"])
def test_backend_attend_layers_of_different_windows_share_one_metadata(name):
    """``AttentionBackend.attend`` passes the window on; on torch the per-step plan is kept per
    window, so layers alternating full and sliding attention over one metadata stay right."""
    if name == "cpu" and CUDA:
        pytest.skip("the native kernels run on the CPU only")
    from services.worker.attention import AttentionBackend, AttentionMetadata

    batch = make_batch(WINDOW_CASES["mixed"], num_heads=4, num_kv_heads=2, head_dim=32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=DEVICE),
        block_tables=batch["block_tables"], seq_lens=batch["seq_lens"],
        query_start_loc=batch["query_start_loc"], max_query_len=batch["max_query_len"],
        max_seq_len=batch["max_seq_len"])
    backend = AttentionBackend(name)
    for window in [0, 5, 0, 16, 5]:
        out = backend.attend(batch["query"], batch["k_cache"], batch["v_cache"], meta,
                             batch["scale"], sliding_window=window)
        assert_matches_reference(out, {**batch, "sliding_window": window})
    if name == "torch":
        assert sorted(meta.plan) == [0, 5, 16]
