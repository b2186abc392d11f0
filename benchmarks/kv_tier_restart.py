"""Time to first token after a restart, with the KV tier on disk vs without: does a prefix
computed before the stack went down come back from the folder?

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_tier_restart.py [--model gemma3-270m] \\
        [--prefix-len 2000 --rounds 3 --json out.json]

One round, per mode (``tier``: the worker's ``--kv-offload-dir`` a fresh temp folder; ``none``:
no tier), on the same ``--prefix-len``-token window of real text (``corpus.corpus_text``; each
round its own window):

    stack 1 (fresh; the folder empty) -> prefix                         -> TTFT cold
    stop it; stack 2 on the same folder -> prefix + one block more (16)  -> TTFT warm

Stack 2's RAM pool is empty: with the tier, the prefix's blocks are read from the files stack 1
wrote; without, all of it is computed again. Each stack first serves a 3-token warm-up request
that shares no block (so neither TTFT pays for the first forward). Modes alternate within a
round. Prints per round and mode the two TTFTs (to the first streamed token, seconds), the tier
hit tokens of the warm request and the blocks the tier held at stack 2's start; then per mode
the median of warm/cold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from corpus import corpus_text
from stack_harness import InProcessStack


async def ttft(address: str, prompt: list[int], output_len: int) -> float:
    """Seconds from sending ``prompt`` (after a warm-up request) to its first streamed token."""
    from pagedserve_client import AsyncClient

    async with AsyncClient(address) as client:
        await client.generate(prompt_token_ids=[1, 2, 3], max_tokens=2)  # warm-up, no sharing
        t0 = time.perf_counter()
        first = None
        async for d in client.stream(prompt_token_ids=prompt, max_tokens=output_len,
                                     ignore_eos=True, temperature=0):
            if d.token_ids and first is None:
                first = time.perf_counter() - t0
        return first


def one_stack(a, folder: str | None, prompt: list[int]) -> tuple[float, object, str]:
    """(TTFT of ``prompt``, the scheduler's stats at start and after, dtype) on a fresh stack."""
    worker = ["--dtype", a.dtype] + (["--kv-offload-dir", folder] if folder else [])
    scheduler = ["--kv-offload-size", "8GiB"] if folder else []
    stack = InProcessStack(a.model, worker_argv=worker, scheduler_argv=scheduler).start()
    try:
        at_start = stack.stats()
        t = asyncio.run(ttft(stack.address, prompt, a.output_len))
        after = stack.wait_idle()
        dtype = stack.info().dtype
    finally:
        stack.stop()  # NOTE: stop() returns once the services' serve() have returned
    return t, (at_start, after), dtype


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="folder, .gguf or packaged name, e.g. gemma3-270m (default: SmolLM2)")
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--extra-len", type=int, default=16, help="the warm request's extra tokens")
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--json", default=None, help="write the figures as JSON here")
    a = p.parse_args()

    from services.router.tokenizer import load_tokenizer

    ids = load_tokenizer(a.model)(corpus_text())["input_ids"]
    span = a.prefix_len + a.extra_len
    rows = []
    for r in range(a.rounds):
        window = ids[r * span:(r + 1) * span]
        assert len(window) == span, "the corpus is too short for this many rounds"
        prefix = window[:a.prefix_len]
        modes = ("tier", "none") if r % 2 == 0 else ("none", "tier")
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="kv-tier-restart-") as folder:
                folder = folder if mode == "tier" else None
                cold, _, dtype = one_stack(a, folder, prefix)
                warm, (start, after), _ = one_stack(a, folder, window)
            row = {"round": r, "mode": mode, "dtype": dtype, "ttft_cold_s": cold,
                   "ttft_warm_s": warm, "warm_over_cold": warm / cold,
                   "tier_blocks_at_restart": start.kv_offload_blocks,
                   "warm_hit_tokens": after.prefix_cache_hits_total,
                   "warm_tier_hit_tokens": after.prefix_cache_tier_hits_total,
                   "loads_failed": after.kv_offload_loads_failed_total}
            rows.append(row)
            print(f"round {r} {mode:4s} ({dtype}): TTFT cold {cold:.3f} s  warm {warm:.3f} s  "
                  f"warm/cold {warm / cold:.2f}  tier blocks at restart "
                  f"{row['tier_blocks_at_restart']}  warm hits {row['warm_hit_tokens']} tokens "
                  f"(tier {row['warm_tier_hit_tokens']})  loads failed {row['loads_failed']}",
                  flush=True)
    summary = {}
    for mode in ("tier", "none"):
        mine = [x for x in rows if x["mode"] == mode]
        summary[mode] = {k: statistics.median(x[k] for x in mine)
                         for k in ("ttft_cold_s", "ttft_warm_s", "warm_over_cold")}
        s = summary[mode]
        print(f"median {mode:4s}: TTFT cold {s['ttft_cold_s']:.3f} s  warm {s['ttft_warm_s']:.3f}"
              f" s  warm/cold {s['warm_over_cold']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows, "median": summary},
                                           indent=1))


if __name__ == "__main__":
    main()
