"""Prefix caching on vs off: requests that share a long system prompt, through the stack.

    .venv/bin/python benchmarks/prefix_caching.py [--num-requests 64 --system-len 1024 \\
        --question-len 32 --output-len 32]

Each request is the same ``--system-len``-token system prompt (a window of real text) plus its
own ``--question-len``-token question, all sent at once, greedy, ``--output-len`` tokens each
(ignore_eos). The stack runs twice in the same command, with ``--enable-prefix-caching`` and
``--no-enable-prefix-caching``, everything else equal. Prints per run the median and p90 time to
first token (seconds, from sending to the first streamed token), the wall time, output tokens/s
and the prompt tokens served from the cache; then the on/off ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput import make_prompts, running_stack  # noqa: E402


async def drive(address: str, prompts: list[list[int]], output_len: int) -> dict:
    """Send every prompt at once; TTFT per request, wall time, tokens, cached tokens."""
    from pagedserve_client import AsyncClient

    async with AsyncClient(address) as client:
        await client.generate(prompt_token_ids=[1, 2, 3], max_tokens=2)  # warm-up, no sharing

        async def one(prompt):
            t0 = time.perf_counter()
            ttft, n, cached = None, 0, 0
            async for d in client.stream(prompt_token_ids=prompt, max_tokens=output_len,
                                         ignore_eos=True, temperature=0):
                if d.token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                n += len(d.token_ids)
                if d.usage is not None:
                    cached = d.usage.num_cached_tokens
            return ttft, n, cached

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    assert tokens == output_len * len(prompts), "a request ended early"
    return {"ttft_median_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "wall_s": wall, "output_tok_s": tokens / wall,
            "cached_prompt_tokens": sum(r[2] for r in results)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="folder or .gguf (default: packaged SmolLM2)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--serve-args", default="", help="extra flags for pagedserve serve")
    p.add_argument("--output", default=None, help="write the figures as JSON here")
    a = p.parse_args()

    from services.router.tokenizer import load_tokenizer

    windows = make_prompts(load_tokenizer(a.model), a.num_requests + 1,
                           max(a.system_len, a.question_len))
    system = windows[0][:a.system_len]
    # NOTE: questions come from windows far from the system prompt's, so they share no block.
    prompts = [system + w[-a.question_len:] for w in windows[1:]]
    runs = {}
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        with running_stack(a.model, a.dtype, [flag, *a.serve_args.split()]) as address:
            runs[flag.lstrip("-")] = r = asyncio.run(drive(address, prompts, a.output_len))
        print(f"{flag:28s} TTFT median {r['ttft_median_s']:7.2f} s  p90 {r['ttft_p90_s']:7.2f} s"
              f"  wall {r['wall_s']:7.1f} s  {r['output_tok_s']:7.1f} output tok/s  "
              f"cached prompt tokens {r['cached_prompt_tokens']}", flush=True)
    on, off = runs["enable-prefix-caching"], runs["no-enable-prefix-caching"]
    print(f"TTFT median off/on: {off['ttft_median_s'] / on['ttft_median_s']:.2f}x   "
          f"throughput on/off: {on['output_tok_s'] / off['output_tok_s']:.2f}x")
    if a.output:
        Path(a.output).write_text(json.dumps({"args": vars(a), **runs}, indent=2))


if __name__ == "__main__":
    main()
