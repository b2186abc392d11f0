"""KV blocks one long request holds with sliding-window KV cache groups, against a cache that
keeps every block of every layer: Scheduler + ModelRunner in one process on a real model.

    .venv/bin/python benchmarks/kv_groups.py --model gemma3-270m --prompt-len 4000 --output-len 96

Runs one greedy request of ``--prompt-len`` + ``--output-len`` tokens (chunked by
``--max-num-batched-tokens``) and records, after every step, the blocks the request holds in
each KV cache group. Prints the peak while decoding, the bound (full groups' ceil(L / bs) +
sliding groups' ceil(W / bs) + 1), what one full-attention group of all layers would hold, the
bytes of each, and how many requests of that length fit at once in ``--kv-cache-memory``
before (one group of all layers) and after (the model's groups). A prefill chunk of C tokens
briefly holds its sliding groups' ceil((C + W - 1) / bs) + 1 blocks; they are released as the
request moves on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="bytes")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    a = p.parse_args()

    import random

    from services.scheduler.config import SchedulerConfig
    from services.scheduler.request import EngineSamplingParams, Request
    from services.scheduler.scheduler import Scheduler
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    runner = ModelRunner(WorkerConfig(model=a.model, dtype=a.dtype,
                                      kv_cache_memory=a.kv_cache_memory, enforce_eager=True))
    windows = [g.sliding_window for g in runner.kv_cache_groups]
    bs = runner.block_size
    scheduler = Scheduler(SchedulerConfig(max_model_len=a.prompt_len + a.output_len,
                                          max_num_batched_tokens=a.max_num_batched_tokens,
                                          long_prefill_token_threshold=0),
                          runner.num_kv_blocks, runner.eos_token_ids, sliding_windows=windows)
    rng = random.Random(0)
    prompt = [rng.randrange(100, runner.vocab_size) for _ in range(a.prompt_len)]
    request = Request("long", prompt, EngineSamplingParams(
        temperature=0, max_tokens=a.output_len, ignore_eos=True))
    scheduler.add_request(request)
    bm = scheduler.block_manager
    peak_decode = peak_prefill = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        held = bm.num_blocks_held(request)
        if request.num_computed_tokens > a.prompt_len:
            peak_decode = max(peak_decode, held)
        else:
            peak_prefill = max(peak_prefill, held)
        scheduler.update_from_output(out, runner.execute_step(out.for_rank(samples=True)))
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"

    n = -(-(a.prompt_len + a.output_len) // bs)
    bound = sum(n if w == 0 else -(-w // bs) + 1 for w in windows)
    layers = runner.num_layers
    per_block = runner.bytes_per_block  # one block in every group position (pair)
    per_block_full = per_block // runner.num_kv_pairs * layers  # one block in every layer
    blocks_full = a.kv_cache_memory // per_block_full
    fit_before = blocks_full // n
    fit_after = runner.num_kv_blocks // peak_decode
    print(f"model {a.model}: {layers} layers, groups (window: layers) "
          + ", ".join(f"{g.sliding_window or 'full'}: {list(g.layer_ids)}"
                      for g in runner.kv_cache_groups))
    print(f"one request of {a.prompt_len} + {a.output_len} tokens, block {bs}:")
    print(f"  held while decoding (peak): {peak_decode} blocks of {per_block / 2**10:.0f} KiB "
          f"= {peak_decode * per_block / 2**20:.1f} MiB; bound {bound}; prefill peak "
          f"{peak_prefill} (chunks of {a.max_num_batched_tokens})")
    print(f"  a full cache of all layers: {n} blocks of {per_block_full / 2**10:.0f} KiB = "
          f"{n * per_block_full / 2**20:.1f} MiB "
          f"({n * per_block_full / (peak_decode * per_block):.2f}x the memory)")
    print(f"  requests of that length that fit in {a.kv_cache_memory / 2**30:.2f} GiB at once: "
          f"{fit_before} before ({blocks_full} blocks), {fit_after} after "
          f"({runner.num_kv_blocks} blocks; decoding, each at its peak; "
          f"{runner.num_kv_blocks // peak_prefill} if all were at their prefill peak)")


if __name__ == "__main__":
    main()
