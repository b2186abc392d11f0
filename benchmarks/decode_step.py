"""Batch-1 decode step time per weight mode, in one process: one ``ModelRunner`` per
``--quantization`` mode (compiled forward unless ``--enforce-eager``; bf16 by default), each
generating one request of ``--tokens`` greedy tokens after a 64-token prompt, the modes
alternated ``--rounds`` times; per round the median ``execute_step`` time of its decode steps
(the request asks top-5 logprobs: ``benchmarks/engine_steps.py``). ``--profile``: then one
more request per mode under ``torch.profiler``, the top ops by self CPU time.

    .venv/bin/python benchmarks/decode_step.py [--model gemma3-270m] [--modes unset,none]
        [--dtype bfloat16] [--tokens 128] [--rounds 3] [--profile]

Modes: ``unset`` (a GGUF's quantized tensors as stored), ``none`` (dequantized at load to
``--dtype``), ``int8``, ``w8a8``. Models with one KV cache group only (``engine_steps`` hands
the request one block table: not Gemma 3's sliding-window groups).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--modes", default="unset,none")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.engine_steps import generate
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    prompt = list(range(100, 164))
    runners, times = {}, {}
    for mode in a.modes.split(","):
        runner = ModelRunner(WorkerConfig(
            model=a.model, dtype=a.dtype, enforce_eager=a.enforce_eager,
            kv_cache_memory=128 << 20, quantization=None if mode == "unset" else mode))
        steps: list[float] = []
        step = runner.execute_step

        def timed(*args, _step=step, _steps=steps, **kwargs):
            t = time.perf_counter()
            out = _step(*args, **kwargs)
            _steps.append(time.perf_counter() - t)
            return out

        runner.execute_step = timed  # type: ignore[method-assign]
        generate(runner, prompt, 16)  # warm-up (and the compile or load)
        runners[mode], times[mode] = runner, steps
    medians: dict[str, list[float]] = {m: [] for m in runners}
    for _ in range(a.rounds):
        for mode, runner in runners.items():
            times[mode].clear()
            generate(runner, prompt, a.tokens)
            decode = [t for t in times[mode][1:] if t > 1e-3]  # (not the finishing step)
            medians[mode].append(statistics.median(decode) * 1e3)
    first = next(iter(medians))
    print(f"decode step, batch 1, ms (median per round; {a.dtype}, "
          f"{'eager' if a.enforce_eager else 'compiled'})")
    for mode, ms in medians.items():
        ratio = " ".join(f"{b / x:.2f}" for x, b in zip(medians[first], ms, strict=True))
        print(f"{mode:6s} {' '.join(f'{x:6.2f}' for x in ms)}   / {first}: {ratio}")
    if a.profile:
        for mode, runner in runners.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                generate(runner, prompt, a.tokens)
            print(f"===== {mode}: {a.tokens} tokens")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20,
                                            max_name_column_width=60))


if __name__ == "__main__":
    main()
