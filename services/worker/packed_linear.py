"""Linear layers on the native CPU kernel (``kernels.cpu_linear``): weights packed once at load.

On a CPU worker with the native library:

- **a 16-bit model** (always): every linear layer of the decoder, and the LM head as
  ``PackedLinear(..., out_dtype=float32)``, which takes bf16 (or fp16) hidden states and
  weights and returns float32 logits, accumulated in float32 and never rounded to the model
  dtype. A bf16 matmul rounds logits of magnitude ~20 to a 0.125 grid, which turned SmolLM2's
  near-tied first tokens into exact ties (issue 30). The kernel never splits K and never picks
  another kernel for another number of rows, so each row's result is the same whatever else
  the step holds; oneDNN's bf16 matmul is not (on a Xeon with AMX it takes another kernel above
  32 rows), and a prefix-cache hit, which shrinks the step, changed a request's answer;
- **a float32 model on a CPU whose best step is AVX2** (``native_float32_default``), or with
  ``--batch-invariant`` on any CPU: the same, in place of ATen's (MKL) sgemm. The kernel's
  AVX2 float32 body is faster than MKL's sgemm at every shape of SmolLM2 from 1 to 512 rows
  (1.02-1.2x at 128-512 rows, 1.5-2.9x at 8-32: docs/benchmarks.md, issue 31); its AVX-512
  float32 body is a plain compiled loop, not measured against MKL's zmm sgemm, so an AVX-512
  CPU keeps MKL at float32 unless ``--batch-invariant`` asks otherwise.

Packing is a copy in the kernel's layout; the module it replaces is dropped, so an untied LM
head or a decoder linear costs no extra memory. A tied LM head keeps the embedding table as it
is (the embedding still reads it) and adds the packed copy beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from kernels.cpu_linear import gate_up_blocks, pack_linear_weight, write_packed

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """``y = reduce(x W^T) + b`` through ``kernels.cpu_linear``.

    Args:
        weight: ``[N, K]`` float32 / bfloat16 / float16 on the CPU (packed here; not kept).
        bias: ``[N]`` or None; added in float32 before the one rounding to ``out_dtype`` (with
            ``reduce``, after the sum: a row-parallel layer adds its bias once).
        out_dtype: the output dtype; None = ``x``'s.
        reduce: applied to the float32 matmul before the bias (the tensor-parallel all-reduce
            of a row-parallel layer: partial sums in float32, not rounded to bf16 per rank), or
            None.
        silu_mul: ``weight`` is a SwiGLU layer's gate-then-up ``[2I, K]``, and the layer
            returns ``silu(gate) * up`` (``cpu_linear``'s fused epilogue), ``[..., I]``.

    ``forward``: ``x [..., K]`` in the weight's dtype -> ``[..., N]`` (``[..., N / 2]`` with
    ``silu_mul``).
    """

    packed: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 silu_mul: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype, self.reduce, self.silu_mul = out_dtype, reduce, silu_mul
        if silu_mul:
            if reduce is not None:
                raise ValueError("silu_mul is for a column-parallel gate_up layer, not a "
                                 "row-parallel one")
            weight = gate_up_blocks(weight.detach())
            bias = None if bias is None else gate_up_blocks(bias.detach())
        self.register_buffer("packed", pack_linear_weight(weight.detach()), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the op itself, not kernels.cpu_linear.cpu_linear, whose lazy library load
        # torch.compile would have to trace (packing loaded it, fake kernel included)
        linear = torch.ops.pagedserve.linear
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.silu_mul:
            y = linear(flat, self.packed, self.out_features, self.bias, self.out_dtype, None,
                       True)
            return y.reshape(*lead, self.out_features // 2)
        if self.reduce is None:
            y = linear(flat, self.packed, self.out_features, self.bias, self.out_dtype)
        else:  # the partial sums are reduced in float32, rounded once after, as one rank does
            y = self.reduce(linear(flat, self.packed, self.out_features, None, torch.float32))
            if self.bias is not None:
                y = y + self.bias
            y = y.to(self.out_dtype or x.dtype)
        return y.reshape(*lead, self.out_features)


    @torch.no_grad()
    def write(self, row: int, col: int, block: torch.Tensor) -> None:
        """``W[row:row + r, col:col + c] = block``, in place, its rows in the weight's own
        order (for ``silu_mul``: gate then up, reordered here as the packing did, so only whole
        columns, ``row`` 0 and ``r = N``). A fused LoRA layer's slot swap
        (``services/worker/lora/layers.py``).

        Raises:
            ValueError: the block does not fit the weight (``write_packed``), or a partial
                column of a ``silu_mul`` layer.
        """
        if self.silu_mul:
            if row != 0 or block.shape[0] != self.out_features:
                raise ValueError("a silu_mul layer's packed weight is written whole columns")
            block = gate_up_blocks(block)
        write_packed(self.packed, row, col, block)


# Whether a float32 model on the kernels' AVX2 step goes native by default (a module constant,
# so that benchmarks/ab_engine.py can A/B it: --knob services.worker.packed_linear.
# FLOAT32_NATIVE_ON_AVX2 --values False True).
FLOAT32_NATIVE_ON_AVX2 = True


def native_float32_default() -> bool:
    """Whether a float32 model's linear layers go to the native kernel without
    ``--batch-invariant``: where the kernels take their AVX2 step (``kernels.cpu_attention.
    cpu_isa``: this CPU's best, or ``PAGEDSERVE_CPU_ISA``'s choice), whose float32 body beats
    MKL's sgemm (the module docstring). False where the library cannot be built or loaded."""
    from kernels.cpu_attention import cpu_isa

    try:
        return FLOAT32_NATIVE_ON_AVX2 and cpu_isa() == "avx2"
    except Exception as e:  # noqa: BLE001 - any build/load failure: MKL, as before
        log.debug("native CPU kernels unavailable: %s", e)
        return False


def pack_model_linears(model: nn.Module, *, lm_head: bool, decoder: bool) -> None:
    """Swap ``model``'s linear layers for ``PackedLinear``s, in place.

    Args:
        model: a loaded decoder (``services/worker/models``) on the CPU, in eval mode.
        lm_head: give it a float32-output packed LM head (``model.lm_head``; for a tied model,
            a packed copy of the embedding table). Only on the rank that computes logits (the
            last pipeline stage); a model without an LM head or embedding here is left alone.
        decoder: also pack every linear layer of the decoder layers (a 16-bit model, or
            ``--batch-invariant``), the row-parallel ones with their all-reduce.

    Raises:
        RuntimeError: the native library cannot be built or loaded (``kernels.cpu_build``).
    """
    if decoder:
        from services.worker.parallel.sharding import RowParallelLinear

        for layer in cast(nn.ModuleList, model.layers):
            fuse_silu_mul(layer)
            for parent in list(layer.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, RowParallelLinear):
                        setattr(parent, name, PackedLinear(child.weight, child.bias,
                                                           reduce=child.ps.all_reduce))
                    elif type(child) is nn.Linear:
                        setattr(parent, name, PackedLinear(child.weight, child.bias))
    if lm_head:
        head = cast(nn.Module | None, model.lm_head)
        source = head if head is not None else cast(nn.Module, model.embed_tokens)
        model.lm_head = PackedLinear(cast(torch.Tensor, source.weight), out_dtype=torch.float32)


def takes_silu_mul(parent: nn.Module, name: str) -> bool:
    """Whether ``parent.<name>`` is a SwiGLU MLP's gate_up layer whose SiLU-and-multiply the
    native kernel can apply in its epilogue (``cpu_linear``'s ``silu_mul``): ``parent`` has
    ``act``, a ``SiluAndMul``, and the layer's ``2I`` outputs are whole blocks of 32. A layer
    built with ``silu_mul=True`` in its place must be followed by ``parent.act = Identity()``
    (``fuse_silu_mul`` does both; the int8 layers' builders too).

    The fused layer writes ``[T, I]`` where the plain one wrote ``[T, 2I]`` for a separate
    SiLU-and-multiply pass to read (on an AMD EPYC at bf16 that pass was 1.4 s of
    compare.py's workload W: docs/benchmarks.md, issue 31).
    """
    from services.worker.models.llama import SiluAndMul

    layer = getattr(parent, name, None)
    out_features = getattr(layer, "out_features", 0)
    return (name == "gate_up_proj" and isinstance(getattr(parent, "act", None), SiluAndMul)
            and out_features > 0 and out_features % 32 == 0)


def fuse_silu_mul(layer: nn.Module) -> None:
    """Give a decoder layer's SwiGLU MLP (``takes_silu_mul``) whose gate_up is a plain
    ``nn.Linear`` a ``PackedLinear`` that applies the gate in its epilogue, and make its
    ``act`` an identity; other MLPs (GeGLU, quantized layers) stay as they are. In place. A
    fused LoRA gate_up (``services/worker/lora/layers.py``) gets it in its base: its update
    is part of the sums the gate reads."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return
    # a LoRA layer whose update runs inside its base GEMM (``LoRALinear.fused``): its base
    owner, name = ((mlp.gate_up_proj, "base") if getattr(mlp.gate_up_proj, "fused", False)
                   else (mlp, "gate_up_proj"))
    gate_up = getattr(owner, name)
    if type(gate_up) is not nn.Linear or not takes_silu_mul(mlp, "gate_up_proj"):
        return
    setattr(owner, name, PackedLinear(gate_up.weight, gate_up.bias, silu_mul=True))
    mlp.act = nn.Identity()
