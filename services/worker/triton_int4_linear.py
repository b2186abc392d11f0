"""4-bit weights served as stored on the Triton backend (the CUDA path): ``TritonInt4Linear``
runs ``kernels.triton_int4.triton_int4_linear``, the codes dequantized in registers inside the
matmul.

STATUS: written for CUDA and tested only in Triton's CPU interpreter (``TRITON_INTERPRET=1``,
a CPU worker with ``--attention-backend triton``: tests/worker/test_triton_int4_models.py);
never run on a GPU, so neither the CUDA compilation nor its speed has been checked.

What it serves when the worker's attention backend is ``"triton"`` (``loader.load_model``):

- an AWQ / GPTQ checkpoint's 4-bit layers (``int4_checkpoints.py``; a GPTQ act-order layer
  permutes x first, ``x.index_select(1, perm)``), which the native CPU kernel serves on a CPU;
- under ``--quantization gguf`` (unset, a GGUF is dequantized at load on this path until the
  kernel has run on a GPU: ``as_stored.gguf_as_stored``), a GGUF's decoder modules whose every
  tensor has 4-bit codes (Q4_0, Q4_1, Q4_K). A module with
  an int8-code part (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0: e.g. Q4_K_M's Q6_K ``attn_v``), the
  embedding and the LM head are dequantized at load to ``--dtype`` on this path (the kernel
  reads 4-bit codes only), and the start-up log says so (``triton_note``).

The gate_up layer is not fused with its activation here: it returns ``[..., 2I]`` and the
model's own ``act`` (``SiluAndMul``; Gemma 3's GELU) multiplies, as after an ``nn.Linear``.
Tensor parallelism stays refused (``as_stored.int4_stored``), as on the CPU.

``kernels.triton_int4`` (and so triton) is imported only when a layer is built, so a CPU
worker on another backend never imports triton.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from services.worker.gguf_blocks import GroupCodes
from services.worker.gguf_weights import StoredWeights


class TritonInt4Linear(nn.Module):
    """``y = x[..., perm] W^T + b`` with ``W[n, k] = code[n, k] * scale[n, k // G] + min[n, k //
    G]``, on the Triton kernel (``kernels.triton_int4``), float32 sums.

    Args:
        weight: 4-bit ``GroupCodes`` ``[N, K]`` (codes uint8 0..15, scale and min float32
            ``[N, K/G]``; K and G even), packed here two codes a byte (``pack_int4``).
        bias: ``[N]`` (any float dtype) or None; added in float32 before the one rounding.
        perm: int64 ``[K]``, a GPTQ act-order layer's input order, or None.
        out_dtype: the output dtype; None: ``x``'s.

    ``forward``: ``x [..., K]`` float16 / bfloat16 / float32 -> ``[..., N]``.

    Raises:
        ValueError: ``weight`` without 4-bit codes, or K / G odd.
    """

    qweight: torch.Tensor
    weight_scale: torch.Tensor
    weight_min: torch.Tensor | None
    perm: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, weight: GroupCodes, bias: torch.Tensor | None = None,
                 perm: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        from kernels.triton_int4 import pack_int4, triton_int4_linear

        if weight.bits != 4 or weight.group % 2:
            raise ValueError(f"TritonInt4Linear takes 4-bit codes in even groups, got "
                             f"{weight.codes.dtype} codes in groups of {weight.group}")
        self.out_features, self.in_features = weight.codes.shape
        self.group = weight.group
        self.out_dtype = out_dtype
        self.stored_as = ""  # what it holds ("GGUF Q4_K", "AWQ int4, group 128"), for the log
        self._op: Callable[..., torch.Tensor] = triton_int4_linear
        self.register_buffer("qweight", _dense(pack_int4(weight.codes.detach())),
                             persistent=False)
        self.register_buffer("weight_scale", _dense(weight.scale.float()), persistent=False)
        self.register_buffer("weight_min", None if weight.min is None
                             else _dense(weight.min.float()), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self.register_buffer("perm", None if perm is None else perm.long(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.perm is not None:  # (a GPTQ act-order layer's input order)
            flat = flat.index_select(1, self.perm)
        y = self._op(flat, self.qweight, self.weight_scale, self.weight_min, self.group,
                     self.bias, self.out_dtype)
        return y.reshape(*lead, self.out_features)

    def describe(self) -> str:
        """The start-up log's kind of this layer."""
        min_ = " and min" if self.weight_min is not None else ""
        return (f"{self.stored_as} as stored (4-bit codes, a scale{min_} per {self.group}, "
                f"Triton kernel)")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group={self.group}")


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A copy with row-major strides, a size-1 dimension's too (``.contiguous()`` keeps a
    transposed ``[N, 1]``'s stride N in its last dimension, which the kernel refuses)."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def four_bit_only(stored: StoredWeights) -> tuple[StoredWeights, dict[str, tuple[str, ...]]]:
    """``stored``'s linear layers with 4-bit codes (what ``TritonInt4Linear`` serves), without
    the embedding and LM head; and the GGML types of the modules left out, by name (they are
    read from the float conversion instead)."""
    kept = StoredWeights(source=stored.source)
    dropped: dict[str, tuple[str, ...]] = {}
    for name, weight in stored.linears.items():
        if weight.bits == 4:
            kept.linears[name] = weight
            kept.types[name] = stored.types[name]
            if name in stored.perms:
                kept.perms[name] = stored.perms[name]
        else:
            dropped[name] = stored.types[name]
    return kept, dropped


def serve_on_triton(net: nn.Module, stored: StoredWeights) -> None:
    """Put a ``TritonInt4Linear`` over each of ``stored.linears`` in ``net``, in place of the
    module whose weight was not read (meta); its bias (read) is kept. ``stored`` holds 4-bit
    linear layers only (``four_bit_only``; an AWQ / GPTQ checkpoint's are)."""
    for name, weight in stored.linears.items():
        parent, _, attr = name.rpartition(".")
        old = cast(nn.Linear, net.get_submodule(name))
        layer = TritonInt4Linear(weight, old.bias, perm=stored.perms.get(name))
        layer.stored_as = f"{stored.source} " + "+".join(dict.fromkeys(stored.types[name]))
        net.get_submodule(parent).register_module(attr, layer)


def triton_note(gguf_on_triton: bool) -> str:
    """The start-up log's note for a GGUF served as stored on the Triton backend: what is
    dequantized at load on that path; "" otherwise."""
    if not gguf_on_triton:
        return ""
    return ("; Triton backend: GGUF Q4_0 / Q4_1 / Q4_K layers as stored, every other GGUF "
            "type (Q5_*, Q6_K, Q8_0) and the embedding and LM head dequantized at load")
