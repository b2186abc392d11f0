"""Llama-family decoder over a flat token batch: Llama 2/3, SmolLM2, TinyLlama, and the families
whose math differs from Llama's only by flags of ``LlamaConfig`` (so they share this file):

- Mistral (``MistralForCausalLM``): ``sliding_window`` on every layer when the config sets one.
- Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): ``qkv_bias`` (bias on q/k/v, none on o_proj); optional
  sliding window on the layers ``layer_types`` marks ``"sliding_attention"``.
- Qwen3 (``Qwen3ForCausalLM``): ``qk_norm``, an RMSNorm over each head's ``D`` features of q and
  k, after the projection and before RoPE (weights ``[D]``, shared by all heads).

Gemma 3 differs in more than flags (four norms per layer, (1 + w) norms, GeGLU, two RoPE bases)
and lives in ``models/gemma3.py``.

Written as readable math in the gpt-fast style; numerics follow transformers'
``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` (RMSNorm
in float32, rotate-half RoPE, SiLU-gated MLP) so float32 outputs match them closely. The batch has
no padding and no batch dimension: ``T`` tokens of any number of sequences, concatenated.
Attention goes through an ``AttentionBackend`` (``services/worker/attention.py``), which writes
this step's K/V into the paged cache and attends over it (over the last ``W`` positions only on
a sliding-window layer).

Weights are named like ours (``layers.N.attn.qkv_proj.weight``); ``services/worker/checkpoint.py``
maps transformers' checkpoint names onto them (q/k/v and gate/up are fused into one matmul each).

Shape letters: T tokens, E hidden size, H query heads, K kv heads, D head dim, I intermediate,
V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kernels.torch_ops import torch_wide_linear


@dataclass(slots=True)
class LlamaConfig:
    """The architecture numbers, read from a transformers ``config.json`` by ``from_hf``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None = default RoPE; else {"rope_type": ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v and o_proj (Llama, Qwen3 configs)
    mlp_bias: bool = False
    qkv_bias: bool = False  # bias on q/k/v only (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: int = 0  # W of the sliding layers; 0 = none
    # per layer "sliding_attention" / "full_attention"; None = every layer slides when W > 0
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3)")

    @property
    def attention_scale(self) -> float:
        """Softmax scale of the attention scores: ``head_dim ** -0.5``."""
        return self.head_dim ** -0.5

    @property
    def sliding_windows(self) -> list[int]:
        """Per layer (global index), the tokens its queries attend back over, themselves
        included; 0 = full attention. What the worker groups its KV cache by."""
        types = self.layer_types or ("sliding_attention",) * self.num_hidden_layers
        return [self.sliding_window if t == "sliding_attention" else 0 for t in types]

    @property
    def qkv_proj_bias(self) -> bool:
        return self.attention_bias or self.qkv_bias

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Build from a ``config.json`` dict (transformers 4 ``rope_theta``/``rope_scaling`` or
        transformers 5 ``rope_parameters`` style). Raises ValueError on an unsupported RoPE type."""
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        model_type = cfg.get("model_type", "llama")
        layers = cfg["num_hidden_layers"]
        window = cfg.get("sliding_window") or 0
        layer_types = cfg.get("layer_types")
        if model_type in ("qwen2", "qwen3"):  # transformers' Qwen2Config.__post_init__
            if not cfg.get("use_sliding_window", False):
                window = 0
            if layer_types is None:
                first = cfg.get("max_window_layers", layers)
                layer_types = ["sliding_attention" if window and i >= first
                               else "full_attention" for i in range(layers)]
        elif model_type == "mistral":
            layer_types = None  # transformers' Mistral slides on every layer
        elif model_type == "llama":
            window, layer_types = 0, None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            sliding_window=int(window),
            layer_types=None if layer_types is None else tuple(layer_types),
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """``rope_frequencies`` of ``cfg``'s head dim, base and scaling: ``[D/2]`` float32."""
    return rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def rope_frequencies(d: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse RoPE frequencies ``[d/2]`` float32 (Su et al. 2021, "RoFormer") of base ``theta``,
    with the "linear" (position interpolation) and "llama3" (Meta's Llama 3.1 frequency
    smoothing) scalings, computed as transformers' ``modeling_rope_utils`` does."""
    exponents = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d  # [D/2]
    inv_freq = 1.0 / (theta ** exponents)
    scaling = scaling or {}
    if scaling.get("rope_type") == "linear":
        return inv_freq / scaling["factor"]
    if scaling.get("rope_type") == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32 by the backend
    (``kernels.torch_ops.torch_rms_norm`` is the math). Given a ``residual``, it first adds it
    (vLLM's fused add + norm) and also returns the sum, the new residual stream."""

    def __init__(self, dim: int, eps: float, backend: Any) -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # [T, E] -> [T, E]
            return self.backend.rms_norm(x, self.weight, self.eps)
        # ([T, E], [T, E]) -> (norm(x + residual), x + residual)
        return self.backend.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """GQA self-attention of global layer ``layer_id``: optional per-head q/k RMSNorm before
    RoPE (Qwen3, Gemma 3), paged attention over the layer's window
    (``cfg.sliding_windows[layer_id]``, 0 = all positions), softmax scale
    ``cfg.attention_scale``. Shared by every family (``cfg`` is a ``LlamaConfig`` or a
    ``Gemma3Config``)."""

    def __init__(self, cfg: Any, backend: Any, layer_id: int) -> None:
        super().__init__()
        self.backend = backend
        self.sliding_window = cfg.sliding_windows[layer_id]
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.scale = cfg.attention_scale
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.qkv_proj_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Any, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: Any) -> torch.Tensor:
        """``x [T, E]`` -> ``[T, E]``; ``rope`` is the step's ``backend.rotary_table`` of this
        layer's frequencies."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)  # [T, H, D]
        k = k.view(T, self.n_kv_heads, self.head_dim)  # [T, K, D]
        v = v.view(T, self.n_kv_heads, self.head_dim)  # [T, K, D]
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per head, over D
            q = self.q_norm(q.reshape(T * self.n_heads, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(T * self.n_kv_heads, self.head_dim)).view(k.shape)
        self.backend.rotary_embedding(rope, q, k)  # in place: q*cos + rot(q)*sin
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta)
        out = self.backend.attend(q, k_cache, v_cache, meta, self.scale,
                                  sliding_window=self.sliding_window)  # [T, H, D]
        return self.o_proj(out.reshape(T, self.q_size))  # [T, E]


class SiluAndMul(nn.Module):
    """``[..., 2I]`` gate-then-up -> ``silu(gate) * up``, ``[..., I]`` (vLLM's name). On a CPU
    with the native kernels it becomes an identity and the gate_up layer applies it in its
    epilogue (``services/worker/packed_linear.py``, ``fuse_silu_mul``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # [..., I] each
        return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.act = SiluAndMul()
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        return self.down_proj(self.act(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, E]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: Any, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.attn = Attention(cfg, backend, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Any,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's pre-norm form: the residual stream is ``x + residual`` (``x`` alone, with
        ``residual=None``, at the first layer); each norm adds the pending branch output into
        it in the same fused op. The stream is kept in float32 whatever the model dtype (a
        bfloat16 sum rounded at every layer was the largest error of a bf16 step:
        docs/benchmarks.md, "Numerics"); the branches and the norms' outputs are in the model
        dtype. Returns ``(mlp_out, residual)``, both ``[T, E]``, model dtype and float32."""
        if residual is None:
            x, residual = self.input_layernorm(x), x.float()
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus the LM head.

    Args:
        cfg: architecture numbers.
        backend: an ``AttentionBackend`` (``write_kv`` / ``attend``, and the ``rms_norm`` /
            ``fused_add_rms_norm`` / ``rotary_embedding`` ops), shared by all layers.

    ``inv_freq`` is a float32 buffer that is not in the state dict; it stays float32 as long as
    the model is only moved with ``.to(device)`` (the loader casts weights before assigning them).
    """

    def __init__(self, cfg: LlamaConfig, backend: Any) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, i) for i in range(cfg.num_hidden_layers))
        # (an Identity on a pipeline stage before the last: services/worker/parallel/sharding.py)
        self.norm: nn.Module = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        # Computed on the CPU even under a meta-device context, so loading with assign=True
        # (which skips buffers) keeps real values; the loader then moves it with .to(device).
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: list[Any], hidden_states: torch.Tensor | None = None,
                ) -> torch.Tensor:
        """Run ``T`` tokens through the decoder, writing their K/V into ``kv_caches``.

        Args:
            input_ids: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 position of each token in its sequence.
            kv_caches: per layer ``(k_cache, v_cache)``, each
                ``[num_blocks, block_size, K, D]`` in the model dtype.
            attn_metadata: per layer, the ``AttentionMetadata`` of this step (slot mapping,
                block tables, ...) of the layer's KV cache group; layers of one group share
                one object.
            hidden_states: ``[T, E]`` the previous pipeline stage's output (the float32
                residual stream), used instead of embedding ``input_ids``
                (``services/worker/parallel/sharding.py`` splits the layers).
        Returns:
            ``[T, E]`` final hidden states (after the last norm), model dtype; a stage before
            the last (norm = Identity) returns the float32 residual stream.
        """
        x = self.embed_tokens(input_ids) if hidden_states is None else hidden_states  # [T, E]
        residual = None
        rope = self.backend.rotary_table(positions, self.inv_freq)  # once for every layer
        for layer, kv_cache, meta in zip(self.layers, kv_caches, attn_metadata, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        # NOTE: the final add is not fused into the norm, so that a pipeline stage before the
        # last (norm = Identity) hands on the plain residual stream; one [T, E] add per step.
        return self.norm(x if residual is None else x + residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, E]`` -> logits ``[N, V]`` float32 (``lm_head_logits``)."""
        return lm_head_logits(self, hidden)


def lm_head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden [N, E]`` (model dtype) -> ``model``'s logits ``[N, V']`` float32 (``V' = V``, or
    this rank's vocabulary shard under tensor parallelism), never rounded to the model dtype.

    ``model.lm_head`` is an ``nn.Linear``, None (tied: the embedding table's weight), or, on a
    CPU with the native kernels, a float32-output ``PackedLinear``
    (``services/worker/packed_linear.py``) that the loader put in its place. The first two go
    through ``kernels.torch_ops.torch_wide_linear`` with a float32 output (exact at float32).
    """
    head = cast(nn.Module | None, model.lm_head)
    if head is not None and not isinstance(head, nn.Linear):
        return head(hidden)
    weight = cast(nn.Module, model.embed_tokens).weight if head is None else head.weight
    return torch_wide_linear(hidden, cast(torch.Tensor, weight), out_dtype=torch.float32)
