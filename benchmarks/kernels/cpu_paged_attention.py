"""Native CPU paged attention (``kernels.cpu_attention``) against the torch backend, per call.

One attention call of one layer, SmolLM2-135M shapes by default (9 query heads, 3 KV heads,
head_dim 64, block 16), float32, blocks scattered over the cache by a random permutation:

- decode steps: batch 1, 8, 64 at contexts 128 .. 2048 tokens;
- mixed steps: a prefill chunk and prefix-hit tails next to decodes (chunked prefill), and
  whole prompts of 512 and 2048 tokens.

Next to the times, each row reports what the native kernel achieves against this machine's
ceilings, both measured in the same run:

- ``GB/s`` and ``% copy``: the K/V bytes the step must read (every context token's K and V
  rows of every KV head, once) over the native time, and the time ``Tensor.copy_`` takes to
  copy that many bytes over the native time (the decode goal: >= 60 %);
- ``GFLOP/s`` and ``% mm``: the attention's multiply-adds (2 x 2 x head_dim per query head and
  visible key: Q K^T and P V, causal) over the native time, against ``torch.mm`` of
  1024 x 1024 x 1024 at the same dtype (oneDNN / MKL: AMX where the CPU has it; the prefill
  goal: >= 40 % at 512 tokens).

``--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2`` stores the caches quantized (``kernels/kv_quant.py``):
``GB/s`` and ``% copy`` then count the cache's own bytes (int8: head_dim + 1 per row).

``--layers N`` times each call round-robin over N copies of the step (distinct caches, as a
model's layers are) and the copy over N distinct buffers: once their bytes exceed the last-level
cache, both read from memory, as in serving, where a layer's K/V is evicted by the other
layers' before its next call (with the default of 1 both are timed on cache-resident bytes).

The torch backend gets its per-step plan built beforehand (the model builds it once per step and
every layer reuses it), so both columns time only what a layer pays. Minimum (or ``--stat
median``) of ``--reps`` calls after warm-up; the ratio is torch / native (> 1: native faster).

    .venv/bin/python benchmarks/kernels/cpu_paged_attention.py [--dtype float32] [--reps 30]
        [--stat min] [--threads N] [--layers N] [--only SUBSTRING] [--kv-cache-dtype int8]
        [--kv-layout auto|rows|pairs]

``--kv-layout`` (``kernels/kv_layout.py``): the native kernel's caches in the ``rows`` or the
``pairs`` order (bf16); ``auto`` = the model runner's choice for this CPU and dtype. ``% read``
is like ``% copy`` against ``Tensor.sum`` of the same bytes (float32): what this machine reads
when it only reads, the floor decode attention approaches.
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
from kernels.kv_layout import to_pairs
from kernels.kv_quant import KV_CACHE_DTYPES, quantize_kv
from kernels.torch_attention import plan_paged_attention, torch_paged_attention
from services.worker.attention import choose_kv_layout
from services.worker.huge_pages import zeros_on_huge_pages

DECODE = [(batch, ctx) for batch in (1, 8, 64) for ctx in (128, 512, 2048)]
MIXED = {
    "prefill 512": [(512, 512)],
    "prefill 512 + 16 decodes @1024": [(512, 512)] + [(1, 1024)] * 16,
    "chunk 256 @768 + 2 tails + 8 decodes": [(256, 768), (32, 700), (5, 300)] + [(1, 2048)] * 8,
    "prefill 2048": [(2048, 2048)],
}


def make_step(pairs, num_heads, num_kv_heads, head_dim, block_size, dtype,
              cache_dtype=None) -> dict:
    """Query, filled caches (on huge pages as the model runner's, quantized to ``cache_dtype``
    unless None) and metadata of one step; ``pairs`` = (query_len, seq_len)."""
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
    # on huge pages where the kernel has them, as the model runner allocates its caches
    k_cache = zeros_on_huge_pages(shape, dtype).copy_(torch.randn(shape, dtype=dtype))
    v_cache = zeros_on_huge_pages(shape, dtype).copy_(torch.randn(shape, dtype=dtype))
    if cache_dtype is not None:
        k_cache, v_cache = quantize_kv(k_cache, cache_dtype), quantize_kv(v_cache, cache_dtype)
    return dict(
        query=torch.randn(int(qsl[-1]), num_heads, head_dim, dtype=dtype),
        k_cache=k_cache, v_cache=v_cache,
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


def step_bytes(pairs, num_kv_heads, head_dim, elem) -> int:
    """K/V bytes a step must read: every context token's K and V rows, once."""
    return sum(s for _, s in pairs) * num_kv_heads * head_dim * 2 * elem


def step_flops(pairs, num_heads, head_dim) -> int:
    """Multiply-adds x 2 of Q K^T and P V: each query row against the keys it sees (causal)."""
    visible = sum(q * (s - q) + q * (q + 1) // 2 for q, s in pairs)
    return 2 * 2 * head_dim * num_heads * visible


def copy_ms(nbytes: int, reps: int, layers: int = 1) -> float:
    """Time of ``Tensor.copy_`` of ``nbytes`` bytes (min of ``reps``), ms; with ``layers`` > 1,
    per copy of a round over that many distinct buffers."""
    pairs = [(torch.randn(nbytes // 4), torch.empty(nbytes // 4)) for _ in range(layers)]
    return time_ms(lambda: [dst.copy_(src) for src, dst in pairs], reps, "min") / layers


def read_ms(nbytes: int, reps: int, layers: int = 1) -> float:
    """Time of ``Tensor.sum`` over ``nbytes`` bytes of float32 (min of ``reps``), ms; with
    ``layers`` > 1, per buffer of ``layers`` distinct ones read round-robin."""
    bufs = [torch.randn(nbytes // 4) for _ in range(layers)]
    return time_ms(lambda: [b.sum() for b in bufs], reps, "min") / layers


def matmul_gflops(dtype: torch.dtype, reps: int) -> float:
    """``torch.mm`` of 1024 x 1024 x 1024 at ``dtype``: this machine's matmul ceiling."""
    a = torch.randn(1024, 1024).to(dtype)
    b = torch.randn(1024, 1024).to(dtype)
    ms = time_ms(lambda: torch.mm(a, b), reps, "min")
    return 2 * 1024**3 / ms / 1e6


def bench(name: str, pairs, args) -> None:
    cache_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
    steps = [make_step(pairs, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size,
                       getattr(torch, args.dtype), cache_dtype) for _ in range(args.layers)]
    step = steps[0]
    layout = args.kv_layout
    if layout == "auto":
        layout = choose_kv_layout("cpu", step["k_cache"].dtype, args.block_size, [args.head_dim],
                                  compute_dtype=getattr(torch, args.dtype))
    native_steps = steps
    if layout == "pairs":
        native_steps = []
        for st in steps:
            k, v = to_pairs(st["k_cache"], st["v_cache"])
            native_steps.append({**st, "k_cache": k, "v_cache": v})
    plan = plan_paged_attention(step["block_tables"], step["seq_lens"], step["query_start_loc"],
                                step["max_query_len"], step["max_seq_len"], args.block_size)
    with torch.inference_mode():
        native = time_ms(lambda: [cpu_paged_attention(**st, kv_layout=layout)
                                  for st in native_steps], args.reps, args.stat) / args.layers
        ref = time_ms(lambda: [torch_paged_attention(**st, plan=plan) for st in steps],
                      args.reps, args.stat) / args.layers
        diff = (cpu_paged_attention(**native_steps[0], kv_layout=layout).float()
                - torch_paged_attention(**step, plan=plan).float()).abs().max().item()
    row = step["k_cache"].shape[-1]  # head_dim (+ an int8 row's 2 scale bytes)
    nbytes = step_bytes(pairs, args.num_kv_heads, row, step["k_cache"].dtype.itemsize)
    copy = copy_ms(nbytes, args.reps, args.layers)
    read = read_ms(nbytes, args.reps, args.layers)
    gflops = step_flops(pairs, args.num_heads, args.head_dim) / native / 1e6
    print(f"| {name:<38} | {ref:9.3f} | {native:9.3f} | {ref / native:6.2f}x | {diff:.1e} "
          f"| {nbytes / native / 1e6:6.1f} | {100 * copy / native:5.0f} % "
          f"| {100 * read / native:5.0f} % | {gflops:7.1f} "
          f"| {100 * gflops / args.mm_gflops:4.0f} % |", flush=True)


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
    p.add_argument("--layers", type=int, default=1,
                   help="distinct copies of each step timed round-robin (30: SmolLM2's layers)")
    p.add_argument("--only", default="", help="run only the steps whose name contains this")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the caches' storage (auto = --dtype)")
    p.add_argument("--kv-layout", default="auto", choices=["auto", "rows", "pairs"],
                   help="the native kernel's cache order (auto = the model runner's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cpu_paged_attention(**make_step([(1, 16)], args.num_heads, args.num_kv_heads,
                                    args.head_dim, args.block_size, torch.float32))  # build/load
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, isa {cpu_isa()}, "
          f"{args.dtype}, H={args.num_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
          f"block={args.block_size}, {args.stat} of {args.reps}, {args.layers} layer(s), "
          f"--kv-cache-dtype {args.kv_cache_dtype}, --kv-layout {args.kv_layout}")
    with torch.inference_mode():
        args.mm_gflops = matmul_gflops(getattr(torch, args.dtype), args.reps)
    print(f"# matmul ceiling: torch.mm 1024^3 {args.dtype} {args.mm_gflops:.0f} GFLOP/s")
    print("| step (query_len, seq_len)              |  torch ms | native ms |  ratio | max diff "
          "|   GB/s | % copy | % read | GFLOP/s | % mm |")
    print("|----------------------------------------|-----------|-----------|--------|----------"
          "|--------|--------|--------|---------|------|")
    steps = {f"decode batch {batch} @ {ctx}": [(1, ctx)] * batch for batch, ctx in DECODE}
    for name, pairs in {**steps, **MIXED}.items():
        if args.only in name:
            bench(name, pairs, args)


if __name__ == "__main__":
    main()
