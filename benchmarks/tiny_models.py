"""Tiny random-weight models written the way real checkpoints are, and PEFT LoRA adapters of
them: for the benchmarks that need a servable model without a download (``soak``, ``lora``)
and for the tests (``tests/helpers.py`` imports them from here)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_LLAMA_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    # Large enough that the logits are well separated: greedy ties would make exact token
    # comparisons against transformers flaky.
    "initializer_range": 0.15,
}


def make_tiny_llama(path: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a random-weight transformers ``LlamaForCausalLM`` (safetensors) into ``path``.

    ``overrides`` replace ``TINY_LLAMA_CONFIG`` entries or add any ``LlamaConfig`` field
    (e.g. ``rope_scaling``, ``attention_bias``, ``eos_token_id``). Returns ``path``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    config = LlamaConfig(**{**TINY_LLAMA_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_servable_tiny_llama(path: str | Path, **overrides) -> str:
    """A tiny Llama the whole stack can serve: SmolLM2's whole vocabulary (so sampled text has
    real multi-byte characters) and SmolLM2's tokenizer files beside the weights."""
    from services.router.tokenizer import load_tokenizer

    make_tiny_llama(path, **{"vocab_size": 49152, **overrides})
    load_tokenizer(None).save_pretrained(str(path))
    return str(path)


def make_peft_lora(model_dir: str | Path, path: str | Path, r: int = 8, seed: int = 0,
                   target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj"), **config) -> str:
    """Write a random PEFT LoRA adapter of ``model_dir``'s model into ``path`` (what
    ``PeftModel.save_pretrained`` writes: adapter_config.json + adapter_model.safetensors).
    Both A and B are random (PEFT's own init zeroes B, which would change nothing);
    ``config`` adds ``LoraConfig`` fields (``lora_alpha``, ``use_rslora``, ...). Returns
    ``path``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    lora = get_peft_model(model, LoraConfig(r=r, target_modules=list(target_modules),
                                            init_lora_weights=False, **config))
    lora.save_pretrained(str(path))
    return str(path)
