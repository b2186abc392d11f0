"""A transformers checkpoint read as our decoder's weights: the model families (``MODEL_TYPES``,
by ``config.json``'s model_type), a GGUF file's one-off float32 conversion (``convert_gguf``),
the safetensors read into our names with q/k/v and gate/up fused (``read_state_dict``, only a
rank's layers and slices), and the EOS ids. ``loader.py`` decides what is read and builds the
model from it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.model_files import ModelSource
from services.common.progress import startup_step
from services.worker.as_stored import open_safetensors
from services.worker.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from services.worker.models.llama import LlamaConfig, LlamaForCausalLM
from services.worker.parallel.sharding import ShardPlan

log = logging.getLogger(__name__)

ModelConfig = LlamaConfig | Gemma3Config
Model = LlamaForCausalLM | Gemma3ForCausalLM


@dataclass(frozen=True, slots=True)
class Family:
    """How one transformers ``model_type`` loads: our config and model classes, and the
    weight mapping's family-specific part (the rest, fused q/k/v and gate/up, is shared).

    Attributes:
        config: has ``from_hf(config.json dict)``.
        model: built as ``model(config, backend)``.
        layer_norms: the per-layer norm weights (transformers' names, after ``layers.N.``).
        norm_offset: added to every norm weight at load (Gemma's ``(1 + w)`` norms: 1.0).
    """

    config: Any
    model: Any
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    norm_offset: float = 0.0


_GEMMA3 = Family(Gemma3Config, Gemma3ForCausalLM, (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm"), norm_offset=1.0)
MODEL_TYPES: dict[str, Family] = {
    "llama": Family(LlamaConfig, LlamaForCausalLM),
    "mistral": Family(LlamaConfig, LlamaForCausalLM),
    "qwen2": Family(LlamaConfig, LlamaForCausalLM),
    "qwen3": Family(LlamaConfig, LlamaForCausalLM),
    "gemma3_text": _GEMMA3,
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)
# A 4-bit AWQ / GPTQ layer's tensors (read by int4_checkpoints, not by _build_state).
_INT4_TENSORS = (".qweight", ".qzeros", ".scales", ".g_idx")


def family_of(config: dict, where: str | Path) -> Family:
    """The ``Family`` of a ``config.json`` dict; ValueError naming the model_type (and the
    architectures) and the supported list when there is none."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        arch = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise ValueError(f"{where}: model_type {model_type!r} ({arch}) is not supported "
                         f"(supported model_types: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return MODEL_TYPES[model_type]


def convert_gguf(source: ModelSource) -> Path:
    """Dequantise ``source`` (a GGUF file) to a float32 safetensors folder, once; return it.

    The folder is written in a temporary sibling and renamed into place, so a killed or
    concurrent start never sees half a cache (the loser of a race discards its copy).
    """
    target = source.cache_dir("weights")
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to safetensors (once) into %s", source.path, target)
    with startup_step(f"converting {source.name} to safetensors", detail="once"):
        _convert(source, target)
    return target


def _convert(source: ModelSource, target: Path) -> None:
    """``convert_gguf``'s work: the dequantised model saved into ``target``, atomically."""
    from transformers import AutoModelForCausalLM  # slow import; only for the conversion

    hf = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.gguf_file,
                                              dtype=torch.float32)
    # NOTE: the weights are already dequantised; without this transformers refuses to save a
    # "gguf-quantised" model. (The ignore: torch types Module.__setattr__'s value as a tensor
    # or module, and transformers does not declare the attribute it reads as optional.)
    hf.hf_quantizer = None  # type: ignore[assignment]
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


def read_state_dict(folder: Path, cfg: ModelConfig, family: Family, dtype: torch.dtype,
                     device: torch.device, plan: ShardPlan | None = None,
                     skip: set[str] | None = None,
                     copy: Callable[[str], bool] | None = None,
                     skip_shapes: dict[str, tuple[int, int]] | None = None,
                     ) -> dict[str, torch.Tensor]:
    """Read transformers-named safetensors into our names, fusing q/k/v and gate/up.

    With a ``plan`` only this rank's layers and slices are read (``safe_open.get_slice``), so a
    rank never holds the whole model in memory; local layer j is checkpoint layer
    ``plan.layers[j]``. The weights of the modules in ``skip`` (``"layers.{j}.attn.qkv_proj"``:
    served from elsewhere) are not read; they get meta tensors of their shape. The tensors
    whose names ``copy`` accepts are copies, not views of the file's memory map. ``skip`` may
    also name ``"embed_tokens"`` and ``"lm_head"``; ``skip_shapes`` gives the shape of a
    skipped weight the checkpoint does not hold (a 4-bit layer's, by checkpoint name).
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    with ExitStack() as stack:
        handles = open_safetensors(folder, stack)
        return _build_state(folder, cfg, family, handles, plan, dtype, device, skip or set(),
                            copy, skip_shapes or {})


def _build_state(folder: Path, cfg: ModelConfig, family: Family, handles: dict,
                 plan: ShardPlan | None, dtype: torch.dtype, device: torch.device,
                 skip: set[str], copy: Callable[[str], bool] | None,
                 skip_shapes: dict[str, tuple[int, int]],
                 ) -> dict[str, torch.Tensor]:
    reading = True  # False: the weight's shape only, as a meta tensor (a skipped module)

    def take(name: str) -> torch.Tensor:
        if not reading and name in skip_shapes:
            return torch.empty(skip_shapes[name], device="meta")
        if name not in handles:
            raise ValueError(f"{folder}: weight {name!r} is missing")
        f, full_name = handles.pop(name)
        if not reading:
            rows, cols = f.get_slice(full_name).get_shape()
            return torch.empty(rows, cols, device="meta")
        part = plan.slice_of(name) if plan else None
        if part is None:
            return f.get_tensor(full_name)
        assert plan is not None  # part is None without a plan
        dim, start, stop = part
        view = f.get_slice(full_name)
        tensor = view[start:stop] if dim == 0 else view[:, start:stop]
        return plan.pad(name, tensor)

    def norm(name: str) -> torch.Tensor:  # Gemma: (1 + w) folded in, in float32
        w = take(name)
        return w.float() + family.norm_offset if family.norm_offset else w

    layers = plan.layers if plan else range(cfg.num_hidden_layers)
    state: dict[str, torch.Tensor] = {}
    for j, i in enumerate(layers):
        p, q, ours = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{j}."
        for s in ["weight"] + (["bias"] if cfg.qkv_proj_bias else []):
            reading = s == "bias" or ours + "attn.qkv_proj" not in skip
            state[ours + f"attn.qkv_proj.{s}"] = torch.cat(
                [take(q + f"q_proj.{s}"), take(q + f"k_proj.{s}"), take(q + f"v_proj.{s}")])
        for s in ["weight"] + (["bias"] if cfg.attention_bias else []):
            reading = s == "bias" or ours + "attn.o_proj" not in skip
            state[ours + f"attn.o_proj.{s}"] = take(q + f"o_proj.{s}")
        reading = True
        if cfg.qk_norm:
            for n in ("q_norm", "k_norm"):
                state[ours + f"attn.{n}.weight"] = norm(q + f"{n}.weight")
        for s in ["weight"] + (["bias"] if cfg.mlp_bias else []):
            reading = s == "bias" or ours + "mlp.gate_up_proj" not in skip
            state[ours + f"mlp.gate_up_proj.{s}"] = torch.cat(
                [take(p + f"mlp.gate_proj.{s}"), take(p + f"mlp.up_proj.{s}")])
            reading = s == "bias" or ours + "mlp.down_proj" not in skip
            state[ours + f"mlp.down_proj.{s}"] = take(p + f"mlp.down_proj.{s}")
        reading = True
        for n in family.layer_norms:
            state[ours + f"{n}.weight"] = norm(p + f"{n}.weight")
    last = plan is None or plan.pc.is_last_stage
    if plan is None or plan.keeps_embedding:
        reading = "embed_tokens" not in skip
        state["embed_tokens.weight"] = take("embed_tokens.weight")
    if last:
        reading = True
        state["norm.weight"] = norm("norm.weight")
    if last and not cfg.tie_word_embeddings:
        reading = "lm_head" not in skip
        state["lm_head.weight"] = take("lm_head.weight")
    # NOTE: left over and expected: old checkpoints' rotary inv_freq, a tied checkpoint's
    # lm_head copy, and other pipeline stages' layers, embedding, norm and LM head.
    unused = [k for k in handles if "rotary_emb" not in k
              and not k.endswith(_INT4_TENSORS)
              and k not in ("embed_tokens.weight", "norm.weight", "lm_head.weight")
              and not (k.startswith("layers.") and int(k.split(".")[1]) not in layers)]
    if unused:
        log.warning("ignoring %d unused weights, e.g. %s", len(unused), unused[0])
    return {k: v if v.is_meta else v.to(device=device, dtype=dtype,
                                         copy=copy is not None and copy(k))
            for k, v in state.items()}


def eos_token_ids(folder: Path, config: dict) -> list[int]:
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
