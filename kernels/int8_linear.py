"""int8 linear layers in torch: symmetric quantization, the W8A8 matmul, and float64 references.

Two kinds of int8 weights (``services/worker/quantized_linear.py`` builds the layers):

- **per output channel** (``--quantization int8`` and ``w8a8``): ``W [N, K] ~ q * s[:, None]``,
  ``s = amax(|W[n, :]|) / 127``, ``q = round(W / s)`` (half to even) clamped to ``[-127, 127]``
  (-128 unused: the range is symmetric). A row of zeros gets ``s = 1``, ``q = 0``;
- **per group of 32 along K** (GGUF ``Q8_0``, read as stored): ``W[n, k] = q[n, k] *
  d[n, k // 32]``, ``d`` an fp16 scale per block of 32 weights (llama.cpp ``ggml-quants.c``).

The weight-only product (int8 weights, activations in the compute dtype) is the native kernel's
(``kernels.cpu_linear``, which dequantizes inside the GEMM). The W8A8 product is here in torch,
the definition the native op (``cpu_linear.cpu_w8a8_linear``, what ``--quantization w8a8``
runs: faster at every shape measured) reproduces bit for bit:
activations quantized per token (row) the same way, dynamically, each step, then
``torch._int_mm`` (int8 x int8 -> int32: oneDNN on a CPU, VNNI / AMX-INT8 where present), then
``y = acc * s_x[:, None] * s_w[None, :]`` in float32, ``+ bias``, rounded once to the output
dtype. Integer sums are exact, so a row's result does not depend on the other rows of the step
(nor on how oneDNN blocks or splits K): W8A8 is batch-invariant by construction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QMAX = 127


def quantize_symmetric(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: ``x [R, C]`` (any float dtype) -> ``(q [R, C] int8, s [R]
    float32)`` with ``x ~ q * s[:, None]``; ``s = amax / 127`` in float32, ``q = round(x / s)``
    (half to even) clamped to +-127; an all-zero row gets ``s = 1``."""
    x = x.float()
    amax = x.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(x / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int | None = None,
               ) -> torch.Tensor:
    """``q [N, K]`` int8 and its scales -> float32 ``[N, K]``: ``q * scale[:, None]`` (per
    output channel, ``scale [N]``) or ``q * scale.repeat_interleave(G, 1)`` (per group,
    ``scale [N, K/G]``). Exact in float32 for GGUF Q8_0's fp16 scales."""
    if group_size is None:
        return q.float() * scale.float()[:, None]
    return q.float() * scale.float().repeat_interleave(group_size, dim=1)


def w8a8_linear(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``x [M, K]`` (float32 / bf16 / fp16) times int8 weights ``q [N, K]`` with scales
    ``w_scale [N]`` (float32) -> ``[M, N]`` in ``out_dtype`` (default ``x.dtype``).

    ``x`` is quantized per row (``quantize_symmetric``); ``acc = x_q @ q^T`` in int32
    (``torch._int_mm``); ``y = acc * s_x[:, None] * w_scale`` in float32; ``reduce`` (the
    tensor-parallel all-reduce of a row-parallel layer) is applied to that, then ``bias`` is
    added (in float32) and the sum rounded once to ``out_dtype``.
    """
    xq, x_scale = quantize_symmetric(x)
    acc = torch._int_mm(xq, q.t())  # [M, N] int32
    y = acc.float() * x_scale[:, None] * w_scale
    if reduce is not None:
        y = reduce(y)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def reference_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     group_size: int | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``x @ dequantize(q, scale)^T (+ bias)``: the weight-only reference."""
    w = q.double() * (scale.double()[:, None] if group_size is None
                      else scale.double().repeat_interleave(group_size, dim=1))
    y = x.double() @ w.T
    return y if bias is None else y + bias.double()


def reference_w8a8(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 W8A8 reference: ``x`` quantized as ``w8a8_linear`` does, the products summed in
    float64 (exact), scaled, plus ``bias``."""
    xq, x_scale = quantize_symmetric(x)
    y = (xq.double() @ q.double().T) * x_scale.double()[:, None] * w_scale.double()
    return y if bias is None else y + bias.double()
