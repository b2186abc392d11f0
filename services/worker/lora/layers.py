"""``LoRALinear``: a targeted linear layer plus the batched low-rank update of the step's
adapters (Punica's shrink / expand, Chen et al. 2023), never merged into the base weights.

Per layer, ``S = --max-loras`` slots of rank ``R = --max-lora-rank`` (smaller ranks zero
padded, so a slot swap is a copy into these buffers, never a reallocation or a recompile)::

    lora_a  [n, S, R, in]       A of each of the layer's n slices (qkv: q, k, v; gate_up:
                                gate, up; o, down: one), slot by slot
    lora_b  [out, S, R]         B of each slice, the slices' output rows side by side as in
                                the base layer (q rows, k rows, v rows)
    mask    [T, S * R]          per token, its slot's scale on that slot's R columns, 0
                                elsewhere (a base-model row: all 0); one per step, shared by
                                every layer (``LoRAContext``)

    y = base(x) + expand_i( shrink(x) * mask )        for each slice i
    shrink(x) = x @ A^T          [T, n*S*R]   (all slots' A in one GEMM)
    expand_i(u) = u_i @ B_i^T    [T, out_i]   (all slots' B of slice i in one GEMM)

NOTE: the "segment" of each row is selected by the mask between the two GEMMs rather than by
gathering rows per adapter: shapes never depend on which adapters a step holds (one compiled
graph, no per-adapter loop), at the cost of S x the low-rank FLOPs (``S * R`` is small next to
the base layer's ``in``; e.g. 4 x 16 = 64 columns for SmolLM2's 576). Zero columns contribute
exact zeros, so a row's result is its own adapter's update.

Tensor parallelism shards the update as the base layer: a column-parallel layer keeps A whole
and its B rows; a row-parallel layer (o, down) its A columns and B whole, and adds its partial
update to its partial base output before the one all-reduce (``reduce``), the bias after it.
"""

from __future__ import annotations

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
        base: the layer's base linear (an ``nn.Linear`` or what the loader made of it: packed,
            int8), without its tensor-parallel reduce (``reduce`` here does it).
        slices: the output features of each slice, this rank's (``[q, k, v]``, ``[gate, up]``
            or ``[out]``).
        in_features: the layer's input features, this rank's.
        ctx: the shared step mask.
        reduce: the row-parallel all-reduce, or None; applied to base + update.
        bias: a row-parallel layer's bias, added once after ``reduce``; None otherwise (a
            column-parallel layer's bias stays in ``base``).

    ``forward``: ``x [T, in]`` -> ``[T, sum(slices)]``, ``x``'s dtype.
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(self, base: nn.Module, slices: tuple[int, ...], in_features: int,
                 ctx: LoRAContext, dtype: torch.dtype,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.base, self.ctx, self.slices, self.reduce = base, ctx, slices, reduce
        self.in_features = in_features
        s, r = ctx.num_slots, ctx.rank
        self.register_buffer("lora_a", torch.zeros(len(slices), s, r, in_features, dtype=dtype),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(sum(slices), s, r, dtype=dtype),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, n, sr = x.shape[0], len(self.slices), self.ctx.num_slots * self.ctx.rank
        u = F.linear(x, self.lora_a.view(n * sr, self.in_features))  # [T, n*S*R] shrink
        u = (u.view(T, n, sr) * self.ctx.mask[:, None, :]).to(x.dtype)  # each row its slot
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

    def slice_weights(self, slot: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of slice ``index``'s slot ``slot``: A ``[R, in]`` and B ``[out_i, R]``."""
        start = sum(self.slices[:index])
        return (self.lora_a[index, slot],
                self.lora_b[start:start + self.slices[index], slot])


def wrap_lora_layers(model: nn.Module, num_slots: int, rank: int, dtype: torch.dtype,
                     ) -> LoRAContext:
    """Wrap every LoRA-targetable linear layer of ``model``'s decoder layers (``SLICES``) in a
    ``LoRALinear``, in place, and return their shared ``LoRAContext`` (also
    ``model.lora_context``). Call on the loaded model (this rank's shard) before its linear
    layers are packed or quantized: those then replace the wrapped base, and the SwiGLU
    epilogue fusion (``packed_linear.fuse_silu_mul``) no longer applies, since the update must
    be added to gate/up before the activation."""
    from services.worker.parallel import RowParallelLinear

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
            if isinstance(base, RowParallelLinear):  # the reduce and bias move out of base
                reduce, bias = base.ps.all_reduce, base.bias
                plain = nn.Linear(base.in_features, base.out_features, bias=False,
                                  device="meta")
                plain.weight = base.weight
                base = plain
            setattr(owner, name, LoRALinear(base, slices, n_in, ctx, dtype, reduce, bias))
    model.lora_context = ctx
    return ctx
