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
"""

from __future__ import annotations

import argparse
import platform

import torch
from cpu_paged_attention import time_ms  # (this folder is on sys.path when run as a script)

from kernels.cpu_attention import cpu_isa
from kernels.cpu_linear import cpu_linear, pack_linear_weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
ROWS = (1, 8, 32, 128, 512)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"native path {cpu_isa()}, {a.dtype}")
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


if __name__ == "__main__":
    main()
