"""The native row-invariant linear (``kernels.cpu_linear``) against torch's ``F.linear`` (oneDNN
at bf16, MKL at float32), per call, on SmolLM2-135M's shapes: qkv ``576 -> 960``, o ``576 ->
576``, gate_up ``576 -> 3072``, down ``1536 -> 576`` and the LM head ``576 -> 49152`` (native:
float32 logits; torch: rounded to the model dtype, as before issue 30).

Median of ``--reps`` calls per (shape, M) after warm-up; ratio = torch / native (> 1: native
faster). The native kernel runs the best path this CPU has (``PAGEDSERVE_CPU_ISA`` forces a
lower one). ``torch rows``: whether torch's M-row result equals the first M rows of its
512-row result bitwise ("same"), or whether M rows took another kernel ("differ"): the reason
a 16-bit model's layers run on the native kernel, which is row-invariant by construction.

    .venv/bin/python benchmarks/kernels/cpu_linear.py [--dtype bfloat16] [--reps 20]

``--quantization int8|w8a8`` (the decoder's shapes; the LM head is not quantized): the int8
layers (``services/worker/quantized_linear.py``) against the unquantized ones, the minimum of
``--reps`` calls (a shared machine), ms per call, at ``--rows`` (default 1,128), with
``--layers N`` distinct weight copies called in turn (N = 30: weights from memory or L3, as a
30-layer model reads them; 1: from L2). Columns: ``torch`` = ``F.linear`` on the float weights
(a float32 model's layers), ``native`` = ``kernels.cpu_linear`` on them (a bf16 model's);
``int8``: ``native int8`` = the native kernel on int8 weights (what ``--quantization int8``
runs), and two weight-only forms torch has, ``torch._weight_int8pack_mm`` and ``dequant+F.linear``
(the float weights rebuilt each call); ``w8a8``: ``native w8a8`` = the native W8A8 op
(``kernels.cpu_linear.cpu_w8a8_linear``, what ``--quantization w8a8`` runs), ``w8a8`` =
``kernels.int8_linear.w8a8_linear`` (per-token quantization + ``torch._int_mm`` + scales)
eager, ``w8a8 compiled`` = the same through ``torch.compile`` (its elementwise ops fused, as
in the compiled forward), ``_int_mm`` = the int8 product alone.

    .venv/bin/python benchmarks/kernels/cpu_linear.py --quantization int8 --dtype bfloat16

``--quantization gguf`` (every shape, the LM head included): GGUF weights as stored
(``GroupQuantLinear``) against the same weights dequantized to ``--dtype`` on the native
kernel (``native``, what ``--quantization none`` runs): ``4-bit`` = Q4_1-shaped codes (0..15, a
scale and a min per 32), ``int8`` = Q8_0-shaped codes (a scale per 32); min of ``--reps``
calls, ms per call, ``--layers`` copies in turn as above; ``4-bit A8`` / ``int8 A8`` = the same
with int8 activations per group of 32 (``PAGEDSERVE_CPU_A8=1``'s op, ``cpu_a8_linear``).

    .venv/bin/python benchmarks/kernels/cpu_linear.py --quantization gguf --layers 30 \
        --rows 1,8,32,128,512
"""

from __future__ import annotations

import argparse
import platform

import torch
from cpu_paged_attention import time_ms  # (this folder is on sys.path when run as a script)

from kernels.cpu_attention import cpu_isa
from kernels.cpu_linear import cpu_linear, cpu_w8a8_linear, pack_linear_weight, pack_w8a8_weight
from kernels.int8_linear import quantize_symmetric, w8a8_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
ROWS = (1, 8, 32, 128, 512)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quantization", choices=["int8", "w8a8", "gguf"], default=None)
    p.add_argument("--rows", default="1,128", help="with --quantization: rows per call")
    p.add_argument("--layers", type=int, default=1,
                   help="with --quantization: distinct weight copies, called in turn")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"native path {cpu_isa()}, {a.dtype}")
    if a.quantization == "gguf":
        gguf_as_stored(a, dtype)
        return
    if a.quantization:
        quantized(a, dtype)
        return
    print(f"{'shape':8s} {'M':>4s} {'torch ms':>9s} {'native ms':>10s} {'ratio':>6s} "
          f"{'torch rows':>10s}")
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) / k ** 0.5).to(dtype)
        packed = pack_linear_weight(w)
        out_dtype = torch.float32 if name == "lm_head" else None
        x_all = torch.randn(max(ROWS), k).to(dtype)
        y_all = torch.nn.functional.linear(x_all, w)
        for m in ROWS:
            x = x_all[:m]
            ref = time_ms(lambda: torch.nn.functional.linear(x, w), a.reps, "median")  # noqa: B023
            ours = time_ms(lambda: cpu_linear(x, packed, n, out_dtype=out_dtype),  # noqa: B023
                           a.reps, "median")
            same = torch.equal(torch.nn.functional.linear(x, w), y_all[:m])
            print(f"{name:8s} {m:4d} {ref:9.3f} {ours:10.3f} {ref / ours:6.2f} "
                  f"{'same' if same else 'differ':>10s}", flush=True)



def quantized(a: argparse.Namespace, dtype: torch.dtype) -> None:
    """The ``--quantization`` table (the module docstring)."""
    import torch.nn.functional as F

    names = (["torch", "native", "native int8", "_weight_int8pack_mm", "dequant+F.linear"]
             if a.quantization == "int8" else ["torch", "native", "native w8a8", "w8a8",
                                               "w8a8 compiled", "_int_mm"])
    compiled = torch.compile(w8a8_linear, dynamic=True)
    print(f"min of {a.reps} calls, ms per call, {a.layers} distinct weight copies in turn")
    print(f"{'shape':8s} {'M':>4s} " + " ".join(f"{n:>19s}" for n in names))
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        if name == "lm_head":
            continue
        ws = [torch.randn(n, k) / k ** 0.5 for _ in range(a.layers)]
        qs = [quantize_symmetric(w) for w in ws]
        floats = [w.to(dtype) for w in ws]
        packed = [pack_linear_weight(w) for w in floats]
        packed_q = [pack_linear_weight(q) for q, _ in qs]
        packed_w8a8 = [pack_w8a8_weight(q) for q, _ in qs]
        scales = [s.to(dtype) for _, s in qs]  # _weight_int8pack_mm takes x's dtype
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k).to(dtype)
            xq, _ = quantize_symmetric(x)
            calls = {
                "torch": [lambda w=w: F.linear(x, w) for w in floats],  # noqa: B023
                "native": [lambda p=p: cpu_linear(x, p, n) for p in packed],  # noqa: B023
                "native int8": [lambda p=p, s=s: cpu_linear(x, p, n, None, None, s)  # noqa: B023
                                for p, (_, s) in zip(packed_q, qs, strict=True)],
                "_weight_int8pack_mm": [
                    lambda q=q, s=s: torch._weight_int8pack_mm(x, q, s)  # noqa: B023
                    for (q, _), s in zip(qs, scales, strict=True)],
                "dequant+F.linear": [
                    lambda q=q, s=s: F.linear(x, q.to(dtype) * s[:, None])  # noqa: B023
                    for (q, _), s in zip(qs, scales, strict=True)],
                "native w8a8": [
                    lambda p=p, s=s: cpu_w8a8_linear(x, *p, n, s)  # noqa: B023
                    for p, (_, s) in zip(packed_w8a8, qs, strict=True)],
                "w8a8": [lambda q=q, s=s: w8a8_linear(x, q, s) for q, s in qs],  # noqa: B023
                "w8a8 compiled": [lambda q=q, s=s: compiled(x, q, s)  # noqa: B023
                                  for q, s in qs],
                "_int_mm": [lambda q=q: torch._int_mm(xq, q.t()) for q, _ in qs],  # noqa: B023
            }
            row = []
            with torch.no_grad():
                compiled(x, *qs[0])  # (compiled here, not timed)
            for col in names:
                fns = calls[col]
                row.append(time_ms(lambda fns=fns: [f() for f in fns], a.reps, "min")
                           / len(fns))
            print(f"{name:8s} {m:4d} " + " ".join(f"{t:19.3f}" for t in row), flush=True)


def gguf_as_stored(a: argparse.Namespace, dtype: torch.dtype) -> None:
    """The ``--quantization gguf`` table (the module docstring)."""
    from services.worker.quantized_linear import GroupQuantLinear

    names = ["native", "4-bit", "int8", "4-bit A8", "int8 A8"]
    print(f"min of {a.reps} calls, ms per call, {a.layers} distinct weight copies in turn")
    print(f"{'shape':8s} {'M':>4s} " + " ".join(f"{n:>9s}" for n in names)
          + f" {'4-bit x':>8s} {'int8 x':>7s}")
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        layers = 1 if name == "lm_head" else a.layers
        out_dtype = torch.float32 if name == "lm_head" else None
        mods: dict[str, list] = {col: [] for col in names}
        for _ in range(layers):
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            scale = torch.rand(n, k // 32) * 0.01
            mn = -8 * scale
            q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            for a8, suffix in ((False, ""), (True, " A8")):
                mods["4-bit" + suffix].append(GroupQuantLinear(codes, scale, mn,
                                                               out_dtype=out_dtype, a8=a8))
                mods["int8" + suffix].append(GroupQuantLinear(q8, scale, out_dtype=out_dtype,
                                                              a8=a8))
            w = (codes.float() * scale.repeat_interleave(32, 1) + mn.repeat_interleave(32, 1))
            packed = pack_linear_weight(w.to(dtype))
            mods["native"].append(
                lambda x, p=packed, n=n, o=out_dtype: cpu_linear(x, p, n, out_dtype=o))
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k).to(dtype)
            row = [time_ms(lambda fns=mods[col]: [f(x) for f in fns], a.reps, "min")  # noqa: B023
                   / layers for col in names]
            print(f"{name:8s} {m:4d} " + " ".join(f"{t:9.3f}" for t in row)
                  + f" {row[0] / row[1]:8.2f} {row[0] / row[2]:7.2f}", flush=True)


if __name__ == "__main__":
    main()
