"""The "pairs" KV cache layout (``kernels/kv_layout.py``) on the native CPU kernels.

Its words sit where the layout says; converting to it and back is exact; the KV write stores
what ``to_pairs`` of a rows write stores; and attention over a pairs cache is bitwise the
attention over the same values in rows, on every instruction-set path this CPU has (the bf16
pair bodies copy its rows, the float32 body unpacks them), so it inherits every float64
reference test of the rows layout (and is checked against the reference here too). The model
runner picks it where it should, and greedy tokens of a bf16 model are the same either way.
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_attention import cpu_paged_attention, cpu_reshape_and_cache
from kernels.kv_layout import layout_code, pairs_fit, to_pairs, to_rows
from tests.kernels.test_cpu_paged_attention import SPLITS, check, garble_unused, make_batch
from tests.kernels.test_paged_attention import CASES, WINDOW_CASES, poison_out_of_window


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_pairs_words_sit_where_the_layout_says_and_convert_back_exactly():
    nb, bs, hkv, d = 3, 8, 2, 6
    k = torch.randn(nb, bs, hkv, d).to(torch.bfloat16)
    v = torch.randn(nb, bs, hkv, d).to(torch.bfloat16)
    kp, vp = to_pairs(k, v)
    assert kp.shape == k.shape and vp.shape == v.shape and kp.is_contiguous()
    kf = kp.reshape(nb, hkv, d // 2, bs, 2)  # K^T [head_dim / 2][block_size][2]
    vf = vp.reshape(nb, hkv, bs // 2, d, 2)  # V [block_size / 2][head_dim][2]
    for b, h, t, j in [(0, 0, 0, 0), (2, 1, 7, 2), (1, 0, 3, 1)]:
        assert torch.equal(kf[b, h, j, t], k[b, t, h, 2 * j:2 * j + 2])
    for b, h, t, e in [(0, 0, 0, 0), (2, 1, 7, 5), (1, 1, 4, 3)]:
        assert vf[b, h, t // 2, e, t % 2] == v[b, t, h, e]
    k2, v2 = to_rows(kp, vp)
    assert torch.equal(k2, k) and torch.equal(v2, v)


@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_pairs_is_to_pairs_of_the_rows_write(block_size):
    nb, hkv, d, n = 9, 3, 64, 50
    key = torch.randn(n, hkv, d).to(torch.bfloat16)
    value = torch.randn(n, hkv, 2 * d).to(torch.bfloat16)[..., ::2]  # strided rows
    slots = torch.randperm(nb * block_size)[:n].to(torch.int32)
    slots[::7] = -1  # padding tokens: no slot
    k_rows = torch.randn(nb, block_size, hkv, d).to(torch.bfloat16)
    v_rows = torch.randn(nb, block_size, hkv, d).to(torch.bfloat16)
    k_pairs, v_pairs = to_pairs(k_rows, v_rows)
    cpu_reshape_and_cache(key, value, k_rows, v_rows, slots)
    cpu_reshape_and_cache(key, value, k_pairs, v_pairs, slots, kv_layout="pairs")
    k_exp, v_exp = to_pairs(k_rows, v_rows)
    assert torch.equal(k_pairs, k_exp) and torch.equal(v_pairs, v_exp)


def _both_layouts(batch: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    rows = cpu_paged_attention(**batch, **kw)
    k, v = to_pairs(batch["k_cache"], batch["v_cache"])
    pairs = cpu_paged_attention(**dict(batch, k_cache=k, v_cache=v), **kw, kv_layout="pairs")
    return rows, pairs


@pytest.mark.parametrize("splits", list(SPLITS))
# block_size 8: the vdpbf16ps body copies K^T / V (16-key runs span blocks); 16 and up: in place
@pytest.mark.parametrize(("num_queries_per_kv", "block_size"), [(1, 16), (3, 16), (3, 32),
                                                                (8, 64), (2, 8)])
@pytest.mark.parametrize("case", list(CASES))
def test_pairs_attention_is_bitwise_the_rows_attention(isa, case, num_queries_per_kv,
                                                       block_size, splits):
    """Unused slots hold NaN and unused table entries garbage (``garble_unused``): the pairs
    path must zero what it copies past a sequence's keys, as the rows path never reads it."""
    batch = make_batch(CASES[case], num_heads=2 * num_queries_per_kv, num_kv_heads=2,
                       block_size=block_size, dtype=torch.bfloat16)
    garble_unused(batch)
    rows, pairs = _both_layouts(batch, split_keys=SPLITS[splits])
    assert torch.equal(pairs, rows)
    check(pairs, batch)


@pytest.mark.parametrize("sliding_window", [1, 5, 40])
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_pairs_attention_with_a_sliding_window(isa, case, sliding_window):
    batch = make_batch(WINDOW_CASES[case], num_heads=6, num_kv_heads=2, dtype=torch.bfloat16)
    poison_out_of_window(batch, sliding_window, -1)  # blocks before every window: never read
    rows, pairs = _both_layouts(batch, sliding_window=sliding_window)
    assert torch.equal(pairs, rows)
    check(pairs, dict(batch, sliding_window=sliding_window))


def test_pairs_attention_long_contexts_and_head_dims(isa):
    for head_dim in (64, 128):
        batch = make_batch([(1, 2049), (1, 513), (300, 1100), (1, 1)], num_heads=9,
                           num_kv_heads=3, head_dim=head_dim, dtype=torch.bfloat16)
        rows, pairs = _both_layouts(batch)
        assert torch.equal(pairs, rows), head_dim


def test_pairs_layout_is_refused_where_it_does_not_fit():
    batch = make_batch(CASES["decode"], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"kv_layout 1 .* needs a bfloat16, int8 or float8 cache"):
        cpu_paged_attention(**batch, kv_layout="pairs")
    bf16 = make_batch(CASES["decode"], dtype=torch.bfloat16)
    combined = torch.stack([bf16["k_cache"], bf16["v_cache"]], dim=2)  # K/V interleaved
    with pytest.raises(ValueError, match="dense blocks"):
        cpu_paged_attention(**dict(bf16, k_cache=combined[:, :, 0], v_cache=combined[:, :, 1]),
                            kv_layout="pairs")
    key = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    odd = torch.zeros(4, 15, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="even block_size"):
        cpu_reshape_and_cache(key, key, odd, odd.clone(), torch.zeros(1, dtype=torch.long),
                              kv_layout="pairs")
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        layout_code("vnni")
    assert pairs_fit(torch.bfloat16, 16, 64)
    assert not pairs_fit(torch.float32, 16, 64) and not pairs_fit(torch.bfloat16, 15, 64)


def test_choose_kv_layout(monkeypatch):
    from kernels.cpu_attention import cpu_isa
    from services.worker import attention
    from services.worker.attention import choose_kv_layout

    native = "pairs" if cpu_isa() in ("amx", "avx512_bf16") else "rows"
    assert choose_kv_layout("cpu", torch.bfloat16, 16, [64]) == native
    assert choose_kv_layout("cpu", torch.bfloat16, 16, [64, 128]) == native
    for backend, dtype, bs, dims in [("torch", torch.bfloat16, 16, [64]),
                                     ("cpu", torch.float32, 16, [64]),
                                     ("cpu", torch.int8, 8, [64]),  # int8: multiples of 16
                                     ("cpu", torch.int8, 16, [64, 40]),
                                     ("cpu", torch.bfloat16, 16, [80]),  # not a multiple of 32
                                     ("cpu", torch.bfloat16, 16, [64, 80]),  # a draft's
                                     ("cpu", torch.bfloat16, 15, [64])]:
        assert choose_kv_layout(backend, dtype, bs, dims) == "rows", (backend, dtype, bs, dims)
    # an int8 cache takes pairs on every CPU step (the integer products have every body); a
    # float8 one where the bf16 products run, under bf16 compute only
    assert choose_kv_layout("cpu", torch.int8, 16, [64, 48]) == "pairs"
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert choose_kv_layout("cpu", fp8, 16, [64], compute_dtype=torch.bfloat16) == native
        assert choose_kv_layout("cpu", fp8, 16, [64], compute_dtype=torch.float32) == "rows"
        assert choose_kv_layout("cpu", fp8, 16, [48], compute_dtype=torch.bfloat16) == "rows"
    monkeypatch.setattr(attention, "CPU_KV_LAYOUT", "rows")
    assert choose_kv_layout("cpu", torch.bfloat16, 16, [64]) == "rows"
    assert choose_kv_layout("cpu", torch.int8, 16, [64]) == "rows"
    monkeypatch.setattr(attention, "CPU_KV_LAYOUT", "pairs")
    assert choose_kv_layout("cpu", torch.bfloat16, 16, [64]) == "pairs"
    assert choose_kv_layout("torch", torch.bfloat16, 16, [64]) == "rows"
    with pytest.raises(ValueError, match="needs the cpu attention backend"):
        attention.AttentionBackend("torch", kv_layout="pairs")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers import make_tiny_llama

    # head_dim 32: the smallest the bf16 pair products take
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-kv-layout"), hidden_size=128)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_bf16_greedy_tokens_are_the_same_in_either_layout(tiny_llama, monkeypatch,
                                                          kv_cache_dtype):
    """Continuous batching with chunked prefill, a late arrival and a preemption (eager; the
    bf16 stack tests run the compiled forward on whichever layout the CPU gets): the pairs
    layout gives the rows layout's greedy tokens exactly (its attention is bitwise the same;
    a float8 cache's pairs are widened in registers, where the CPU has the bf16 products),
    and the runner reports the layout it took."""
    from kernels.cpu_attention import cpu_isa
    from services.worker import attention
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner
    from tests.worker.test_model import NEW_TOKENS, drive_greedy

    if kv_cache_dtype != "auto" and cpu_isa() not in ("amx", "avx512_bf16"):
        pytest.skip("a float8 pairs cache is read by the bf16 products only")

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 40, 300)]
    outputs = {}
    for layout in ("rows", "pairs"):
        monkeypatch.setattr(attention, "CPU_KV_LAYOUT", layout)
        runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="bfloat16", device="cpu",
                                          kv_cache_memory=4 << 20, attention_backend="cpu",
                                          enforce_eager=True, kv_cache_dtype=kv_cache_dtype))
        assert runner.kv_layout == layout
        outputs[layout] = drive_greedy(runner, prompts, NEW_TOKENS, token_budget=64,
                                       arrivals=[0, 2, 0], preempt=(6, 1))
    assert outputs["pairs"] == outputs["rows"]
