"""The LM head matmul at float32 on CPU: ATen (MKL sgemm) against oneDNN's linear, the choice
``kernels.torch_ops.torch_wide_linear`` makes. SmolLM2's shape, ``[M, 576] x [49152, 576]^T``.

    .venv/bin/python benchmarks/kernels/lm_head.py

Prints the median of 20 calls per M and the ratio.
"""

import time

import torch


def bench(f, n: int = 20) -> float:
    for _ in range(3):
        f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2]


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(49152, 576) * 0.05
    for m in (1, 4, 16, 64, 128, 256):
        x = torch.randn(m, 576)
        aten = bench(lambda: torch.nn.functional.linear(x, w))
        onednn = bench(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
        print(f"M {m:3d}: aten {aten * 1e3:7.2f} ms, oneDNN {onednn * 1e3:7.2f} ms, "
              f"{aten / onednn:.2f}x")


if __name__ == "__main__":
    main()
