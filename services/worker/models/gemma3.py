"""Gemma 3 text decoder (``Gemma3ForCausalLM``, model_type ``gemma3_text``) over a flat batch.

Numerics follow transformers' ``models/gemma3/modeling_gemma3.py`` (5.24), which differs from
Llama (``models/llama.py``, whose RoPE, attention backend and flat-batch conventions this file
shares) in:

- interleaved layers: ``layer_types[i]`` is ``"sliding_attention"`` (attends over the last
  ``sliding_window`` positions, RoPE base ``rope_local_base_freq``) or ``"full_attention"``
  (RoPE base ``rope_theta``, with the config's RoPE scaling if any);
- RMSNorm as ``norm(x) * (1 + w)`` in float32: the loader folds ``1 + w`` into the weight (so
  the backend's ``w * norm(x)`` op serves; exact at float32), four norms per layer (before and
  after attention, before and after the MLP) and a per-head q/k norm before RoPE;
- GeGLU MLP with tanh-approximated GELU: ``down(gelu_tanh(gate(x)) * up(x))``;
- the embedding scaled by ``sqrt(E)``, rounded to the model dtype first (as transformers does);
- attention scale ``query_pre_attn_scalar ** -0.5``;
- logits soft-capped, ``cap * tanh(logits / cap)``, when ``final_logit_softcapping`` is set;
- tied embeddings by default.

Module and attribute names (``layers[i].attn.qkv_proj`` / ``o_proj`` / ``n_heads`` ...,
``mlp.gate_up_proj`` / ``down_proj``) are Llama's, so ``services/worker/parallel/sharding.py``
shards both.

Shape letters: T tokens, E hidden size, H query heads, K kv heads, D head dim, I intermediate,
V vocab.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models.llama import Attention, RMSNorm, lm_head_logits, rope_frequencies

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(slots=True)
class Gemma3Config:
    """The architecture numbers, read from a transformers ``config.json`` by ``from_hf``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]  # per layer, SLIDING or FULL
    sliding_window: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # full-attention layers
    rope_scaling: dict[str, Any] | None = None  # full-attention layers; None = default RoPE
    rope_local_theta: float = 10_000.0  # sliding layers (transformers' rope_local_base_freq)
    query_pre_attn_scalar: float = 256
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    # Llama's flags, fixed for Gemma 3 (the loader and the TP plan read them from either config)
    mlp_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = True

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING,
                                                                                        FULL}:
            raise ValueError(f"layer_types {self.layer_types} must give {SLIDING!r} or {FULL!r} "
                             f"for each of the {self.num_hidden_layers} layers")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3)")

    @property
    def sliding_windows(self) -> list[int]:
        """Per layer (global index), the positions a query attends back over (itself
        included); 0 = full attention."""
        return [self.sliding_window if t == SLIDING else 0 for t in self.layer_types]

    @property
    def qkv_proj_bias(self) -> bool:
        return self.attention_bias

    @property
    def attention_scale(self) -> float:
        """Softmax scale of the attention scores: ``query_pre_attn_scalar ** -0.5``."""
        return self.query_pre_attn_scalar ** -0.5

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Gemma3Config:
        """Build from a ``config.json`` dict: transformers 5 (``rope_parameters`` per layer
        type) or 4 (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``,
        ``sliding_window_pattern``).

        Raises:
            ValueError: an activation other than tanh-GELU, attention-logit soft-capping,
                bidirectional attention, or an unsupported RoPE type.
        """
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"gemma3_text: hidden_activation {act!r} is not supported "
                             "(gelu_pytorch_tanh)")
        if cfg.get("attn_logit_softcapping") or cfg.get("use_bidirectional_attention"):
            raise ValueError("gemma3_text: attn_logit_softcapping / use_bidirectional_attention "
                             "are not supported")
        layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        pattern = cfg.get("sliding_window_pattern", 6)
        layer_types = cfg.get("layer_types") or [
            SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        rope = cfg.get("rope_parameters") or {}
        full = dict(rope.get(FULL) or cfg.get("rope_scaling") or {})
        local = dict(rope.get(SLIDING) or {})
        theta = full.pop("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local_theta = local.pop("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ValueError(f"gemma3_text: sliding-layer RoPE {local} is not supported")
        rope_type = full.get("rope_type", full.get("type", "default"))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            layer_types=tuple(layer_types),
            sliding_window=int(cfg.get("sliding_window") or 0),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**full, "rope_type": rope_type},
            rope_local_theta=float(local_theta),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            attention_bias=cfg.get("attention_bias", False),
        )


class MLP(nn.Module):
    """GeGLU feed-forward (Shazeer 2020) with tanh GELU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, backend: Any, layer_id: int) -> None:
        super().__init__()
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(e, eps, backend)
        self.attn = Attention(cfg, backend, layer_id)
        self.post_attention_layernorm = RMSNorm(e, eps, backend)
        self.pre_feedforward_layernorm = RMSNorm(e, eps, backend)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(e, eps, backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Any,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' ``h = h + post_attn(attn(pre(h))); h = h + post_ff(mlp(pre_ff(h)))``
        in vLLM's fused form: the residual stream is ``x + residual`` (``x`` alone at the first
        layer), in float32 as Llama's. Returns ``(post_ff(mlp_out), residual)``, both
        ``[T, E]``, model dtype and float32."""
        if residual is None:
            x, residual = self.input_layernorm(x), x.float()
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.attn(x, rope, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(nn.Module):
    """The decoder stack plus the (tied) LM head; the same interface as ``LlamaForCausalLM``.

    ``inv_freq_full`` / ``inv_freq_sliding`` are float32 buffers ``[D/2]`` outside the state
    dict (kept float32 while the model is only moved with ``.to(device)``).
    """

    def __init__(self, cfg: Gemma3Config, backend: Any) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, i) for i in range(cfg.num_hidden_layers))
        self.norm: nn.Module = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.register_buffer("inv_freq_full", rope_frequencies(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)
        self.register_buffer("inv_freq_sliding", rope_frequencies(
            cfg.head_dim, cfg.rope_local_theta, None), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: list[Any], hidden_states: torch.Tensor | None = None,
                ) -> torch.Tensor:
        """Run ``T`` tokens through the decoder, writing their K/V into ``kv_caches``.

        Args:
            input_ids: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 position of each token in its sequence.
            kv_caches: per local layer ``(k_cache, v_cache)``, each
                ``[num_blocks, block_size, K, D]`` in the model dtype.
            attn_metadata: per local layer, the ``AttentionMetadata`` of its KV cache group.
            hidden_states: ``[T, E]`` the previous pipeline stage's output (already scaled;
                the float32 residual stream), used instead of embedding ``input_ids``.
        Returns:
            ``[T, E]`` final hidden states (after the last norm), model dtype; a stage before
            the last returns the float32 residual stream.
        """
        if hidden_states is None:
            x = self.embed_tokens(input_ids)  # [T, E]
            # transformers: embed * tensor(sqrt(E)).to(dtype), the factor rounded to the dtype
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        else:
            x = hidden_states
        residual = None
        layers = cast(Iterable[DecoderLayer], self.layers)  # (typed as Iterable[Module])
        # the two RoPE tables, once for every layer
        rope_sliding = self.backend.rotary_table(positions, self.inv_freq_sliding)
        rope_full = self.backend.rotary_table(positions, self.inv_freq_full)
        for layer, kv_cache, meta in zip(layers, kv_caches, attn_metadata, strict=True):
            rope = rope_sliding if layer.attn.sliding_window else rope_full
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.norm(x if residual is None else x + residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, E]`` -> logits ``[N, V]`` float32 (``lm_head_logits``), soft-capped
        when the config says so."""
        return softcap(lm_head_logits(self, hidden), self.config.final_logit_softcapping)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma 2's final-logit soft-capping) on float32 logits
    (transformers caps in the model dtype; ours are never rounded to it); ``logits`` as they
    are when ``cap`` is None."""
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
