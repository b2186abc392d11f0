"""Read a PEFT LoRA folder into this rank's A/B tensors (the worker's side of an adapter).

A PEFT folder (``LoraConfig`` + ``save_pretrained``) holds ``adapter_config.json`` (``r``,
``lora_alpha``, ``target_modules``, ``use_rslora``, ...) and ``adapter_model.safetensors``
with, per targeted linear layer, ``...layers.N.self_attn.q_proj.lora_A.weight`` ``[r, in]``
and ``...lora_B.weight`` ``[out, r]``. PEFT adds ``scale * B(A(x))`` to the layer's output,
``scale = lora_alpha / r`` (rsLoRA, Kalajdzievski 2023: ``lora_alpha / sqrt(r)``).

Checks that need no tensors (files present, rank within ``--max-lora-rank``, supported
targets, options we do not run) are made here at load, each error naming the adapter and the
problem; the router checks the same before it registers an adapter (``check_adapter`` in
``services/common/lora.py``), which this module calls when present, so they live in one place.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.lora import LoRARequest
from services.worker.lora import LoRALoadError

# The linear layers an adapter may target (PEFT's module names) and where each sits.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
ROW_PARALLEL = ("o_proj", "down_proj")  # input features split under TP; the others by output
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# PEFT options whose math we do not run: refused at load, naming the option.
_UNSUPPORTED = ("use_dora", "lora_bias", "rank_pattern", "alpha_pattern", "modules_to_save",
                "layers_to_transform", "trainable_token_indices")

# (dim, start, stop) of this rank's part of a base weight named like ``layers.N.<attn|mlp>.
# <target>.weight`` (services/worker/parallel.ShardPlan.slice_of), None = all of it
SliceOf = Callable[[str], "tuple[int, int, int] | None"]


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter, loaded: its request, rank, scale and this rank's weights.

    Attributes:
        request: the adapter as the router named it.
        rank: ``r``.
        scale: what its update is multiplied by (``lora_alpha / r`` or rsLoRA's).
        weights: ``(global layer, target) -> (A [r, in'], B [out', r])`` in the model dtype,
            on the CPU, for this rank's layers: a column-parallel target's B cut to its
            output rows, a row-parallel one's A to its input columns (``in'`` / ``out'``).
    """

    request: LoRARequest
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter_config(request: LoRARequest, max_rank: int) -> tuple[int, float]:
    """``(r, scale)`` of ``request``'s ``adapter_config.json``.

    Raises:
        LoRALoadError: a missing or unreadable file, a rank above ``max_rank``
            (``--max-lora-rank``), a target outside ``TARGETS``, or a PEFT option this server
            does not run (DoRA, per-module ranks, ...).
    """
    where = f"LoRA adapter {request.name!r} ({request.path})"
    path = Path(request.path) / "adapter_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LoRALoadError(f"{where}: cannot read adapter_config.json: {e}") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRALoadError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for option in _UNSUPPORTED:
        if cfg.get(option):
            raise LoRALoadError(f"{where}: {option} is not supported")
    rank, alpha = int(cfg.get("r", 0)), float(cfg.get("lora_alpha", 0))
    if not 1 <= rank <= max_rank:
        raise LoRALoadError(f"{where}: rank r={rank} is above --max-lora-rank {max_rank}"
                            if rank > max_rank else f"{where}: rank r={rank} must be >= 1")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise LoRALoadError(f"{where}: target_modules {unknown} are not layers of the model "
                                f"that LoRA can target ({', '.join(TARGETS)})")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, scale


def load_adapter(request: LoRARequest, model_config: dict, max_rank: int,
                 dtype: torch.dtype, layers: range, slice_of: SliceOf | None = None,
                 ) -> LoRAAdapter:
    """Load ``request``'s folder: the checks (``read_adapter_config``, and the router's
    ``check_adapter`` where present), then this rank's part of its weights.

    Args:
        request: the adapter (its ``path`` is the PEFT folder).
        model_config: the base model's ``config.json``.
        max_rank: ``--max-lora-rank``.
        dtype: the model dtype the weights are cast to.
        layers: the global layer indices this rank holds (a pipeline stage's).
        slice_of: this rank's part of a base weight under tensor parallelism; None = one rank.

    Raises:
        LoRALoadError: as ``read_adapter_config``; a missing or unreadable
            ``adapter_model.safetensors``; a key of a module we cannot target; an A/B pair
            missing a half; shapes that do not fit the base layer.
    """
    where = f"LoRA adapter {request.name!r} ({request.path})"
    check = getattr(importlib.import_module("services.common.lora"), "check_adapter", None)
    if check is not None:  # the router's torch-free checks (shapes against the config too)
        try:
            check(request.path, model_config, max_rank)
        except ValueError as e:
            raise LoRALoadError(f"{where}: {e}") from e
    rank, scale = read_adapter_config(request, max_rank)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    path = Path(request.path) / "adapter_model.safetensors"
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                m = _KEY.search(key)
                if m is None or m.group(2) not in TARGETS:
                    raise LoRALoadError(f"{where}: weight {key!r} is not a LoRA A/B of a layer "
                                        f"LoRA can target ({', '.join(TARGETS)})")
                layer, target, half = int(m.group(1)), m.group(2), m.group(3)
                if layer in layers:
                    halves.setdefault((layer, target), {})[half] = f.get_tensor(key)
    except LoRALoadError:
        raise
    except Exception as e:
        raise LoRALoadError(f"{where}: cannot read adapter_model.safetensors: {e}") from e
    weights = {}
    for (layer, target), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRALoadError(f"{where}: layers.{layer}.{target} has lora_{''.join(pair)} "
                                "without its other half")
        weights[layer, target] = _fit(where, layer, target, pair["A"], pair["B"], rank,
                                      model_config, slice_of)
    return LoRAAdapter(request, rank, scale,
                       {k: (a.to(dtype), b.to(dtype)) for k, (a, b) in weights.items()})


def target_shape(target: str, cfg: dict) -> tuple[int, int]:
    """``(in, out)`` features of ``target`` in the whole (unsharded) model of ``cfg``."""
    e, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or e // heads
    kv = (cfg.get("num_key_value_heads") or heads) * d
    i = cfg["intermediate_size"]
    return {"q_proj": (e, heads * d), "k_proj": (e, kv), "v_proj": (e, kv),
            "o_proj": (heads * d, e), "gate_proj": (e, i), "up_proj": (e, i),
            "down_proj": (i, e)}[target]


def _fit(where: str, layer: int, target: str, a: torch.Tensor, b: torch.Tensor, rank: int,
         cfg: dict, slice_of: SliceOf | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Check one A ``[r, in]`` / B ``[out, r]`` pair against the base layer, then cut this
    rank's part (column-parallel: B's rows; row-parallel: A's columns)."""
    n_in, n_out = target_shape(target, cfg)
    if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
        raise LoRALoadError(f"{where}: layers.{layer}.{target} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; the base model needs A ({rank}, {n_in}) and "
                            f"B ({n_out}, {rank})")
    part = "self_attn" if target in ATTENTION_TARGETS else "mlp"
    cut = slice_of(f"layers.{layer}.{part}.{target}.weight") if slice_of else None
    if cut is not None:
        dim, start, stop = cut
        if target in ROW_PARALLEL:  # (dim 1 of the base weight: A's columns)
            a = a[:, start:stop]
        else:  # (dim 0 of the base weight: B's rows)
            b = b[start:stop]
        assert dim == (1 if target in ROW_PARALLEL else 0)
    return a.contiguous(), b.contiguous()
