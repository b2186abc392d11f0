"""Attention backend choice: which paged-attention kernels the model calls, and their metadata.

The model only calls ``backend.write_kv`` and ``backend.attend``, plus the per-layer ops
``rms_norm``, ``fused_add_rms_norm`` and ``rotary_embedding`` (with the step's
``rotary_table``, made once per step by the model); the model runner builds one
``AttentionMetadata`` per step and KV cache group, and every layer of the group reuses it. Three
backends share one contract (``kernels/__init__.py`` draws the index arithmetic):

- ``"torch"``:  ``kernels.torch_attention`` + ``kernels.torch_ops`` (batched torch; the readable
  reference path, the model's reference math, and the CPU fallback),
- ``"triton"``: ``kernels.triton_attention`` + ``kernels.triton_norm_rope`` (Triton kernels; the
  CUDA path),
- ``"cpu"``:    ``kernels.cpu_attention`` (native C++ paged attention and KV write, built once
  into the cache by ``kernels.cpu_build``) + ``kernels.torch_ops`` (norms and RoPE); CPU only.

``"auto"`` picks triton on CUDA and cpu on CPU (torch when the native library cannot load).
Each backend's kernels are named in one ``KernelTable`` (``KERNEL_TABLES``), whose modules are
imported on first use, so choosing a backend never imports the other one's dependencies.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kernels.kv_quant import KV_CACHE_DTYPES

log = logging.getLogger(__name__)

# Triton's float8e4nv conversions are native from compute capability 8.9 (Ada, Hopper) on.
FP8_E4M3_MIN_CUDA_CAPABILITY = (8, 9)


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs of the attention kernels, built once per step by the model runner.

    For sequence ``i`` of the step (sequences in scheduling order)::

        |<-- context_len_i -->|<-- query_len_i -->|
        |<-------------- seq_lens[i] ------------>|
        query_len_i = query_start_loc[i + 1] - query_start_loc[i]

    Attributes:
        slot_mapping: ``[T]`` int64, KV-cache slot of each query token,
            ``block_table[pos // block_size] * block_size + pos % block_size`` (< 0 = skip).
        block_tables: ``[B, max_blocks]`` int32, physical block ids per sequence, zero padded.
        seq_lens: ``[B]`` int32, tokens of context INCLUDING this step's query tokens.
        query_start_loc: ``[B + 1]`` int32, offsets of each sequence's query rows in the flat batch.
        max_query_len: largest ``query_len_i`` (tokens).
        max_seq_len: largest ``seq_lens[i]`` (tokens).
        plan: the backend's per-step precomputation, made by the first layer's ``attend`` of
            each sliding window and reused by the others (torch: a dict ``sliding_window ->
            kernels.torch_attention.AttentionPlan``; None until then, and always None for triton
            and cpu, whose kernels plan per call).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    plan: Any = None


@dataclass(slots=True)
class RotaryTable:
    """One step's RoPE inputs for one frequency set (``AttentionBackend.rotary_table``).

    Attributes:
        positions: ``[T]`` int64, each token's position in its sequence.
        inv_freq: ``[D/2]`` float32 inverse frequencies.
        cos_sin: ``cos(theta)``, ``sin(theta)`` ``[T, 1, D]`` float32
            (``kernels.torch_ops.torch_rope_cos_sin``), or None where the backend's kernel
            computes them (triton).
    """

    positions: torch.Tensor
    inv_freq: torch.Tensor
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True, slots=True)
class KernelTable:
    """One backend's kernel functions (``kernels/``), named op by op.

    Attributes:
        reshape_and_cache / paged_attention: the KV write and the paged attention.
        rms_norm / fused_add_rms_norm / rotary_embedding: the per-layer ops.
        rope_cos_sin: the step's float32 cos/sin table maker, or None where
            ``rotary_embedding`` computes them itself (triton).
    """

    reshape_and_cache: Callable[..., Any]
    paged_attention: Callable[..., Any]
    rms_norm: Callable[..., Any]
    fused_add_rms_norm: Callable[..., Any]
    rotary_embedding: Callable[..., Any]
    rope_cos_sin: Callable[..., Any] | None


def _torch_kernels() -> KernelTable:
    from kernels import torch_attention as attn
    from kernels import torch_ops as ops
    return KernelTable(attn.torch_reshape_and_cache, attn.torch_paged_attention,
                       ops.torch_rms_norm, ops.torch_fused_add_rms_norm,
                       ops.torch_rotary_embedding, ops.torch_rope_cos_sin)


def _triton_kernels() -> KernelTable:
    from kernels import triton_attention as attn
    from kernels import triton_norm_rope as ops
    return KernelTable(attn.triton_reshape_and_cache, attn.triton_paged_attention,
                       ops.triton_rms_norm, ops.triton_fused_add_rms_norm,
                       ops.triton_rotary_embedding, None)  # (its rope computes cos/sin)


def _cpu_kernels() -> KernelTable:
    from kernels.cpu_attention import (
        cpu_paged_attention,
        cpu_reshape_and_cache,
        cpu_rotary_embedding,
    )
    # (the norms and the cos/sin table are torch's)
    return replace(_torch_kernels(), reshape_and_cache=cpu_reshape_and_cache,
                   paged_attention=cpu_paged_attention,
                   rotary_embedding=cpu_rotary_embedding)


# backend name -> its kernel table's maker; each imports its kernel modules when called, so
# choosing a backend never imports another one's dependencies (triton's on a CPU)
KERNEL_TABLES: dict[str, Callable[[], KernelTable]] = {
    "torch": _torch_kernels, "triton": _triton_kernels, "cpu": _cpu_kernels}


class AttentionBackend:
    """Paged attention, norms and RoPE through one backend's ``KernelTable``, made on first use.

    Args:
        name: ``"torch"``, ``"triton"`` or ``"cpu"`` (a key of ``KERNEL_TABLES``).
        kv_layout: how the KV caches order a block's values (``kernels/kv_layout.py``):
            ``"rows"`` (every backend) or ``"pairs"`` (the cpu backend's bf16 layout; the model
            runner picks it with ``choose_kv_layout``). Read at every call.

    Raises:
        ValueError: an unknown name, or ``"pairs"`` on a backend other than cpu.
    """

    def __init__(self, name: str, kv_layout: str = "rows") -> None:
        if name not in KERNEL_TABLES:
            raise ValueError(f"unknown attention backend {name!r}; "
                             f"choose from {sorted(KERNEL_TABLES)}")
        if kv_layout != "rows" and name != "cpu":
            raise ValueError(f"kv_layout {kv_layout!r} needs the cpu attention backend, not "
                             f"{name!r}")
        self.name = name
        self.kv_layout = kv_layout
        self._table: KernelTable | None = None

    def load(self) -> None:
        """Import the kernel modules and load the native library now (the first op call does
        it otherwise): before ``torch.compile`` traces the model, so neither the import
        machinery nor the library loader's lock is traced.

        Raises:
            RuntimeError: the native library (``"cpu"``) cannot be built or loaded.
        """
        _ = self.kernels
        if self.name == "cpu":
            from kernels import cpu_build

            cpu_build.load()

    @property
    def kernels(self) -> KernelTable:
        """This backend's kernel functions (their modules imported on first use)."""
        if self._table is None:
            self._table = KERNEL_TABLES[self.name]()
        return self._table

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store this step's ``key``/``value`` ``[T, K, D]`` into the caches
        ``[num_blocks, block_size, K, D]`` at ``meta.slot_mapping`` (in place)."""
        self.kernels.reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping,
                                       **self._layout())

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, sliding_window: int = 0) -> torch.Tensor:
        """Causal attention of ``query [T, H, D]`` over each sequence's cached K/V (which must
        already hold this step's tokens). Returns ``[T, H, D]`` in ``query.dtype``.

        ``sliding_window``: 0 = full causal attention; ``W > 0`` = the query at position ``p``
        attends keys ``max(0, p - W + 1) .. p`` only, and block-table entries of blocks wholly
        before every query's window are not read (``kernels/__init__.py``)."""
        args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                meta.max_seq_len)
        if self.name != "torch":
            return self.kernels.paged_attention(query, k_cache, v_cache, *args, scale,
                                                sliding_window=sliding_window,
                                                **self._layout())
        # the step's first layer with this window plans it; every layer with that window reuses
        # the plan (layers of different windows may share one metadata object)
        if meta.plan is None:
            meta.plan = {}
        plan = meta.plan.get(sliding_window)
        if plan is None:
            from kernels.torch_attention import plan_paged_attention
            plan = meta.plan[sliding_window] = plan_paged_attention(
                *args, k_cache.shape[1], sliding_window)
        return self.kernels.paged_attention(query, k_cache, v_cache, *args, scale, plan=plan,
                                            sliding_window=sliding_window)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of ``x [T, E]`` (float32 inside), a new ``[T, E]`` tensor."""
        return self.kernels.rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = x + residual`` then its RMSNorm: new ``(normed, residual)``, ``[T, E]``."""
        return self.kernels.fused_add_rms_norm(x, residual, weight, eps)

    def rotary_table(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> RotaryTable:
        """What ``rotary_embedding`` needs at ``positions [T]`` with float32 ``inv_freq [D/2]``:
        made once per step and frequency set by the model and used by every layer (torch /
        cpu: the float32 cos and sin tables, so a compiled forward computes them once, not in
        every layer; triton computes them in its kernel)."""
        op = self.kernels.rope_cos_sin
        return RotaryTable(positions, inv_freq,
                           None if op is None else op(positions, inv_freq))

    def rotary_embedding(self, rope: RotaryTable, query: torch.Tensor,
                         key: torch.Tensor) -> None:
        """Rotate-half RoPE of ``query [T, H, D]`` and ``key [T, K, D]``, in place, at the
        positions and frequencies of ``rope`` (``rotary_table``)."""
        if rope.cos_sin is None:
            self.kernels.rotary_embedding(rope.positions, query, key, rope.inv_freq)
        else:
            self.kernels.rotary_embedding(rope.positions, query, key, rope.inv_freq,
                                          cos_sin=rope.cos_sin)

    def _layout(self) -> dict[str, str]:
        """The cache ops' layout keyword: only the cpu backend's ops take one."""
        return {"kv_layout": self.kv_layout} if self.name == "cpu" else {}

    def __repr__(self) -> str:
        return f"AttentionBackend({self.name!r}, kv_layout={self.kv_layout!r})"


def choose_kv_layout(backend: str, kv_cache_dtype: torch.dtype, block_size: int,
                     head_dims: list[int], compute_dtype: torch.dtype | None = None) -> str:
    """The KV cache layout for a model (and its draft model: ``head_dims`` has each one's).

    ``"pairs"`` (``kernels/kv_layout.py``) where the native CPU kernels' products read it in
    place: the cpu backend and an int8 cache (``block_size`` and every head_dim multiples of
    16: the integer products, on every CPU step), or on a CPU step with the bf16 products
    (``amx`` or ``avx512_bf16``) a bfloat16 cache (an even ``block_size``, every head_dim a
    multiple of 32) or a float8 one under bfloat16 ``compute_dtype`` (``block_size`` a
    multiple of 16, every head_dim of 32); ``"rows"`` otherwise. ``CPU_KV_LAYOUT`` =
    ``"rows"`` keeps rows everywhere, ``"pairs"`` takes pairs wherever the cache fits them,
    whatever the CPU (the float32 body unpacks bf16 pairs: tests).
    """
    from kernels.kv_layout import pairs_fit
    from kernels.kv_quant import is_quantized
    int8 = kv_cache_dtype == torch.int8
    float8 = is_quantized(kv_cache_dtype) and not int8
    if (backend != "cpu" or CPU_KV_LAYOUT == "rows"
            or (float8 and compute_dtype != torch.bfloat16)
            or not all(pairs_fit(kv_cache_dtype, block_size, d) and (int8 or d % 32 == 0)
                       for d in head_dims)):
        return "rows"
    if int8 or (CPU_KV_LAYOUT == "pairs" and not float8):
        return "pairs"
    from kernels.cpu_attention import cpu_isa
    return "pairs" if cpu_isa() in ("amx", "avx512_bf16") else "rows"


# "auto" = choose_kv_layout's rule; "rows" / "pairs" force one where it fits
# (benchmarks/ab_engine.py varies it: --knob services.worker.attention.CPU_KV_LAYOUT
# --values rows auto).
CPU_KV_LAYOUT = "auto"


# What "auto" means on a CPU (benchmarks/ab_engine.py varies it): the native kernels, 2.2x the
# torch backend's engine throughput at float32 here (docs/benchmarks.md), when their library
# loads; the torch backend otherwise.
CPU_AUTO_BACKEND = "cpu"


def _native_cpu_kernels_load() -> bool:
    """Whether ``torch.ops.pagedserve`` loads (building it first if the cache lacks it)."""
    from kernels import cpu_build
    try:
        cpu_build.load()
        return True
    except Exception as e:  # noqa: BLE001 - any build/load failure means "use torch"
        log.warning("native CPU kernels unavailable (%s); using the torch attention backend", e)
        return False


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, backend: str,
                           cuda_capability: tuple[int, int] | None = None) -> torch.dtype:
    """The KV cache tensors' dtype for ``--kv-cache-dtype name`` (vLLM's values): ``"auto"`` =
    ``model_dtype``; ``"int8"``, ``"fp8"`` (= ``"fp8_e4m3"``) and ``"fp8_e5m2"`` =
    ``torch.int8`` / ``float8_e4m3fn`` / ``float8_e5m2`` (``kernels/kv_quant.py``). Every
    backend (``backend``: the resolved name) reads and writes them.

    Raises:
        ValueError: an unknown name, or an e4m3 cache on the triton backend of a GPU whose
            ``cuda_capability`` (major, minor) is below 8.9 (no native float8e4nv).
    """
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    dtype = KV_CACHE_DTYPES[name]
    if dtype is None:
        return model_dtype
    if (dtype == torch.float8_e4m3fn and backend == "triton" and cuda_capability is not None
            and cuda_capability < FP8_E4M3_MIN_CUDA_CAPABILITY):
        need = ".".join(map(str, FP8_E4M3_MIN_CUDA_CAPABILITY))
        raise ValueError(f"--kv-cache-dtype {name}: the triton attention backend reads "
                         f"float8_e4m3 on GPUs of compute capability >= {need} only, this one "
                         f"is {cuda_capability[0]}.{cuda_capability[1]}; use "
                         f"--kv-cache-dtype fp8_e5m2 or int8")
    return dtype


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Pick the backend for ``device``: ``"auto"`` = triton on CUDA, ``CPU_AUTO_BACKEND``
    elsewhere; when that is ``"cpu"`` and the native library cannot be built or loaded (no
    compiler in the image, say), ``"auto"`` logs why and falls back to ``"torch"``.

    Raises:
        ValueError: unknown name, ``"triton"`` on a CPU without ``TRITON_INTERPRET=1``, or
            ``"cpu"`` on a non-CPU device.
    """
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else CPU_AUTO_BACKEND
        if name == "cpu" and not _native_cpu_kernels_load():
            name = "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton attention backend needs a CUDA device "
                         "(or TRITON_INTERPRET=1 for slow CPU testing); use 'torch' on CPU")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on the CPU only, not {device}")
    return AttentionBackend(name)
