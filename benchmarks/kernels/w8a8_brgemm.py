"""The native W8A8 op's two products on this CPU, in one process: the vnni512 tiles against
ATen's ``cpublas::brgemm`` (oneDNN's ukernel: AMX-INT8 tiles on an AMX CPU, its AVX512-VNNI
code elsewhere), ``PAGEDSERVE_CPU_W8A8_BRGEMM=0`` / ``1`` alternated per shape; min of
``--reps`` calls, ms, on SmolLM2's decoder shapes at bf16, and whether the two outputs are
bitwise equal (they must be: the sums are integers).

    .venv/bin/python benchmarks/kernels/w8a8_brgemm.py [--rows 16,64,128,512] [--reps 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="16,64,128,512")
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()

    import torch

    from kernels.cpu_linear import (
        BRGEMM_ENV,
        cpu_w8a8_linear,
        pack_w8a8_weight,
        w8a8_linear_body,
    )

    def best_ms(f) -> float:
        f()
        best = float("inf")
        for _ in range(a.reps):
            t = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t)
        return best * 1e3

    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads; default body {w8a8_linear_body()}")
    print(f"{'shape':8s} {'M':>5s} {'tiles':>8s} {'brgemm':>8s} {'ratio':>6s} bitwise")
    for name, (n, k) in {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}.items():
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        packed, comp = pack_w8a8_weight(q)
        scale = torch.rand(n)
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            ms, out = {}, {}
            for flag in ("0", "1"):
                os.environ[BRGEMM_ENV] = flag
                ms[flag] = best_ms(lambda: cpu_w8a8_linear(x, packed, comp, n, scale))  # noqa: B023
                out[flag] = cpu_w8a8_linear(x, packed, comp, n, scale)
            print(f"{name:8s} {m:5d} {ms['0']:8.3f} {ms['1']:8.3f} {ms['0'] / ms['1']:6.2f} "
                  f"{torch.equal(out['0'], out['1'])}")
    os.environ.pop(BRGEMM_ENV)


if __name__ == "__main__":
    main()
