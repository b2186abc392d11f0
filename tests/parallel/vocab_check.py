"""Run by ``test_vocab_parallel_padding`` in 2 spawned processes (kept free of test imports):
the vocab-parallel embedding and logits of a vocabulary that does not split evenly."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from services.worker.models.llama import LlamaConfig
from services.worker.parallel.distributed import (
    ParallelConfig,
    destroy_distributed,
    init_distributed,
)
from services.worker.parallel.sharding import (
    ShardPlan,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)


def check_rank(rank: int, port: int) -> None:
    """Compare rank ``rank``'s results with the single-device math; raises AssertionError."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    pc = ParallelConfig(2, 1, rank)
    ps = init_distributed(pc, torch.device("cpu"), timeout_s=30)
    cfg = LlamaConfig(vocab_size=7, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=2)
    plan = ShardPlan(cfg, pc)  # Vp = 4: rank 0 rows 0..3, rank 1 rows 4..6 + one zero row
    weight = torch.arange(28, dtype=torch.float32).reshape(7, 4)
    _, start, stop = plan.slice_of("embed_tokens.weight")
    shard = plan.pad("embed_tokens.weight", weight[start:stop])
    assert shard.shape == (4, 4)
    emb = VocabParallelEmbedding(4, 4, plan.vocab_start, ps)
    emb.weight.data.copy_(shard)
    ids = torch.tensor([0, 3, 4, 6, 2])
    assert torch.equal(emb(ids), F.embedding(ids, weight))
    hidden = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    logits = vocab_parallel_logits(hidden @ shard.T, 7, ps)
    assert logits.shape == (3, 7) and torch.allclose(logits, hidden @ weight.T)
    # NOTE: without this, gloo's threads can outlive the group into interpreter exit and the
    # process aborts with -6 after passing every check (see
    # services/worker/parallel/distributed.py).
    destroy_distributed()
