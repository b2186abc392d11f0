"""GGUF ``Q8_0`` linear weights read as stored: int8 values and an fp16 scale per 32 weights.

A ``Q8_0`` tensor ``[N, K]`` is ``N * K / 32`` blocks of 34 bytes, each an fp16 scale ``d``
then 32 int8 values ``q`` along K; the weight is ``q * d`` (llama.cpp ``ggml-quants.c``,
``dequantize_row_q8_0``). We keep ``q`` as int8 ``[N, K]`` and ``d`` as float32 ``[N, K/32]``
(exact), and serve them with ``quantized_linear.GroupInt8Linear``, never through the float32
copy the GGUF conversion writes (``loader.convert_gguf``), which still provides the config,
norms, embedding and every other tensor.

Names: a decoder layer's fused module takes its GGUF tensors in row order (``qkv_proj`` =
``attn_q``, ``attn_k``, ``attn_v``; ``gate_up_proj`` = ``ffn_gate``, ``ffn_up``); a module is
read here only when all of its tensors are ``Q8_0`` (a mixed file keeps the float path for the
others). llama.cpp permutes the rows of ``attn_q`` / ``attn_k`` of the ``llama`` architecture
for its interleaved RoPE; we undo it as transformers' GGUF loader does (rows only, so the int8
values and their scales move together). ``loader`` checks the first layer against the float
conversion, value for value, before serving any of it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

GROUP = 32  # weights per Q8_0 block
_BLOCK_BYTES = 2 + GROUP  # fp16 d, then 32 int8

# our fused module (after "layers.{j}.") -> its GGUF tensors (after "blk.{i}."), in row order
MODULES = {
    "attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


@dataclass(frozen=True, slots=True)
class Q8_0Weight:
    """One fused module's weight as stored: ``q [N, K]`` int8, ``scale [N, K/32]`` float32."""

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``, ``q * scale`` per block: the GGUF conversion's values."""
        return self.q.float() * self.scale.repeat_interleave(GROUP, dim=1)


def read_q8_0_linears(path: str, num_heads: int, num_kv_heads: int,
                      layers: list[int] | range) -> dict[str, Q8_0Weight]:
    """The ``Q8_0`` linear weights of ``layers`` (checkpoint layer ids) of the GGUF at ``path``.

    Returns ``{"layers.{j}.attn.qkv_proj": Q8_0Weight, ...}`` with ``j`` the local index of
    layer ``layers[j]``, for each fused module whose tensors are all ``Q8_0``; ``{}`` when none
    is.
    """
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    tensors = {t.name: t for t in reader.tensors}
    out: dict[str, Q8_0Weight] = {}
    for j, i in enumerate(layers):
        for ours, parts in MODULES.items():
            found = [tensors.get(f"blk.{i}.{p}.weight") for p in parts]
            if not all(t is not None and t.tensor_type == gguf.GGMLQuantizationType.Q8_0
                       for t in found):
                continue
            qs, ds = [], []
            for part, tensor in zip(parts, found, strict=True):
                assert tensor is not None  # (checked above)
                q, d = _blocks(tensor.data)
                if arch == "llama" and part in ("attn_q", "attn_k"):
                    rows = _unpermute_rows(q.shape[0],
                                           num_heads if part == "attn_q" else num_kv_heads)
                    q, d = q[rows], d[rows]
                qs.append(q)
                ds.append(d)
            out[f"layers.{j}.{ours}"] = Q8_0Weight(torch.cat(qs), torch.cat(ds))
    return out


def tensor_type_counts(path: str, cache: Path) -> tuple[dict[str, int], int]:
    """How many tensors of each GGML type the GGUF at ``path`` holds, most first (for the
    start-up log line on what the weights are stored as), and how many of its decoder layers'
    tensors (``blk.*``) are ``Q8_0`` (none: no reason to read the file for them).

    NOTE: kept in the JSON file ``cache`` (beside the converted weights) after the first call:
    ``GGUFReader`` parses every metadata field, the tokenizer's 49k strings included, ~4 s for
    SmolLM2, which a cached start must not pay.
    """
    if cache.is_file():
        saved = json.loads(cache.read_text())
        return saved["counts"], saved["q8_0_layer_tensors"]
    import gguf

    counts: dict[str, int] = {}
    q8_0_layer_tensors = 0
    for tensor in gguf.GGUFReader(path).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
        q8_0_layer_tensors += (tensor.name.startswith("blk.")
                               and tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0)
    counts = dict(sorted(counts.items(), key=lambda item: -item[1]))
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"counts": counts, "q8_0_layer_tensors": q8_0_layer_tensors}))
    os.replace(tmp, cache)  # (atomic: a concurrent start reads the whole file or none)
    return counts, q8_0_layer_tensors


def _blocks(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``Q8_0`` tensor's bytes ``[N, K/32 * 34]`` -> ``(q [N, K] int8, d [N, K/32]
    float32)``, copied out of the file's memory map."""
    rows = data.shape[0]
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES)
    d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    q = blocks[:, :, 2:].copy().view(np.int8).reshape(rows, -1)
    return torch.from_numpy(q), torch.from_numpy(d)


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation (transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``): row ``h*2*D + a*D + b`` of the result
    is GGUF row ``h*2*D + b*2 + a``, ``D = rows / heads / 2``."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)
