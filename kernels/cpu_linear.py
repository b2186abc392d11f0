"""Row-invariant linear layers in native C++: ``y = x W^T (+ b)`` with ``W`` packed once.

The torch custom ops of ``kernels/csrc/cpu_linear.cpp`` (``torch.ops.pagedserve.pack_linear_weight``
/ ``linear``), loaded through ``kernels.cpu_build``. Two things ATen's CPU matmul does not give:

- **float32 output from 16-bit inputs**: the LM head of a bf16 model returns float32 logits
  (accumulated in float32, never rounded to bf16);
- **row invariance**: each output element is one float32 accumulator over ``k = 0 .. K-1`` in
  order, whatever the number of rows, the row's place in the batch or the thread count (work is
  split over rows and 32-column blocks, never over K). MKL and oneDNN pick kernels and K
  splits by M, so with them a row's result can change with the step's size.

Paths by instruction set (``PAGEDSERVE_CPU_ISA`` forces a lower one; see ``cpu_attention``):
AMX tiles through ATen's ``cpublas::brgemm`` (bf16), ``vdpbf16ps`` (AVX512-BF16, bf16), and a
float32 FMA micro-kernel for AVX-512, AVX2 and the baseline (every dtype).

Quantized weights (``services/worker/quantized_linear.py``) take the same paths: int8 codes
(``--quantization int8``, GGUF Q8_0 / Q5_x / Q6_K) or 4-bit codes (``pack_uint4_weight``: GGUF
Q4_0 / Q4_1 / Q4_K). Each packed block is dequantized inside the GEMM, to bf16 for a bf16
``x`` on the bf16 paths, to float32 otherwise, with a float32 scale per output channel
(applied to the float32 sums) or a scale and an optional min per group of K (GGUF's 32, or 16;
``q * s + m`` applied to each weight as it is dequantized).

W8A8 (``--quantization w8a8``) has its own op, ``kernels/csrc/cpu_int8_linear.cpp``
(``pack_w8a8_weight`` / ``cpu_w8a8_linear``): activations quantized per token in the op, int8
products summed exactly in int32 (vpdpbusd where the CPU has VNNI); and so has "A8"
(``kernels/csrc/cpu_a8_linear.cpp``, ``pack_a8_weight`` / ``cpu_a8_linear``): group-quantized
4-bit or int8 codes against activations quantized per group of 32 (W4A8 / W8A8 with GGUF's
groups), an opt-in for the layers served as stored.
"""

from __future__ import annotations

import torch

_fake_registered = False


def _ops():
    global _fake_registered
    from kernels import cpu_build  # NOTE: lazy, as in cpu_attention

    cpu_build.load()
    if not _fake_registered:
        _register_fake()
        _fake_registered = True
    return torch.ops.pagedserve


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """Pack ``weight [N, K]`` (float32, bfloat16, float16 or int8, CPU) for ``cpu_linear``.

    Returns a new tensor in ``weight``'s dtype: ``[ceil(N/32), ceil(K/2), 32, 2]`` for 16-bit
    and int8 weights (VNNI-2 pairs), ``[ceil(N/32), K, 32]`` for float32; N is zero-padded to
    whole blocks of 32 (and K to even).

    Raises:
        ValueError: not 2-D, not on the CPU, or another dtype.
    """
    return _ops().pack_linear_weight(weight)


def pack_uint4_weight(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[N, K]`` (uint8 holding 0..15, K even) for ``cpu_linear``:
    ``[ceil(N/32), K/2, 32]`` uint8, W[n, 2j] in the low nibble of ``[n // 32, j, n % 32]`` and
    W[n, 2j + 1] in its high nibble; N zero-padded to whole blocks of 32. A quarter of the
    bytes of a bf16 weight; the kernel reads them with a per-group scale (and min).

    Raises:
        ValueError: not 2-D uint8, K odd, or a code above 15.
    """
    if codes.dim() != 2 or codes.dtype != torch.uint8 or codes.shape[1] % 2:
        raise ValueError(f"pack_uint4_weight: codes must be uint8 [N, K] with K even, got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"pack_uint4_weight: codes must be 0..15, got {int(codes.max())}")
    n, k = codes.shape
    blocks = -(-n // 32)
    padded = torch.zeros(blocks * 32, k, dtype=torch.uint8)
    padded[:n] = codes
    pairs = padded.view(blocks, 32, k // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(1, 2).contiguous()


def gate_up_blocks(gate_up: torch.Tensor) -> torch.Tensor:
    """A SwiGLU layer's fused ``[2I, ...]`` gate-then-up rows (a weight ``[2I, K]`` or a bias
    ``[2I]``) reordered for ``cpu_linear(..., silu_mul=True)``: blocks of 32 rows, block ``b``
    holding gate rows ``16b .. 16b + 15`` then up rows ``16b .. 16b + 15``.

    Raises:
        ValueError: ``2I`` is not a multiple of 32.
    """
    rows = gate_up.shape[0]
    if rows % 32:
        raise ValueError(f"gate_up has {rows} rows; silu_mul needs a multiple of 32")
    gate, up = gate_up.reshape(2, rows // 32, 16, *gate_up.shape[1:]).unbind(0)
    return torch.stack((gate, up), dim=1).reshape(gate_up.shape).contiguous()


def cpu_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None,
               weight_scale: torch.Tensor | None = None,
               silu_mul: bool = False,
               weight_min: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias) -> [M, out_features]`` in ``out_dtype`` (default ``x.dtype``).

    ``x`` must have the packed weight's dtype (quantized weights, int8 or
    ``pack_uint4_weight``'s uint8: float32, bfloat16 or float16);
    ``bias [N]`` may have any float dtype (added in float32 before the one rounding to
    ``out_dtype``). Accumulation is float32.

    ``weight_scale`` (quantized weights only; float32): ``[N]``, a scale per output channel
    (int8 only), ``W = q * scale[:, None]``, applied to the float32 sums before the bias; or
    ``pack_group_scale``'s ``[ceil(N/32), K/G, 32]``, a scale per group of G consecutive k (G
    even; required for 4-bit codes), ``W[n, k] = q[n, k] * scale[n, k // G] + min[n, k // G]``
    with ``weight_min`` (the same layout; None: 0), applied to each weight as it is
    dequantized (then rounded to ``x``'s dtype, as a model in that dtype holds its weights).

    ``silu_mul``: SwiGLU's gate (Shazeer 2020, "GLU Variants Improve Transformer") in the
    epilogue: the weight, bias and scale rows are ``gate_up_blocks``' order and the result is
    ``[M, out_features / 2]``, ``silu(gate) * up`` computed from the float32 sums (bias
    added) and rounded once, where an unfused layer rounds gate and up to ``out_dtype`` first.

    Raises:
        ValueError: mismatched dtypes or shapes, a tensor that is not ``pack_linear_weight``'s,
            quantized weights without ``weight_scale`` (4-bit: without a per-group one) or
            another weight with one, ``weight_min`` without a per-group scale of its shape,
            ``silu_mul`` with ``out_features`` not a multiple of 32.
    """
    return _ops().linear(x, packed, out_features, bias, out_dtype, weight_scale, silu_mul,
                         weight_min)


def write_packed(packed: torch.Tensor, row: int, col: int, block: torch.Tensor) -> None:
    """Overwrite a block of a packed weight in place: after it, ``packed`` is what
    ``pack_linear_weight`` gives for the weight with ``W[row:row + r, col:col + c] = block``.
    A fused LoRA layer's slot swap writes its adapter's A and B this way
    (``services/worker/lora/layers.py``), where repacking would copy the whole weight.

    Args:
        packed: ``pack_linear_weight``'s result for a float32, bfloat16 or float16 weight
            ``[N, K]`` (``[ceil(N/32), K, 32]`` or ``[ceil(N/32), ceil(K/2), 32, 2]``).
        row, col: the block's first output and input feature.
        block: ``[r, c]``, any float dtype (cast to ``packed``'s); it must lie within the
            packed blocks (rows up to ``32 * ceil(N/32)``, columns up to K rounded up to even
            for 16-bit weights).

    Raises:
        ValueError: a block outside the packed weight, or a packed int8 weight.
    """
    r, c = block.shape
    rows = packed.shape[0] * 32
    cols = packed.shape[1] * (1 if packed.dim() == 3 else 2)
    if packed.dtype == torch.int8 or min(row, col) < 0 or row + r > rows or col + c > cols:
        raise ValueError(f"cannot write a [{r}, {c}] block at ({row}, {col}) into a packed "
                         f"{packed.dtype} weight {tuple(packed.shape)}")
    n = torch.arange(row, row + r)[:, None]
    k = torch.arange(col, col + c)[None, :]
    if packed.dim() == 3:  # float32: W[n, k] at [n / 32, k, n % 32]
        packed[n // 32, k, n % 32] = block.to(packed.dtype)
    else:  # 16-bit: W[n, k] at [n / 32, k / 2, n % 32, k % 2]
        packed[n // 32, k // 2, n % 32, k % 2] = block.to(packed.dtype)


def pack_group_scale(scale: torch.Tensor) -> torch.Tensor:
    """Per-group scales ``[N, K/G]`` (float32) -> ``cpu_linear``'s ``[ceil(N/32), K/G, 32]``:
    group g of row n at ``[n // 32, g, n % 32]`` (N zero-padded to whole blocks of 32)."""
    n, groups = scale.shape
    blocks = -(-n // 32)
    padded = torch.zeros(blocks * 32, groups, dtype=torch.float32)
    padded[:n] = scale
    return padded.view(blocks, 32, groups).transpose(1, 2).contiguous()


VNNI_ENV = "PAGEDSERVE_CPU_VNNI"  # "0": w8a8_linear's VNNI bodies off (tests of the others)
# "1" / "0": w8a8_linear's items of 16+ rows on ATen's cpublas::brgemm (oneDNN's ukernel:
# AMX-INT8 tiles on an AMX CPU, the default there) on / off, on an AVX512-VNNI CPU
BRGEMM_ENV = "PAGEDSERVE_CPU_W8A8_BRGEMM"


def pack_w8a8_weight(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack int8 weights ``q [N, K]`` (values in [-127, 127], CPU) for ``cpu_w8a8_linear``.

    Returns ``(packed, compensation)``: ``packed [ceil(N/32), ceil(K/4), 32, 4]`` int8 with
    ``W[n, k]`` at ``[n // 32, k // 4, n % 32, k % 4]`` (VNNI-4, N and K zero-padded), and
    ``compensation [32 ceil(N/32)]`` int32, ``128 * q[n, :].sum()`` (what the VNNI bodies
    subtract: they read the activations as ``xq + 128``).

    Raises:
        ValueError: not 2-D int8 on the CPU, or a -128 (the range is symmetric).
    """
    packed, compensation = _ops().pack_w8a8_weight(q)
    return packed, compensation


def cpu_w8a8_linear(x: torch.Tensor, packed: torch.Tensor, compensation: torch.Tensor,
                    out_features: int, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                    silu_mul: bool = False) -> torch.Tensor:
    """W8A8: ``x [M, K]`` (float32 / bf16 / fp16) times ``pack_w8a8_weight``'s int8 weights
    with scales ``weight_scale [N]`` (float32) -> ``[M, N]`` in ``out_dtype`` (default
    ``x.dtype``); ``silu_mul`` as ``cpu_linear``'s (``[M, N / 2]``).

    Each row of ``x`` is quantized per token in the op (``kernels.int8_linear.
    quantize_symmetric``'s rule), the products summed in int32 (vpdpbusd on AVX512-VNNI /
    AVX-VNNI, vpmaddubsw on AVX2, loops otherwise; on an AMX CPU items of 16 rows or more as
    one ``cpublas::brgemm`` call, AMX-INT8 tiles; exact, so every body agrees), and
    ``(float(acc) * s_x) * s_w + bias`` rounded once: ``kernels.int8_linear.w8a8_linear``'s
    result bit for bit (without ``silu_mul``).

    Raises:
        ValueError: mismatched dtypes or shapes, or tensors that are not
            ``pack_w8a8_weight``'s.
    """
    return _ops().w8a8_linear(x, packed, compensation, out_features, weight_scale, bias,
                              out_dtype, silu_mul)


def w8a8_linear_body() -> str:
    """The body ``cpu_w8a8_linear`` runs now: ``brgemm`` (``vnni512`` below 16 rows),
    ``vnni512``, ``avxvnni``, ``avx2`` or ``scalar`` (the best this CPU has under
    ``PAGEDSERVE_CPU_ISA``, ``PAGEDSERVE_CPU_VNNI`` and ``PAGEDSERVE_CPU_W8A8_BRGEMM``)."""
    return str(_ops().w8a8_linear_body())


A8_ENV = "PAGEDSERVE_CPU_A8"  # "1": int8 activations (services/worker/quantized_linear.py)


def pack_a8_weight(codes: torch.Tensor) -> torch.Tensor:
    """Pack group-quantized codes ``[N, K]`` (K a multiple of 32; N zero-padded to blocks of
    32) for ``cpu_a8_linear``: 4-bit codes (uint8 holding 0..15) -> ``[ceil(N/32), K/8, 32,
    4]`` uint8, the four bytes of (octet j, column c) holding codes ``k = 8j .. 8j+3`` in
    their low nibbles and ``8j+4 .. 8j+7`` in their high ones (``pack_uint4_weight``'s bytes
    in another order); int8 codes (in [-127, 127]) -> ``[ceil(N/32), K/4, 32, 4]`` int8.

    Raises:
        ValueError: not 2-D uint8 / int8 on the CPU, K not a multiple of 32, a 4-bit code
            above 15 or an int8 code of -128.
    """
    return _ops().pack_a8_weight(codes)


def cpu_a8_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  weight_scale: torch.Tensor, weight_min: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  silu_mul: bool = False) -> torch.Tensor:
    """W4A8 / W8A8 per group (llama.cpp's Q4 / Q8 x Q8 forms): ``x [M, K]`` times
    ``pack_a8_weight``'s codes with ``pack_group_scale``'s scales (and mins) per group of G
    (a multiple of 32) -> ``[M, N]`` in ``out_dtype`` (default ``x.dtype``).

    Each row of ``x`` is quantized to int8 per group of 32 (scale ``amax / 127``, round half
    to even), ``x . q`` summed exactly in int32 per group (vpdpbusd on AVX512-VNNI, vpmaddubsw
    on AVX2; ``x`` float32 / bf16 / fp16), then
    ``y = sum_a float(D_a) * (s_x,a * s_g) + sum_g m_g * X_g + bias`` in float32, ``X_g``
    the group's sum of the dequantized activations ``xq * s_x`` (llama.cpp's ``y.s``): the
    weight-only product of those activations. Row-invariant. ``silu_mul`` as
    ``cpu_linear``'s.

    Raises:
        ValueError: mismatched dtypes or shapes, or tensors that are not the packers'.
    """
    return _ops().a8_linear(x, packed, out_features, weight_scale, weight_min, bias,
                            out_dtype, silu_mul)


def _register_fake() -> None:
    """Shape functions for ``torch.compile`` (FakeTensor tracing with dynamic ``M``)."""
    @torch.library.register_fake("pagedserve::linear")
    def _linear_fake(x, packed_weight, out_features, bias=None, out_dtype=None,
                     weight_scale=None, silu_mul=False, weight_min=None):
        cols = out_features // 2 if silu_mul else out_features
        return x.new_empty((x.shape[0], cols), dtype=out_dtype or x.dtype)

    @torch.library.register_fake("pagedserve::w8a8_linear")
    def _w8a8_fake(x, packed_weight, compensation, out_features, weight_scale, bias=None,
                   out_dtype=None, silu_mul=False):
        cols = out_features // 2 if silu_mul else out_features
        return x.new_empty((x.shape[0], cols), dtype=out_dtype or x.dtype)

    @torch.library.register_fake("pagedserve::a8_linear")
    def _a8_fake(x, packed_weight, out_features, weight_scale, weight_min=None, bias=None,
                   out_dtype=None, silu_mul=False):
        cols = out_features // 2 if silu_mul else out_features
        return x.new_empty((x.shape[0], cols), dtype=out_dtype or x.dtype)

    @torch.library.register_fake("pagedserve::pack_linear_weight")
    def _pack_fake(weight):
        n, k = weight.shape
        if weight.dtype == torch.float32:
            return weight.new_empty(((n + 31) // 32, k, 32))
        return weight.new_empty(((n + 31) // 32, (k + 1) // 2, 32, 2))
