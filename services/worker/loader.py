"""Load a model's weights into our decoder of its family (``MODEL_TYPES``, by model_type):
``llama``, ``mistral``, ``qwen2``, ``qwen3`` -> ``models/llama.py``; ``gemma3_text`` ->
``models/gemma3.py`` (transformers' name for ``Gemma3ForCausalLM``, also what its GGUF reader
makes of a Gemma 3 GGUF). Any other model_type is refused, naming the supported ones.

``--model`` is a transformers folder (``config.json`` + ``*.safetensors``) or one ``.gguf`` file
(``services/common/model_files.py`` resolves it). A GGUF file is dequantised once with
transformers (which also un-permutes GGUF's Q/K rows, and takes llama.cpp's ``+1`` off Gemma's
norm weights) and cached as a float32 safetensors
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
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from services.common.model_files import ModelSource, resolve_model
from services.worker.attention import AttentionBackend, select_backend
from services.worker.distributed import ParallelState
from services.worker.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from services.worker.models.llama import LlamaConfig, LlamaForCausalLM
from services.worker.packed_linear import pack_model_linears
from services.worker.parallel import ShardPlan, shard_model

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
               parallel: ParallelState | None = None, batch_invariant: bool = False,
               ) -> tuple[Model, dict, ModelInfo]:
    """Build the model on ``device`` with weights cast to ``dtype``.

    On a CPU the linear layers go to the native row-invariant kernel where needed
    (``services/worker/packed_linear.py``): every linear layer and the LM head (float32 logits)
    of a 16-bit model, and of a float32 model with ``batch_invariant``. A float32 model without
    it keeps ATen's (MKL, faster at float32; row-variant in the last bits).

    Args:
        model: a transformers folder or ``.gguf`` path; None/"" = the packaged SmolLM2.
        dtype: weight (and activation) dtype.
        device: where the weights go.
        attn_backend: attention kernels; default ``select_backend("auto", device)``.
        parallel: this rank's groups; the model is then this rank's shard
            (``services/worker/parallel.py``) and only that part of the weights is read.
    Returns:
        ``(model in eval mode, config.json dict, ModelInfo)``.
    Raises:
        FileNotFoundError: no such model, or a folder without ``*.safetensors``.
        ValueError: a model_type not in ``MODEL_TYPES``, a config the family cannot run, a
            size the parallel split does not divide, or a weight missing / of the wrong shape;
            ``batch_invariant`` where the native CPU kernels cannot run (not a CPU, or they
            cannot be built).
    """
    start = time.perf_counter()
    device = torch.device(device)
    source = resolve_model(model)
    folder = convert_gguf(source) if source.is_gguf else Path(source.path)
    config = json.loads((folder / "config.json").read_text())
    family = family_of(config, source.path)
    cfg = family.config.from_hf(config)
    plan = ShardPlan(cfg, parallel.config) if parallel and parallel.config.world_size > 1 else None
    with torch.device("meta"):
        net = family.model(cfg, attn_backend or select_backend("auto", device))
        if plan:
            assert parallel is not None  # a plan is made only for a parallel state
            shard_model(net, plan, parallel)
    state = _read_state_dict(folder, cfg, family, dtype, device, plan)
    try:
        net.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # missing/unexpected keys or shape mismatch
        raise ValueError(f"{folder}: weights do not fit the config: {e}") from e
    net = net.to(device).eval().requires_grad_(False)  # moves the float32 inv_freq buffer
    _pack_linears(net, dtype, device, batch_invariant,
                  is_last_stage=plan is None or plan.pc.is_last_stage)
    info = ModelInfo(name=source.name, eos_token_ids=_eos_token_ids(folder, config),
                     max_model_len=cfg.max_position_embeddings, vocab_size=cfg.vocab_size)
    log.info("loaded %s (%d layers, %.1fM params) as %s on %s in %.2f s", source.name,
             len(net.layers), sum(p.numel() for p in net.parameters()) / 1e6,
             str(dtype).removeprefix("torch."), device, time.perf_counter() - start)
    return net, config, info


def _pack_linears(net: Model, dtype: torch.dtype, device: torch.device, batch_invariant: bool,
                  is_last_stage: bool) -> None:
    """Put ``PackedLinear``s where the native kernel is needed (``load_model``'s docstring).

    Raises:
        ValueError: ``batch_invariant`` off a CPU or without the native library.
    """
    if device.type != "cpu":
        if batch_invariant:
            raise ValueError(f"--batch-invariant is implemented for the CPU only, not "
                             f"{device.type}")
        return
    if not (batch_invariant or dtype != torch.float32):
        return
    try:
        pack_model_linears(net, lm_head=is_last_stage, decoder=True)
    except Exception as e:  # the native library cannot be built or loaded here
        if batch_invariant:
            raise ValueError(f"--batch-invariant needs the native CPU kernels, which could not "
                             f"be built or loaded: {e}") from e
        log.warning("native CPU kernels unavailable (%s): the linear layers run on ATen and "
                    "the logits are rounded to %s", e, str(dtype).removeprefix("torch."))


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
    from transformers import AutoModelForCausalLM  # slow import; only for the conversion

    start = time.perf_counter()
    log.info("converting %s to safetensors (once) into %s", source.path, target)
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
    log.info("converted %s in %.1f s", source.name, time.perf_counter() - start)
    return target


def _read_state_dict(folder: Path, cfg: ModelConfig, family: Family, dtype: torch.dtype,
                     device: torch.device, plan: ShardPlan | None = None,
                     ) -> dict[str, torch.Tensor]:
    """Read transformers-named safetensors into our names, fusing q/k/v and gate/up.

    With a ``plan`` only this rank's layers and slices are read (``safe_open.get_slice``), so a
    rank never holds the whole model in memory; local layer j is checkpoint layer
    ``plan.layers[j]``.
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    with ExitStack() as stack:
        handles = {}  # our-prefix-less name -> (open file, checkpoint name)
        for file in files:
            f = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for name in f.keys():  # noqa: SIM118 - a safetensors file, not a dict
                handles[name.removeprefix("model.")] = (f, name)
        return _build_state(folder, cfg, family, handles, plan, dtype, device)


def _build_state(folder: Path, cfg: ModelConfig, family: Family, handles: dict,
                 plan: ShardPlan | None, dtype: torch.dtype, device: torch.device,
                 ) -> dict[str, torch.Tensor]:
    def take(name: str) -> torch.Tensor:
        if name not in handles:
            raise ValueError(f"{folder}: weight {name!r} is missing")
        f, full_name = handles.pop(name)
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
            state[ours + f"attn.qkv_proj.{s}"] = torch.cat(
                [take(q + f"q_proj.{s}"), take(q + f"k_proj.{s}"), take(q + f"v_proj.{s}")])
        for s in ["weight"] + (["bias"] if cfg.attention_bias else []):
            state[ours + f"attn.o_proj.{s}"] = take(q + f"o_proj.{s}")
        if cfg.qk_norm:
            for n in ("q_norm", "k_norm"):
                state[ours + f"attn.{n}.weight"] = norm(q + f"{n}.weight")
        for s in ["weight"] + (["bias"] if cfg.mlp_bias else []):
            state[ours + f"mlp.gate_up_proj.{s}"] = torch.cat(
                [take(p + f"mlp.gate_proj.{s}"), take(p + f"mlp.up_proj.{s}")])
            state[ours + f"mlp.down_proj.{s}"] = take(p + f"mlp.down_proj.{s}")
        for n in family.layer_norms:
            state[ours + f"{n}.weight"] = norm(p + f"{n}.weight")
    last = plan is None or plan.pc.is_last_stage
    if plan is None or plan.keeps_embedding:
        state["embed_tokens.weight"] = take("embed_tokens.weight")
    if last:
        state["norm.weight"] = norm("norm.weight")
    if last and not cfg.tie_word_embeddings:
        state["lm_head.weight"] = take("lm_head.weight")
    # NOTE: left over and expected: old checkpoints' rotary inv_freq, a tied checkpoint's
    # lm_head copy, and other pipeline stages' layers, embedding, norm and LM head.
    unused = [k for k in handles if "rotary_emb" not in k
              and k not in ("embed_tokens.weight", "norm.weight", "lm_head.weight")
              and not (k.startswith("layers.") and int(k.split(".")[1]) not in layers)]
    if unused:
        log.warning("ignoring %d unused weights, e.g. %s", len(unused), unused[0])
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
