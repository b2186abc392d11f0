"""Does running the forward on an executor thread (as the worker service does, beside its
asyncio loop) slow it down? The same requests through Scheduler + ModelRunner, alternating:

- ``main``: ``execute_step`` called on the main thread (as ``compare.py``'s in-process engine);
- ``executor``: ``execute_step`` run by ``loop.run_in_executor`` on a one-thread pool, the
  model loaded on the main thread (as ``services/worker/server.py`` did before issue 16);
- ``executor, loaded there``: the model loaded on that same one-thread pool, which then runs
  every step (``services/worker/server.py`` now: ``forward_thread``).

All run inside a uvloop event loop that also serves an idle grpc.aio server; ``executor, no
server`` runs the executor case without it.

    .venv/bin/python benchmarks/forward_thread.py --num-requests 32

Prints output tokens/s and the process's voluntary context switches per run (OpenMP worker
threads sleeping and being woken), and the median ratio of each variant to main.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


async def run_engine(runner, items, on_executor: bool, with_server: bool = True,
                     pool: ThreadPoolExecutor | None = None) -> float:
    """Output tokens/s of ``items`` through a fresh Scheduler and ``runner``, with an idle
    grpc.aio server on this loop; each step's forward runs on this (the main) thread, or on a
    one-thread executor when ``on_executor``, as in ``services/worker/server.py``."""
    from throughput import loaded_scheduler

    from services.common.grpc_utils import new_server

    server = (await new_server("127.0.0.1", 0))[0] if with_server else None
    if server is not None:
        await server.start()
    loop = asyncio.get_running_loop()
    pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
    scheduler = loaded_scheduler(runner, [it.prompt_token_ids for it in items],
                                 [it.output_len for it in items])
    try:
        n, t0 = 0, time.perf_counter()
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            step = out.for_rank(samples=True)
            if on_executor:
                res = await loop.run_in_executor(pool, runner.execute_step, step)
            else:
                res = runner.execute_step(step)
            updates = scheduler.update_from_output(out, res)
            n += sum(len(u.new_token_ids) for u in updates)
        return n / (time.perf_counter() - t0)
    finally:
        pool.shutdown()
        if server is not None:
            await server.stop(None)


VARIANTS = ["main", "executor", "executor, no server", "executor, loaded there"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    from compare import add_workload_args

    add_workload_args(p)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS,
                   help="which to run, in this order (the first is the base of the ratios). "
                        "NOTE: OpenMP pools outlive a run, so a variant run after another that "
                        "used a different thread is not clean: run one variant per process to "
                        "see each alone")
    a = p.parse_args()

    from compare import workload

    from services.common.grpc_utils import install_uvloop
    from services.router.tokenizer import load_tokenizer
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    install_uvloop()
    items = workload(load_tokenizer(a.model), a.num_requests, a.seed)
    runs: dict[str, list[float]] = {name: [] for name in a.variants}
    for r in range(a.rounds):
        for name in runs:
            pool = None
            if name == "executor, loaded there":
                pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
                runner = pool.submit(ModelRunner,
                                     WorkerConfig(model=a.model, dtype=a.dtype)).result()
            else:
                # a fresh KV cache each run
                runner = ModelRunner(WorkerConfig(model=a.model, dtype=a.dtype))
            before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            tok_s = asyncio.run(run_engine(runner, items, on_executor=name != "main",
                                           with_server=name != "executor, no server", pool=pool))
            switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
            runs[name].append(tok_s)
            print(f"round {r + 1} {name:22s}: {tok_s:.1f} output tok/s, {switches} voluntary "
                  f"context switches", flush=True)
            del runner
    base = statistics.median(runs[a.variants[0]])
    for name, xs in runs.items():
        print(f"median {name:22s}: {statistics.median(xs):.1f} tok/s, "
              f"{statistics.median(xs) / base:.2f}x of {a.variants[0]}")


if __name__ == "__main__":
    main()
