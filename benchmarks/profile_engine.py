"""Where an engine step's time goes: compare.py's workload through Scheduler + ModelRunner in
one process, under torch.profiler, plus the Python time outside torch ops.

    .venv/bin/python benchmarks/profile_engine.py --num-requests 32 --dtype float32
        [--quantization w8a8] [--kv-cache-dtype int8] [--by-shape]

Prints the top torch ops by self CPU time (``--by-shape``: the native linear and attention
ops split by shape, with GFLOP/s), and splits each step's wall time into scheduling
(``Scheduler.schedule`` + ``update_from_output``), the sampling rank's view of the step
(``StepInput.for_rank``), and the worker's ``execute_step``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    from compare import add_workload_args

    add_workload_args(p)
    p.add_argument("--rows", type=int, default=15, help="torch ops to print")
    p.add_argument("--quantization", default=None, help="the worker's --quantization")
    p.add_argument("--kv-cache-dtype", default="auto", help="the worker's --kv-cache-dtype")
    p.add_argument("--by-shape", action="store_true",
                   help="also split the native linear and attention ops by shape (records "
                        "shapes: a little more profiler overhead)")
    a = p.parse_args()

    import torch
    from compare import workload
    from torch.profiler import ProfilerActivity, profile

    from services.router.tokenizer import load_tokenizer
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.request import EngineSamplingParams, Request
    from services.scheduler.scheduler import Scheduler
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    items = workload(load_tokenizer(a.model), a.num_requests, a.seed)
    runner = ModelRunner(WorkerConfig(model=a.model, dtype=a.dtype, quantization=a.quantization,
                                      kv_cache_dtype=a.kv_cache_dtype))
    scheduler = Scheduler(SchedulerConfig(max_model_len=runner.max_model_len),
                          runner.num_kv_blocks, runner.eos_token_ids,
                          sliding_windows=[g.sliding_window for g in runner.kv_cache_groups])
    for i, it in enumerate(items):
        scheduler.add_request(Request(f"r{i}", list(it.prompt_token_ids), EngineSamplingParams(
            temperature=0, max_tokens=it.output_len, ignore_eos=True)))
    spent = {"schedule": 0.0, "rank view": 0.0, "execute_step": 0.0, "update": 0.0}
    steps, tokens = 0, 0
    t_all = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=a.by_shape) as prof:
        while scheduler.has_unfinished_requests():
            t0 = time.perf_counter()
            out = scheduler.schedule()
            t1 = time.perf_counter()
            step = out.for_rank(samples=True)
            t2 = time.perf_counter()
            res = runner.execute_step(step)
            t3 = time.perf_counter()
            updates = scheduler.update_from_output(out, res)
            t4 = time.perf_counter()
            for k, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                spent[k] += dt
            steps += 1
            tokens += sum(len(u.new_token_ids) for u in updates)
    wall = time.perf_counter() - t_all
    print(f"{steps} steps, {tokens} output tokens, {wall:.1f} s ({tokens / wall:.1f} tok/s, "
          f"{torch.get_num_threads()} threads, profiler on)")
    for k, v in spent.items():
        print(f"  {k:14s} {v:7.2f} s  {100 * v / wall:5.1f} %")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    if a.by_shape:
        print_by_shape(prof.events())


def print_by_shape(events) -> None:
    """Seconds, calls and GFLOP/s of ``pagedserve::linear`` / ``w8a8_linear`` /
    ``a8_linear`` (and ATen's ``mm`` / ``addmm``, a
    float32 model's linear layers) per (N, K, rows: 1-8 each, <= 128, > 128) and of
    ``pagedserve::paged_attention`` per step kind (query rows <= 128: decode-sized, else with
    prefill), largest first."""
    table: dict[tuple, list[float]] = {}
    for e in events:
        if e.name in ("pagedserve::linear", "pagedserve::w8a8_linear",
                      "pagedserve::a8_linear"):
            (m, k), n = e.input_shapes[0], e.input_shapes[1][0] * 32  # blocks of 32 columns
        elif e.name in ("aten::mm", "aten::addmm") and e.input_shapes:  # a float32 model: MKL
            first = 1 if e.name == "aten::addmm" else 0  # addmm(bias, x, w^T, ...)
            (m, k), (_, n) = e.input_shapes[first], e.input_shapes[first + 1]
        elif e.name == "pagedserve::paged_attention":
            rows = "<= 128" if e.input_shapes[0][0] <= 128 else "> 128"
            key, flops = ("paged_attention", "", "", rows), 0.0
        else:
            continue
        if e.name != "pagedserve::paged_attention":
            rows = f"{m}" if m <= 8 else "<= 128" if m <= 128 else "> 128"
            op = e.name.removeprefix("pagedserve::")
            key, flops = (op, n, k, rows), 2.0 * m * k * n
        entry = table.setdefault(key, [0.0, 0, 0.0])
        entry[0] += e.self_cpu_time_total / 1e6
        entry[1] += 1
        entry[2] += flops
    print(f"{'op':16s} {'N':>6s} {'K':>5s} {'rows':>7s} {'seconds':>8s} {'calls':>6s} GFLOP/s")
    for (op, n, k, rows), (sec, calls, flops) in sorted(table.items(), key=lambda kv: -kv[1][0]):
        rate = f"{flops / sec / 1e9:7.0f}" if flops and sec else ""
        print(f"{op:16s} {n!s:>6s} {k!s:>5s} {rows:>7s} {sec:8.2f} {calls:6d} {rate}")


if __name__ == "__main__":
    main()
