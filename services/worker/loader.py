"""Load a Llama-family model's weights into ``LlamaForCausalLM``.

``--model`` is a transformers folder (``config.json`` + ``*.safetensors``) or one ``.gguf`` file
(``services/common/model_files.py`` resolves it). A GGUF file is dequantised once with
transformers (which also un-permutes GGUF's Q/K rows) and cached as a float32 safetensors
folder under ``ModelSource.cache_dir("weights")``; every later start reads that folder.

The hot path never uses transformers' modeling code: only the one-off GGUF conversion does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.model_files import ModelSource, resolve_model
from services.worker.attention import AttentionBackend, select_backend
from services.worker.models.llama import LlamaConfig, LlamaForCausalLM

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama",)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the worker reports about its model.

    Attributes:
        name: display name (folder or GGUF file stem).
        eos_token_ids: end-of-sequence token ids (generation_config.json, else config.json).
        max_model_len: longest sequence the model supports (tokens).
        vocab_size: rows of the logits.
    """

    name: str
    eos_token_ids: list[int]
    max_model_len: int
    vocab_size: int


def load_model(model: str | None, dtype: torch.dtype, device: torch.device | str,
               attn_backend: AttentionBackend | None = None,
               ) -> tuple[LlamaForCausalLM, dict, ModelInfo]:
    """Build the model on ``device`` with weights cast to ``dtype``.

    Args:
        model: a transformers folder or ``.gguf`` path; None/"" = the packaged SmolLM2.
        dtype: weight (and activation) dtype.
        device: where the weights go.
        attn_backend: attention kernels; default ``select_backend("auto", device)``.
    Returns:
        ``(model in eval mode, config.json dict, ModelInfo)``.
    Raises:
        FileNotFoundError: no such model, or a folder without ``*.safetensors``.
        ValueError: not a Llama-family checkpoint, or a weight is missing / has the wrong shape.
    """
    start = time.perf_counter()
    device = torch.device(device)
    source = resolve_model(model)
    folder = convert_gguf(source) if source.is_gguf else Path(source.path)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source.path}: model_type {config.get('model_type')!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    cfg = LlamaConfig.from_hf(config)
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg, attn_backend or select_backend("auto", device))
    state = _read_state_dict(folder, cfg, dtype, device)
    try:
        net.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # missing/unexpected keys or shape mismatch
        raise ValueError(f"{folder}: weights do not fit the config: {e}") from e
    net = net.to(device).eval().requires_grad_(False)  # moves the float32 inv_freq buffer
    info = ModelInfo(name=source.name, eos_token_ids=_eos_token_ids(folder, config),
                     max_model_len=cfg.max_position_embeddings, vocab_size=cfg.vocab_size)
    log.info("loaded %s (%d layers, %.1fM params) as %s on %s in %.2f s", source.name,
             cfg.num_hidden_layers, sum(p.numel() for p in net.parameters()) / 1e6,
             str(dtype).removeprefix("torch."), device, time.perf_counter() - start)
    return net, config, info


def convert_gguf(source: ModelSource) -> Path:
    """Dequantise ``source`` (a GGUF file) to a float32 safetensors folder, once; return it.

    The folder is written in a temporary sibling and renamed into place, so a killed or
    concurrent start never sees half a cache (the loser of a race discards its copy).
    """
    target = source.cache_dir("weights")
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM  # slow import; only for the conversion

    start = time.perf_counter()
    log.info("converting %s to safetensors (once) into %s", source.path, target)
    hf = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.gguf_file,
                                              dtype=torch.float32)
    # NOTE: the weights are already dequantised; without this transformers refuses to save a
    # "gguf-quantised" model.
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".weights-tmp-", dir=target.parent)
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        log.info("another process converted %s first; using its copy", source.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", source.name, time.perf_counter() - start)
    return target


def _read_state_dict(folder: Path, cfg: LlamaConfig, dtype: torch.dtype,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """Read transformers-named safetensors into our names, fusing q/k/v and gate/up."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    hf: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                hf[name.removeprefix("model.")] = f.get_tensor(name)

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"{folder}: weight {name!r} is missing")
        return hf.pop(name)

    state: dict[str, torch.Tensor] = {}
    suffixes = ["weight"] + (["bias"] if cfg.attention_bias else [])
    for i in range(cfg.num_hidden_layers):
        p, q = f"layers.{i}.", f"layers.{i}.self_attn."
        for s in suffixes:
            state[p + f"attn.qkv_proj.{s}"] = torch.cat(
                [take(q + f"q_proj.{s}"), take(q + f"k_proj.{s}"), take(q + f"v_proj.{s}")])
            state[p + f"attn.o_proj.{s}"] = take(q + f"o_proj.{s}")
        for s in ["weight"] + (["bias"] if cfg.mlp_bias else []):
            state[p + f"mlp.gate_up_proj.{s}"] = torch.cat(
                [take(p + f"mlp.gate_proj.{s}"), take(p + f"mlp.up_proj.{s}")])
            state[p + f"mlp.down_proj.{s}"] = take(p + f"mlp.down_proj.{s}")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[p + f"{norm}.weight"] = take(p + f"{norm}.weight")
    state["embed_tokens.weight"] = take("embed_tokens.weight")
    state["norm.weight"] = take("norm.weight")
    lm_head = hf.pop("lm_head.weight", None)
    if not cfg.tie_word_embeddings:
        if lm_head is None:
            raise ValueError(f"{folder}: weight 'lm_head.weight' is missing")
        state["lm_head.weight"] = lm_head
    hf = {k: v for k, v in hf.items() if "rotary_emb" not in k}  # old checkpoints store inv_freq
    if hf:
        log.warning("ignoring %d unused weights, e.g. %s", len(hf), next(iter(hf)))
    return {k: v.to(device=device, dtype=dtype) for k, v in state.items()}


def _eos_token_ids(folder: Path, config: dict) -> list[int]:
    """EOS ids from generation_config.json, else config.json; an int or a list in either."""
    eos = None
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
