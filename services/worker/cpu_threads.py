"""How many OpenMP threads a CPU worker runs, and on which cores: ``--cpu-threads`` and
``--cpu-bind``.

The default thread count is what the process may really use, not the cores the machine shows:
the CPUs in its affinity mask (``taskset``, a cpuset cgroup, Kubernetes' static CPU manager),
capped by its cgroup's CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``, the lowest along the cgroup's path; a quota of 1.5 CPUs gives 1
thread: a thread more than the quota is throttled for the rest of each period, and every
parallel region's barrier waits for it), and shared between the worker ranks this host runs
(tensor / pipeline parallel on one machine). ``--cpu-threads N`` sets it.

``--cpu-bind`` pins the threads one per core, the way vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` does
(that variable is read when the flag and ``PAGEDSERVE_CPU_BIND`` are unset, in its spelling):
``auto`` binds to the CPUs the process may use (this rank's share of them), a list such as
``0-3,8`` binds to those (split between this host's ranks), ``0-1|2-3`` gives each rank its
own list, and ``none`` / ``nobind`` (the default) pins nothing. The worker's other threads (the
event loop, gRPC's) are moved off the bound cores when any core is left for them, as vLLM
reserves a core for its frontend.

Which cores a thread is on is the OS's business until pinned; the OpenMP threads are found by
``torch.ops.pagedserve.omp_thread_ids`` (kernels/csrc/cpu_threads.cpp): the forward thread is
the team's thread 0, and libgomp gives later teams the same threads in the same order.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

NO_BIND = ("", "none", "nobind")


@dataclass(frozen=True)
class CpuPlan:
    """The worker's CPU threads.

    Attributes:
        threads: OpenMP threads for the forward (the most the contention governor may use).
        bind: the core each thread is pinned to (``len(bind) == threads``), or None (unpinned).
        others: the cores the worker's other threads are moved to when ``bind`` is set (the
            allowed CPUs not bound), or None (left as they are: every bound core was all there
            was, or nothing is bound).
        reason: why, in words (logged at start).
    """

    threads: int
    bind: tuple[int, ...] | None
    others: tuple[int, ...] | None
    reason: str


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` → ``[0, 1, 2, 3, 8]`` (Linux's cpu-list format, as ``taskset -c`` reads it).

    Raises:
        ValueError: an empty list, a part that is not N or N-M with N <= M, or a CPU listed
            twice.
    """
    cpus: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not a CPU number or range N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"{part.strip()!r} is not a CPU range N-M with 0 <= N <= M")
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{text!r} lists a CPU twice")
    return cpus


def cpu_bind_flag(text: str) -> str:
    """``--cpu-bind``'s argparse type: the text, once it is ``auto``, ``none`` / ``nobind`` or
    core lists (``0-3``, ``0-1|2-3``).

    Raises:
        argparse.ArgumentTypeError: naming the part that is wrong.
    """
    import argparse
    if text.strip().lower() in (*NO_BIND, "auto"):
        return text.strip().lower()
    try:
        for part in text.split("|"):
            parse_cpu_list(part)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip()


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup",
                     root: str = "/sys/fs/cgroup") -> tuple[float, str] | None:
    """The CPU quota of this process's cgroup in CPUs, and where it was read; None when there
    is none (or no cgroup file system to read).

    cgroup v2: ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") of the cgroup named by the ``0::``
    line and of each parent up to the mount; v1: ``cpu.cfs_quota_us`` (-1: none) over
    ``cpu.cfs_period_us`` in the ``cpu`` controller's hierarchy. The lowest quota on the path
    wins (a parent's limit holds for its children). Inside a container the cgroup path is
    usually ``/`` (a cgroup namespace), so the mount itself is the container's cgroup.
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    best: tuple[float, str] | None = None
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        files: tuple[str, ...]
        if hier == "0" and controllers == "":
            dirs = [Path(root)]
            files = ("cpu.max",)
        elif "cpu" in controllers.split(","):
            dirs = [Path(root) / name for name in (controllers, "cpu", "cpu,cpuacct",
                                                   "cpuacct,cpu")]
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        for mount in dirs:
            if not mount.is_dir():
                continue
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):
                folder = mount.joinpath(*parts[:depth])
                quota = _read_quota(folder, files)
                if quota is not None and (best is None or quota < best[0]):
                    best = (quota, str(folder / files[0]))
            break
    return best


def _read_quota(folder: Path, files: tuple[str, ...]) -> float | None:
    """CPUs allowed by the quota file(s) in ``folder``, or None (no file, no limit)."""
    try:
        if len(files) == 1:  # v2: "max 100000" or "150000 100000"
            words = (folder / files[0]).read_text().split()
            return None if words[0] == "max" else int(words[0]) / int(words[1])
        quota = int((folder / files[0]).read_text())
        period = int((folder / files[1]).read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError, IndexError, ZeroDivisionError):
        return None


def plan_cpu_threads(cpu_threads: int | None = None, cpu_bind: str | None = None,
                     local_rank: int = 0, local_ranks: int = 1,
                     cpus: list[int] | None = None,
                     limit: tuple[float, str] | str | None = "cgroup") -> CpuPlan:
    """The worker's threads and their cores from its flags and what the process may use.

    Args:
        cpu_threads: ``--cpu-threads`` (None: from the CPUs, as the module says).
        cpu_bind: ``--cpu-bind`` (see the module; None = none).
        local_rank, local_ranks: this rank's index among the worker ranks this host runs, and
            how many there are (they share the CPUs: each gets a contiguous slice).
        cpus: the CPUs the process may run on (default: its affinity mask).
        limit: the cgroup's quota ``(cpus, file)``, None for none; "cgroup" (default) reads it
            (``cgroup_cpu_limit``).

    Raises:
        ValueError: naming the flag: a bound core outside the affinity mask, per-rank lists
            (``|``) whose number is not the host's ranks, fewer cores than ranks or than
            ``--cpu-threads``.
    """
    allowed = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    quota = cgroup_cpu_limit() if isinstance(limit, str) else limit
    bind = (cpu_bind or "").strip().lower()
    share = (f", shared by the {local_ranks} worker ranks on this host (this is local rank "
             f"{local_rank})" if local_ranks > 1 else "")
    if bind not in NO_BIND:
        cores = _bound_cores(cpu_bind or "", allowed, quota, local_rank, local_ranks)
        if cpu_threads is not None:
            if cpu_threads > len(cores):
                raise ValueError(f"--cpu-threads {cpu_threads} is more than the "
                                 f"{len(cores)} cores --cpu-bind {cpu_bind} gives this rank"
                                 f" ({_cpu_list(cores)})")
            cores = cores[:cpu_threads]
        others = tuple(c for c in allowed if c not in cores) or None
        return CpuPlan(len(cores), tuple(cores), others,
                       f"bound one per core to CPUs {_cpu_list(cores)} (--cpu-bind "
                       f"{cpu_bind}){share}; other threads on "
                       f"{_cpu_list(others) if others else 'the same CPUs (none left)'}")
    if cpu_threads is not None:
        return CpuPlan(cpu_threads, None, None, "--cpu-threads")
    usable, why = len(allowed), f"{len(allowed)} CPUs in the affinity mask"
    if quota is not None and math.floor(quota[0]) < usable:
        usable = max(1, math.floor(quota[0]))
        why = f"the cgroup's CPU quota is {quota[0]:g} CPUs ({quota[1]}), {why}"
    threads = max(1, usable // local_ranks)
    return CpuPlan(threads, None, None, why + share)


def _bound_cores(spec: str, allowed: list[int], quota: tuple[float, str] | None,
                 local_rank: int, local_ranks: int) -> list[int]:
    """This rank's cores under ``--cpu-bind spec`` (not none)."""
    if spec.strip().lower() == "auto":
        cores = list(allowed)
        if quota is not None:  # bind no more cores than the quota pays for
            cores = cores[:max(1, math.floor(quota[0]))]
    else:
        lists = [parse_cpu_list(part) for part in spec.split("|")]
        if len(lists) > 1:
            if len(lists) != local_ranks:
                raise ValueError(f"--cpu-bind {spec} has {len(lists)} lists (one per rank, "
                                 f"'|' between) but this host runs {local_ranks} worker ranks")
            return _check_allowed(spec, lists[local_rank], allowed)
        cores = _check_allowed(spec, lists[0], allowed)
    if len(cores) < local_ranks:
        raise ValueError(f"--cpu-bind {spec} gives {len(cores)} cores to {local_ranks} worker "
                         "ranks on this host (each needs one)")
    per = len(cores) // local_ranks
    return cores[local_rank * per:(local_rank + 1) * per]


def _check_allowed(spec: str, cores: list[int], allowed: list[int]) -> list[int]:
    outside = [c for c in cores if c not in allowed]
    if outside:
        raise ValueError(f"--cpu-bind {spec}: CPUs {_cpu_list(outside)} are not in this "
                         f"process's affinity mask ({_cpu_list(allowed)})")
    return cores


def _cpu_list(cpus) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"``."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def omp_thread_ids(threads: int) -> list[int]:
    """The Linux thread ids of the calling thread's OpenMP team of ``threads``, by team index
    (kernels/csrc/cpu_threads.cpp; loads the native kernels).

    Raises:
        RuntimeError: the native kernels cannot be built or loaded.
    """
    import torch

    from kernels import cpu_build
    cpu_build.load()
    return [int(t) for t in torch.ops.pagedserve.omp_thread_ids(threads)]


def set_threads(plan: CpuPlan) -> None:
    """``torch.set_num_threads(plan.threads)`` for the calling thread (the forward thread:
    OpenMP's thread count is per calling thread)."""
    import torch
    torch.set_num_threads(plan.threads)


def pin_threads(plan: CpuPlan) -> list[int]:
    """Pin the calling thread's OpenMP team one thread per core of ``plan.bind`` and move the
    process's other threads to ``plan.others`` (when it is set); returns the team's thread ids.
    Call it on the forward thread once the model is loaded and warmed up: threads and
    processes started later by a pinned thread (Inductor's compile workers) would inherit its
    single core.

    Raises:
        RuntimeError: the native kernels cannot be loaded.
        OSError: the OS refused an affinity (a CPU outside the cpuset).
    """
    assert plan.bind is not None
    tids = omp_thread_ids(plan.threads)
    for tid, cpu in zip(tids, plan.bind, strict=True):
        os.sched_setaffinity(tid, {cpu})
    if plan.others:
        for name in os.listdir("/proc/self/task"):
            if int(name) not in tids:
                try:
                    os.sched_setaffinity(int(name), set(plan.others))
                except (ProcessLookupError, OSError):
                    pass  # a thread that has just exited
    return tids


def local_rank_of(args) -> tuple[int, int]:
    """``(index, count)`` of this rank among the worker ranks its host runs (``--rank``,
    ``--tensor-parallel-size`` x ``--pipeline-parallel-size`` over ``--nnodes``)."""
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    per_host = max(1, world // max(1, args.nnodes))
    return (args.rank or 0) % per_host, per_host


def plan_from_args(args) -> CpuPlan:
    """The plan of a worker's flags (``--cpu-threads``, ``--cpu-bind``), logged; see
    ``plan_cpu_threads`` for the errors."""
    index, count = local_rank_of(args)
    plan = plan_cpu_threads(args.cpu_threads, args.cpu_bind, index, count)
    log.info("OpenMP threads: %d (%s)", plan.threads, plan.reason)
    return plan
