"""What ``--kv-cache-dtype`` costs and buys on SmolLM2: capacity and quality per mode.

For each compute dtype (``--dtypes``) and KV cache mode (auto, int8, fp8_e4m3, fp8_e5m2):

- **capacity**: KV tokens that fit in ``--kv-cache-memory`` (2 GiB; the worker's sizing rule,
  ``ModelRunner.bytes_per_block``), and the ratio to ``auto`` at that dtype;
- **first-step logprobs**: the first generated token's top-5 logprobs of the 16 chat prompts
  of ``benchmarks/probes.py``, mean |logprob - transformers float32|;
- **greedy agreement**: how many of the 16 chats' greedy answers (``--max-tokens`` tokens) are
  identical to ``auto``'s at that dtype, and the mean length of the common prefix.

pagedserve runs eagerly in process (``ModelRunner(WorkerConfig(enforce_eager=True))``, the
native kernels).

    .venv/bin/python benchmarks/kv_cache_dtype.py [--dtypes bfloat16,float32] [--max-tokens 32]
        [--modes auto,int8] [--kv-layout rows]

``--kv-layout rows`` keeps every cache in the rows order (``services.worker.attention
.CPU_KV_LAYOUT``): an int8 cache is then dequantized before the products instead of read as
stored by the integer products of the ``pairs`` order (the default for int8).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ["auto", "int8", "fp8_e4m3", "fp8_e5m2"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="bytes")
    p.add_argument("--modes", default=",".join(MODES), help="--kv-cache-dtype values, auto first")
    p.add_argument("--kv-layout", default="auto", choices=["auto", "rows", "pairs"])
    a = p.parse_args()
    import torch

    from benchmarks.engine_steps import generate
    from benchmarks.probes import (
        TOP,
        hf_first_logprobs,
        mean_distance,
        probe_prompts_and_reference,
    )
    from services.worker import attention
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    attention.CPU_KV_LAYOUT = a.kv_layout
    prompts, hf = probe_prompts_and_reference()
    fp32 = hf_first_logprobs(hf, prompts)
    del hf
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, SmolLM2-135M, {len(prompts)} chats, top {TOP}, "
          f"{a.max_tokens} greedy tokens, KV memory {a.kv_cache_memory / 2**30:.2f} GiB, "
          f"--kv-layout {a.kv_layout}")
    print("| dtype | --kv-cache-dtype | KV tokens | x auto | mean abs dlogprob vs transformers "
          "fp32 | answers = auto's | mean common prefix |")
    print("|---|---|---|---|---|---|---|")
    for dtype in a.dtypes.split(","):
        base_tokens = base_answers = None
        for mode in a.modes.split(","):
            runner = ModelRunner(WorkerConfig(model=None, dtype=dtype, enforce_eager=True,
                                              kv_cache_memory=64 << 20, kv_cache_dtype=mode))
            tokens = a.kv_cache_memory // runner.bytes_per_block * runner.block_size
            tops, answers = [], []
            for prompt in prompts:
                out, logprobs = generate(runner, prompt, a.max_tokens)
                tops.append(list(zip(*logprobs[0][1:], strict=True)))
                answers.append(out)
            del runner
            base_tokens = base_tokens or tokens
            base_answers = base_answers or answers
            same = sum(x == y for x, y in zip(answers, base_answers, strict=True))
            prefix = sum(next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t),
                              len(x)) for x, y in zip(answers, base_answers, strict=True))
            print(f"| {dtype} | {mode} | {tokens:,} | {tokens / base_tokens:.2f}x | "
                  f"{mean_distance(tops, fp32):.4f} | {same}/{len(prompts)} | "
                  f"{prefix / len(prompts):.1f} |", flush=True)


if __name__ == "__main__":
    main()
