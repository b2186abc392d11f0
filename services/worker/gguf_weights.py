"""A GGUF's quantized weights read as stored: integer codes and per-group scales (and mins).
(``StoredWeights`` and ``fuse`` serve AWQ / GPTQ checkpoints too: ``int4_checkpoints``.)

``gguf_blocks.split_blocks`` splits one tensor's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K) into codes, scales and mins that give back the file's dequantized values bit for
bit; this module names the tensors, fuses a decoder layer's parts into our modules and undoes
llama.cpp's Q/K row permutation, so that ``quantized_linear.GroupQuantLinear`` serves them
instead of the float32 copy the GGUF conversion writes (``checkpoint.convert_gguf``, which still
provides the config, the norms and every tensor of another type).

Names: a decoder layer's fused module takes its GGUF tensors in row order (``qkv_proj`` =
``attn_q``, ``attn_k``, ``attn_v``; ``gate_up_proj`` = ``ffn_gate``, ``ffn_up``); a module is
read here only when all of its tensors are of a supported type (a file with an F16 or Q2_K part
keeps the float path for that module). Parts of different types are fused as ``fuse`` says:
4-bit codes where every part has them, int8 codes otherwise, at the smallest group. llama.cpp
permutes the rows of ``attn_q`` / ``attn_k`` of the ``llama`` architecture for its interleaved
RoPE; we undo it as transformers' GGUF loader does (rows only, so codes, scales and mins move
together). The embedding ``token_embd`` and an untied LM head ``output`` are read the same way.
``loader`` checks the first layer and the embedding against the float conversion, value for
value, before serving any of it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.worker.gguf_blocks import SUPPORTED, GroupCodes, split_blocks

# our fused module (after "layers.{j}.") -> its GGUF tensors (after "blk.{i}."), in row order
MODULES = {
    "attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


@dataclass(slots=True)
class StoredWeights:
    """The quantized weights of one rank's part of a GGUF, as stored.

    Attributes:
        linears: ``{"layers.{j}.attn.qkv_proj": GroupCodes, ...}``, ``j`` the local layer.
        types: the GGML type names of each entry of ``linears`` (and ``"embed_tokens"`` /
            ``"lm_head"``), in row order, for the start-up log.
        embedding: ``token_embd`` ``[V, E]``, or None (not read, or not quantized).
        lm_head: an untied ``output`` ``[V, E]``, or None.
        perms: an input permutation of an entry of ``linears`` (a GPTQ act-order layer
            computes ``x[:, perm] @ W^T``: ``int4_checkpoints``); absent: none.
        source: what the weights come from, for the log ("GGUF", "AWQ", "GPTQ").
    """

    linears: dict[str, GroupCodes] = field(default_factory=dict)
    types: dict[str, tuple[str, ...]] = field(default_factory=dict)
    perms: dict[str, torch.Tensor] = field(default_factory=dict)
    source: str = "GGUF"
    embedding: GroupCodes | None = None
    lm_head: GroupCodes | None = None

    def __bool__(self) -> bool:
        return bool(self.linears) or self.embedding is not None or self.lm_head is not None


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lies in a GGUF: its GGML type name, its dims (GGUF order, innermost
    first), and its bytes' offset and length in the file."""

    type: str
    dims: tuple[int, ...]
    offset: int
    n_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    """A GGUF's architecture and tensor table (``gguf_index``)."""

    arch: str
    tensors: dict[str, TensorInfo]

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each GGML type, most first (for the start-up log line)."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type] = counts.get(t.type, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))

    def stored_tensors(self) -> int:
        """How many tensors are of a type served as stored (``gguf_blocks.SUPPORTED``)."""
        return sum(t.type in SUPPORTED for t in self.tensors.values())


def gguf_index(path: str, cache: Path) -> GGUFIndex:
    """The architecture and tensor table of the GGUF at ``path``, read with the gguf package
    once and kept in the JSON file ``cache`` (in the file's conversion cache folder).

    NOTE: ``GGUFReader`` parses every metadata field, the tokenizer's 49k strings included,
    ~4 s for SmolLM2, which a cached start must not pay: later starts read the tensors at the
    offsets kept here, through a memory map of the file.

    Raises:
        ValueError: the file is not a GGUF the gguf package can read, or a tensor's data lies
            past its end (a truncated file), naming the tensor.
    """
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("version") == 2:  # (an older cache lacks the table: read again)
            return GGUFIndex(saved["arch"], {name: TensorInfo(t[0], tuple(t[1]), t[2], t[3])
                                             for name, t in saved["tensors"].items()})
    try:
        reader = _checked_reader()(path)
    except ValueError as e:
        raise ValueError(f"{path}: not a readable GGUF: {e}") from e
    index = GGUFIndex(str(reader.fields["general.architecture"].contents()), {
        t.name: TensorInfo(t.tensor_type.name, tuple(int(d) for d in t.shape),
                           int(t.data_offset), int(t.n_bytes)) for t in reader.tensors})
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"version": 2, "arch": index.arch, "tensors": {
        name: [t.type, list(t.dims), t.offset, t.n_bytes] for name, t in index.tensors.items()}}))
    os.replace(tmp, cache)  # (atomic: a concurrent start reads the whole file or none)
    return index


def _checked_reader() -> type:
    """``gguf.GGUFReader`` that first checks every tensor's data lies within the file.

    NOTE: the reader itself fails on a truncated file with numpy's "cannot reshape array"
    naming no tensor; this reads the tensor table it has parsed (the parts of each tensor-info
    field, as gguf 0.19's ``_build_tensors`` does; pinned in requirements.lock) and names the
    first tensor that ends past the file's end.
    """
    import gguf
    import numpy as np

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for info in fields:
                _, name_data, _, dims, raw_dtype, offset = info.parts
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_dtype[0])]
                end = start_offs + int(offset[0]) + int(np.prod(dims)) * size // block
                if end > len(self.data):
                    raise ValueError(f"GGUF tensor {bytes(name_data).decode()!r} ends at byte "
                                     f"{end}, past the file's {len(self.data)} (a truncated "
                                     f"file?)")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def read_stored_weights(path: str, index: GGUFIndex, num_heads: int, num_kv_heads: int,
                        layers: list[int] | range, embedding: bool) -> StoredWeights:
    """The supported quantized weights of ``layers`` (checkpoint layer ids) of the GGUF at
    ``path`` (its ``gguf_index``), and with ``embedding`` its ``token_embd`` and ``output``
    tensors.

    Raises:
        ValueError: a tensor whose bytes do not fit its type and shape, or lie past the end
            of the file (truncated or corrupt), naming the tensor.
    """
    import numpy as np

    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = index.tensors

    def split(name: str) -> GroupCodes:
        t = tensors[name]
        if len(t.dims) != 2:
            raise ValueError(f"{path}: GGUF tensor {name!r} has dims {t.dims}, not 2")
        k, n = t.dims  # GGUF lists dims innermost first
        raw = data[t.offset:t.offset + t.n_bytes]
        try:
            return split_blocks(raw, t.type, (n, k))
        except ValueError as e:
            raise ValueError(f"{path}: GGUF tensor {name!r}: {e}") from e

    def supported(name: str) -> bool:
        t = tensors.get(name)
        return t is not None and t.type in SUPPORTED

    out = StoredWeights()
    for j, i in enumerate(layers):
        for ours, parts in MODULES.items():
            names = [f"blk.{i}.{p}.weight" for p in parts]
            if not all(supported(n) for n in names):
                continue
            pieces = []
            for part, name in zip(parts, names, strict=True):
                w = split(name)
                if index.arch == "llama" and part in ("attn_q", "attn_k"):
                    w = _take_rows(w, _unpermute_rows(
                        w.codes.shape[0], num_heads if part == "attn_q" else num_kv_heads))
                pieces.append(w)
            key = f"layers.{j}.{ours}"
            out.linears[key] = fuse(pieces)
            out.types[key] = tuple(tensors[n].type for n in names)
    if embedding:
        for name, attr in (("token_embd.weight", "embedding"), ("output.weight", "lm_head")):
            if supported(name):
                setattr(out, attr, split(name))
                out.types["embed_tokens" if attr == "embedding" else attr] = (
                    tensors[name].type,)
    return out


def fuse(parts: list[GroupCodes]) -> GroupCodes:
    """Stack weights row-wise into one: 4-bit codes where every part has them (and one group
    size), else int8 codes (a 4-bit part's 0..15 as they are) at the smallest group, each
    part's scales and mins repeated to it (a part without mins gets zeros, where another has
    them). The dequantized values stay each part's own.

    Raises:
        ValueError: parts of different K, or groups that do not divide each other.
    """
    if len(parts) == 1:
        return parts[0]
    if len({p.codes.shape[1] for p in parts}) != 1:
        raise ValueError(f"cannot fuse weights of K = {[p.codes.shape[1] for p in parts]}")
    group = min(p.group for p in parts)
    if any(p.group % group for p in parts):
        raise ValueError(f"cannot fuse groups {[p.group for p in parts]}")
    four_bit = all(p.bits == 4 for p in parts) and all(p.group == group for p in parts)
    with_min = any(p.min is not None for p in parts)
    codes, scales, mins = [], [], []
    for p in parts:
        codes.append(p.codes if four_bit else p.codes.to(torch.int8))
        r = p.group // group
        scales.append(p.scale.repeat_interleave(r, dim=1))
        if with_min:
            mins.append(torch.zeros_like(scales[-1]) if p.min is None
                        else p.min.repeat_interleave(r, dim=1))
    return GroupCodes(torch.cat(codes), torch.cat(scales),
                      torch.cat(mins) if with_min else None, group)


def _take_rows(w: GroupCodes, rows: torch.Tensor) -> GroupCodes:
    return GroupCodes(w.codes[rows], w.scale[rows], None if w.min is None else w.min[rows],
                      w.group)


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation (transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``): row ``h*2*D + a*D + b`` of the result
    is GGUF row ``h*2*D + b*2 + a``, ``D = rows / heads / 2``."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)
