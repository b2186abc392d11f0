"""Tensor parallelism: greedy tokens of N rank processes equal one rank's, exactly (float32)."""

from __future__ import annotations

import pytest

from services.worker.models.llama import LlamaConfig
from services.worker.parallel.distributed import ParallelConfig
from services.worker.parallel.sharding import ShardPlan, check_parallel_config
from tests.helpers import make_servable_tiny_llama
from tests.parallel.conftest import PROMPTS, ParallelStack, reference_greedy, stack_greedy

MAX_TOKENS = 6


def _cfg(**kw) -> LlamaConfig:
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return LlamaConfig(**{**base, **kw})


def test_shard_plan_splits_heads_and_replicates_kv_heads():
    # 4 heads, 2 KV heads, TP=4: one q head per rank, KV head r*2//4 (replicated twice).
    plans = [ShardPlan(_cfg(), ParallelConfig(4, 1, r)) for r in range(4)]
    assert [p.num_heads for p in plans] == [1, 1, 1, 1]
    assert [(p.num_kv_heads, p.kv_head_start) for p in plans] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert plans[3].slice_of("layers.0.self_attn.q_proj.weight") == (0, 48, 64)
    assert plans[3].slice_of("layers.0.self_attn.k_proj.weight") == (0, 16, 32)
    assert plans[1].slice_of("layers.0.self_attn.o_proj.weight") == (1, 16, 32)
    assert plans[1].slice_of("layers.0.mlp.down_proj.weight") == (1, 32, 64)
    assert plans[2].slice_of("layers.0.input_layernorm.weight") is None
    # vocab 100 over 3 ranks: 34 rows each, the last shard 32 rows padded to 34
    p3 = ShardPlan(_cfg(num_attention_heads=3, num_key_value_heads=3, intermediate_size=129),
                   ParallelConfig(3, 1, 2))
    assert (p3.vocab_per_rank, p3.slice_of("embed_tokens.weight")) == (34, (0, 68, 100))


def test_bad_sizes_name_the_flag():
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide num_attention"):
        check_parallel_config(_cfg(), ParallelConfig(3, 1, 0))
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 must divide num_key_value"):
        check_parallel_config(_cfg(num_attention_heads=6, num_key_value_heads=3),
                              ParallelConfig(2, 1, 0))
    with pytest.raises(ValueError, match="--pipeline-parallel-size 4 exceeds"):
        check_parallel_config(_cfg(), ParallelConfig(1, 4, 0))
    with pytest.raises(ValueError, match="--rank 2"):
        ParallelConfig(2, 1, 2)
    assert [list(ParallelConfig(1, 2, r).layer_range(3)) for r in (0, 1)] == [[0, 1], [2]]


def test_vocab_parallel_embedding_and_logits_with_padding():
    """Vocab 7 over 2 ranks (4 + 3 rows, one padding row): equal to the one-device math."""
    import multiprocessing as mp

    from tests.parallel.conftest import free_port_range
    from tests.parallel.vocab_check import check_rank

    ctx = mp.get_context("spawn")
    port = free_port_range(1)
    procs = [ctx.Process(target=check_rank, args=(r, port)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        # 0 for both: each passed its checks *and* left its group before exiting (a rank that
        # skips destroy_distributed can abort at interpreter exit: -6)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:  # explicitly: no rank outlives the test, even a hung one
            if p.is_alive():
                p.kill()
            p.join(10)


def test_tp2_equals_single_rank(tiny_model, tp2_stack):
    expected = reference_greedy(tiny_model, PROMPTS, MAX_TOKENS)
    assert stack_greedy(tp2_stack, PROMPTS, MAX_TOKENS) == expected


def test_tp2_replicates_a_single_kv_head(tmp_path):
    model = make_servable_tiny_llama(tmp_path / "kv1", num_key_value_heads=1, seed=1)
    expected = reference_greedy(model, PROMPTS, MAX_TOKENS)
    stack = ParallelStack(model, tp=2).start()
    try:
        assert stack_greedy(stack, PROMPTS, MAX_TOKENS) == expected
    finally:
        stack.stop()


def test_tp3_smollm2_equals_single_rank():
    """The default model: 9 heads, 3 KV heads, tied embeddings (vocab-parallel LM head)."""
    prompts = PROMPTS[:2]
    expected = reference_greedy(None, prompts, 4)
    stack = ParallelStack(None, tp=3, scheduler_argv=["--max-model-len", "512"]).start()
    try:
        assert stack_greedy(stack, prompts, 4) == expected
    finally:
        stack.stop()
