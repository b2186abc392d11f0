"""Native CPU paged attention (``kernels.cpu_attention``) against the torch backend, per call.

One attention call of one layer, SmolLM2-135M shapes by default (9 query heads, 3 KV heads,
head_dim 64, block 16), float32, blocks scattered over the cache by a random permutation:

- decode steps: batch 1, 8, 64 at contexts 128 .. 2048 tokens;
- mixed steps: a prefill chunk and prefix-hit tails next to decodes (chunked prefill).

The torch backend gets its per-step plan built beforehand (the model builds it once per step and
every layer reuses it), so both columns time only what a layer pays. Minimum (or ``--stat
median``) of ``--reps`` calls after warm-up; the ratio is torch / native (> 1: native faster).

    .venv/bin/python benchmarks/kernels/cpu_paged_attention.py [--dtype float32] [--reps 30]
        [--stat min] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import torch

from kernels.cpu_attention import cpu_isa, cpu_paged_attention
from kernels.torch_attention import plan_paged_attention, torch_paged_attention

DECODE = [(batch, ctx) for batch in (1, 8, 64) for ctx in (128, 512, 2048)]
MIXED = {
    "prefill 512 + 16 decodes @1024": [(512, 512)] + [(1, 1024)] * 16,
    "chunk 256 @768 + 2 tails + 8 decodes": [(256, 768), (32, 700), (5, 300)] + [(1, 2048)] * 8,
    "prefill 2048": [(2048, 2048)],
}


def make_step(pairs, num_heads, num_kv_heads, head_dim, block_size, dtype) -> dict:
    """Query, filled caches and metadata of one step; ``pairs`` = (query_len, seq_len)."""
    blocks = [math.ceil(s / block_size) for _, s in pairs]
    num_blocks = sum(blocks) + 8
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    perm = torch.randperm(num_blocks)
    table = torch.zeros(len(pairs), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[used:used + n]
        used += n
    qsl = torch.zeros(len(pairs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for q, _ in pairs]), 0)
    return dict(
        query=torch.randn(int(qsl[-1]), num_heads, head_dim, dtype=dtype),
        k_cache=torch.randn(shape, dtype=dtype), v_cache=torch.randn(shape, dtype=dtype),
        block_tables=table, seq_lens=torch.tensor([s for _, s in pairs], dtype=torch.int32),
        query_start_loc=qsl, max_query_len=max(q for q, _ in pairs),
        max_seq_len=max(s for _, s in pairs), scale=head_dim**-0.5)


def time_ms(fn, reps: int, stat: str) -> float:
    """``stat`` (min or median) of ``reps`` timed calls, in milliseconds, after 3 warm-ups.

    NOTE: min is the default: on a shared 2-core machine a call that loses a core to another
    process for one scheduler slice (~4-8 ms) says nothing about the kernel."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * (min(times) if stat == "min" else statistics.median(times))


def bench(name: str, pairs, args) -> None:
    step = make_step(pairs, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size,
                     getattr(torch, args.dtype))
    plan = plan_paged_attention(step["block_tables"], step["seq_lens"], step["query_start_loc"],
                                step["max_query_len"], step["max_seq_len"], args.block_size)
    with torch.inference_mode():
        native = time_ms(lambda: cpu_paged_attention(**step), args.reps, args.stat)
        ref = time_ms(lambda: torch_paged_attention(**step, plan=plan), args.reps, args.stat)
        diff = (cpu_paged_attention(**step).float()
                - torch_paged_attention(**step, plan=plan).float()).abs().max().item()
    print(f"| {name:<38} | {ref:9.3f} | {native:9.3f} | {ref / native:6.2f}x | {diff:.1e} |",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--stat", default="min", choices=["min", "median"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (both kernels); default: torch's")
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cpu_paged_attention(**make_step([(1, 16)], args.num_heads, args.num_kv_heads,
                                    args.head_dim, args.block_size, torch.float32))  # build/load
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, isa {cpu_isa()}, "
          f"{args.dtype}, H={args.num_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
          f"block={args.block_size}, {args.stat} of {args.reps}")
    print("| step (query_len, seq_len)              |  torch ms | native ms |  ratio | max diff |")
    print("|----------------------------------------|-----------|-----------|--------|----------|")
    for batch, ctx in DECODE:
        bench(f"decode batch {batch} @ {ctx}", [(1, ctx)] * batch, args)
    for name, pairs in MIXED.items():
        bench(name, pairs, args)


if __name__ == "__main__":
    main()
