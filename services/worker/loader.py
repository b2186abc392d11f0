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

Weights are stored in the compute dtype, except (on a CPU; ``quantized_linear.py``):
``--quantization int8|w8a8`` quantizes the decoder's linear layers per output channel at load,
and a GGUF's quantized tensors (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0: the decoder's
linear layers, the embedding and the LM head) are served as stored (``--quantization gguf``,
the default for a ``.gguf``; ``gguf_weights.py``): the file's codes with their per-group scales
and mins, dequantized inside the GEMM, rather than the float32 conversion.
``--quantization none`` serves a GGUF from that conversion in ``--dtype`` (dequantized at
load). A 4-bit AWQ or GPTQ safetensors checkpoint (its ``quantization_config``) has its linear
layers served as stored too (``int4_checkpoints.py``). With the triton attention backend (CUDA,
or a CPU under ``TRITON_INTERPRET=1``) the 4-bit layers (AWQ / GPTQ; GGUF Q4_0 / Q4_1 / Q4_K
under ``--quantization gguf`` only, the kernel not yet run on a GPU) are served as stored by
``triton_int4_linear.TritonInt4Linear`` instead, and a GGUF's other types, embedding and LM
head are dequantized at load. One log line at start says what the
weights are stored as, and a GGUF is only re-quantized when ``--quantization`` asks, with a
warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from services.common.model_files import ModelSource, resolve_model
from services.common.progress import startup_step
from services.worker.as_stored import (
    GGUF_MODES,
    INT4_MODES,
    check_int4,
    gguf_as_stored,
    int4_stored,
    native_kernels_missing,
    serve_as_stored,
)
from services.worker.attention import AttentionBackend, select_backend
from services.worker.checkpoint import (
    Family,
    Model,
    ModelConfig,
    convert_gguf,
    eos_token_ids,
    family_of,
    read_state_dict,
)
from services.worker.gguf_weights import GGUFIndex, StoredWeights, gguf_index
from services.worker.int4_checkpoints import Int4Config, quant_config
from services.worker.lora import LoRAConfig
from services.worker.lora.layers import wrap_lora_layers
from services.worker.packed_linear import (
    PackedLinear,
    native_float32_default,
    pack_model_linears,
)
from services.worker.parallel.distributed import ParallelState
from services.worker.parallel.sharding import ShardPlan, shard_model
from services.worker.pooler_config import PoolerConfig, checkpoint_pooler, resolve_runner
from services.worker.quantized_linear import (
    QUANTIZATIONS,
    GroupQuantLinear,
    Int8Linear,
    QuantizedEmbedding,
    W8A8Linear,
    quantize_model_linears,
)
from services.worker.triton_int4_linear import TritonInt4Linear, triton_note

log = logging.getLogger(__name__)

# The decoder's linear weights (the ends of our names), which --quantization replaces.
_LINEAR_WEIGHTS = (".qkv_proj.weight", ".o_proj.weight", ".gate_up_proj.weight",
                   ".down_proj.weight")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the worker reports about its model.

    Attributes:
        name: display name (folder or GGUF file stem).
        eos_token_ids: end-of-sequence token ids (generation_config.json, else config.json).
        max_model_len: longest sequence the model supports (tokens).
        vocab_size: rows of the logits.
        quantization: how the weights are stored: ``--quantization``'s value (``"int8"``,
            ``"w8a8"``), ``"gguf"`` (a GGUF's quantized tensors as stored), ``"awq"`` /
            ``"gptq"`` (a 4-bit checkpoint's), ``""`` = the compute dtype.
        runner / pooler / matryoshka_dimensions / is_matryoshka: the pooling runner's
            (``services/worker/pooler.py``).
    """

    name: str
    eos_token_ids: list[int]
    max_model_len: int
    vocab_size: int
    quantization: str = ""
    runner: str = "generate"  # --runner resolved: "generate" or "pooling" (no LM head)
    pooler: PoolerConfig | None = None  # pooling: what the checkpoint declares (the default)
    matryoshka_dimensions: tuple[int, ...] = ()  # pooling: config.json's, as vLLM reads them
    is_matryoshka: bool = False  # pooling: shortened embeddings supported


def load_model(model: str | None, dtype: torch.dtype, device: torch.device | str,
               attn_backend: AttentionBackend | None = None,
               parallel: ParallelState | None = None, batch_invariant: bool = False,
               quantization: str | None = None, runner: str = "generate",
               lora: LoRAConfig | None = None) -> tuple[Model, dict, ModelInfo]:
    """Build the model on ``device`` with weights cast to ``dtype``.

    On a CPU the linear layers go to the native row-invariant kernel where needed
    (``_pack_linears``).

    Args:
        model: a transformers folder or ``.gguf`` path; None/"" = the packaged SmolLM2.
        dtype: weight (and activation) dtype.
        device: where the weights go.
        attn_backend: attention kernels; default ``select_backend("auto", device)``.
        parallel: this rank's groups; the model is then this rank's shard
            (``services/worker/parallel/sharding.py``) and only that part of the weights is read.
        quantization: ``--quantization``: None, ``"int8"`` or ``"w8a8"``
            (``services/worker/quantized_linear.py``; the CPU only), ``"gguf"`` (a GGUF's
            quantized tensors as stored; also what None means for a GGUF where it can be
            served so: a CPU worker without tensor parallelism), ``"none"`` (a GGUF
            dequantized at load), ``"awq"`` / ``"gptq"`` (a 4-bit checkpoint of that
            ``quantization_config``, also detected without the flag; served as stored by
            ``int4_checkpoints.py``). With a triton ``attn_backend`` the 4-bit layers (AWQ /
            GPTQ; a GGUF's only under ``"gguf"``) are served by ``TritonInt4Linear`` on any
            device (the GGUF's other types, embedding and LM head dequantized at load).
        runner: ``--runner``: ``"generate"``, ``"pooling"`` (the model without an LM head,
            none read: an embedding checkpoint has none) or ``"auto"`` (``resolve_runner``).
        lora: ``--enable-lora``'s limits: the targetable linear layers are wrapped in
            ``LoRALinear``s (``services/worker/lora/layers.py``) before packing, and the
            gate_up layer's SiLU epilogue is not fused; None = no LoRA.
    Returns:
        ``(model in eval mode, config.json dict, ModelInfo)``.
    Raises:
        FileNotFoundError: no such model, or a folder without ``*.safetensors``.
        ValueError: a model_type not in ``MODEL_TYPES``, a config the family cannot run, a
            size the parallel split does not divide, or a weight missing / of the wrong shape;
            ``batch_invariant`` or ``quantization`` where the native CPU kernels cannot run
            (not a CPU, or they cannot be built), or another
            ``quantization``.
    """
    start = time.perf_counter()
    device = torch.device(device)
    check_quantization(quantization, device)
    source = resolve_model(model)
    with startup_step(f"loading {source.name} on {device}"):
        ckpt = _open_checkpoint(source, quantization, runner)
        backend = attn_backend or select_backend("auto", device)
        triton = backend.name == "triton"  # 4-bit layers on TritonInt4Linear
        net, plan = _build_on_meta(ckpt, backend, parallel)
        stored, skip_shapes = _stored_weights(ckpt, device, plan, quantization, triton)
        _load_weights(net, ckpt, dtype, device, plan, stored, skip_shapes,
                      int8_modes=quantization in QUANTIZATIONS)
        net = _finish_weights(net, ckpt, stored, dtype, device, plan, quantization, lora,
                              batch_invariant, triton)
    gguf_types = ckpt.index.type_counts() if ckpt.index else None
    log.info("weights: %s%s", describe_weights(net, dtype, quantization, gguf_types,
                                               stored.types),
             triton_note(triton and gguf_types is not None and bool(stored)))
    log.info("loaded %s (%d layers, %.1fM params) as %s on %s in %.2f s", ckpt.source.name,
             len(net.layers), _num_weights(net) / 1e6,
             str(dtype).removeprefix("torch."), device, time.perf_counter() - start)
    return net, ckpt.config, _model_info(ckpt, quantization, stored)


@dataclass(frozen=True, slots=True)
class _Checkpoint:
    """What ``load_model`` reads of a model before building it.

    Attributes:
        source: the resolved ``--model``.
        folder: its transformers folder (a GGUF's conversion).
        config: ``config.json`` as a dict.
        index: a GGUF's tensor index (None for a folder).
        int4: a 4-bit AWQ / GPTQ folder's ``quantization_config`` (None otherwise).
        family / cfg: its ``Family`` and our config of it.
        runner: ``--runner`` resolved (``"generate"`` or ``"pooling"``).
    """

    source: ModelSource
    folder: Path
    config: dict
    index: GGUFIndex | None
    int4: Int4Config | None
    family: Family
    cfg: ModelConfig
    runner: str


def _open_checkpoint(source: ModelSource, quantization: str | None, runner: str
                     ) -> _Checkpoint:
    """Read ``source``'s config (converting a GGUF once); ``load_model``'s errors."""
    # (first: a truncated or corrupt GGUF is refused naming the tensor, before the conversion)
    index = (gguf_index(source.path, source.cache_dir("gguf_index.json")) if source.is_gguf
             else None)
    folder = convert_gguf(source) if source.is_gguf else Path(source.path)
    config = json.loads((folder / "config.json").read_text())
    int4 = None if source.is_gguf else quant_config(config)
    check_int4(int4, quantization, folder)
    family = family_of(config, source.path)
    cfg = family.config.from_hf(config)
    runner = resolve_runner(runner, config, folder)
    if runner == "pooling":  # (a tied model builds no LM head, and none is read)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    return _Checkpoint(source, folder, config, index, int4, family, cfg, runner)


def _build_on_meta(ckpt: _Checkpoint, backend: AttentionBackend,
                   parallel: ParallelState | None) -> tuple[Model, ShardPlan | None]:
    """The model without weights (meta tensors), sharded for ``parallel``; and its plan
    (None without parallelism)."""
    cfg = ckpt.cfg
    plan = ShardPlan(cfg, parallel.config) if parallel and parallel.config.world_size > 1 else None
    with torch.device("meta"):
        net = ckpt.family.model(cfg, backend)
        if plan:
            assert parallel is not None  # a plan is made only for a parallel state
            shard_model(net, plan, parallel)
    return net, plan


def _stored_weights(ckpt: _Checkpoint, device: torch.device, plan: ShardPlan | None,
                    quantization: str | None, triton: bool
                    ) -> tuple[StoredWeights, dict[str, tuple[int, int]]]:
    """The weights served as stored (a 4-bit checkpoint's or a GGUF's; ``triton``: 4-bit
    layers for ``TritonInt4Linear``), and the shapes of the 4-bit layers' float weights the
    checkpoint does not hold."""
    if quantization == "gguf" and not ckpt.source.is_gguf:
        raise ValueError(f"--quantization gguf needs a .gguf model, not {ckpt.source.path}")
    layers = plan.layers if plan else range(ckpt.cfg.num_hidden_layers)
    if ckpt.int4 is not None:
        return int4_stored(ckpt.folder, ckpt.int4, device, plan, layers, triton)
    return gguf_as_stored(ckpt.source, ckpt.folder, ckpt.cfg, device, plan, quantization,
                          ckpt.index, embedding=plan is None, triton=triton), {}


def _load_weights(net: Model, ckpt: _Checkpoint, dtype: torch.dtype, device: torch.device,
                  plan: ShardPlan | None, stored: StoredWeights,
                  skip_shapes: dict[str, tuple[int, int]], int8_modes: bool) -> None:
    """Read the weights not served as stored into ``net`` (assigned in place of its meta
    tensors); ValueError where they do not fit the config."""
    skip = set(stored.linears) | {name for name, w in (("embed_tokens", stored.embedding),
                                                       ("lm_head", stored.lm_head)) if w}
    # NOTE: safetensors hands out tensors on the file's memory map, which a float32 model keeps
    # as its weights; one that keeps few of them (int8) copies those few (not the linear
    # weights it quantizes), or the whole map, its pages read by the quantization, would stay
    # resident.
    state = read_state_dict(ckpt.folder, ckpt.cfg, ckpt.family, dtype, device, plan, skip=skip,
                             copy=(lambda name: not name.endswith(_LINEAR_WEIGHTS))
                             if int8_modes else (lambda name: True) if stored else None,
                             skip_shapes=skip_shapes)
    try:
        net.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # missing/unexpected keys or shape mismatch
        raise ValueError(f"{ckpt.folder}: weights do not fit the config: {e}") from e


def _finish_weights(net: Model, ckpt: _Checkpoint, stored: StoredWeights, dtype: torch.dtype,
                    device: torch.device, plan: ShardPlan | None, quantization: str | None,
                    lora: LoRAConfig | None, batch_invariant: bool, triton: bool) -> Model:
    """Turn the loaded ``net`` into the served one, on ``device`` in eval mode: the weights
    served as stored swapped in (``triton``: ``TritonInt4Linear``s), LoRA wrappers,
    ``--quantization``'s int8 layers and the native CPU kernel's packed layers."""
    int8_modes = quantization in QUANTIZATIONS
    # before .to(): their float weights were never read
    serve_as_stored(net, stored, dtype, fuse_gate=lora is None,
                    lm_head=ckpt.runner != "pooling", triton=triton)
    if lora is not None:
        wrap_lora_layers(net, lora.max_loras, lora.max_lora_rank, dtype,
                         fuse=not int8_modes)
    net = net.to(device).eval().requires_grad_(False)  # moves the float32 inv_freq buffer
    if int8_modes:
        assert quantization is not None  # (int8_modes)
        quantize_model_linears(net, quantization, skip=lambda m: isinstance(m, Int8Linear))
    _pack_linears(net, dtype, device, batch_invariant,
                  is_last_stage=((plan is None or plan.pc.is_last_stage)
                                 and ckpt.runner != "pooling"
                                 and not isinstance(net.lm_head, GroupQuantLinear)))
    if int8_modes or stored:
        _return_freed_memory()
    return net


def _model_info(ckpt: _Checkpoint, quantization: str | None, stored: StoredWeights
                ) -> ModelInfo:
    """What the worker reports about the loaded model."""
    config, runner = ckpt.config, ckpt.runner
    return ModelInfo(name=ckpt.source.name, eos_token_ids=eos_token_ids(ckpt.folder, config),
                     max_model_len=ckpt.cfg.max_position_embeddings,
                     vocab_size=ckpt.cfg.vocab_size,
                     quantization=(quantization or "") if quantization in QUANTIZATIONS
                     else stored.source.lower() if stored else "",
                     runner=runner,
                     pooler=checkpoint_pooler(ckpt.folder) if runner == "pooling" else None,
                     matryoshka_dimensions=tuple(config.get("matryoshka_dimensions") or ()),
                     is_matryoshka=bool(config.get("is_matryoshka")
                                        or config.get("matryoshka_dimensions")))


def _num_weights(net: nn.Module) -> int:
    """The model's weights counted as values (a quantized layer's ``N * K``, not its bytes)."""
    quantized = {id(m): m for m in net.modules()
                 if isinstance(m, (Int8Linear, W8A8Linear, TritonInt4Linear))}
    return (sum(p.numel() for p in net.parameters())
            + sum(m.in_features * m.out_features for m in quantized.values()))


def _return_freed_memory() -> None:
    """Hand the memory freed at load back to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    NOTE: quantization frees the float weights it replaces and many temporaries of a few MB;
    glibc keeps such blocks in its heap (its mmap threshold rises as large blocks are freed),
    so without this a worker that quantized SmolLM2 to W8A8 at bf16 held 765 MiB of RSS over
    its imports, with it 553 (``benchmarks/weight_modes.py``).
    """
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def check_quantization(quantization: str | None, device: torch.device) -> None:
    """ValueError, naming ``--quantization``, for a mode we do not have or cannot run here:
    the int8 modes are CPU-only, and ``int8`` needs the native kernels
    (``kernels.cpu_build``); ``gguf`` / ``none`` / ``awq`` / ``gptq`` are checked against the
    model at load."""
    if quantization is None or quantization in (*GGUF_MODES, *INT4_MODES):
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r} is not one of "
                         f"{', '.join((*QUANTIZATIONS, *GGUF_MODES, *INT4_MODES))}")
    if device.type != "cpu":
        raise ValueError(f"--quantization {quantization} is implemented for the CPU only, not "
                         f"{device.type}")
    if missing := native_kernels_missing():
        raise ValueError(f"--quantization {quantization} needs the native CPU kernels, which "
                         f"could not be built or loaded: {missing}")


def describe_weights(net: nn.Module, dtype: torch.dtype, quantization: str | None,
                     gguf_types: dict[str, int] | None,
                     stored_types: dict[str, tuple[str, ...]] | None = None) -> str:
    """One line on what the weights are stored as: the decoder's linear layers (how many are
    quantized, and of which kind), the embedding and LM head, and a GGUF's tensor types
    (``stored_types``: the GGML types of the tensors served as stored, by module)."""
    name = str(dtype).removeprefix("torch.")
    kinds: dict[str, int] = {}
    for layer in cast(nn.ModuleList, net.layers):
        for m in layer.modules():
            kind = (m.describe() if isinstance(m, TritonInt4Linear) else
                    f"{m.stored_as} as stored ("
                    f"{'4-bit' if m.packed.dtype == torch.uint8 else 'int8'}"
                    f" codes, a scale{' and min' if m.weight_min is not None else ''} per "
                    f"{m.in_features // m.weight_scale.shape[1]}"
                    f"{', A8: activations int8 per 32' if m.a8 else ''})"
                    if isinstance(m, GroupQuantLinear) else
                    "int8 per output channel, weight-only (--quantization int8)"
                    if isinstance(m, Int8Linear) else
                    "int8 per output channel, activations int8 per token (--quantization w8a8)"
                    if isinstance(m, W8A8Linear) else
                    name if isinstance(m, (nn.Linear, PackedLinear)) else None)
            if kind:
                kinds[kind] = kinds.get(kind, 0) + 1
    total = sum(kinds.values())
    linear = ", ".join(f"{n} of {total} {k}" for k, n in kinds.items()) or "none"
    size = sum(t.numel() * t.element_size() for t in (*net.parameters(), *net.buffers()))
    stored_types = stored_types or {}
    ends = []
    for part in ("embed_tokens", "lm_head"):
        module = getattr(net, part, None)
        if isinstance(module, QuantizedEmbedding) or (
                isinstance(module, GroupQuantLinear) and part == "lm_head"):
            tied = part == "lm_head" and "lm_head" not in stored_types
            types = stored_types.get("embed_tokens" if tied else part, ("?",))
            label = ("LM head (tied)" if tied else "embedding" if part == "embed_tokens"
                     else "LM head")
            ends.append(f"{label} GGUF {types[0]} as stored")
    ends_text = "; ".join(ends) if ends else f"embedding and LM head {name}"
    text = (f"decoder linear layers: {linear}; {ends_text}; "
            f"{size / 2**20:.1f} MiB of weights")
    if gguf_types:
        text += " (GGUF tensors: " + ", ".join(f"{t} x{n}" for t, n in gguf_types.items()) + ")"
        requantized = [t for t in gguf_types if t not in ("F32", "F16", "BF16", "Q8_0")]
        if quantization in QUANTIZATIONS and requantized:
            log.warning("--quantization %s: the GGUF's %s weights, dequantized by the "
                        "conversion, are quantized again to int8 per output channel",
                        quantization, "/".join(requantized))
    return text


def _pack_linears(net: Model, dtype: torch.dtype, device: torch.device, batch_invariant: bool,
                  is_last_stage: bool) -> None:
    """Put ``PackedLinear``s where the native row-invariant kernel is needed
    (``services/worker/packed_linear.py``): on a CPU, every linear layer and the LM head
    (float32 logits; ``is_last_stage``) of a 16-bit model, and of a float32 model with
    ``batch_invariant`` or where the kernels' AVX2 step runs (``native_float32_default``). A
    float32 model elsewhere keeps ATen's (MKL: faster there at float32; row-variant in the last
    bits).

    Raises:
        ValueError: ``batch_invariant`` off a CPU or without the native library.
    """
    if device.type != "cpu":
        if batch_invariant:
            raise ValueError(f"--batch-invariant is implemented for the CPU only, not "
                             f"{device.type}")
        return
    if not (batch_invariant or dtype != torch.float32 or native_float32_default()):
        return
    try:
        pack_model_linears(net, lm_head=is_last_stage, decoder=True)
    except Exception as e:  # the native library cannot be built or loaded here
        if batch_invariant:
            raise ValueError(f"--batch-invariant needs the native CPU kernels, which could not "
                             f"be built or loaded: {e}") from e
        log.warning("native CPU kernels unavailable (%s): the linear layers run on ATen and "
                    "the logits are rounded to %s", e, str(dtype).removeprefix("torch."))
