"""Attention backend choice: which paged-attention kernels the model calls, and their metadata.

The model only calls ``backend.write_kv`` and ``backend.attend``; the model runner builds one
``AttentionMetadata`` per step and every layer reuses it. Two backends share one contract
(``kernels/__init__.py`` draws the index arithmetic):

- ``"torch"``:  ``kernels.torch_attention`` (batched torch; the CPU path),
- ``"triton"``: ``kernels.triton_attention`` (one Triton kernel; the CUDA path).

``"auto"`` picks triton on CUDA and torch on CPU. Kernel modules are imported lazily, on first
use, so choosing a backend never imports the other one's dependencies.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable

import torch


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
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int


class AttentionBackend:
    """Paged attention through one kernel module (``kernels.<module>``), loaded on first use.

    Args:
        name: ``"torch"`` or ``"triton"``.
    """

    _MODULES = {"torch": "kernels.torch_attention", "triton": "kernels.triton_attention"}

    def __init__(self, name: str) -> None:
        if name not in self._MODULES:
            raise ValueError(f"unknown attention backend {name!r}; "
                             f"choose from {sorted(self._MODULES)}")
        self.name = name
        self._reshape_and_cache: Callable[..., None] | None = None
        self._paged_attention: Callable[..., torch.Tensor] | None = None

    def _load(self) -> None:
        module = importlib.import_module(self._MODULES[self.name])
        self._paged_attention = getattr(module, f"{self.name}_paged_attention")
        self._reshape_and_cache = getattr(module, f"{self.name}_reshape_and_cache")

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store this step's ``key``/``value`` ``[T, K, D]`` into the caches
        ``[num_blocks, block_size, K, D]`` at ``meta.slot_mapping`` (in place)."""
        if self._reshape_and_cache is None:
            self._load()
        self._reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of ``query [T, H, D]`` over each sequence's cached K/V (which must
        already hold this step's tokens). Returns ``[T, H, D]`` in ``query.dtype``."""
        if self._paged_attention is None:
            self._load()
        return self._paged_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.max_query_len, meta.max_seq_len, scale)

    def __repr__(self) -> str:
        return f"AttentionBackend({self.name!r})"


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Pick the backend for ``device``: ``"auto"`` = triton on CUDA, torch elsewhere.

    Raises:
        ValueError: unknown name, or ``"triton"`` on a CPU without ``TRITON_INTERPRET=1``.
    """
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton attention backend needs a CUDA device "
                         "(or TRITON_INTERPRET=1 for slow CPU testing); use 'torch' on CPU")
    return AttentionBackend(name)
