"""The LM head matmul at float32 on CPU: ATen (MKL sgemm) against oneDNN's linear, the choice
``kernels.torch_ops.torch_wide_linear`` makes. SmolLM2's shape, ``[M, 576] x [49152, 576]^T``.

    .venv/bin/python benchmarks/kernels/lm_head.py

Prints the median of 20 calls per M and the ratio.
"""

import torch
from cpu_paged_attention import time_ms  # (this folder is on sys.path when run as a script)


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(49152, 576) * 0.05
    for m in (1, 4, 16, 64, 128, 256):
        x = torch.randn(m, 576)
        aten = time_ms(lambda: torch.nn.functional.linear(x, w), 20, "median")
        onednn = time_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                         20, "median")
        print(f"M {m:3d}: aten {aten:7.2f} ms, oneDNN {onednn:7.2f} ms, {aten / onednn:.2f}x")


if __name__ == "__main__":
    main()
