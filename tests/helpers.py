"""Shared test helpers: tiny random-weight models written the way real checkpoints are."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import numpy as np
import torch

from benchmarks.tiny_models import (  # noqa: F401 (the tests import them from here)
    TINY_LLAMA_CONFIG,
    make_peft_lora,
    make_servable_tiny_llama,
    make_tiny_llama,
)

def asynctest(fn):
    """Run an async test on a fresh event loop (pytest-asyncio is not a dependency)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return run


def _save_tiny(config, model_cls: type, path: str | Path, seed: int) -> Path:
    """Build ``model_cls(config)`` with seeded random weights, including random norm weights
    and biases (transformers initialises those to constants), and save it as safetensors."""
    path = Path(path)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_qwen2(path: str | Path, seed: int = 0, **overrides) -> Path:
    """A random-weight transformers ``Qwen2ForCausalLM`` (bias on q/k/v, none on o_proj);
    ``overrides`` are ``Qwen2Config`` fields (e.g. ``use_sliding_window=True,
    sliding_window=16, max_window_layers=1``: layers 1.. slide). Returns ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _save_tiny(Qwen2Config(**{**TINY_LLAMA_CONFIG, **overrides}), Qwen2ForCausalLM,
                      path, seed)


def make_tiny_qwen3(path: str | Path, seed: int = 0, **overrides) -> Path:
    """A random-weight transformers ``Qwen3ForCausalLM`` (q/k RMSNorm per head; head_dim 32,
    not hidden / heads, as Qwen3's are). Returns ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**TINY_LLAMA_CONFIG, "head_dim": 32, **overrides})
    return _save_tiny(config, Qwen3ForCausalLM, path, seed)


def make_tiny_mistral(path: str | Path, seed: int = 0, **overrides) -> Path:
    """A random-weight transformers ``MistralForCausalLM``, sliding window 16 on every layer.
    Returns ``path``."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**{**TINY_LLAMA_CONFIG, "sliding_window": 16, **overrides})
    return _save_tiny(config, MistralForCausalLM, path, seed)


TINY_GEMMA3_CONFIG = {
    **TINY_LLAMA_CONFIG,
    "num_hidden_layers": 4,
    "head_dim": 16,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    "query_pre_attn_scalar": 24,  # not head_dim: the scale must come from it
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
}


def make_tiny_gemma3(path: str | Path, seed: int = 0, **overrides) -> Path:
    """A random-weight transformers ``Gemma3ForCausalLM`` (``Gemma3TextConfig``): 4 layers,
    sliding (window 16, RoPE base 1e4) and full (RoPE base 1e6) alternating, tied
    embeddings, logits soft-capped at 30, random (1 + w) norm weights. Returns ``path``."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**{**TINY_GEMMA3_CONFIG, **overrides})
    return _save_tiny(config, Gemma3ForCausalLM, path, seed)


def _permute_for_gguf(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (rotate-half -> interleaved RoPE), as its converter does."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def random_gguf_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """An ``[n, k]`` tensor of GGML type ``qtype`` as raw bytes (uint8 ``[n, k / block *
    bytes]``), for the k-quants gguf-py cannot quantize (Q4_K, Q5_K, Q6_K): random codes and
    sub-scales, the fp16 super-block scales (and mins) set so that the weights are of a
    trained layer's size (|w| <~ 0.1)."""
    from services.worker.gguf_blocks import _BLOCK

    block, size = _BLOCK[qtype]
    gen = np.random.default_rng(seed)
    raw = gen.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    d = (gen.random((raw.shape[0], 2)) * 1e-4 + 1e-5).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":  # ql, qh, int8 scales[16], then d
        raw[:, -2:] = d[:, 0:2]
    else:  # Q4_K / Q5_K: d, dmin, then the 6-bit scales and mins
        raw[:, 0:4] = d
    return raw.reshape(n, -1)


def _gguf_tensor(writer, name: str, tensor: torch.Tensor, qtype_name: str, seed: int) -> None:
    import gguf

    if qtype_name == "F32":
        writer.add_tensor(name, tensor.numpy())
        return
    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype_name in ("Q4_K", "Q5_K", "Q6_K"):
        data = random_gguf_blocks(qtype_name, *tensor.shape, seed=seed)
    else:
        data = gguf.quants.quantize(tensor.numpy(), qtype)
    writer.add_tensor(name, data, raw_dtype=qtype)


def make_tiny_gguf(path: str | Path, hf_folder: str | Path, eos_token_id: int = 2,
                   linear_type: str = "F32", embedding_type: str = "F32",
                   types: dict[str, str] | None = None) -> Path:
    """Write the Llama of ``hf_folder`` (from ``make_tiny_llama``) as a GGUF file at ``path``.

    Tensors are named and Q/K-permuted the way llama.cpp's ``convert_hf_to_gguf.py`` does, so
    transformers' GGUF loader must undo the permutation to get the original model back. The
    decoder's linear weights are stored as ``linear_type`` (a ``GGMLQuantizationType`` name,
    e.g. ``Q8_0``, ``Q4_0``), or per GGUF tensor kind as ``types`` says (``{"attn_v":
    "Q6_K", ...}``, the others ``linear_type``), the embedding and LM head as
    ``embedding_type``, everything else as F32. gguf-py quantizes the legacy formats from the
    model's weights; the k-quants (Q4_K, Q5_K, Q6_K), which it cannot, are random blocks
    (``random_gguf_blocks``): the GGUF is then another random model, which transformers'
    GGUF loader reads as the reference. No tokenizer is stored (the model loads without one).
    Returns ``path``.
    """
    import json

    import gguf
    from safetensors.torch import load_file

    path, hf_folder = Path(path), Path(hf_folder)
    cfg = json.loads((hf_folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(path.stem)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos_token_id)
    for seed, (name, tensor) in enumerate(load_file(hf_folder / "model.safetensors").items()):
        tensor = tensor.float()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            name = "token_embd.weight" if name.startswith("model.") else "output.weight"
            _gguf_tensor(writer, name, tensor, embedding_type, seed)
            continue
        if name == "model.norm.weight":
            name = "output_norm.weight"
        else:  # model.layers.N.<module>.weight
            _, _, layer, *module, _ = name.split(".")
            module = ".".join(module)
            if module == "self_attn.q_proj":
                tensor = _permute_for_gguf(tensor, cfg["num_attention_heads"])
            elif module == "self_attn.k_proj":
                tensor = _permute_for_gguf(tensor, cfg["num_key_value_heads"])
            kind = _GGUF_NAMES[module]
            name = f"blk.{layer}.{kind}.weight"
            if "norm" not in module:
                _gguf_tensor(writer, name, tensor, (types or {}).get(kind, linear_type), seed)
                continue
        writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_beam_search(model, prompt: list[int], beam_width: int, n: int, max_new_tokens: int,
                   length_penalty: float = 1.0, early_stopping: bool | str = False
                   ) -> list[tuple[list[int], float]]:
    """transformers' ``generate(num_beams=beam_width, num_return_sequences=n,
    do_sample=False)`` of one prompt: each hypothesis as (its generated token ids, cut after a
    first EOS, which stays; its ``sequences_scores`` entry), best first."""
    out = model.generate(torch.tensor([prompt]), num_beams=beam_width, num_return_sequences=n,
                         do_sample=False, max_new_tokens=max_new_tokens,
                         length_penalty=length_penalty, early_stopping=early_stopping,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    result = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        gen = seq[len(prompt):]
        end = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
        result.append((gen[:end], score))
    return result

