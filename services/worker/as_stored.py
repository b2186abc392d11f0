"""A quantized checkpoint's weights served as stored, for the loader: which tensors this rank
serves so (a GGUF's quantized ones: ``gguf_weights.py``; a 4-bit AWQ / GPTQ checkpoint's
layers: ``int4_checkpoints.py``), the checks before any is served (the device, tensor
parallelism, the native kernels, ``--quantization`` against the checkpoint, the GGUF's first
layer against its float conversion), and the modules put in place of the float ones
(``quantized_linear.GroupQuantLinear`` / ``QuantizedEmbedding`` on the native CPU kernels;
on the Triton backend ``triton_int4_linear.TritonInt4Linear``, 4-bit layers only).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from services.common.model_files import ModelSource
from services.worker.gguf_weights import GGUFIndex, StoredWeights, read_stored_weights
from services.worker.int4_checkpoints import Int4Config, read_int4_modules
from services.worker.models.gemma3 import Gemma3Config
from services.worker.models.llama import LlamaConfig
from services.worker.packed_linear import takes_silu_mul
from services.worker.parallel.sharding import ShardPlan
from services.worker.quantized_linear import (
    GroupQuantLinear,
    QuantizedEmbedding,
    a8_requested,
)
from services.worker.triton_int4_linear import four_bit_only, serve_on_triton

log = logging.getLogger(__name__)

# --quantization for a GGUF: its quantized tensors as stored (vLLM's name), or dequantized at
# load to --dtype; beside the int8 modes of quantized_linear.QUANTIZATIONS.
GGUF_MODES = ("gguf", "none")
# --quantization for a 4-bit AWQ / GPTQ checkpoint (detected from its config.json either way)
INT4_MODES = ("awq", "gptq")


def native_kernels_missing() -> str | None:
    """Why the native CPU kernels (``kernels.cpu_build``) cannot run here (no compiler, a
    failed build, an unloadable library), or None: they are loaded."""
    try:
        from kernels import cpu_build

        cpu_build.load()
    except Exception as e:  # noqa: BLE001 - any build/load failure is a reason
        return str(e)
    return None


def check_int4(int4: Int4Config | None, quantization: str | None, folder: Path) -> None:
    """ValueError, naming ``--quantization``, where it does not fit the checkpoint: ``awq`` /
    ``gptq`` without that ``quantization_config``, or another mode for such a checkpoint (its
    4-bit layers have no float weights to serve otherwise)."""
    method = int4.quant_method if int4 else None
    if quantization in INT4_MODES and quantization != method:
        raise ValueError(f"--quantization {quantization}: {folder} is not a 4-bit "
                         f"{quantization} checkpoint (config.json's quantization_config "
                         f"says {method or 'nothing'})")
    if method and quantization not in (None, method):
        raise ValueError(f"{folder} is a 4-bit {method} checkpoint: --quantization "
                         f"{quantization} cannot serve it (leave it unset, or {method})")


def int4_stored(folder: Path, int4: Int4Config, device: torch.device, plan: ShardPlan | None,
                layers: list[int] | range, triton: bool = False
                ) -> tuple[StoredWeights, dict[str, tuple[int, int]]]:
    """A 4-bit AWQ / GPTQ checkpoint's linear layers as stored (``int4_checkpoints.py``), and
    the shapes of the float weights they stand for. ``triton``: the worker's attention
    backend is triton (CUDA, or the interpreter): served by ``TritonInt4Linear`` on any
    device, without the native CPU kernels.

    Raises:
        ValueError: not a CPU (without ``triton``), tensor parallelism, the native kernels
            missing (without ``triton``), or a malformed tensor.
    """
    method = int4.quant_method
    if device.type != "cpu" and not triton:
        raise ValueError(f"{folder}: {method} checkpoints are served on the CPU or with the "
                         f"triton attention backend only, not {device.type} with another")
    if plan is not None and plan.pc.tensor_parallel_size > 1:
        raise ValueError(f"{folder}: {method} checkpoints are not served with tensor "
                         f"parallelism yet")
    if not triton and (missing := native_kernels_missing()):
        raise ValueError(f"{folder}: {method} checkpoints need the native CPU kernels, which "
                         f"could not be built or loaded: {missing}")
    with ExitStack() as stack:
        modules, shapes = read_int4_modules(open_safetensors(folder, stack), int4, layers)
    # (the log line's "AWQ int4, group 128": serve_as_stored puts the source first)
    label = f"int4, group {int4.group_size}" + (", act-order" if int4.desc_act else "")
    stored = StoredWeights(linears={k: m.weight for k, m in modules.items()},
                           types=dict.fromkeys(modules, (label,)),
                           perms={k: m.perm for k, m in modules.items() if m.perm is not None},
                           source=method.upper())
    return stored, shapes


def open_safetensors(folder: Path, stack: ExitStack) -> dict[str, tuple[Any, str]]:
    """Every tensor of the folder's ``*.safetensors``: name without the ``model.`` prefix ->
    ``(open file, its name)``; the files stay open as long as ``stack``."""
    handles = {}
    for file in sorted(folder.glob("*.safetensors")):
        f = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
        for name in f.keys():  # noqa: SIM118 - a safetensors file, not a dict
            handles[name.removeprefix("model.")] = (f, name)
    return handles


def gguf_as_stored(source: ModelSource, folder: Path, cfg: LlamaConfig | Gemma3Config,
                   device: torch.device, plan: ShardPlan | None, quantization: str | None,
                   index: GGUFIndex | None, embedding: bool, triton: bool = False
                   ) -> StoredWeights:
    """The GGUF's quantized tensors this rank serves as stored (``gguf_weights.py``): its
    decoder layers' linear weights, and with ``embedding`` the embedding and an untied LM
    head; empty: not a GGUF (``index`` None), nothing of a supported type, or not servable
    here (not a
    CPU, tensor parallel, no native kernels, ``--quantization w8a8`` or ``none``), each said
    in the log. The first layer and the embedding are checked against the float conversion.
    ``triton`` (the worker's attention backend is triton): only with ``--quantization gguf``
    (the default there stays dequantize-at-load: the Triton kernel has never run on a GPU);
    any device, no native kernels; only the modules whose every tensor has 4-bit codes (Q4_0,
    Q4_1, Q4_K), never the embedding or LM head (``triton_int4_linear.four_bit_only``); the
    rest is dequantized at load, said in the log.

    Raises:
        ValueError: ``--quantization gguf`` where it cannot be served; a corrupt or truncated
            tensor (named).
    """
    if index is None or not index.stored_tensors() or quantization in ("w8a8", "none"):
        if source.is_gguf and quantization == "w8a8":
            log.warning("%s: the GGUF's quantized tensors are not served as stored: "
                        "--quantization w8a8 re-quantizes them per output channel from their "
                        "dequantized values", source.name)
        return StoredWeights()
    why_not = None
    if triton and quantization != "gguf":
        # NOTE: opt-in until kernels.triton_int4 has run on a GPU (it has only run in Triton's
        # CPU interpreter); AWQ / GPTQ, which have no other path off the CPU, take it anyway
        log.info("%s: dequantized at load on the triton backend; --quantization gguf serves "
                 "its 4-bit layers as stored with the Triton int4 kernel (not yet run on a "
                 "GPU)", source.name)
        return StoredWeights()
    if device.type != "cpu" and not triton:
        why_not = (f"they are served as stored on the CPU or with the triton attention "
                   f"backend only, not {device.type} with another")
    elif plan is not None and plan.pc.tensor_parallel_size > 1:
        why_not = "tensor parallelism slices them (served from the float conversion)"
    elif not triton and (missing := native_kernels_missing()):
        why_not = f"the native CPU kernels could not be built or loaded ({missing})"
    if why_not is not None:
        if quantization == "gguf":
            raise ValueError(f"--quantization gguf: {source.name}'s quantized tensors cannot "
                             f"be served as stored: {why_not}")
        log.warning("%s: the GGUF's quantized tensors are not served as stored: %s",
                    source.name, why_not)
        return StoredWeights()
    layers = plan.layers if plan else range(cfg.num_hidden_layers)
    stored = read_stored_weights(source.path, index, cfg.num_attention_heads,
                                 cfg.num_key_value_heads, layers, embedding and not triton)
    if stored and not _matches_conversion(folder, stored, layers[0] if len(layers) else 0):
        log.warning("%s: the GGUF's quantized tensors are not served as stored: their first "
                    "layer or embedding differs from the float conversion's (an unknown "
                    "layout)", source.name)
        return StoredWeights()
    return _four_bit_on_triton(source.name, stored, quantization) if triton else stored


def _four_bit_on_triton(name: str, stored: StoredWeights, quantization: str | None
                        ) -> StoredWeights:
    """``stored``'s 4-bit modules, the others logged as dequantized at load.

    Raises:
        ValueError: ``--quantization gguf`` and no module with 4-bit codes.
    """
    kept, dropped = four_bit_only(stored)
    if not kept and quantization == "gguf":
        raise ValueError(f"--quantization gguf: {name} has no layer of 4-bit codes (Q4_0, "
                         f"Q4_1, Q4_K), the only ones the Triton backend serves as stored")
    if dropped:
        types = sorted({t for ts in dropped.values() for t in ts})
        log.info("%s: on the Triton backend %d of %d GGUF modules are served as stored (4-bit "
                 "codes); %d with %s parts are dequantized at load, and so are the embedding "
                 "and LM head", name, len(kept.linears), len(stored.linears), len(dropped),
                 "/".join(types))
    return kept


def _matches_conversion(folder: Path, stored: StoredWeights, layer: int) -> bool:
    """Whether local layer 0's stored weights and the first 1024 rows of the stored embedding
    and LM head, dequantized, equal the float32 conversion's (checkpoint layer ``layer``)
    value for value: the names, the row order and the formats' reading are right."""
    parts = {"attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "attn.o_proj": ("self_attn.o_proj",),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "mlp.down_proj": ("mlp.down_proj",)}
    checks = [(w, [f"layers.{layer}.{n}.weight" for n in parts[module]])
              for module in parts if (w := stored.linears.get(f"layers.0.{module}"))]
    for w, name in ((stored.embedding, "embed_tokens.weight"), (stored.lm_head, "lm_head.weight")):
        if w is not None:
            rows = min(1024, w.codes.shape[0])
            checks.append((dataclasses.replace(w, codes=w.codes[:rows], scale=w.scale[:rows],
                                               min=None if w.min is None else w.min[:rows]),
                           [name]))
    with ExitStack() as stack:
        handles = open_safetensors(folder, stack)
        for weight, keys in checks:
            if any(k not in handles for k in keys):
                return False
            rows = weight.codes.shape[0]
            ref = torch.cat([handles[k][0].get_slice(handles[k][1])[:rows].float()
                             for k in keys])
            if not torch.equal(weight.dequantize(), ref):
                return False
    return True


def serve_as_stored(net: nn.Module, stored: StoredWeights, dtype: torch.dtype,
                    fuse_gate: bool, lm_head: bool, triton: bool = False) -> None:
    """Put ``GroupQuantLinear``s (and a ``QuantizedEmbedding``) over ``stored`` in ``net``, in
    place of the modules whose weights were not read (meta). ``fuse_gate``: a SwiGLU gate_up
    layer applies its gate in the kernel's epilogue (not with LoRA, which adds to gate and
    up); ``lm_head``: a tied model's LM head reads the stored embedding (not for pooling).
    With ``PAGEDSERVE_CPU_A8=1`` they take int8 activations where they can (``a8_requested``).
    ``triton``: ``TritonInt4Linear``s instead (4-bit linear layers only: ``serve_on_triton``).
    """
    if triton:
        serve_on_triton(net, stored)
        return
    a8 = a8_requested()
    for name, weight in stored.linears.items():
        parent, _, attr = name.rpartition(".")
        old = cast(nn.Linear, net.get_submodule(name))
        owner = net.get_submodule(parent)
        silu_mul = takes_silu_mul(owner, attr) and fuse_gate
        layer = GroupQuantLinear(weight.codes, weight.scale, weight.min, old.bias,
                                 silu_mul=silu_mul, perm=stored.perms.get(name), a8=a8)
        layer.stored_as = f"{stored.source} " + "+".join(dict.fromkeys(stored.types[name]))
        owner.register_module(attr, layer)
        if silu_mul:
            owner.act = nn.Identity()
    if stored.embedding is not None:
        e = stored.embedding
        table = GroupQuantLinear(e.codes, e.scale, e.min, out_dtype=torch.float32, a8=a8)
        net.embed_tokens = QuantizedEmbedding(table, dtype)
        if lm_head and net.lm_head is None:  # tied
            net.lm_head = table
    if stored.lm_head is not None and lm_head:
        w = stored.lm_head
        net.lm_head = GroupQuantLinear(w.codes, w.scale, w.min, out_dtype=torch.float32, a8=a8)
