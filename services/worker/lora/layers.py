"""``LoRALinear``: a targeted linear layer plus the batched low-rank update of the step's
adapters (Punica's shrink / expand, Chen et al. 2023), never merged into the base weights.

Per layer, ``S = --max-loras`` slots of rank ``R = --max-lora-rank`` (smaller ranks zero
padded, so a slot swap is a copy into these buffers, never a reallocation or a recompile)::

    A       [n, S, R, in]       A of each of the layer's n slices (qkv: q, k, v; gate_up:
                                gate, up; o, down: one), slot by slot
    B       [out, S, R]         B of each slice, the slices' output rows side by side as in
                                the base layer (q rows, k rows, v rows)
    mask    [T, S * R]          per token, its slot's scale on that slot's R columns, 0
                                elsewhere (a base-model row: all 0); one per step, shared by
                                every layer (``LoRAContext``)

    u = shrink(x) * mask        [T, n*S*R]   shrink(x) = x @ A^T, all slots' A in one GEMM
    y = base(x) + expand(u)     expand(u)_i = u_i @ B_i^T for each slice i

**Fused** (the base is a plain linear layer: every float model): the shrink is a linear layer
of its own, ``lora_shrink`` (``[n*S*R, in]``, A's rows), and the expand runs inside the base
GEMM: the base weight gets ``n * S * R`` more input features holding each slot's B
block-diagonally (slice i's output rows read only slice i's columns of u), and the layer
computes ``base([x, u])``. Both are plain ``nn.Linear``s, so on the CPU the loader packs them
for the native kernel as every other layer (``packed_linear.pack_model_linears``): row
invariant as the base, one GEMM for base and update, nothing added after it, and a SwiGLU
gate_up keeps the SiLU-and-multiply in the kernel's epilogue (``fuse_silu_mul``). A
base-model row's u is 0: the extra products add exact zeros. **Unfused** (a quantized base,
whose weight cannot take B): buffers ``lora_a [n, S, R, in]`` and ``lora_b [out, S, R]``,
ATen GEMMs for shrink and expand, the update added to the base output.

NOTE: the "segment" of each row is selected by the mask between the two GEMMs rather than by
gathering rows per adapter: shapes never depend on which adapters a step holds (one compiled
graph, no per-adapter loop), at the cost of S x the low-rank FLOPs (``S * R`` is small next to
the base layer's ``in``; e.g. 4 x 8 = 32 columns for SmolLM2's 576). Zero columns contribute
exact zeros, so a row's result is its own adapter's update.

Tensor parallelism shards the update as the base layer: a column-parallel layer keeps A whole
and its B rows; a row-parallel layer (o, down) its A columns and B whole, so its partial update
joins its partial base output before the one all-reduce (fused: inside the base layer, which
keeps its reduce and bias; unfused: ``reduce`` here, the bias after it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

# (our module, its slices: PEFT's targets in the order of the base layer's output rows)
SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRAContext(nn.Module):
    """The step's row -> slot mask ``[T, S * R]`` (model dtype), shared by every
    ``LoRALinear``; set before each forward (``LoRAManager.set_step``).

    NOTE: a plain attribute, not a buffer: Dynamo gives a module's buffers static shapes, and
    the mask has one row per token of the step (``compiled.py`` marks it dynamic)."""

    def __init__(self, num_slots: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_slots, self.rank = num_slots, rank
        self.mask = torch.zeros(2, num_slots * rank, dtype=dtype)

    def dynamic_rows(self) -> tuple[torch.Tensor, ...]:
        """The tensors whose first dimension is the step's token count (``compiled.py``
        marks it dynamic)."""
        return (self.mask,)


class LoRALinear(nn.Module):
    """``base`` plus the LoRA update of the step's slots (the module docstring's math).

    Args:
        base: the layer's base linear: an ``nn.Linear`` or ``RowParallelLinear`` (fused: its
            weight is widened here; packing later keeps the width), or a quantized layer
            (unfused; for a row-parallel one, without its reduce: ``reduce`` here does it).
        slices: the output features of each slice, this rank's (``[q, k, v]``, ``[gate, up]``
            or ``[out]``).
        in_features: the layer's input features, this rank's.
        ctx: the shared step mask.
        reduce: unfused only: the row-parallel all-reduce, or None; applied to base + update.
        bias: unfused only: a row-parallel layer's bias, added once after ``reduce``; None
            otherwise.
        fused: run the update inside ``base``'s GEMM (``base`` must be an ``nn.Linear``).

    ``forward``: ``x [T, in]`` -> ``[T, sum(slices)]`` (``[T, sum(slices) / 2]`` when the
    fused base applies SwiGLU's gate), ``x``'s dtype.
    """

    lora_a: torch.Tensor | None
    lora_b: torch.Tensor | None

    def __init__(self, base: nn.Module, slices: tuple[int, ...], in_features: int,
                 ctx: LoRAContext, dtype: torch.dtype,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 bias: torch.Tensor | None = None, fused: bool = False) -> None:
        super().__init__()
        self.ctx, self.slices, self.reduce, self.fused = ctx, slices, reduce, fused
        self.in_features, self.out_features = in_features, sum(slices)
        s, r, n = ctx.num_slots, ctx.rank, len(slices)
        if fused:  # B's columns beside W's, zeros until a slot is written
            linear = cast(nn.Linear, base)
            w = linear.weight.detach()
            linear.weight = nn.Parameter(torch.cat(
                [w.to(dtype), w.new_zeros(linear.out_features, n * s * r, dtype=dtype)], dim=1),
                requires_grad=False)
            linear.in_features = linear.weight.shape[1]
            self.lora_shrink = nn.Linear(in_features, n * s * r, bias=False, dtype=dtype,
                                         device=w.device).requires_grad_(False)
            self.lora_shrink.weight.zero_()
        self.base = base
        self.register_buffer("lora_a", None if fused else
                             torch.zeros(n, s, r, in_features, dtype=dtype), persistent=False)
        self.register_buffer("lora_b", None if fused else
                             torch.zeros(sum(slices), s, r, dtype=dtype), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, n, sr = x.shape[0], len(self.slices), self.ctx.num_slots * self.ctx.rank
        if self.fused:
            u = _select(self.lora_shrink(x), self.ctx.mask.repeat(1, n))  # [T, n*S*R]
            return self.base(torch.cat([x, u.to(x.dtype)], dim=-1))
        assert self.lora_a is not None and self.lora_b is not None
        u = F.linear(x, self.lora_a.view(n * sr, self.in_features))  # [T, n*S*R] shrink
        u = _select(u.view(T, n, sr), self.ctx.mask[:, None, :]).to(x.dtype)
        b = self.lora_b.view(-1, sr)  # [out, S*R]
        if n == 1:
            delta = F.linear(u[:, 0], b)  # [T, out] expand
        else:
            delta = torch.cat([F.linear(u[:, i], bi)
                               for i, bi in enumerate(b.split(list(self.slices)))], dim=-1)
        y = self.base(x) + delta
        if self.reduce is not None:
            y = self.reduce(y)
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def write_slot(self, slot: int, index: int, a: torch.Tensor | None,
                   b: torch.Tensor | None) -> None:
        """Slice ``index``'s slot ``slot`` := ``a [r, in]``, ``b [out_i, r]`` (``r`` up to the
        slots' rank; zero padded), or zeros when ``a`` is None (an adapter without this
        target). Fused: into ``lora_shrink``'s rows and the base weight's columns of that
        slot, packed in place (``PackedLinear.write``) once the loader packed them.

        Raises:
            ValueError: a shape that does not fit the slot.
        """
        r_max, start, rows = self.ctx.rank, sum(self.slices[:index]), self.slices[index]
        r = 0 if a is None else a.shape[0]
        if a is not None and (r > r_max or a.shape[1] != self.in_features or b is None
                              or tuple(b.shape) != (rows, r)):
            raise ValueError(f"LoRA slice {index}: A {tuple(a.shape)}, B "
                             f"{None if b is None else tuple(b.shape)} do not fit a slot of "
                             f"rank {r_max}: A [r, {self.in_features}], B [{rows}, r]")
        dtype = self.ctx.mask.dtype
        device = next(itertools.chain(self.parameters(), self.buffers())).device
        a_slot = torch.zeros(r_max, self.in_features, dtype=dtype, device=device)
        b_slot = torch.zeros(rows, r_max, dtype=dtype, device=device)
        if a is not None and b is not None:
            a_slot[:r], b_slot[:, :r] = a, b
        if not self.fused:
            assert self.lora_a is not None and self.lora_b is not None
            self.lora_a[index, slot] = a_slot
            self.lora_b[start:start + rows, slot] = b_slot
            return
        first = (index * self.ctx.num_slots + slot) * r_max  # the slot's u columns
        columns = torch.zeros(self.out_features, r_max, dtype=dtype, device=device)
        columns[start:start + rows] = b_slot  # (block-diagonal: other slices' rows 0)
        _write(self.lora_shrink, first, 0, a_slot)
        _write(self.base, 0, self.in_features + first, columns)


def _select(u: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``u * mask`` with exact zeros where ``mask`` is 0, also where ``u`` is not finite (a
    row's product with another slot's A can overflow, and 0 * inf is NaN)."""
    return torch.where(mask != 0, u * mask, 0)


def _write(layer: nn.Module, row: int, col: int, block: torch.Tensor) -> None:
    """``layer``'s ``W[row:row + r, col:col + c] = block``: a ``PackedLinear``'s packed
    weight, or an ``nn.Linear``'s."""
    write = getattr(layer, "write", None)
    if write is not None:
        write(row, col, block)
    else:
        cast(nn.Linear, layer).weight[row:row + block.shape[0], col:col + block.shape[1]] = block


def wrap_lora_layers(model: nn.Module, num_slots: int, rank: int, dtype: torch.dtype,
                     fuse: bool = True) -> LoRAContext:
    """Wrap every LoRA-targetable linear layer of ``model``'s decoder layers (``SLICES``) in a
    ``LoRALinear``, in place, and return their shared ``LoRAContext`` (also
    ``model.lora_context``). Call on the loaded model (this rank's shard) before its linear
    layers are packed or quantized.

    Args:
        fuse: widen plain linear bases to run the update inside their GEMM (the module
            docstring); False where the bases will be quantized after this (``--quantization``:
            B's columns would be quantized with W), or already are (GGUF Q8_0 layers are
            never fused).
    """
    from services.worker.parallel.sharding import RowParallelLinear

    ctx = LoRAContext(num_slots, rank, dtype)
    for layer in cast(nn.ModuleList, model.layers):
        attn, mlp = cast(nn.Module, layer.attn), cast(nn.Module, layer.mlp)
        q, kv = cast(int, attn.q_size), cast(int, attn.kv_size)
        gate_up = cast(nn.Linear, mlp.gate_up_proj)
        i = gate_up.out_features // 2
        e = gate_up.in_features
        for owner, name, slices, n_in in ((attn, "qkv_proj", (q, kv, kv), e),
                                          (attn, "o_proj", (e,), q),
                                          (mlp, "gate_up_proj", (i, i), e),
                                          (mlp, "down_proj", (e,), i)):
            base = getattr(owner, name)
            reduce, bias = None, None
            fused = fuse and isinstance(base, nn.Linear)
            if not fused and isinstance(base, RowParallelLinear):  # reduce, bias out of base
                reduce, bias = base.ps.all_reduce, base.bias
                plain = nn.Linear(base.in_features, base.out_features, bias=False,
                                  device="meta")
                plain.weight = base.weight
                base = plain
            setattr(owner, name, LoRALinear(base, slices, n_in, ctx, dtype, reduce, bias,
                                            fused))
    model.lora_context = ctx
    return ctx
