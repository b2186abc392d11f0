"""4-bit AWQ and GPTQ safetensors checkpoints read as ``GroupCodes`` (codes, scale, min).

One linear layer of an AWQ (GEMM) or GPTQ checkpoint is stored as packed int32 codes, packed
int32 zero points and fp16 scales, one scale and zero per group of ``G`` input features (K)
and output feature (N). ``read_awq`` / ``read_gptq`` unpack them into the
``gguf_blocks.GroupCodes`` the native CPU kernel serves::

    codes [N, K] uint8 (0..15)     scale [N, K/G] float32 = s     min [N, K/G] float32 = -(z*s)

so that ``codes * scale + min`` is ``(q - z) * s``, the published dequantization, EXACTLY in
float32: ``s`` has at most 11 significant bits (fp16; bf16: 8), ``q``, ``z`` are at most 16,
so ``q*s`` and ``z*s`` are exact in float32 and so is their difference (at most 16
significant bits, no rounding below the normal range either: fp16 and bf16 values are
multiples of 2**-24 and 2**-133, float32's subnormals of 2**-149), which the float32 addition
then gives unrounded. (Scales that are not finite, or bf16 ones of 2**124 or more, where
``code * scale`` would overflow, are refused.) Only the sign of a zero may differ (``q ==
z`` gives +0.0 where ``(q - z) * s`` is -0.0 for a negative ``s``). The reference
dequantizations (AutoAWQ ``dequantize_gemm``, AutoGPTQ's torch path) compute ``(q - z) * s``
in fp16 (one rounding of that exact product), so a weight here rounded to fp16 is bit for bit
theirs (+-inf where theirs overflows); GPU kernels (vLLM's) round in their own ways.

Formats (packing, ``0xF`` nibbles, little end first):

AWQ, GEMM version (AutoAWQ ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear`` and
``awq/utils/packing_utils.py`` ``unpack_awq`` / ``reverse_awq_order`` / ``dequantize_gemm``;
vLLM ``model_executor/layers/quantization/awq.py``, ``utils/quant_utils.py``
``AWQ_PACK_ORDER`` / ``AWQ_REVERSE_ORDER``):

* ``qweight`` int32 ``[K, N/8]``: word ``qweight[k, c]`` holds ``q[k, 8c .. 8c+7]``, nibble
  ``i`` (bits ``4i .. 4i+3``) holding column ``8c + AWQ_PACK_ORDER[i]``, ``AWQ_PACK_ORDER =
  [0, 2, 4, 6, 1, 3, 5, 7]`` (the packer: ``qweight[:, c] |= q[:, 8c + order[i]] << 4i``);
  unpacking takes nibble ``AWQ_REVERSE_ORDER[j]`` for column ``8c + j``.
* ``qzeros`` int32 ``[K/G, N/8]``, packed the same way; ``scales`` fp16 ``[K/G, N]``.
* ``W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]`` (AutoAWQ: int8 difference times
  fp16 scales, in fp16).

GPTQ (AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py`` ``pack`` / ``forward``,
GPTQModel ``gptqmodel/nn_modules/qlinear``; vLLM ``model_executor/layers/quantization/
gptq.py``, ``csrc/quantization/gptq/q_gemm.cu``):

* ``qweight`` int32 ``[K/8, N]``: ``q[8r + i, n]`` in nibble ``i`` of ``qweight[r, n]``
  (the packer: ``qweight[r] |= q[8r + i] << 4i``).
* ``qzeros`` int32 ``[K/G, N/8]``: ``z[g, 8c + i]`` in nibble ``i`` of ``qzeros[g, c]``.
* ``scales`` fp16 ``[K/G, N]``; ``g_idx`` int32 ``[K]``, the group of each input feature
  (``k // G`` without act-order; with ``desc_act`` a permutation of that).
* Zero points: ``checkpoint_format`` "gptq" (v1, AutoGPTQ and most published checkpoints)
  stores ``zero - 1``: the zero is the stored nibble plus 1, modulo 16 as AutoGPTQ's torch
  dequantization gives it (``zeros = (zeros + 1) & 0xF``). NOTE: only a stored 15 tells the
  conventions apart: vLLM's exllama kernel (``q_gemm.cu``) adds 1 unmasked (zero 16), and
  GPTQModel's v1 -> v2 conversion adds 0x11111111 to the words (zero 0, carry into the next
  nibble); a 15 comes only from a zero of 0, which AutoGPTQ's packer writes as -1 OR'd over
  the higher nibbles too, so no reading is right for such a word. "gptq_v2" (GPTQModel)
  stores the zero as is. ``sym=True`` means every zero is 8 (v1 stores 7); then ``qzeros``
  may be absent.
* ``W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]``; ``group_size`` -1 is a
  single group over all of K.

Act-order (``desc_act``): the kernel needs each group's K contiguous, so ``read_gptq`` sorts
the input features by group: ``perm = argsort(g_idx, stable=True)`` and ``W'[:, j] = W[:,
perm[j]]``; the layer computes ``x[:, perm] @ W'.T``, which is ``x @ W.T``.

The kernel packs pairs of K, so K (and G) must be even.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.worker.gguf_blocks import GroupCodes
from services.worker.gguf_weights import fuse

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble ``i`` of an AWQ word holds column ``AWQ_PACK_ORDER[i]`` of its 8."""

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""Column ``j`` of an AWQ word's 8 is in nibble ``AWQ_REVERSE_ORDER[j]`` (the inverse)."""

GROUP_SIZES = (32, 64, 128)
"""``group_size`` values ``quant_config`` accepts (GPTQ also -1: one group over K)."""

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")

_SCALE_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Int4Config:
    """A checkpoint's ``quantization_config`` (``config.json``), as far as this reader needs.

    Attributes:
        quant_method: "awq" or "gptq".
        bits: 4.
        group_size: 32, 64 or 128; GPTQ also -1 (one group over all of K).
        desc_act: GPTQ act-order: ``g_idx`` not ``k // G`` (``read_gptq`` permutes K).
        sym: GPTQ symmetric (every zero point 8); False for AWQ.
        checkpoint_format: GPTQ zero convention, "gptq" (v1: zero - 1 stored) or "gptq_v2";
            "gptq" for AWQ (unused).
        zero_point: AWQ ``zero_point`` (True for every GEMM checkpoint AutoAWQ writes; the
            ``qzeros`` tensor is read either way); True for GPTQ.
    """

    quant_method: str
    bits: int
    group_size: int
    desc_act: bool = False
    sym: bool = False
    checkpoint_format: str = "gptq"
    zero_point: bool = True


@dataclass(frozen=True, slots=True)
class Int4Layer:
    """One linear layer of an AWQ / GPTQ checkpoint, as the native kernel serves it.

    Attributes:
        weight: ``GroupCodes``: codes uint8 ``[N, K]`` (0..15; K columns permuted by
            ``perm``), scale and min float32 ``[N, K/G]``, group ``G``.
        perm: int64 ``[K]``: the layer computes ``x[:, perm] @ weight.dequantize().T``
            (``weight``'s column ``j`` is the checkpoint's input feature ``perm[j]``);
            None: the identity.
    """

    weight: GroupCodes
    perm: torch.Tensor | None


def _get(cfg: dict[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    for key in keys:
        if key in cfg:
            return cfg[key]
    return default


def quant_config(config: dict[str, Any]) -> Int4Config | None:
    """Parse ``config.json``'s ``quantization_config`` (keys as vLLM's ``AWQConfig`` /
    ``GPTQConfig.from_config`` read them; AutoAWQ's ``w_bit`` / ``q_group_size`` too).

    Args:
        config: the whole ``config.json`` as a dict.

    Returns:
        The parsed config; None when ``config`` has no ``quantization_config``.

    Raises:
        ValueError: naming the field, for anything this reader does not support:
            ``quant_method`` not "awq" / "gptq"; ``bits`` not 4; ``group_size`` not 32 / 64 /
            128 (GPTQ: or -1); AWQ ``version`` not "gemm" (any case; absent: GEMM, AutoAWQ's
            default) or ``backend`` "llm-awq" (another packing); GPTQ ``checkpoint_format``
            (or ``format``) not "gptq" / "gptq_v2", or ``is_marlin_format``.
    """
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be a dict, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ValueError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not "
                         "supported (only 'awq' and 'gptq' 4-bit checkpoints)")
    bits = _get(qc, ("bits", "w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config.bits {bits!r} is not supported (only 4-bit "
                         f"{method} checkpoints)")
    group = _get(qc, ("group_size", "q_group_size"))
    allowed = (*GROUP_SIZES, -1) if method == "gptq" else GROUP_SIZES
    if isinstance(group, bool) or group not in allowed:
        raise ValueError(f"quantization_config.group_size {group!r} is not supported for "
                         f"{method} (one of {allowed})")
    if method == "awq":
        version = str(qc.get("version", "gemm"))
        if version.lower() != "gemm":
            raise ValueError(f"quantization_config.version {version!r} is not supported for "
                             "awq (only the GEMM packing)")
        backend = str(qc.get("backend", "autoawq")).lower()
        if backend != "autoawq":
            raise ValueError(f"quantization_config.backend {qc.get('backend')!r} is not "
                             "supported for awq (only AutoAWQ's GEMM packing)")
        return Int4Config("awq", 4, int(group), zero_point=bool(qc.get("zero_point", True)))
    fmt = str(_get(qc, ("checkpoint_format", "format"), "gptq")).lower()
    if fmt not in CHECKPOINT_FORMATS or qc.get("is_marlin_format", False):
        raise ValueError(f"quantization_config.checkpoint_format {fmt!r} is not supported for "
                         f"gptq (one of {CHECKPOINT_FORMATS}; no marlin repacking)")
    return Int4Config("gptq", 4, int(group), desc_act=bool(qc.get("desc_act", False)),
                      sym=bool(qc.get("sym", True)), checkpoint_format=fmt)


def _check(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...],
           shape: tuple[int, ...], what: str) -> None:
    if t.dtype not in dtypes or tuple(t.shape) != shape:
        want = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {want} {what} = {list(shape)}, got "
                         f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}")


def _check_dims(name: str, t: torch.Tensor, what: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D {what}, got {list(t.shape)}")


def _check_kn(k: int, n: int, group: int) -> None:
    if n <= 0 or n % 8:
        raise ValueError(f"N={n} output features must be a positive multiple of 8 (8 4-bit "
                         "values per int32)")
    if k <= 0 or k % 2:
        raise ValueError(f"K={k} input features must be positive and even (the kernel packs "
                         "pairs of K)")
    if group <= 0 or k % group or group % 2:
        raise ValueError(f"group_size {group} must be even and divide K={k}")


def _nibbles(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """uint8 ``[*packed.shape, 8]``: ``out[..., j] = nibble order[j] of packed``."""
    out = torch.empty((*packed.shape, 8), dtype=torch.uint8, device=packed.device)
    for j, i in enumerate(order):
        # >> is arithmetic on int32; the mask drops the sign bits
        out[..., j] = torch.bitwise_and(packed >> (4 * i), 0xF).to(torch.uint8)
    return out


def _group_codes(codes_kn: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 group: int) -> GroupCodes:
    """codes ``[K, N]`` uint8, zeros ``[K/G, N]`` (any integer dtype), scales ``[K/G, N]``
    fp16 / bf16 -> ``GroupCodes`` ``[N, K]`` with ``min = -(z * s)`` (exact in float32)."""
    s = scales.to(torch.float32)
    if not bool(torch.isfinite(s * 16).all()):
        raise ValueError("scales must be finite with |scale| * 16 within float32 (a bf16 "
                         "scale of 2**124 or more would overflow code * scale)")
    neg_min = zeros.to(torch.float32) * s
    return GroupCodes(codes_kn.t().contiguous(), s.t().contiguous(),
                      (-neg_min).t().contiguous(), group)


def read_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             group_size: int) -> Int4Layer:
    """One AWQ (GEMM version) linear layer as ``GroupCodes``; see the module docstring.

    ``weight.dequantize()[n, k]`` is ``(q[k, n] - z[k // G, n]) * s[k // G, n]`` exactly in
    float32 (AutoAWQ ``packing_utils.dequantize_gemm``, transposed to ``[N, K]``, before its
    fp16 rounding).

    Args:
        qweight: int32 ``[K, N/8]``, 8 columns per word in ``AWQ_PACK_ORDER``.
        qzeros: int32 ``[K/G, N/8]``, packed as ``qweight``.
        scales: float16 (or bfloat16) ``[K/G, N]``.
        group_size: G (32, 64, 128 in published checkpoints; any even divisor of K).

    Returns:
        ``Int4Layer`` with ``perm`` None; new tensors (the inputs are not aliased).

    Raises:
        ValueError: a tensor of the wrong dtype or shape (named, with the expected shape);
            N not a multiple of 8; K odd; G not even or not dividing K; a scale not finite
            or of 2**124 or more.
    """
    _check_dims("scales", scales, "[K/G, N]")
    _check_dims("qweight", qweight, "[K, N/8]")
    n = scales.shape[1]
    k = qweight.shape[0]
    _check_kn(k, n, group_size)
    ng = k // group_size
    _check("qweight", qweight, (torch.int32,), (k, n // 8), "[K, N/8]")
    _check("qzeros", qzeros, (torch.int32,), (ng, n // 8), "[K/G, N/8]")
    _check("scales", scales, _SCALE_DTYPES, (ng, n), "[K/G, N]")
    codes = _nibbles(qweight, AWQ_REVERSE_ORDER).view(k, n)
    zeros = _nibbles(qzeros, AWQ_REVERSE_ORDER).view(ng, n)
    return Int4Layer(_group_codes(codes, zeros, scales, group_size), None)


def _gptq_zeros(qzeros: torch.Tensor | None, ng: int, n: int, sym: bool,
                checkpoint_format: str) -> torch.Tensor:
    """The zero points, uint8 ``[K/G, N]`` (0..15), per the checkpoint format."""
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format {checkpoint_format!r} is not one of "
                         f"{CHECKPOINT_FORMATS}")
    if qzeros is None:
        if not sym:
            raise ValueError("qzeros is required unless sym=True (zero point 8)")
        return torch.full((ng, n), 8, dtype=torch.uint8)
    _check("qzeros", qzeros, (torch.int32,), (ng, n // 8), "[K/G, N/8]")
    zeros = _nibbles(qzeros, tuple(range(8))).view(ng, n)
    if checkpoint_format == "gptq":
        zeros = torch.bitwise_and(zeros + 1, 0xF)  # v1 stores zero - 1 (AutoGPTQ's & 0xF)
    if sym and not bool((zeros == 8).all()):
        bad = int((zeros != 8).sum())
        raise ValueError(f"qzeros: sym=True but {bad} zero points are not 8 (stored "
                         f"{'7' if checkpoint_format == 'gptq' else '8'} in {checkpoint_format} "
                         "format); is the checkpoint asymmetric?")
    return zeros


def read_gptq(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
              group_size: int, g_idx: torch.Tensor | None = None, sym: bool = True,
              checkpoint_format: str = "gptq") -> Int4Layer:
    """One GPTQ linear layer as ``GroupCodes`` plus the act-order permutation; see the module
    docstring.

    ``weight.dequantize()[n, j]`` is ``(q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]``
    for ``k = perm[j]`` (``k = j`` without ``perm``), exactly in float32 (AutoGPTQ's
    dequantization before its fp16 rounding).

    Args:
        qweight: int32 ``[K/8, N]``, 8 consecutive k of a column per word.
        qzeros: int32 ``[K/G, N/8]``, 8 consecutive columns per word; None only with
            ``sym`` (every zero 8).
        scales: float16 (or bfloat16) ``[K/G, N]``.
        group_size: G; -1: one group over all of K.
        g_idx: int32 / int64 ``[K]``, the group of each input feature, each group exactly G
            long; None or ``k // G``: no permutation.
        sym: every zero point is 8; given ``qzeros`` are checked to say so.
        checkpoint_format: "gptq" (v1: ``qzeros`` holds zero - 1) or "gptq_v2".

    Returns:
        ``Int4Layer``: ``weight`` with its K columns sorted by group (``perm`` = the stable
        argsort of ``g_idx``, int64), or ``perm`` None when ``g_idx`` is already sorted.

    Raises:
        ValueError: a tensor of the wrong dtype or shape (named, with the expected shape);
            N not a multiple of 8; K odd; G not even or not dividing K; ``g_idx`` values out
            of range or a group not exactly G long; ``qzeros`` None without ``sym``, or not
            all 8 with ``sym``; an unknown ``checkpoint_format``; a scale not finite or of
            2**124 or more.
    """
    _check_dims("qweight", qweight, "[K/8, N]")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = k if group_size == -1 else group_size
    _check_kn(k, n, group)
    ng = k // group
    _check("qweight", qweight, (torch.int32,), (k // 8, n), "[K/8, N]")
    _check("scales", scales, _SCALE_DTYPES, (ng, n), "[K/G, N]")
    zeros = _gptq_zeros(qzeros, ng, n, sym, checkpoint_format)
    # [K/8, N, 8] -> [K/8, 8, N] -> [K, N]
    codes = _nibbles(qweight, tuple(range(8))).permute(0, 2, 1).reshape(k, n)
    perm = None
    if g_idx is not None:
        _check("g_idx", g_idx, (torch.int32, torch.int64), (k,), "[K]")
        g = g_idx.to(torch.int64)
        if bool((g < 0).any()) or bool((g >= ng).any()):
            raise ValueError(f"g_idx values must be in [0, {ng}) (K/G groups), got "
                             f"[{int(g.min())}, {int(g.max())}]")
        counts = torch.bincount(g, minlength=ng)
        if bool((counts != group).any()):
            j = int(torch.nonzero(counts != group)[0])
            raise ValueError(f"g_idx: group {j} has {int(counts[j])} input features, not "
                             f"group_size {group}")
        if not bool((g[1:] >= g[:-1]).all()):
            perm = torch.argsort(g, stable=True)
            codes = codes[perm]
    return Int4Layer(_group_codes(codes, zeros, scales, group), perm)


def dequantize_reference(quant_method: str, qweight: torch.Tensor,
                         qzeros: torch.Tensor | None, scales: torch.Tensor, group_size: int,
                         g_idx: torch.Tensor | None = None, sym: bool = True,
                         checkpoint_format: str = "gptq",
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The published dequantization, ``[N, K]`` in the checkpoint's K order, for tests.

    Written after the reference code, independently of ``read_awq`` / ``read_gptq``:

    * "awq": AutoAWQ ``packing_utils``: ``unpack_awq`` (shift every word by 0, 4, .., 28),
      ``reverse_awq_order`` (index the columns by ``arange(N).view(-1, 8)[:,
      AWQ_REVERSE_ORDER]``), ``dequantize_gemm``: ``(iweight - izeros) * scales``, scales and
      zeros repeated G times along K; transposed.
    * "gptq": AutoGPTQ ``qlinear_cuda_old`` dequantization: zeros ``(nibble + 1) & 0xF`` for
      v1 ("gptq"), as stored for "gptq_v2", 8 for ``sym`` without ``qzeros``; ``weight =
      scales[g_idx] * (q - zeros[g_idx])``; transposed.

    Args:
        quant_method: "awq" or "gptq".
        qweight, qzeros, scales, group_size, g_idx, sym, checkpoint_format: as ``read_awq``
            / ``read_gptq`` take them (not validated here; ``g_idx`` only for GPTQ).
        dtype: ``torch.float32``: ``(q - z).float() * s.float()``, exact; ``torch.float16``:
            ``(q - z).half() * s.half()``, rounded once to fp16 as AutoAWQ / AutoGPTQ
            compute it.

    Returns:
        ``dtype`` ``[N, K]``.

    Raises:
        ValueError: ``quant_method`` or ``dtype`` not one of the above; AWQ ``qzeros`` None.
    """
    if dtype not in (torch.float32, torch.float16):
        raise ValueError(f"dtype must be float32 or float16, got {dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if quant_method == "awq":
        if qzeros is None:
            raise ValueError("qzeros is required for awq")
        iweight = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :])
        iweight = iweight.reshape(qweight.shape[0], -1)
        izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :])
        izeros = izeros.reshape(qzeros.shape[0], -1)
        order = torch.arange(iweight.shape[-1]).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)]
        iweight = torch.bitwise_and(iweight[:, order.reshape(-1)], 0xF).to(torch.int64)
        izeros = torch.bitwise_and(izeros[:, order.reshape(-1)], 0xF).to(torch.int64)
        z = izeros.repeat_interleave(group_size, dim=0)
        s = scales.repeat_interleave(group_size, dim=0)
    elif quant_method == "gptq":
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        group = k if group_size == -1 else group_size
        iweight = torch.bitwise_right_shift(qweight[:, None, :], shifts[None, :, None])
        iweight = torch.bitwise_and(iweight.reshape(k, n), 0xF).to(torch.int64)
        if qzeros is None:
            zeros = torch.full((k // group, n), 8, dtype=torch.int64)
        else:
            zeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :])
            zeros = torch.bitwise_and(zeros.reshape(qzeros.shape[0], -1), 0xF).to(torch.int64)
            if checkpoint_format == "gptq":
                zeros = torch.bitwise_and(zeros + 1, 0xF)
        gi = (torch.arange(k) // group if g_idx is None else g_idx.to(torch.int64))
        z = zeros[gi]
        s = scales[gi]
    else:
        raise ValueError(f"quant_method {quant_method!r} is not 'awq' or 'gptq'")
    w = (iweight - z).to(dtype) * s.to(dtype)
    return w.t().contiguous()


# our fused module (after "layers.{j}.") -> its checkpoint layers (after "layers.{i}."), in row
# order
MODULES = {
    "attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def read_int4_modules(handles: dict[str, Any], config: Int4Config,
                      layers: list[int] | range) -> tuple[dict[str, Int4Layer],
                                                          dict[str, tuple[int, int]]]:
    """The 4-bit layers of ``layers`` (checkpoint layer ids), fused into our modules.

    Args:
        handles: checkpoint tensor name without the ``model.`` prefix -> ``(open safetensors
            file, its name)`` (the loader's).
        config: the checkpoint's ``quant_config``.
        layers: the checkpoint layers this rank serves; local layer ``j`` is ``layers[j]``.

    Returns:
        ``({"layers.{j}.attn.qkv_proj": Int4Layer, ...}, {"layers.{i}.self_attn.q_proj.weight":
        (N, K), ...})``: the modules whose parts are all 4-bit (``gguf_weights.fuse``d: one
        group size, so 4-bit codes), and the shape of each part's float weight, which the
        checkpoint does not hold.

    Raises:
        ValueError: a malformed tensor (``read_awq`` / ``read_gptq``, naming it), or the
            parts of one module with different act-order permutations.
    """
    def tensor(name: str) -> torch.Tensor | None:
        if name not in handles:
            return None
        f, full = handles[name]
        return f.get_tensor(full)

    modules: dict[str, Int4Layer] = {}
    shapes: dict[str, tuple[int, int]] = {}
    for j, i in enumerate(layers):
        for ours, parts in MODULES.items():
            bases = [f"layers.{i}.{p}" for p in parts]
            if not all(f"{b}.qweight" in handles for b in bases):
                continue
            pieces = []
            for base in bases:
                qweight, qzeros, scales = (tensor(f"{base}.{t}")
                                           for t in ("qweight", "qzeros", "scales"))
                if qweight is None or scales is None or (qzeros is None
                                                         and config.quant_method == "awq"):
                    raise ValueError(f"{base}: the {config.quant_method} tensors qweight, "
                                     f"qzeros and scales are not all there")
                try:
                    if config.quant_method == "awq":
                        assert qzeros is not None  # (checked above)
                        layer = read_awq(qweight, qzeros, scales, config.group_size)
                    else:
                        layer = read_gptq(qweight, qzeros, scales, config.group_size,
                                          tensor(f"{base}.g_idx"), sym=config.sym,
                                          checkpoint_format=config.checkpoint_format)
                except ValueError as e:
                    raise ValueError(f"{base}: {e}") from e
                pieces.append(layer)
                shapes[f"{base}.weight"] = (int(layer.weight.codes.shape[0]),
                                            int(layer.weight.codes.shape[1]))
            perm = pieces[0].perm
            if any((p.perm is None) != (perm is None)
                   or (perm is not None and p.perm is not None and not torch.equal(p.perm, perm))
                   for p in pieces):
                raise ValueError(f"layers.{i}: {', '.join(parts)} have different act-order "
                                 f"permutations (g_idx); they cannot be fused into one layer")
            modules[f"layers.{j}.{ours}"] = Int4Layer(fuse([p.weight for p in pieces]), perm)
    return modules, shapes
