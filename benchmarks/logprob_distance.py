"""How far bf16 logprobs are from float32: the first generated token's top-5 logprobs of 16 chat
prompts on SmolLM2, mean |logprob - transformers' float32 logprob| over those tokens, for

- the bf16 stack at its defaults (compiled, float32 logits from the native LM head),
- pagedserve bf16 eager (``ModelRunner(enforce_eager=True)``) and float32 eager,
- transformers bf16 (whose logits are rounded to bf16).

The prompts and helpers are ``tests/stack/test_same_answer.py``'s, which asserts the order of
the first, second and fourth.

    .venv/bin/python benchmarks/logprob_distance.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from services.common.model_files import resolve_model
    from services.worker.model_runner import ModelRunner
    from tests.stack.test_same_answer import (PROBE_CHATS, TOP, _hf_first_logprobs,
                                              _mean_distance, _our_first_logprobs)
    from tests.stack.test_smollm2 import chat_prompts
    from tests.stack_harness import InProcessStack
    from tests.worker.invariance_driver import generate

    prompts = chat_prompts(PROBE_CHATS)
    src = resolve_model(None)
    hf = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file,
                                              dtype=torch.float32).eval()
    fp32 = _hf_first_logprobs(hf, prompts)
    hf_bf16 = _hf_first_logprobs(hf.to(torch.bfloat16), prompts)
    del hf
    stack = InProcessStack(None, worker_argv=["--dtype", "bfloat16",
                                              "--kv-cache-memory", "256MiB"]).start()
    try:
        runs = {"pagedserve bf16, compiled (the default)":
                _our_first_logprobs(stack.address, prompts)}
    finally:
        stack.stop()
    for dtype in ("bfloat16", "float32"):
        runner = ModelRunner(None, dtype=dtype, enforce_eager=True, kv_cache_memory=64 << 20)
        runs[f"pagedserve {dtype}, eager"] = [
            list(zip(*generate(runner, p, 1)[1][0][1:], strict=True)) for p in prompts]
        del runner
    runs["transformers bf16"] = [[(t, ref[t].item()) for t in ref.topk(TOP).indices.tolist()]
                                 for ref in hf_bf16]
    print(f"mean |logprob - transformers float32| of the top {TOP}, {len(prompts)} chats:")
    for name, tops in runs.items():
        print(f"  {name:42s} {_mean_distance(tops, fp32):.4f}")


if __name__ == "__main__":
    main()
