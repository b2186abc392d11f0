"""The default model's greedy answer to one chat prompt and its first tokens' top-3 logprobs,
from a ``ModelRunner`` in this process: how near a tie the first token is at a given dtype
and attention body.

    .venv/bin/python benchmarks/first_token.py [--dtype bfloat16] [--enforce-eager]
        [--chat "What is the capital of France?"]

``PAGEDSERVE_CPU_ISA=avx512_bf16`` runs the vdpbf16ps attention body on an AMX CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--chat", default="What is the capital of France?")
    p.add_argument("--tokens", type=int, default=20)
    a = p.parse_args()

    from benchmarks.engine_steps import generate
    from benchmarks.probes import chat_prompts
    from services.common.tokenizer_loading import load_tokenizer
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    prompt = chat_prompts([a.chat])[0]
    runner = ModelRunner(WorkerConfig(model=None, dtype=a.dtype, enforce_eager=a.enforce_eager,
                                      kv_cache_memory=64 << 20))
    tokens, logprobs = generate(runner, prompt, a.tokens)
    print(repr(load_tokenizer(None).decode(tokens)))
    for i, (_, ids, values) in enumerate(logprobs[:4]):
        print(f"token {i}: top ids {list(ids[:3])}, logprobs {[round(v, 3) for v in values[:3]]}")


if __name__ == "__main__":
    main()
