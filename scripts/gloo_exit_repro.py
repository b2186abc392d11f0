"""Reproduce the gloo exit abort behind the once-flaky vocab-parallel test (docs/reliability.md,
"Clean teardown"): ranks that init a gloo group, run two collectives and exit, with or without
``destroy_distributed`` first. Counts runs in which any rank's exit code was not 0 (an abort is
-6, "terminate called without an active exception").

    .venv/bin/python scripts/gloo_exit_repro.py --runs 20 --world 3            # no destroy
    .venv/bin/python scripts/gloo_exit_repro.py --runs 20 --world 3 --destroy  # with it
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rank(rank: int, world: int, port: int, destroy: bool) -> None:
    import torch
    import torch.distributed as dist

    from services.worker.parallel.distributed import destroy_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    x = torch.tensor([float(rank)])
    dist.all_gather([torch.empty(1) for _ in range(world)], x, group=group)
    dist.all_reduce(x, group=group)
    if destroy:
        destroy_distributed()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--destroy", action="store_true", help="call destroy_distributed before exit")
    a = p.parse_args()
    from services.common.ports import free_port

    ctx = mp.get_context("spawn")
    bad = 0
    for i in range(a.runs):
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, a.world, port, a.destroy))
                 for r in range(a.world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120)
            if proc.is_alive():
                proc.kill()
                proc.join()
        codes = [proc.exitcode for proc in procs]
        if codes != [0] * a.world:
            bad += 1
            print(f"run {i}: exit codes {codes}", flush=True)
    print(f"destroy={a.destroy}: {bad} of {a.runs} runs had a rank exit non-zero")


if __name__ == "__main__":
    main()
