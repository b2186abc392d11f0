"""Quantized weights for the linear layers (``--quantization``, GGUF as stored), on the CPU.

``quantize_model_linears`` swaps every linear layer of the decoder layers (q/k/v, o, gate/up,
down; the tensor-parallel row-parallel ones with their all-reduce) for one of:

- ``Int8Linear`` (``--quantization int8``, weight-only): int8 weights, a float32 scale per
  output channel (symmetric, ``kernels.int8_linear.quantize_symmetric``); activations stay in
  the compute dtype and the native kernel (``kernels.cpu_linear``) dequantizes each block of
  weights inside the GEMM (to bf16 for a bf16 model, on AMX / AVX512-BF16; to float32
  otherwise). A layer computes what the same kernel computes for the dequantized weights
  ``q * s``, from half (bf16) or a quarter (float32) of the bytes, row-invariant as the
  unquantized layers are.
- ``GroupQuantLinear``: the same kernel with a scale (and optionally a min) per group of
  weights along K, on int8 codes or 4-bit ones (a quarter of bf16's bytes): a GGUF tensor as
  stored (``gguf_weights.py``: Q4_0, Q4_1, Q4_K as 4-bit codes; Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
  as int8 codes; AWQ / GPTQ 4-bit layers: ``int4_checkpoints.py``), never re-quantized. The
  kernel sums ``x . q`` per group and adds ``s`` times it plus ``m`` times the group's sum of
  x (llama.cpp's form), so every weight is the file's exact value ``q * s + m`` (the float
  conversion's float32 value), not rounded to a bf16 model's dtype: at float32 the float
  conversion's logits to float32 rounding, at bf16 nearer float32 than the bf16 conversion
  (on AMX the tiles read each block converted to bf16: the conversion's bf16 weights).
- ``W8A8Linear`` (``--quantization w8a8``): int8 weights per output channel and int8
  activations per token, quantized dynamically each step in the native op
  (``kernels/csrc/cpu_int8_linear.cpp``: vpdpbusd on AVX512-VNNI / AVX-VNNI, vpmaddubsw on
  AVX2), exact int32 sums and a float32 epilogue (``kernels.int8_linear.w8a8_linear``'s
  result, which it replaces: torch._int_mm was slower at every shape measured).

Rows: the native kernel is row-invariant, and W8A8's int32 sums are exact and its scales per
token, so an int8 layer's result for a row never depends on the other rows of the step (as the
unquantized layers', ``packed_linear.py``; ``--batch-invariant`` holds). Under tensor
parallelism each rank quantizes its own shard: a row-parallel layer's weight scales (and
W8A8's activation scales) are taken over the rank's slice of K, so the result is not the
single-rank one (close: int8 gave the same greedy tokens on the tiny test model at TP=2, W8A8
not).

NOTE: with ``--quantization int8|w8a8`` the embedding and the LM head stay in the compute
dtype (the LM head gives the logits that sampling and logprobs read); a GGUF served as stored
keeps a quantized embedding and LM head as the file stores them (``QuantizedEmbedding`` and a
float32-output ``GroupQuantLinear`` over the same codes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from kernels.cpu_linear import (
    A8_ENV,
    gate_up_blocks,
    pack_a8_weight,
    pack_group_scale,
    pack_linear_weight,
    pack_uint4_weight,
    pack_w8a8_weight,
)
from kernels.int8_linear import quantize_symmetric
from services.worker.packed_linear import takes_silu_mul

QUANTIZATIONS = ("int8", "w8a8")
Reduce = Callable[[torch.Tensor], torch.Tensor]


def a8_requested() -> bool:
    """``PAGEDSERVE_CPU_A8=1``: the layers served as stored whose groups are multiples of 32
    (GGUF Q4_0 / Q4_1 / Q4_K, Q8_0, Q5_0 / Q5_1 / Q5_K, AWQ, GPTQ; the embedding's LM head
    included; not Q6_K's groups of 16) take int8 activations, quantized per group of 32 in
    the op (``kernels.cpu_linear.cpu_a8_linear``: W4A8 and W8A8 on int8 products, llama.cpp's
    Q8 activations; vLLM's ``VLLM_CPU_INT4_W4A8`` idea). Faster; no longer the float
    conversion's result, so off by default."""
    return os.environ.get(A8_ENV, "") == "1"


class Int8Linear(nn.Module):
    """``y = reduce(x dequantize(q)^T) + b`` on the native kernel, weights int8.

    Args:
        q: ``[N, K]`` int8 (packed here; not kept).
        scale: ``[N]`` float32, ``W = q * scale[:, None]``.
        bias: ``[N]`` or None; added in float32 (after ``reduce``).
        reduce: the tensor-parallel all-reduce of a row-parallel layer (on the float32
            product), or None.
        silu_mul: a SwiGLU gate_up layer (``q`` gate rows then up rows) that returns
            ``silu(gate) * up``, ``[..., N / 2]`` (``PackedLinear``'s ``silu_mul``).

    ``forward``: ``x [..., K]`` float32 / bf16 / fp16 -> ``[..., N]`` in ``x``'s dtype.
    """

    packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_min: torch.Tensor | None
    perm: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 reduce: Reduce | None = None, silu_mul: bool = False) -> None:
        super().__init__()
        self.out_dtype: torch.dtype | None = None
        self._setup(q, scale, None, bias, reduce, silu_mul)

    def _setup(self, q: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor | None,
               bias: torch.Tensor | None, reduce: Reduce | None, silu_mul: bool,
               perm: torch.Tensor | None = None, a8: bool = False) -> None:
        self.out_features, self.in_features = q.shape
        self.reduce, self.silu_mul = reduce, silu_mul
        if silu_mul:  # rows (and their scales and mins) in blocks of 16 gate and 16 up
            q, scale = gate_up_blocks(q.detach()), gate_up_blocks(scale.detach())
            min_ = None if min_ is None else gate_up_blocks(min_.detach())
            bias = None if bias is None else gate_up_blocks(bias.detach())
        # int8 activations (cpu_a8_linear): groups of a multiple of 32, codes in [-127, 15|127]
        self.a8 = (a8 and self.in_features % 32 == 0 and scale.dim() == 2
                   and (self.in_features // scale.shape[1]) % 32 == 0
                   and (q.dtype == torch.uint8 or int(q.min()) >= -127))
        packed = (pack_a8_weight(q.detach()) if self.a8
                  else pack_uint4_weight(q.detach()) if q.dtype == torch.uint8
                  else pack_linear_weight(q.detach()))
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("weight_scale", self._kernel_scale(scale), persistent=False)
        self.register_buffer("weight_min", None if min_ is None else self._kernel_scale(min_),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self.register_buffer("perm", None if perm is None else perm.long(), persistent=False)

    @staticmethod
    def _kernel_scale(scale: torch.Tensor) -> torch.Tensor:
        return scale.detach().float().contiguous()

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype | None, silu_mul: bool) -> torch.Tensor:
        # NOTE: the ops themselves, as PackedLinear (no lazy library load for torch.compile)
        if self.a8:
            return torch.ops.pagedserve.a8_linear(x, self.packed, self.out_features,
                                                  self.weight_scale, self.weight_min, bias,
                                                  out_dtype, silu_mul)
        return torch.ops.pagedserve.linear(x, self.packed, self.out_features, bias, out_dtype,
                                           self.weight_scale, silu_mul, self.weight_min)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.perm is not None:  # (a GPTQ act-order layer's input order)
            flat = flat.index_select(1, self.perm)
        if self.silu_mul:
            y = self._product(flat, self.bias, None, True)
            return y.reshape(*lead, self.out_features // 2)
        if self.reduce is None:
            y = self._product(flat, self.bias, self.out_dtype, False)
        else:  # partial sums reduced in float32, the bias added once, rounded once
            y = self.reduce(self._product(flat, None, torch.float32, False))
            if self.bias is not None:
                y = y + self.bias
            y = y.to(self.out_dtype or x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class GroupQuantLinear(Int8Linear):
    """``Int8Linear`` with a scale and an optional min per group of ``G`` consecutive weights
    of a row (GGUF: G = 32, Q6_K 16): ``W[n, k] = q[n, k] * scale[n, k // G] + min[n, k // G]``.

    Args:
        q: ``[N, K]`` codes: int8, or uint8 holding 4-bit codes 0..15 (packed two a byte by
            ``kernels.cpu_linear.pack_uint4_weight``; K even).
        scale, min_: ``[N, K/G]`` float32 (``min_`` None: 0); G even.
        bias, reduce, silu_mul: as ``Int8Linear``.
        out_dtype: the output dtype (None: ``x``'s); a float32-output LM head.
        perm: int64 ``[K]``, the layer computes ``x[..., perm] W^T`` (a GPTQ act-order
            layer, its K sorted by group: ``int4_checkpoints``); None: ``x W^T``.
        a8: with groups of a multiple of 32, take int8 activations
            (``kernels.cpu_linear.cpu_a8_linear``: quantized per group of 32 in the op, int8
            products; ``a8_requested``); other layers ignore it.

    ``forward``: ``x [..., K]`` float32 / bf16 / fp16 -> ``[..., N]``.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, reduce: Reduce | None = None,
                 silu_mul: bool = False, out_dtype: torch.dtype | None = None,
                 perm: torch.Tensor | None = None, a8: bool = False) -> None:
        nn.Module.__init__(self)
        self.out_dtype = out_dtype
        self.stored_as = ""  # what it holds ("GGUF Q4_K", "AWQ int4, group 128"), for the log
        self._setup(q, scale, min_, bias, reduce, silu_mul, perm, a8)

    @staticmethod
    def _kernel_scale(scale: torch.Tensor) -> torch.Tensor:
        return pack_group_scale(scale.detach().float())


class W8A8Linear(nn.Module):
    """W8A8 on the native kernel (``kernels.cpu_linear.cpu_w8a8_linear``): int8 weights per
    output channel, activations quantized per token in the op each call, exact int32 sums
    (vpdpbusd on VNNI), the scales in a float32 epilogue: ``kernels.int8_linear.w8a8_linear``'s
    result bit for bit, 1.1-9x faster than it (torch._int_mm) at every shape measured
    (docs/benchmarks.md).

    Args:
        q: ``[N, K]`` int8 in [-127, 127] (packed here; not kept); scale: ``[N]`` float32.
        bias, reduce, silu_mul: as ``Int8Linear``.

    ``forward``: ``x [..., K]`` float32 / bf16 / fp16 -> ``[..., N]`` in ``x``'s dtype.
    """

    packed: torch.Tensor
    compensation: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 reduce: Reduce | None = None, silu_mul: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.reduce, self.silu_mul = reduce, silu_mul
        if silu_mul:  # rows (and their scales) in blocks of 16 gate and 16 up
            q, scale = gate_up_blocks(q.detach()), gate_up_blocks(scale.detach())
            bias = None if bias is None else gate_up_blocks(bias.detach())
        packed, compensation = pack_w8a8_weight(q.detach())
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("compensation", compensation, persistent=False)
        self.register_buffer("weight_scale", scale.detach().float().contiguous(),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the op itself, as Int8Linear (no lazy library load for torch.compile to trace)
        w8a8 = torch.ops.pagedserve.w8a8_linear
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.reduce is None:
            y = w8a8(flat, self.packed, self.compensation, self.out_features, self.weight_scale,
                     self.bias, None, self.silu_mul)
            return y.reshape(*lead, y.shape[-1])
        # partial sums reduced in float32, the bias added once, rounded once
        y = self.reduce(w8a8(flat, self.packed, self.compensation, self.out_features,
                             self.weight_scale, None, torch.float32, False))
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def quantize_model_linears(model: nn.Module, quantization: str,
                           skip: Callable[[nn.Module], bool] = lambda m: False) -> int:
    """Swap the linear layers of ``model.layers`` for int8 ones, in place; return how many.

    Args:
        model: a loaded decoder (``services/worker/models``) on the CPU, in eval mode.
        quantization: ``"int8"`` (``Int8Linear``) or ``"w8a8"`` (``W8A8Linear``); weights
            quantized per output channel from their current values; a SwiGLU gate_up gets
            the SiLU-and-multiply in its epilogue (``takes_silu_mul``).
        skip: layers to leave as they are (those already int8, e.g. GGUF Q8_0 ones).

    Raises:
        ValueError: another ``quantization``.
        RuntimeError: the native library cannot be built or loaded.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r}: choose one of "
                         f"{', '.join(QUANTIZATIONS)}")
    from services.worker.parallel.sharding import RowParallelLinear

    cls = Int8Linear if quantization == "int8" else W8A8Linear
    swapped = 0
    for layer in cast(nn.ModuleList, model.layers):
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if skip(child) or not (isinstance(child, RowParallelLinear)
                                       or type(child) is nn.Linear):
                    continue
                q, scale = quantize_symmetric(child.weight.detach())
                reduce = child.ps.all_reduce if isinstance(child, RowParallelLinear) else None
                if takes_silu_mul(parent, name):
                    setattr(parent, name, cls(q, scale, child.bias, silu_mul=True))
                    parent.act = nn.Identity()
                else:
                    setattr(parent, name, cls(q, scale, child.bias, reduce=reduce))
                swapped += 1
    return swapped


class QuantizedEmbedding(nn.Module):
    """An embedding table read from a ``GroupQuantLinear``'s packed codes, scales and mins
    (a tied model's LM head, or one built for the table alone): the rows of ``ids`` are
    gathered from the packed layout and dequantized as the kernel dequantizes a weight,
    ``q * s + m`` in float32, then rounded once to ``dtype``: the values of the float
    conversion's table in that dtype. No float copy of the table is kept.

    Args:
        table: ``GroupQuantLinear`` of the ``[V, E]`` table (``out_features = V``).
        dtype: the model dtype of the result.

    ``forward``: ``ids [...]`` int64 -> ``[..., E]`` in ``dtype``.
    """

    def __init__(self, table: GroupQuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        # NOTE: a tied model's LM head is this same module: nn.Module counts shared buffers once
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        packed, scale, mn = self.table.packed, self.table.weight_scale, self.table.weight_min
        lead, ids = ids.shape, ids.reshape(-1)
        block, col = ids // 32, ids % 32
        if packed.dim() == 3:  # 4-bit codes [nb, K/2, 32]: low nibble k = 2j, high 2j + 1
            pairs = packed[block, :, col]  # [T, K/2]
            codes = torch.stack((pairs & 0x0F, pairs >> 4), dim=-1).flatten(1)
        elif packed.dtype == torch.uint8:  # A8 4-bit [nb, K/8, 32, 4]: 8j + i low, + 4 high
            octets = packed[block, :, col]  # [T, K/8, 4]
            codes = torch.cat((octets & 0x0F, octets >> 4), dim=-1).flatten(1)
        else:  # int8 codes [nb, K2, 32, 2] (A8: [nb, K/4, 32, 4]): k in order
            codes = packed[block, :, col].flatten(1)[:, :self.embedding_dim]
        groups = scale.shape[1]
        shape = (ids.shape[0], groups, self.embedding_dim // groups)
        w = codes.float().view(shape) * scale[block, :, col].unsqueeze(-1)
        if mn is not None:
            w = w + mn[block, :, col].unsqueeze(-1)
        return w.view(*lead, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
