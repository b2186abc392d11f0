"""How far bf16 logprobs are from float32: the first generated token's top-5 logprobs of 16 chat
prompts on SmolLM2, mean |logprob - transformers' float32 logprob| over those tokens, for

- the bf16 stack at its defaults (compiled, float32 logits from the native LM head),
- pagedserve bf16 eager (``ModelRunner(WorkerConfig(enforce_eager=True))``) and float32 eager,
- transformers bf16 (whose logits are rounded to bf16).

The prompts and helpers are ``benchmarks/probes.py``'s; ``tests/stack/test_same_answer.py``
asserts the order of the first, second and fourth.

    .venv/bin/python benchmarks/logprob_distance.py

``--quantization MODE`` (``int8`` or ``w8a8``; repeat it for both) measures the weight modes
instead: per ``--dtypes`` (default bfloat16,float32), pagedserve eager unquantized and with
each mode, the mean |logprob - reference| of each run's own top 5, against transformers'
float32 and against pagedserve's unquantized run at that dtype (its full log_softmax).

    .venv/bin/python benchmarks/logprob_distance.py --quantization int8 --quantization w8a8
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", action="append", choices=["int8", "w8a8"], default=[])
    p.add_argument("--dtypes", default="bfloat16,float32")
    a = p.parse_args()
    if a.quantization:
        quantized(a.quantization, a.dtypes.split(","))
        return
    import torch

    from benchmarks.engine_steps import generate
    from benchmarks.probes import (
        TOP,
        hf_first_logprobs,
        mean_distance,
        our_first_logprobs,
        probe_prompts_and_reference,
    )
    from benchmarks.stack_harness import InProcessStack
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    prompts, hf = probe_prompts_and_reference()
    fp32 = hf_first_logprobs(hf, prompts)
    hf_bf16 = hf_first_logprobs(hf.to(torch.bfloat16), prompts)
    del hf
    stack = InProcessStack(None, worker_argv=["--dtype", "bfloat16",
                                              "--kv-cache-memory", "256MiB"]).start()
    try:
        runs = {"pagedserve bf16, compiled (the default)":
                our_first_logprobs(stack.address, prompts)}
    finally:
        stack.stop()
    for dtype in ("bfloat16", "float32"):
        runner = ModelRunner(WorkerConfig(model=None, dtype=dtype, enforce_eager=True,
                                          kv_cache_memory=64 << 20))
        runs[f"pagedserve {dtype}, eager"] = [
            list(zip(*generate(runner, p, 1)[1][0][1:], strict=True)) for p in prompts]
        del runner
    runs["transformers bf16"] = [[(t, ref[t].item()) for t in ref.topk(TOP).indices.tolist()]
                                 for ref in hf_bf16]
    print(f"mean |logprob - transformers float32| of the top {TOP}, {len(prompts)} chats:")
    for name, tops in runs.items():
        print(f"  {name:42s} {mean_distance(tops, fp32):.4f}")




def quantized(modes: list[str], dtypes: list[str]) -> None:
    """The ``--quantization`` table (the module docstring)."""
    import torch

    from benchmarks.probes import (
        TOP,
        hf_first_logprobs,
        mean_distance,
        probe_prompts_and_reference,
        run_ours,
    )
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    prompts, hf = probe_prompts_and_reference()
    fp32 = hf_first_logprobs(hf, prompts)
    del hf
    print(f"mean |logprob - reference| of each run's top {TOP}, first step, {len(prompts)} "
          f"chats (pagedserve eager)")
    print(f"  {'run':34s} {'vs transformers fp32':>21s} {'vs unquantized':>15s}")
    for dtype in dtypes:
        unquantized = None
        for mode in [None, *modes]:
            runner = ModelRunner(WorkerConfig(model=None, dtype=dtype, enforce_eager=True,
                                              kv_cache_memory=64 << 20, quantization=mode))
            full = [torch.log_softmax(run_ours(runner.model, p)[-1], dim=-1) for p in prompts]
            del runner
            tops = [[(t, lp[t].item()) for t in lp.topk(TOP).indices.tolist()] for lp in full]
            unquantized = unquantized or full
            print(f"  {dtype + ', ' + (mode or 'unquantized'):34s} "
                  f"{mean_distance(tops, fp32):21.4f} {mean_distance(tops, unquantized):15.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
