"""Time one decode step of paged attention.

    .venv/bin/python benchmarks/kernels/paged_attention.py [--batch 64 --context 512]

CPU: the torch backend (``kernels.torch_attention``), median of --repeats runs. The CUDA timings
(Triton vs SDPA, bandwidth) come with the kernels issue.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kernels.torch_attention import torch_paged_attention  # noqa: E402


def time_decode(batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of one decode step: ``batch`` sequences, ``context`` tokens each, random
    block tables."""
    g = torch.Generator().manual_seed(0)
    num_blocks = batch * context // block_size
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=g, dtype=torch.int32).view(batch, -1)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch_paged_attention(q, k, v, block_tables, seq_lens, query_start_loc, 1, context,
                              head_dim ** -0.5)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=21)
    a = p.parse_args()
    for dtype in (torch.float32, torch.bfloat16):
        s = time_decode(a.batch, a.context, a.heads, a.kv_heads, a.head_dim, a.block_size,
                        dtype, a.repeats)
        kv_bytes = 2 * a.batch * a.context * a.kv_heads * a.head_dim * dtype.itemsize
        print(f"torch backend, {str(dtype).removeprefix('torch.'):8s} batch {a.batch} x context "
              f"{a.context}: {s * 1e3:7.2f} ms per decode step ({kv_bytes / s / 1e9:5.1f} GB/s of "
              f"K/V, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
