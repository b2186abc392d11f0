"""A CPU worker beside other load (issue 52): batch-1 inter-token latency and W, alone and
beside a neighbour, for each stack configuration; and two replicas pinned one core each.

    # the default stack and today's fixed thread count, alone / beside one busy thread /
    # beside a second pagedserve stack under load (2 rounds, interleaved)
    .venv/bin/python benchmarks/sharing.py --config="" --config="--no-cpu-adaptive-threads"
    # two replicas (router -> 2 schedulers -> 2 workers, --cpu-bind 0 and 1) against one
    # replica on both cores, W only
    .venv/bin/python benchmarks/sharing.py --replicas

Per configuration (``--config``: extra ``pagedserve serve`` flags, one string each) a stack
is started (``--dtype``, the default model unless ``--model``), and for each neighbour
(``--neighbours``):

- ``alone``: nothing else runs;
- ``busy``: one busy Python thread (``python -c "while True: pass"``) runs beside it;
- ``worker``: a second ``pagedserve serve`` (same model and flags) runs beside it, kept busy by
  a client streaming 4 requests at a time;

it measures batch 1 (``--itl-requests`` requests of ``--itl-tokens`` tokens, one at a time,
streamed over gRPC: ITL p50 / p90 in ms) and W (compare.py's workload, ``--w-requests``
requests at once: output tokens/s). A measurement past ``--timeout`` seconds is reported as
such (a collapsed configuration would take hours). Prints each row and, per configuration,
each neighbour's ratio to alone (ITL: neighbour / alone, W: neighbour / alone).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

BUSY = [sys.executable, "-c", "while True: pass"]
# W sends the same prompts in every measurement: no prefix cache, or later runs would skip
# their prefills
STACK = ["--http-port", "-1", "--no-enable-prefix-caching"]


async def batch_one(address: str, items, timeout: float) -> list[float] | None:
    """Inter-token gaps (s) of ``items`` streamed one at a time; None past ``timeout``."""
    from pagedserve_client import AsyncClient

    gaps: list[float] = []

    async def run():
        async with AsyncClient(address) as client:
            for it in items:
                last = None
                async for d in client.stream(prompt_token_ids=it.prompt_token_ids,
                                             max_tokens=it.output_len, ignore_eos=True,
                                             temperature=0):
                    now = time.perf_counter()
                    if d.token_ids:
                        if last is not None:
                            gaps.append(now - last)
                        last = now
    try:
        await asyncio.wait_for(run(), timeout)
    except TimeoutError:
        return None
    return gaps


async def throughput(address: str, items, timeout: float) -> float | None:
    """Output tokens/s of ``items`` sent at once; None past ``timeout``."""
    from pagedserve_client import AsyncClient

    async def run():
        async with AsyncClient(address) as client:
            t0 = time.perf_counter()
            rs = await asyncio.gather(*(client.generate(
                prompt_token_ids=it.prompt_token_ids, max_tokens=it.output_len,
                ignore_eos=True, temperature=0) for it in items))
            return sum(r.usage.completion_tokens for r in rs) / (time.perf_counter() - t0)
    try:
        return await asyncio.wait_for(run(), timeout)
    except TimeoutError:
        return None


@contextlib.contextmanager
def neighbour(kind: str, model: str | None, dtype: str, extra: list[str]):
    """Run the neighbour ``kind`` (see the module) for the duration of the block."""
    if kind == "alone":
        yield
        return
    if kind == "busy":
        proc = subprocess.Popen(BUSY)
        try:
            time.sleep(0.5)
            yield
        finally:
            proc.kill()
            proc.wait()
        return
    from throughput import running_stack
    with running_stack(model, dtype, [*extra, *STACK]) as address:
        load = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--address", address,
             "--num-prompts", "100000", "--max-concurrency", "4", "--max-output-len", "256",
             "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(5)  # (its first requests in flight)
            yield
        finally:
            load.kill()
            load.wait()


def fmt(x: float | None, unit: str) -> str:
    return "timeout" if x is None else f"{x:.1f} {unit}"


def run_configs(a, tokenizer) -> None:
    from compare import workload
    from throughput import running_stack

    itl_items = workload(tokenizer, a.itl_requests, a.seed + 7, output_range=(a.itl_tokens,
                                                                              a.itl_tokens))
    w_items = workload(tokenizer, a.w_requests, a.seed)
    rows: dict[tuple[str, str], list[tuple[float | None, float | None]]] = {}
    for r in range(a.rounds):
        for config in a.configs:
            extra = shlex.split(config)
            with running_stack(a.model, a.dtype, [*extra, *STACK]) as address:
                asyncio.run(throughput(address, w_items[:4], a.timeout))  # warm-up
                for kind in a.neighbours:
                    with neighbour(kind, a.model, a.dtype, extra):
                        gaps = asyncio.run(batch_one(address, itl_items, a.timeout))
                        tok_s = asyncio.run(throughput(address, w_items, a.timeout))
                    itl = statistics.median(gaps) * 1e3 if gaps else None
                    rows.setdefault((config, kind), []).append((itl, tok_s))
                    print(f"round {r} [{config or 'default'}] {kind:6s}: batch-1 ITL p50 "
                          f"{fmt(itl, 'ms')}, W {fmt(tok_s, 'tok/s')}", flush=True)
    print("\nmedians over rounds; ratios to the same configuration alone")
    for config in a.configs:
        base = rows.get((config, "alone"))
        for kind in a.neighbours:
            vals = rows[(config, kind)]
            itl = _median([v[0] for v in vals])
            tok = _median([v[1] for v in vals])
            line = (f"[{config or 'default'}] {kind:6s}: ITL p50 {fmt(itl, 'ms')}, "
                    f"W {fmt(tok, 'tok/s')}")
            if base and kind != "alone":
                b_itl, b_tok = _median([v[0] for v in base]), _median([v[1] for v in base])
                if itl and b_itl:
                    line += f" | ITL {itl / b_itl:.2f}x alone"
                if tok and b_tok:
                    line += f", W {tok / b_tok:.2f}x alone"
            print(line)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


@contextlib.contextmanager
def replica_stack(model: str | None, dtype: str, worker_flags: list[list[str]],
                  cgroup: Path | None = None):
    """A router over ``len(worker_flags)`` scheduler + worker pairs on this machine, worker i
    started with ``worker_flags[i]`` (inside ``cgroup`` when given); yields the router's
    address once it is healthy."""
    from services.common.grpc_utils import check_health
    from services.common.ports import free_ports

    ports = free_ports(1 + 2 * len(worker_flags))
    base = [sys.executable, "-m", "services.cli"]
    common = ["--metrics-port", "0", "--log-level", "WARNING"]
    procs = []
    try:
        schedulers = []
        for i, flags in enumerate(worker_flags):
            wport, sport = ports[1 + 2 * i], ports[2 + 2 * i]
            cmd = [*base, "worker", "--port", str(wport), "--dtype", dtype,
                   *(["--model", model] if model else []), *common, *flags]
            if cgroup is not None:  # (the shell joins the cgroup, then becomes the worker)
                cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *cmd]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, start_new_session=True))
            procs.append(subprocess.Popen(
                [*base, "scheduler", "--port", str(sport), "--workers", f"127.0.0.1:{wport}",
                 "--no-enable-prefix-caching", *common], cwd=ROOT, start_new_session=True))
            schedulers.append(f"127.0.0.1:{sport}")
        procs.append(subprocess.Popen(
            [*base, "router", "--port", str(ports[0]), "--schedulers", ",".join(schedulers),
             "--http-port", "-1", *common], cwd=ROOT, start_new_session=True))
        address = f"127.0.0.1:{ports[0]}"
        deadline = time.monotonic() + 900
        while not asyncio.run(check_health(address)):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise RuntimeError("the replicas did not start")
            time.sleep(1)
        yield address
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(60)


def run_replicas(a, tokenizer) -> None:
    from compare import workload
    from throughput import running_stack

    items = workload(tokenizer, a.w_requests, a.seed)
    cpus = sorted(os.sched_getaffinity(0))
    results: dict[str, list[float]] = {"one replica": [], "replicas": []}
    for r in range(a.rounds):
        with running_stack(a.model, a.dtype, STACK) as address:
            asyncio.run(throughput(address, items[:4], a.timeout))
            results["one replica"].append(asyncio.run(throughput(address, items, a.timeout)))
        with replica_stack(a.model, a.dtype, [["--cpu-bind", str(c)] for c in cpus]) as address:
            asyncio.run(throughput(address, items[:8], a.timeout))
            results["replicas"].append(asyncio.run(throughput(address, items, a.timeout)))
        print(f"round {r}: one replica {fmt(results['one replica'][-1], 'tok/s')}, "
              f"{len(cpus)} replicas (--cpu-bind one core each) "
              f"{fmt(results['replicas'][-1], 'tok/s')}", flush=True)
    one, many = _median(results["one replica"]), _median(results["replicas"])
    if one and many:
        print(f"{len(cpus)} pinned replicas: {many / one:.2f}x one replica on all "
              f"{len(cpus)} CPUs")


@contextlib.contextmanager
def cpu_quota_cgroup(cpus: float):
    """A new cgroup (v2, else v1's cpu hierarchy; needs root) with a quota of ``cpus`` CPUs."""
    root = Path("/sys/fs/cgroup")
    name = f"pagedserve-bench-{os.getpid()}"
    period = 100000
    if (root / "cgroup.controllers").exists():
        cg = root / name
        cg.mkdir()
        (cg / "cpu.max").write_text(f"{int(cpus * period)} {period}")
    else:
        cg = next(root / h for h in ("cpu", "cpu,cpuacct") if (root / h).is_dir()) / name
        cg.mkdir()
        (cg / "cpu.cfs_period_us").write_text(str(period))
        (cg / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
    try:
        yield cg
    finally:
        for _ in range(50):  # (its processes may take a moment to exit)
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.2)


def run_cgroup(a, tokenizer) -> None:
    """Batch-1 ITL of a worker in a cgroup with a quota of ``--cgroup-cpus`` (threads from the
    quota) against ``--cpu-threads N`` (N the quota, rounded down) without the cgroup."""
    from compare import workload

    items = workload(tokenizer, a.itl_requests, a.seed + 7,
                     output_range=(a.itl_tokens, a.itl_tokens))
    threads = str(max(1, int(a.cgroup_cpus)))
    itl: dict[str, list[float]] = {"cgroup": [], "threads": []}
    for r in range(a.rounds):
        with cpu_quota_cgroup(a.cgroup_cpus) as cg, replica_stack(
                a.model, a.dtype, [[]], cg) as address:
            asyncio.run(batch_one(address, items[:1], a.timeout))  # warm-up
            itl["cgroup"].append(statistics.median(asyncio.run(batch_one(address, items,
                                                                         a.timeout))) * 1e3)
        with replica_stack(a.model, a.dtype, [["--cpu-threads", threads]]) as address:
            asyncio.run(batch_one(address, items[:1], a.timeout))
            itl["threads"].append(statistics.median(asyncio.run(batch_one(address, items,
                                                                          a.timeout))) * 1e3)
        print(f"round {r}: batch-1 ITL p50 in a cgroup of {a.cgroup_cpus:g} CPUs "
              f"{itl['cgroup'][-1]:.1f} ms, --cpu-threads {threads} without it "
              f"{itl['threads'][-1]:.1f} ms", flush=True)
    print(f"in the cgroup: {_median(itl['cgroup']) / _median(itl['threads']):.2f}x "
          f"--cpu-threads {threads}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="folder or .gguf (default: packaged SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--config", dest="configs", action="append",
                   help="extra serve flags of one configuration, repeatable ('' = the "
                        "defaults, the default); write --config=\"--flag ...\"")
    p.add_argument("--neighbours", nargs="+", default=["alone", "busy", "worker"],
                   choices=["alone", "busy", "worker"])
    p.add_argument("--replicas", action="store_true",
                   help="W of one replica per CPU (--cpu-bind) against one replica")
    p.add_argument("--cgroup-cpus", type=float, default=None,
                   help="batch-1 ITL of a worker in a cgroup with this CPU quota (root) "
                        "against --cpu-threads of that many without it")
    p.add_argument("--itl-requests", type=int, default=3)
    p.add_argument("--itl-tokens", type=int, default=128)
    p.add_argument("--w-requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=180.0, help="per measurement, seconds")
    a = p.parse_args()
    a.configs = a.configs or [""]

    import platform

    from services.router.tokenizer import load_tokenizer
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
          f"(affinity {len(os.sched_getaffinity(0))}), {a.dtype}", flush=True)
    tokenizer = load_tokenizer(a.model)
    if a.replicas:
        run_replicas(a, tokenizer)
    elif a.cgroup_cpus is not None:
        run_cgroup(a, tokenizer)
    else:
        run_configs(a, tokenizer)


if __name__ == "__main__":
    main()
