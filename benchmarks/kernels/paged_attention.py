"""Time one decode step of paged attention.

    .venv/bin/python benchmarks/kernels/paged_attention.py            # CPU: torch backend
    python benchmarks/kernels/paged_attention.py --json out.json       # CUDA: the full sweep

CUDA (the kernels issue's table): for batch 1..256 x context 128..32k, a Llama-3-8B-shaped
layer (32 query heads, 8 KV heads, head_dim 128, bf16, block_size 16, random block tables):

- ``triton``: ``triton_paged_attention`` (split-KV chosen automatically), median of
  ``triton.testing.do_bench``;
- its achieved bandwidth: K/V bytes read / time, against the device's copy bandwidth measured
  here (``dst.copy_(src)`` of 2 GiB: read + write bytes / time);
- ``gather+sdpa``: the same K/V gathered through the block table into contiguous tensors,
  then ``F.scaled_dot_product_attention`` (what an engine without a paged kernel must do),
  timed end to end; ``sdpa`` alone is printed too (a lower bound no paged engine gets).

CPU: the torch backend (``kernels.torch_attention``) at batch 64, median of --repeats runs.
``--dry-run`` runs the CUDA code path on CPU with tiny shapes (Triton interpreter) to check it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

BATCHES = [1, 8, 64, 256]
CONTEXTS = [128, 1024, 4096, 32768]


def make_decode_inputs(batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
                       block_size: int, dtype: torch.dtype, device: str) -> dict:
    """Keyword arguments of one decode step: ``batch`` sequences of ``context`` tokens each,
    block tables a random permutation of all blocks."""
    g = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return dict(
        query=torch.randn(batch, heads, head_dim, generator=g, device=device).to(dtype),
        k_cache=torch.randn(shape, generator=g, device=device).to(dtype),
        v_cache=torch.randn(shape, generator=g, device=device).to(dtype),
        block_tables=torch.randperm(num_blocks, generator=g, device=device,
                                    dtype=torch.int32).view(batch, blocks_per_seq),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=context, scale=head_dim ** -0.5,
    )


def gather_sdpa(query, k_cache, v_cache, block_tables, max_seq_len, scale, **_) -> torch.Tensor:
    """Decode attention the non-paged way: gather K/V contiguous, then SDPA.
    ``query [B, H, D]`` -> ``[B, H, D]``."""
    batch, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    k = k_cache[block_tables].flatten(1, 2)[:, :max_seq_len].transpose(1, 2)  # [B, Hkv, S, D]
    v = v_cache[block_tables].flatten(1, 2)[:, :max_seq_len].transpose(1, 2)
    out = F.scaled_dot_product_attention(query[:, :, None], k, v, scale=scale,
                                         enable_gqa=heads != kv_heads)  # [B, H, 1, D]
    return out[:, :, 0]


def copy_bandwidth(device: str, nbytes: int, bench) -> float:
    """Bytes/s of ``dst.copy_(src)``, counting the read and the write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = bench(lambda: dst.copy_(src))
    return 2 * nbytes / seconds


def cuda_sweep(args) -> list[dict]:
    """The CUDA table; with ``--dry-run`` the same code on CPU, tiny, timed by perf_counter."""
    from kernels.reference import reference_paged_attention
    from kernels.triton_attention import triton_paged_attention

    if args.dry_run:
        device, batches, contexts = "cpu", [1, 2], [32, 80]
        heads, kv_heads, head_dim, dtype, copy_bytes = 4, 2, 32, torch.float16, 1 << 24

        def bench(fn):
            return time_median(fn, 3)
    else:
        import triton.testing

        device, batches, contexts = "cuda", args.batches, args.contexts
        heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
        dtype, copy_bytes = torch.bfloat16, 2 << 30

        def bench(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    peak = copy_bandwidth(device, copy_bytes, bench)
    print(f"device copy bandwidth: {peak / 1e9:.0f} GB/s "
          f"({torch.cuda.get_device_name() if device == 'cuda' else 'cpu, dry run'})")
    rows = []
    for batch in batches:
        for context in contexts:
            inputs = make_decode_inputs(batch, context, heads, kv_heads, head_dim,
                                        args.block_size, dtype, device)
            out = triton_paged_attention(**inputs)
            ref = gather_sdpa(**inputs)
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
            if batch * context <= 4096:  # spot-check against the float64 spec too
                torch.testing.assert_close(out.float(), reference_paged_attention(**inputs).float(),
                                           atol=2e-2, rtol=2e-2)
            t_triton = bench(lambda: triton_paged_attention(**inputs))
            t_gather = bench(lambda: gather_sdpa(**inputs))
            k = inputs["k_cache"][inputs["block_tables"]].flatten(1, 2).transpose(1, 2)
            v = inputs["v_cache"][inputs["block_tables"]].flatten(1, 2).transpose(1, 2)
            q = inputs["query"][:, :, None]
            t_sdpa = bench(lambda: F.scaled_dot_product_attention(
                q, k, v, scale=inputs["scale"], enable_gqa=heads != kv_heads))
            kv_bytes = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
            rows.append(dict(batch=batch, context=context, triton_us=t_triton * 1e6,
                             gather_sdpa_us=t_gather * 1e6, sdpa_us=t_sdpa * 1e6,
                             kv_gbps=kv_bytes / t_triton / 1e9,
                             pct_of_copy=100 * kv_bytes / t_triton / peak,
                             speedup_vs_gather_sdpa=t_gather / t_triton))
            r = rows[-1]
            print(f"batch {batch:4d} ctx {context:6d}: triton {r['triton_us']:9.1f} us "
                  f"{r['kv_gbps']:7.0f} GB/s ({r['pct_of_copy']:5.1f}% of copy) | gather+sdpa "
                  f"{r['gather_sdpa_us']:9.1f} us (x{r['speedup_vs_gather_sdpa']:.2f}) | sdpa "
                  f"{r['sdpa_us']:9.1f} us", flush=True)
            del inputs, k, v, out, ref
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def time_median(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_decode(args) -> None:
    """The torch backend's time per decode step (``--batch`` x ``--context``)."""
    from kernels.torch_attention import torch_paged_attention

    for dtype in (torch.float32, torch.bfloat16):
        inputs = make_decode_inputs(args.batch, args.context, args.heads, args.kv_heads,
                                    args.head_dim, args.block_size, dtype, "cpu")
        s = time_median(lambda: torch_paged_attention(**inputs), args.repeats)
        kv_bytes = 2 * args.batch * args.context * args.kv_heads * args.head_dim * dtype.itemsize
        print(f"torch backend, {str(dtype).removeprefix('torch.'):8s} batch {args.batch} x "
              f"context {args.context}: {s * 1e3:7.2f} ms per decode step "
              f"({kv_bytes / s / 1e9:5.1f} GB/s of K/V, {torch.get_num_threads()} threads)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="CPU: sequences per decode step")
    p.add_argument("--context", type=int, default=512, help="CPU: tokens per sequence")
    p.add_argument("--batches", type=int, nargs="+", default=BATCHES, help="CUDA sweep")
    p.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS, help="CUDA sweep")
    p.add_argument("--heads", type=int, default=None, help="default: 9 on CPU, 32 on CUDA")
    p.add_argument("--kv-heads", type=int, default=None, help="default: 3 on CPU, 8 on CUDA")
    p.add_argument("--head-dim", type=int, default=None, help="default: 64 on CPU, 128 on CUDA")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--dry-run", action="store_true",
                   help="run the CUDA sweep's code on CPU with tiny shapes (Triton interpreter)")
    p.add_argument("--json", type=Path, help="write the CUDA rows here")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.dry_run
    a.heads = a.heads or (32 if cuda else 9)
    a.kv_heads = a.kv_heads or (8 if cuda else 3)
    a.head_dim = a.head_dim or (128 if cuda else 64)
    if cuda or a.dry_run:
        if a.dry_run:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        rows = cuda_sweep(a)
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1))
    else:
        cpu_decode(a)


if __name__ == "__main__":
    main()
