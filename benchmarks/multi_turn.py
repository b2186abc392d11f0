"""Multi-turn conversations with the KV tier on disk off vs on, through the stack.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/multi_turn.py [--model gemma3-270m] \\
        [--num-conversations 32 --turns 4 --system-len 1024 --user-len 64 --output-len 24 \\
         --concurrency 2 --pool-fraction 0.25 --json out.json]

``--num-conversations`` conversations of ``--turns`` turns each (a chat / agent pattern). A
conversation starts with one of ``--num-systems`` shared system prompts (``--system-len`` tokens
of real text, ``corpus.corpus_text``) plus its own first user message (``--user-len`` tokens);
each next turn resends the whole transcript so far as token ids (system, the user messages and
the model's answers) plus a new user message. Requests go round-robin over the conversations
(turn 1 of every conversation, then turn 2, ...), ``--concurrency`` in flight; greedy,
``--output-len`` tokens (ignore_eos), so prefill dominates.

The RAM KV pool (the worker's ``--kv-cache-memory``) is sized to ``--pool-fraction`` of the
working set: every conversation's final transcript, shared blocks counted once, in KV blocks
(blocks per prompt token measured on a probe stack, which also counts Gemma 3's sliding-window
groups as the cache keeps them). The stack runs twice in the same command, tier off and on
(``--kv-offload-dir`` a fresh temp folder, ``--kv-offload-size`` 8GiB), everything else equal.

Prints per run: prefill tokens computed (sum of prompt_tokens - num_cached_tokens), TTFT p50 /
p90 (to the first streamed token), wall time, tier hit tokens, preemptions; then on/off ratios,
and whether the two runs' outputs are identical token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from corpus import corpus_text
from stack_harness import InProcessStack

PROBE_MEMORY = 256 << 20  # the probe stack's KV pool (bytes): room for any one transcript


def texts(tokenizer, a) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(system prompts, user messages [conversation][turn]): disjoint windows of real text.

    NOTE: user messages vary in length between user_len and 1.5 x user_len (the issue's
    50-100 tokens at the default 64), so conversations' blocks do not line up."""
    ids = tokenizer(corpus_text())["input_ids"]
    need = a.num_systems * a.system_len + a.num_conversations * a.turns * (a.user_len * 3 // 2)
    while len(ids) < need:
        ids = ids + ids
    systems = [ids[i * a.system_len:(i + 1) * a.system_len] for i in range(a.num_systems)]
    pos = a.num_systems * a.system_len
    users = []
    for c in range(a.num_conversations):
        turns = []
        for t in range(a.turns):
            n = a.user_len + (c * 7 + t * 13) % (a.user_len // 2 + 1)
            turns.append(ids[pos:pos + n])
            pos += n
        users.append(turns)
    return systems, users


def working_set_tokens(a, systems, users) -> int:
    """Distinct prompt tokens of all final transcripts (a shared system prompt once; answers
    estimated at --output-len)."""
    tail = sum(sum(len(u) for u in turns) + (a.turns - 1) * a.output_len for turns in users)
    return sum(len(s) for s in systems) + tail


def probe(model, dtype, prompt: list[int], max_len: int) -> tuple[float, int, str]:
    """(KV blocks cached per prompt token, bytes per KV block, dtype): one prompt on a stack
    with a ``PROBE_MEMORY`` pool."""
    from pagedserve_client import AsyncClient

    stack = InProcessStack(model, worker_argv=["--dtype", dtype, "--kv-cache-memory",
                                               str(PROBE_MEMORY), "--max-model-len", str(max_len)],
                           scheduler_argv=["--max-model-len", str(max_len)]).start()
    try:
        info = stack.info()

        async def go():
            async with AsyncClient(stack.address) as client:
                await client.generate(prompt_token_ids=prompt, max_tokens=1, temperature=0)
        asyncio.run(go())
        cached = stack.wait_idle().num_cached_blocks
    finally:
        stack.stop()
    return cached / len(prompt), math.ceil(PROBE_MEMORY / info.num_kv_blocks), info.dtype


async def drive(address: str, a, systems, users, order: list[tuple[int, int]] | None = None
                ) -> dict:
    """Run every conversation turn by turn, ``a.concurrency`` requests in flight, in ``order``
    ((turn, conversation) pairs; default: each turn's conversations in turn). Returns
    per-request records (in submission order) and the wall time."""
    from pagedserve_client import AsyncClient

    transcripts = [systems[c % len(systems)] + users[c][0] for c in range(len(users))]
    if order is None:
        order = [(t, c) for t in range(a.turns) for c in range(len(users))]
    done = {}  # (conversation, turn) -> asyncio.Event: its answer is in the transcript
    records = {}
    async with AsyncClient(address) as client:
        await client.generate(prompt_token_ids=[1, 2, 3], max_tokens=2)  # warm-up, no sharing
        for key in order:
            done[key[::-1]] = asyncio.Event()
        queue: asyncio.Queue = asyncio.Queue()
        for key in order:
            queue.put_nowait(key)

        async def one(t: int, c: int) -> None:
            if t > 0:
                await done[(c, t - 1)].wait()
            prompt = list(transcripts[c])
            t0 = time.perf_counter()
            ttft, out, usage = None, [], None
            async for d in client.stream(prompt_token_ids=prompt, max_tokens=a.output_len,
                                         ignore_eos=True, temperature=0):
                if d.token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                out += d.token_ids
                if d.usage is not None:
                    usage = d.usage
            assert len(out) == a.output_len, f"conversation {c} turn {t} ended early"
            records[(t, c)] = {"conversation": c, "turn": t, "prompt_tokens": usage.prompt_tokens,
                               "cached_tokens": usage.num_cached_tokens, "ttft_s": ttft,
                               "output": out}
            if t + 1 < a.turns:
                transcripts[c] = prompt + out + users[c][t + 1]
            done[(c, t)].set()

        async def lane() -> None:
            while not queue.empty():
                await one(*queue.get_nowait())

        t0 = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(a.concurrency)))
        wall = time.perf_counter() - t0
    return {"records": [records[k] for k in order], "wall_s": wall}


def run(a, tier: bool, pool_bytes: int, max_len: int, systems, users) -> dict:
    """One stack (tier off or on) through the whole workload; its figures and records."""
    worker = ["--dtype", a.dtype, "--kv-cache-memory", str(pool_bytes),
              "--max-model-len", str(max_len)]
    scheduler = ["--max-model-len", str(max_len)]
    with tempfile.TemporaryDirectory(prefix="kv-tier-") as folder:
        if tier:
            worker += ["--kv-offload-dir", folder]
            scheduler += ["--kv-offload-size", "8GiB"]
        stack = InProcessStack(a.model, worker_argv=worker, scheduler_argv=scheduler).start()
        try:
            info = stack.info()
            r = asyncio.run(drive(stack.address, a, systems, users))
            s = stack.wait_idle()
        finally:
            stack.stop()
    recs = r["records"]
    ttfts = sorted(x["ttft_s"] for x in recs)
    return {"tier": tier, "dtype": info.dtype, "num_kv_blocks": info.num_kv_blocks,
            "prompt_tokens": sum(x["prompt_tokens"] for x in recs),
            "prefill_tokens_computed": sum(x["prompt_tokens"] - x["cached_tokens"] for x in recs),
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "wall_s": r["wall_s"], "tier_hit_tokens": s.prefix_cache_tier_hits_total,
            "prefix_cache_hits_total": s.prefix_cache_hits_total,
            "kv_offload_blocks": s.kv_offload_blocks,
            "kv_offload_loads_failed_total": s.kv_offload_loads_failed_total,
            "preemptions": s.num_preemptions_total, "records": recs}


def compare_outputs(off: dict, on: dict) -> list[str]:
    """The requests whose output tokens differ between the runs, with the first difference."""
    diffs = []
    for x, y in zip(off["records"], on["records"], strict=True):
        if x["output"] != y["output"]:
            i = next(i for i, (p, q) in enumerate(zip(x["output"], y["output"], strict=True))
                     if p != q)
            diffs.append(f"conversation {x['conversation']} turn {x['turn']}: token {i} "
                         f"{x['output'][i]} (off) vs {y['output'][i]} (on)")
    return diffs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="folder, .gguf or packaged name, e.g. gemma3-270m (default: SmolLM2)")
    p.add_argument("--num-conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--num-systems", type=int, default=2, choices=[1, 2])
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--user-len", type=int, default=64, help="shortest user message (tokens)")
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--pool-fraction", type=float, default=0.25,
                   help="the RAM KV pool as a fraction of the working set")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--json", default=None, help="write the figures as JSON here")
    a = p.parse_args()

    from services.router.tokenizer import load_tokenizer

    systems, users = texts(load_tokenizer(a.model), a)
    ws_tokens = working_set_tokens(a, systems, users)
    longest = max(len(systems[c % len(systems)]) + sum(len(u) for u in users[c])
                  + (a.turns - 1) * a.output_len for c in range(len(users)))
    # NOTE: --max-model-len just above the longest request: the scheduler refuses a pool that
    # cannot hold one request of the model's whole context (8192 tokens).
    max_len = longest + a.output_len + 16
    blocks_per_token, bytes_per_block, dtype = probe(
        a.model, a.dtype, systems[0] + users[0][0] + users[0][1], max_len)
    ws_blocks = math.ceil(ws_tokens * blocks_per_token)
    pool_blocks = math.ceil(ws_blocks * a.pool_fraction)
    need = math.ceil(a.concurrency * (longest + a.output_len) * blocks_per_token)
    print(f"model {a.model or 'SmolLM2-135M-Instruct'} dtype {dtype}; working set {ws_tokens} "
          f"tokens = {ws_blocks} KV blocks ({blocks_per_token:.4f} blocks/token, "
          f"{bytes_per_block} B/block); pool {pool_blocks} blocks "
          f"({a.pool_fraction:.2f} of it; {a.concurrency} longest requests need {need})",
          flush=True)
    if pool_blocks < need:
        sys.exit("the pool would not hold the requests in flight: raise --num-conversations")
    pool_bytes = pool_blocks * bytes_per_block
    runs = {}
    for tier in (False, True):
        r = runs["on" if tier else "off"] = run(a, tier, pool_bytes, max_len, systems, users)
        print(f"tier {'on ' if tier else 'off'}: prefill computed {r['prefill_tokens_computed']:7d}"
              f" of {r['prompt_tokens']} tokens  TTFT p50 {r['ttft_p50_s']:.3f} s "
              f"p90 {r['ttft_p90_s']:.3f} s  wall {r['wall_s']:.1f} s  tier hits "
              f"{r['tier_hit_tokens']} tokens  tier blocks {r['kv_offload_blocks']}  loads "
              f"failed {r['kv_offload_loads_failed_total']}  preemptions {r['preemptions']}  "
              f"({r['num_kv_blocks']} KV blocks)", flush=True)
    off, on = runs["off"], runs["on"]
    ratios = {k: on[k] / off[k] for k in ("prefill_tokens_computed", "ttft_p50_s", "ttft_p90_s",
                                          "wall_s")}
    print("on/off: " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    diffs = compare_outputs(off, on)
    if diffs:
        print(f"!!! OUTPUTS DIFFER between tier off and on in {len(diffs)} of "
              f"{len(off['records'])} requests:\n  " + "\n  ".join(diffs[:10]), flush=True)
    else:
        print(f"outputs identical between tier off and on ({len(off['records'])} requests)")
    if a.json:
        Path(a.json).write_text(json.dumps(
            {"args": vars(a), "working_set_tokens": ws_tokens, "working_set_blocks": ws_blocks,
             "pool_blocks": pool_blocks, "ratios": ratios, "output_diffs": diffs,
             **runs}, indent=1))


if __name__ == "__main__":
    main()
