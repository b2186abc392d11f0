"""Triton kernel: ``y = x @ W^T (+ bias)`` with W held as 4-bit codes, a float32 scale and an
optional float32 min per group of G consecutive k, the codes converted in registers inside the
matmul (never a dequantized copy of W in memory).

STATUS: written for the CUDA backend; tested only in the Triton interpreter on CPU
(``TRITON_INTERPRET=1``, small shapes: ``tests/kernels/test_triton_int4.py``, and the model
through ``tests/worker/test_triton_int4_models.py``); never run on a GPU (none available while
it was written or wired), so neither its compilation by the CUDA backend nor its speed has been
checked. Wired into the model on the triton attention backend (CUDA, or a CPU under the
interpreter): ``services/worker/triton_int4_linear.TritonInt4Linear`` serves an AWQ / GPTQ
checkpoint's 4-bit layers and, under ``--quantization gguf``, a GGUF's Q4_0 / Q4_1 / Q4_K
modules with it (the GGUF's other types, embedding and LM head dequantized at load there).
The CPU worker on its own backends serves 4-bit weights with the native kernel
(``kernels.cpu_linear``, ``services/worker/quantized_linear.py``).

The weight is the CPU path's representation (GGUF Q4_0 / Q4_1 / Q4_K, AWQ / GPTQ unpacked to
codes)::

    W[n, k] = code[n, k] * scale[n, k // G] + min[n, k // G]      code in 0..15, min None: 0

laid out as a loader hands it (``pack_int4``), N rows of K // 2 bytes, two codes a byte::

    qweight [N, K // 2] uint8:  byte j of row n = code[n, 2j] | code[n, 2j + 1] << 4
                                (k = 2j in the low nibble, k = 2j + 1 in the high one)
    scale, min [N, K // G] float32

Work split of ``_int4_linear_kernel``, grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))``: one
program = one ``[BLOCK_M, BLOCK_N]`` tile of y, walking K in steps of BLOCK_K; per step it
loads x ``[BLOCK_M, BLOCK_K]`` and the bytes ``[BLOCK_N, BLOCK_K / 2]``, splits each byte
into its low and high nibble and interleaves them (``tl.interleave``) into the codes
``[BLOCK_N, BLOCK_K]`` in k order. Two forms, by whether a K step lies inside one group:

- ``FACTORED`` (G a multiple of BLOCK_K; the launcher picks such a BLOCK_K whenever G is a
  multiple of 16): the step's codes, exact in every float dtype, go to ``tl.dot`` unscaled and
  the group's scale and min are applied to the step's float32 sums (llama.cpp's form, also
  the native CPU kernel's)::

      acc[m, n] += scale[n, g] * sum_k x[m, k] code[n, k]  +  min[n, g] * sum_k x[m, k]

  so no weight is rounded to x's dtype (each product x * code is exact in float32);
- otherwise (G not a multiple of 16, e.g. 8 or 24, or a forced ``block_k`` that G is not a
  multiple of: a step may hold several groups, or parts of two) each weight is dequantized,
  ``code * scale[n, k // G] + min[n, k // G]`` in float32 with the scale and min gathered per
  element, then rounded to x's dtype for ``tl.dot``.

Accumulation is float32 (``tl.dot`` with ``input_precision="ieee"`` for float32 x: no TF32);
the bias (any float dtype) is added in float32 before the one rounding to ``out_dtype``. The
edges of M, N and K are masked, so M, N and K (even) need not be multiples of the tiles.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_linear_kernel(
    out_ptr,  # [M, N] out_dtype
    x_ptr,  # [M, K] float16 / bfloat16 / float32
    qweight_ptr,  # [N, K // 2] uint8: code of k = 2j in the low nibble of byte j, 2j + 1 high
    scale_ptr,  # [N, K // G] float32
    min_ptr,  # [N, K // G] float32, used iff HAS_MIN
    bias_ptr,  # [N] any float dtype, used iff HAS_BIAS
    M, N, K,
    stride_om,
    stride_xm, stride_xk,
    stride_qn,
    stride_sn,
    stride_mn,
    GROUP: tl.constexpr,  # G: k of one scale / min
    HAS_MIN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FACTORED: tl.constexpr,  # GROUP % BLOCK_K == 0: scale and min applied to each step's sums
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # even, >= 16 (tl.dot)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 x (no TF32), else the default
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    offs_j = tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2] bytes of a step
    x_rows = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    q_rows = qweight_ptr + cols[:, None] * stride_qn  # [BLOCK_N, 1]
    dtype = x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K]
        k_mask = k < K
        x = tl.load(x_rows + k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        j = k0 // 2 + offs_j  # [BLOCK_K / 2]
        packed = tl.load(q_rows + j[None, :], mask=n_mask[:, None] & (j[None, :] < K // 2),
                         other=0)  # [BLOCK_N, BLOCK_K / 2] uint8
        codes = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K]: 2j low, 2j+1 high
        if FACTORED:  # the whole step lies in group g
            g = k0 // GROUP
            s = tl.load(scale_ptr + cols * stride_sn + g, mask=n_mask, other=0.0)  # [BLOCK_N]
            sums = tl.dot(x, tl.trans(codes.to(dtype)), input_precision=DOT_PRECISION)
            acc += sums * s[None, :]  # [BLOCK_M, BLOCK_N]
            if HAS_MIN:
                mn = tl.load(min_ptr + cols * stride_mn + g, mask=n_mask, other=0.0)
                x_sum = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
                acc += x_sum[:, None] * mn[None, :]
        else:  # several groups in a step: dequantize each weight, scale and min gathered
            g2 = k[None, :] // GROUP  # [1, BLOCK_K]
            w_mask = n_mask[:, None] & k_mask[None, :]
            s2 = tl.load(scale_ptr + cols[:, None] * stride_sn + g2, mask=w_mask, other=0.0)
            w = codes.to(tl.float32) * s2  # [BLOCK_N, BLOCK_K] float32
            if HAS_MIN:
                w += tl.load(min_ptr + cols[:, None] * stride_mn + g2, mask=w_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w.to(dtype)), acc, input_precision=DOT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def triton_int4_linear(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    qweight: torch.Tensor,  # [N, K // 2] uint8 (``pack_int4``)
    scale: torch.Tensor,  # [N, K // G] float32
    weight_min: torch.Tensor | None,  # [N, K // G] float32, or None (0)
    group_size: int,  # G
    bias: torch.Tensor | None = None,  # [N] any float dtype
    out_dtype: torch.dtype | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W[n, k] = code[n, k] * scale[n, k // G] + min[n, k // G]``,
    the codes read from ``qweight`` (two a byte, ``pack_int4``'s layout) inside the matmul.

    Returns a new contiguous ``[M, N]`` tensor in ``out_dtype`` (default ``x.dtype``); sums in
    float32, the bias added in float32 before the one rounding. x may have any strides.

    Block sizes (powers of 2, at least 16; ``block_k`` even) default to 64 / 64 / 64 on CUDA
    (``block_m`` 16 for M <= 16) and 16 / 32 / 32 in the interpreter; the default
    ``block_k`` is the largest such power of 2 dividing G (so a K step lies inside one group
    and the factored form runs, see the module docstring), or the cap when G is not a multiple
    of 16. Any ``block_k`` is correct, whether it divides G, G divides it, or neither.

    Raises:
        ValueError: naming the argument: x not 2-D float16 / bfloat16 / float32; K (x's last
            dimension) zero or odd; ``group_size`` not even or not dividing K; ``qweight`` not
            uint8 ``[N, K // 2]``; ``scale`` / ``weight_min`` not float32 ``[N, K // G]``;
            ``bias`` not ``[N]``; a packed tensor whose last dimension is not contiguous; a
            block size that is not a power of 2 >= 16.
    """
    name = "triton_int4_linear"
    _check(x.dim() == 2 and x.dtype in _DTYPES,
           f"{name}: x must be 2-D float16 / bfloat16 / float32, got {x.dtype} "
           f"{tuple(x.shape)}")
    m, k = x.shape
    _check(k > 0 and k % 2 == 0, f"{name}: K (x.shape[1]) = {k} must be positive and even")
    _check(group_size > 0 and group_size % 2 == 0 and k % group_size == 0,
           f"{name}: group_size {group_size} must be even and divide K = {k}")
    _check(qweight.dim() == 2 and qweight.dtype == torch.uint8 and qweight.shape[1] == k // 2,
           f"{name}: qweight must be uint8 [N, K // 2 = {k // 2}], got {qweight.dtype} "
           f"{tuple(qweight.shape)}")
    n = qweight.shape[0]
    groups = k // group_size
    for arg, t in (("scale", scale), ("weight_min", weight_min)):
        if t is None and arg == "weight_min":
            continue
        _check(t is not None and t.dtype == torch.float32 and t.shape == (n, groups),
               f"{name}: {arg} must be float32 [N, K // G] = [{n}, {groups}], got "
               f"{None if t is None else (t.dtype, tuple(t.shape))}")
    _check(bias is None or bias.shape == (n,),
           f"{name}: bias must be [N] = [{n}], got {None if bias is None else tuple(bias.shape)}")
    _check(all(t.stride(-1) == 1 for t in (qweight, scale, weight_min) if t is not None),
           f"{name}: qweight, scale and weight_min must be contiguous in their last dimension")
    cuda = x.is_cuda
    if block_k is None:
        cap = 64 if cuda else 32
        block_k = min(cap, group_size & -group_size)  # largest power of 2 dividing G
        if block_k < 16:
            block_k = cap
    if block_m is None:
        block_m = 64 if cuda and m > 16 else 16
    if block_n is None:
        block_n = 64 if cuda else 32
    for arg, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        _check(b >= 16 and b & (b - 1) == 0, f"{name}: {arg} {b} must be a power of 2 >= 16")

    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _int4_linear_kernel[grid](
        out, x, qweight, scale,
        scale if weight_min is None else weight_min,
        scale if bias is None else bias,
        m, n, k,
        out.stride(0),
        x.stride(0), x.stride(1),
        qweight.stride(0),
        scale.stride(0),
        scale.stride(0) if weight_min is None else weight_min.stride(0),
        GROUP=group_size,
        HAS_MIN=weight_min is not None,
        HAS_BIAS=bias is not None,
        FACTORED=group_size % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[N, K]`` (uint8 holding 0..15, K even) -> ``[N, K // 2]`` uint8, the
    layout ``triton_int4_linear`` reads: byte j of row n = ``codes[n, 2j] | codes[n, 2j + 1]
    << 4``. Same device as ``codes``.

    Raises:
        ValueError: ``codes`` not 2-D uint8, K odd, or a code above 15.
    """
    _check(codes.dim() == 2 and codes.dtype == torch.uint8 and codes.shape[1] % 2 == 0,
           f"pack_int4: codes must be uint8 [N, K] with K even, got {codes.dtype} "
           f"{tuple(codes.shape)}")
    _check(codes.numel() == 0 or int(codes.max()) <= 15,
           f"pack_int4: codes must be 0..15, got {int(codes.max()) if codes.numel() else 0}")
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """``pack_int4``'s inverse: ``[N, K // 2]`` uint8 -> the codes ``[N, K]`` uint8 (0..15)."""
    _check(qweight.dim() == 2 and qweight.dtype == torch.uint8,
           f"unpack_int4: qweight must be 2-D uint8, got {qweight.dtype} {tuple(qweight.shape)}")
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).flatten(1)


def int4_linear_reference(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K // 2] uint8
    scale: torch.Tensor,  # [N, K // G]
    weight_min: torch.Tensor | None,  # [N, K // G] or None
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """The spec of ``triton_int4_linear``, slow and obvious: W dequantized in float64
    (``dequantize_int4``), ``x.double() @ W^T (+ bias)``; returns ``[M, N]`` float64 (no
    rounding to any dtype)."""
    y = x.double() @ dequantize_int4(qweight, scale, weight_min, group_size).T
    return y if bias is None else y + bias.double()


def dequantize_int4(
    qweight: torch.Tensor,  # [N, K // 2] uint8
    scale: torch.Tensor,  # [N, K // G]
    weight_min: torch.Tensor | None,  # [N, K // G] or None
    group_size: int,
) -> torch.Tensor:
    """``W[n, k] = code[n, k] * scale[n, k // G] + min[n, k // G]`` as float64 ``[N, K]``."""
    w = unpack_int4(qweight).double() * scale.double().repeat_interleave(group_size, dim=1)
    if weight_min is not None:
        w = w + weight_min.double().repeat_interleave(group_size, dim=1)
    return w


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
