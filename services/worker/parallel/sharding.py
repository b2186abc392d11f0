"""Tensor and pipeline parallelism as a transform of a single-device decoder
(``LlamaForCausalLM``, and ``Gemma3ForCausalLM``, whose modules carry Llama's names).

In the style of gpt-fast's ``tp.py``: ``models/*.py`` stay single-device; ``shard_model``
swaps its modules (on the meta device, before any weight is read) for per-rank ones, and
``ShardPlan`` tells the loader which slice of each checkpoint tensor this rank reads.
Megatron-LM's split (Shoeybi et al. 2019)::

    qkv_proj      column-parallel  rows: this rank's q heads, then its k heads, then its v heads
                                   (q/k/v biases sliced like their rows)
    q_norm/k_norm replicated       per-head norms over D (Qwen3, Gemma 3): every rank all of it
    o_proj        row-parallel     columns: this rank's q heads; all-reduce, then the bias
    gate_up_proj  column-parallel  rows: gate[I/N slice] then up[I/N slice]
    down_proj     row-parallel     columns: the I/N slice; all-reduce, then the bias
    embed_tokens  vocab-parallel   rows [r*Vp, (r+1)*Vp), Vp = ceil(V/N), zero padded;
                                   ids outside the range embed to 0, then all-reduce
    lm_head       vocab-parallel   same rows; logits all-gathered to [S, N*Vp], cut to [S, V]

KV heads: with K >= N each rank holds K/N of them; with K < N (N a multiple of K) each holds
one, replicated on N/K ranks, as vLLM does. Rank r's q heads ``[r*H/N, (r+1)*H/N)`` then all
use kv head ``r*K // N`` (GQA: q head h reads kv head ``h // (H/K)``).

Pipeline stages keep only their layers (``layer_range``); the first stage embeds, the last
stage applies the final norm and the LM head (and keeps the embedding when it is tied).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from services.worker.models.llama import DecoderLayer, LlamaConfig, LlamaForCausalLM
from services.worker.parallel.distributed import ParallelConfig, ParallelState


def check_parallel_config(cfg: LlamaConfig | Gemma3Config, pc: ParallelConfig) -> None:
    """Raises ValueError, naming the flag, when the model cannot be split this way."""
    n, h, k = pc.tensor_parallel_size, cfg.num_attention_heads, cfg.num_key_value_heads
    if h % n:
        raise ValueError(f"--tensor-parallel-size {n} must divide num_attention_heads {h}")
    if k % n and n % k:
        raise ValueError(f"--tensor-parallel-size {n} must divide num_key_value_heads {k} "
                         "or be a multiple of it")
    if cfg.intermediate_size % n:
        raise ValueError(f"--tensor-parallel-size {n} must divide intermediate_size "
                         f"{cfg.intermediate_size}")
    pc.layer_range(cfg.num_hidden_layers)  # raises naming --pipeline-parallel-size


class ShardPlan:
    """Which part of each checkpoint tensor rank ``pc.rank`` holds (transformers names without
    the ``model.`` prefix). Attributes are per-rank counts: heads, kv heads, I/N, padded Vp."""

    def __init__(self, cfg: LlamaConfig | Gemma3Config, pc: ParallelConfig) -> None:
        check_parallel_config(cfg, pc)
        self.cfg, self.pc = cfg, pc
        n, r = pc.tensor_parallel_size, pc.tp_rank
        self.num_heads = cfg.num_attention_heads // n
        self.num_kv_heads = max(1, cfg.num_key_value_heads // n)
        self.kv_head_start = r * cfg.num_key_value_heads // n
        self.intermediate_size = cfg.intermediate_size // n
        self.vocab_per_rank = -(-cfg.vocab_size // n)  # Vp
        self.vocab_start = r * self.vocab_per_rank
        self.layers = pc.layer_range(cfg.num_hidden_layers)
        self.keeps_embedding = pc.is_first_stage or (pc.is_last_stage and cfg.tie_word_embeddings)

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` of this rank's part of ``name``; None = the whole tensor."""
        if self.pc.tensor_parallel_size == 1:
            return None
        d, kind = self.cfg.head_dim, name.rsplit(".", 2)[-2]
        q = self.num_heads * d  # this rank's q rows
        if kind == "q_proj":
            return 0, self.pc.tp_rank * q, (self.pc.tp_rank + 1) * q
        if kind in ("k_proj", "v_proj"):
            return 0, self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d
        if kind in ("gate_proj", "up_proj"):
            i = self.intermediate_size
            return 0, self.pc.tp_rank * i, (self.pc.tp_rank + 1) * i
        if name.endswith("o_proj.weight"):
            return 1, self.pc.tp_rank * q, (self.pc.tp_rank + 1) * q
        if name.endswith("down_proj.weight"):
            i = self.intermediate_size
            return 1, self.pc.tp_rank * i, (self.pc.tp_rank + 1) * i
        if name in ("embed_tokens.weight", "lm_head.weight"):
            stop = min(self.cfg.vocab_size, self.vocab_start + self.vocab_per_rank)
            return 0, self.vocab_start, stop
        return None  # norms (q/k norms too), o_proj / down_proj biases (added once, after the
        # all-reduce)

    def pad(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Zero-pad the last vocab shard to ``Vp`` rows (no-op elsewhere)."""
        if (self.pc.tensor_parallel_size > 1 and name in ("embed_tokens.weight", "lm_head.weight")
                and tensor.shape[0] < self.vocab_per_rank):
            tensor = F.pad(tensor, (0, 0, 0, self.vocab_per_rank - tensor.shape[0]))
        return tensor


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x @ W_r^T) + b``: input features split across the tp group."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ps: ParallelState) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ps = ps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/N] -> [T, out]
        y = self.ps.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[vocab_start, vocab_start + Vp)``; other ids give 0, then all-reduce."""

    def __init__(self, vocab_per_rank: int, dim: int, vocab_start: int, ps: ParallelState) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_per_rank, dim))
        self.vocab_start, self.ps = vocab_start, ps

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, E]
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.ps.all_reduce(x.masked_fill(outside[:, None], 0))


def vocab_parallel_logits(local: torch.Tensor, vocab_size: int, ps: ParallelState,
                          softcap: float | None = None) -> torch.Tensor:
    """This rank's logits ``local [S, Vp]`` float32 (its LM-head rows, ``lm_head_logits``) ->
    the full logits ``[S, V]`` float32 on every rank of the tp group (all-gather, then cut the
    padding); soft-capped, ``softcap * tanh(logits / softcap)``, when given (Gemma)."""
    logits = ps.all_gather_last_dim(local)[:, :vocab_size]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def shard_model(model: LlamaForCausalLM | Gemma3ForCausalLM, plan: ShardPlan,
                ps: ParallelState) -> None:
    """Turn a single-device model (built on the meta device) into rank ``plan.pc.rank``'s part,
    in place: keep this stage's layers, swap in parallel linears and set per-rank head counts."""
    cfg, pc = plan.cfg, plan.pc
    model.layers = nn.ModuleList(model.layers[i] for i in plan.layers)
    if not pc.is_last_stage:
        model.norm = nn.Identity()  # the next stage gets the residual stream, un-normalised
        model.lm_head = None
    if not plan.keeps_embedding:
        # NOTE: the model's attributes are typed as built; sharding swaps or drops its modules
        model.embed_tokens = None  # type: ignore[assignment]
    if pc.tensor_parallel_size == 1:
        return
    e, d = cfg.hidden_size, cfg.head_dim
    for layer in cast(Iterable[DecoderLayer], model.layers):  # typed as Iterable[Module]
        attn, mlp = layer.attn, layer.mlp
        attn.n_heads, attn.n_kv_heads = plan.num_heads, plan.num_kv_heads
        attn.q_size, attn.kv_size = plan.num_heads * d, plan.num_kv_heads * d
        attn.qkv_proj = nn.Linear(e, attn.q_size + 2 * attn.kv_size, bias=cfg.qkv_proj_bias)
        attn.o_proj = RowParallelLinear(attn.q_size, e, cfg.attention_bias, ps)
        mlp.gate_up_proj = nn.Linear(e, 2 * plan.intermediate_size, bias=cfg.mlp_bias)
        mlp.down_proj = RowParallelLinear(plan.intermediate_size, e, cfg.mlp_bias, ps)
    if model.embed_tokens is not None:
        model.embed_tokens = VocabParallelEmbedding(  # type: ignore[assignment]  # (as above)
            plan.vocab_per_rank, e, plan.vocab_start, ps)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(e, plan.vocab_per_rank, bias=False)
