"""The native CPU attention call over a quantized KV cache against the same step over the
``auto`` cache (the compute dtype), interleaved in one process (A B A B ...) so that drift in
the machine's speed falls on both.

Each cache takes the layout the model runner would give it (``choose_kv_layout``: an int8 cache
in the ``pairs`` order is read as stored by the integer products, ``csrc/cpu_attention_i8.h``);
``--kv-layout rows`` forces rows (an int8 cache then dequantized before the products). Steps as
``cpu_paged_attention.py``'s (SmolLM2 shapes, ``--layers`` distinct caches round-robin so K/V
come from memory). Prints the minimum per call of ``--rounds`` x ``--reps`` timed rounds over
the layers, and auto / quantized (> 1: the quantized cache is faster).

    .venv/bin/python benchmarks/kernels/kv_cache_dtype_attention.py --dtype bfloat16 \\
        --kv-cache-dtypes int8 [--kv-layout rows] [--layers 30] [--only "decode batch 64"]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE))

from cpu_paged_attention import DECODE, MIXED, make_step  # noqa: E402

from kernels.cpu_attention import cpu_isa, cpu_paged_attention  # noqa: E402
from kernels.kv_layout import to_pairs  # noqa: E402
from kernels.kv_quant import KV_CACHE_DTYPES  # noqa: E402
from services.worker.attention import choose_kv_layout  # noqa: E402


def steps_for(pairs, args, cache_name: str, layout: str) -> tuple[list[dict], str]:
    """``--layers`` copies of one step with caches stored as ``cache_name`` in ``layout``
    (``"auto"``: the one the runner picks), and that layout's name."""
    dtype = getattr(torch, args.dtype)
    cache_dtype = KV_CACHE_DTYPES[cache_name]
    steps = [make_step(pairs, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size,
                       dtype, cache_dtype) for _ in range(args.layers)]
    if layout == "auto":
        layout = choose_kv_layout("cpu", steps[0]["k_cache"].dtype, args.block_size,
                                  [args.head_dim], compute_dtype=dtype)
    if layout == "pairs":
        steps = [{**st, **dict(zip(("k_cache", "v_cache"),
                                   to_pairs(st["k_cache"], st["v_cache"]), strict=True))}
                 for st in steps]
    return steps, layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtypes", default="int8",
                   help="comma-separated --kv-cache-dtype values to set against auto")
    p.add_argument("--kv-layout", default="auto", choices=["auto", "rows"],
                   help="the quantized caches' order (auto = the runner's choice)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=5, help="timed rounds over the layers per turn")
    p.add_argument("--rounds", type=int, default=8, help="turns of A B interleaving")
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--only", default="", help="run only the steps whose name contains this")
    args = p.parse_args()
    torch.manual_seed(0)
    names = args.kv_cache_dtypes.split(",")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, isa {cpu_isa()}, "
          f"int8 body {torch.ops.pagedserve.attention_int8_body()}, {args.dtype}, "
          f"H={args.num_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
          f"block={args.block_size}, {args.layers} layer(s), min of {args.rounds} x "
          f"{args.reps}")
    print("| step | auto ms | " + " | ".join(f"{n} ms | x auto" for n in names) + " |")
    print("|---|---|" + "---|---|" * len(names))
    shapes = {f"decode batch {b} @ {c}": [(1, c)] * b for b, c in DECODE}
    for name, pairs in {**shapes, **MIXED}.items():
        if args.only not in name:
            continue
        runs = {"auto": steps_for(pairs, args, "auto", "auto")}
        for n in names:
            runs[n] = steps_for(pairs, args, n, args.kv_layout)
        best = dict.fromkeys(runs, float("inf"))
        with torch.inference_mode():
            for _ in range(args.rounds):
                for key, (steps, layout) in runs.items():
                    for st in steps[:2]:  # warm
                        cpu_paged_attention(**st, kv_layout=layout)
                    for _ in range(args.reps):
                        t = time.perf_counter()
                        for st in steps:
                            cpu_paged_attention(**st, kv_layout=layout)
                        best[key] = min(best[key], (time.perf_counter() - t) / len(steps))
        cells = " | ".join(f"{1e3 * best[n]:.3f} | {best['auto'] / best[n]:.2f}x" for n in names)
        print(f"| {name} | {1e3 * best['auto']:.3f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
