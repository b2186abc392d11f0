"""Read a PEFT LoRA folder into this rank's A/B tensors (the worker's side of an adapter).

A PEFT folder (``LoraConfig`` + ``save_pretrained``) holds ``adapter_config.json`` (``r``,
``lora_alpha``, ``target_modules``, ``use_rslora``, ``rank_pattern``, ``alpha_pattern``) and
``adapter_model.safetensors`` with, per targeted linear layer,
``...layers.N.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``.
PEFT adds ``scale * B(A(x))`` to the layer's output, ``scale = lora_alpha / r`` (rsLoRA,
Kalajdzievski 2023: ``lora_alpha / sqrt(r)``), per module with its own ``r`` and alpha when
``rank_pattern`` / ``alpha_pattern`` say so.

Every check of the folder (files, rank within ``--max-lora-rank``, targets the model has,
shapes, options we do not run, a decidably different base model) is the router's
``check_adapter`` (``services/common/lora.py``), run here too before any weight is read, so the
checks live in one place; its error becomes a ``LoRALoadError`` naming the adapter.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.lora import (
    ADAPTER_WEIGHTS,
    ATTENTION_TARGETS,
    LoRARequest,
    check_adapter,
    pattern_value,
    read_config,
)
from services.worker.lora import LoRALoadError

ROW_PARALLEL = ("o_proj", "down_proj")  # input features split under TP; the others by output
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")

# (dim, start, stop) of this rank's part of a base weight named like ``layers.N.<attn|mlp>.
# <target>.weight`` (services/worker/parallel.ShardPlan.slice_of), None = all of it
SliceOf = Callable[[str], "tuple[int, int, int] | None"]


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter, loaded: its request, rank, scale and this rank's weights.

    Attributes:
        request: the adapter as the router named it.
        rank: its largest rank (of any module).
        scale: what its update is multiplied by (``lora_alpha / r`` or rsLoRA's, of the
            config's ``r``); a module whose ``rank_pattern`` / ``alpha_pattern`` gives it
            another scale has the ratio folded into its B.
        weights: ``(global layer, target) -> (A [r, in'], B [out', r])`` in the model dtype,
            on the CPU, for this rank's layers: a column-parallel target's B cut to its
            output rows, a row-parallel one's A to its input columns (``in'`` / ``out'``).
    """

    request: LoRARequest
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(request: LoRARequest, model_config: dict, max_rank: int,
                 dtype: torch.dtype, layers: range, slice_of: SliceOf | None = None,
                 ) -> LoRAAdapter:
    """Check ``request``'s folder (``check_adapter``), then load this rank's part of it.

    Args:
        request: the adapter (its ``path`` is the PEFT folder).
        model_config: the base model's ``config.json``.
        max_rank: ``--max-lora-rank``.
        dtype: the model dtype the weights are cast to.
        layers: the global layer indices this rank holds (a pipeline stage's).
        slice_of: this rank's part of a base weight under tensor parallelism; None = one rank.

    Raises:
        LoRALoadError: what ``check_adapter`` refuses (its message, after the adapter's
            name), or a file that cannot be read after all.
    """
    try:
        info = check_adapter(request.path, model_config, max_rank)
        config = read_config(Path(request.path))
        default = _scale(float(config.get("lora_alpha", info.lora_alpha)),
                         int(config.get("r", info.rank)), info.use_rslora)
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        with safe_open(str(Path(request.path) / ADAPTER_WEIGHTS), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                m = _KEY.search(key)
                if m is not None and int(m.group(1)) in layers:
                    halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = (
                        f.get_tensor(key))
    except ValueError as e:  # (check_adapter's AdapterError; a bad JSON)
        raise LoRALoadError(f"LoRA adapter {request.name!r}: {e}") from e
    except Exception as e:
        raise LoRALoadError(f"LoRA adapter {request.name!r} ({request.path}): cannot read "
                            f"it: {e}") from e
    for (layer, target), pair in halves.items():
        a, b = pair["A"], pair["B"]  # (check_adapter: both present, shapes fit)
        alpha = pattern_value(config.get("alpha_pattern"), layer, target, info.lora_alpha)
        module_scale = _scale(alpha, a.shape[0], info.use_rslora)
        if module_scale != default:  # (rank_pattern / alpha_pattern)
            b = b * (module_scale / default)
        a, b = _cut(layer, target, a, b, slice_of)
        a, b = a.to(dtype), b.to(dtype)
        # NOTE: a slot's weights meet every row of a step (a masked GEMM: 0 * NaN is NaN), so
        # a non-finite value would corrupt the other requests, not only its own
        if not (math.isfinite(default) and bool(torch.isfinite(a).all())
                and bool(torch.isfinite(b).all())):
            raise LoRALoadError(f"LoRA adapter {request.name!r}: layer {layer} {target} has "
                                f"NaN or infinite values (in {str(dtype).removeprefix('torch.')}"
                                f", scaling {default:g}); refused")
        weights[layer, target] = (a, b)
    return LoRAAdapter(request, info.rank, default, weights)


def _scale(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _cut(layer: int, target: str, a: torch.Tensor, b: torch.Tensor,
         slice_of: SliceOf | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one A ``[r, in]`` / B ``[out, r]`` pair (column-parallel: B's
    rows; row-parallel: A's columns), as ``slice_of`` cuts the base weight."""
    part = "self_attn" if target in ATTENTION_TARGETS else "mlp"
    cut = slice_of(f"layers.{layer}.{part}.{target}.weight") if slice_of else None
    if cut is not None:
        _, start, stop = cut
        if target in ROW_PARALLEL:  # (dim 1 of the base weight: A's columns)
            a = a[:, start:stop]
        else:  # (dim 0 of the base weight: B's rows)
            b = b[start:stop]
    return a.contiguous(), b.contiguous()
