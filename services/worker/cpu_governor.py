"""Fewer OpenMP threads while other load takes the worker's cores, all of them again once it
leaves: why a CPU worker degrades in proportion beside a busy neighbour instead of collapsing.

A step runs hundreds of OpenMP parallel regions, each ending in a barrier, and libgomp's threads
spin at a barrier until the last thread arrives. When another process wants one of the cores,
the OS deschedules one of the worker's threads for a time slice (milliseconds) and its partner
spins through that slice at the next barrier: every barrier costs a slice. Measured on a 2-core
AMD EPYC with one busy Python thread beside the stack: 10 ms per token alone, ~2 s beside it
(both OpenMP threads each runnable but waiting half the time, ~400 preemptions a second); with
one thread, 14 ms (docs/benchmarks.md, "Sharing a machine"). A passive wait policy
(``OMP_WAIT_POLICY=passive``) would not collapse, but makes every step ~2x slower alone.

So the governor watches, between steps, two numbers the kernel keeps anyway:

- ``wait``: the seconds per second the worker's OpenMP threads spent runnable but not running
  (``/proc/self/task/<tid>/schedstat``, second field: run-queue delay), i.e. how many CPUs'
  worth of time other load took from them;
- ``idle``: the seconds per second the CPUs the worker may use were idle (``/proc/stat``).

Every ``WINDOW`` seconds of stepping: ``wait >= DOWN_WAIT`` CPUs drops ``round(wait)`` threads
(at least one, never below one); otherwise ``idle >= UP_IDLE`` CPUs adds ``floor(idle)``
threads back (at least one, up to the plan's count). Alone, the threads wait ~0.1-0.3 CPUs
(the stack's own router and scheduler wake up beside them) and stay; beside one busy thread on
2 cores they wait ~1 CPU and drop to 1, and with 1 thread the other core is busy (idle ~0), so
they stay there until the neighbour leaves. Two workers on the same cores both drop.

The kernels' results do not depend on the thread count (tested: tests/kernels), and Inductor's
generated loops read the thread count at run time (``cpp.dynamic_threads``,
services/worker/compiled.py), so a change applies to the next step. ``--batch-invariant`` keeps
the count fixed (a fused reduction split over threads could round differently).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

WINDOW = 0.25  # seconds of stepping between decisions
DOWN_WAIT = 0.5  # CPUs of run-queue delay that cost a thread
UP_IDLE = 0.6  # CPUs idle that give one back


def decide(threads: int, max_threads: int, wait: float, idle: float) -> int:
    """The thread count for the next window.

    Args:
        threads: the count in use; max_threads: the plan's.
        wait: CPUs of run-queue delay of the threads in use over the window.
        idle: CPUs idle among those the worker may use over the window.
    """
    if threads > 1 and wait >= DOWN_WAIT:
        return max(1, threads - max(1, round(wait)))
    if threads < max_threads and idle >= UP_IDLE:
        return min(max_threads, threads + max(1, math.floor(idle)))
    return threads


def run_delay_ns(tids: list[int]) -> int:
    """Nanoseconds the threads ``tids`` have spent runnable but not running since they started
    (``/proc/self/task/<tid>/schedstat``; a thread that has exited counts 0).

    Raises:
        OSError: the kernel keeps no schedstat (built without CONFIG_SCHED_INFO).
    """
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except FileNotFoundError:
            pass
    return total


def idle_seconds(cpus: set[int], stat: str = "/proc/stat") -> float:
    """Seconds the CPUs ``cpus`` have been idle (idle + iowait) since boot, from ``/proc/stat``
    (USER_HZ ticks, 10 ms each on Linux)."""
    ticks = 0
    with open(stat) as f:
        for line in f:
            if not line.startswith("cpu"):
                break  # (the per-CPU lines come first, after the "cpu " total)
            name, *fields = line.split()
            if name != "cpu" and int(name[3:]) in cpus:
                ticks += int(fields[3]) + int(fields[4])
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Sets the forward thread's OpenMP thread count between steps (see the module).

    Call ``before_step`` and ``after_step`` on the forward thread around each step; both are
    cheap (a clock read) except once per window (two small /proc reads per thread).

    Args:
        max_threads: the plan's thread count (``cpu_threads.CpuPlan.threads``).
        tids: the Linux ids of the forward thread's OpenMP team of ``max_threads``
            (``cpu_threads.omp_thread_ids``), by team index.
        cpus: the CPUs the worker may use (its affinity mask).
        set_threads: applies a count (``torch.set_num_threads``); on_change: told each new
            count (the metric).
        wait_ns, idle_s, clock: the readers (tests give fakes).
    """

    def __init__(self, max_threads: int, tids: list[int], cpus: set[int],
                 set_threads: Callable[[int], None],
                 on_change: Callable[[int], None] | None = None,
                 wait_ns: Callable[[list[int]], int] = run_delay_ns,
                 idle_s: Callable[[set[int]], float] = idle_seconds,
                 clock: Callable[[], float] = time.monotonic):
        self.max_threads = self.threads = max_threads
        self.tids, self.cpus = tids, cpus
        self._set, self.on_change = set_threads, on_change
        self._wait_ns, self._idle_s, self._clock = wait_ns, idle_s, clock
        self._start: tuple[float, int, float] | None = None  # (time, wait ns, idle s)
        self._last_end = -math.inf

    def before_step(self) -> None:
        """A step starts: open a window unless one is open and the worker has been stepping
        (a gap longer than a window, an idle server, starts afresh)."""
        now = self._clock()
        if self._start is None or now - self._last_end > WINDOW:
            self._start = (now, self._wait_ns(self.tids[:self.threads]), self._idle_s(self.cpus))

    def after_step(self) -> None:
        """A step ended: decide once the window is ``WINDOW`` seconds long."""
        now = self._last_end = self._clock()
        if self._start is None or now - self._start[0] < WINDOW:
            return
        t0, w0, i0 = self._start
        wait = (self._wait_ns(self.tids[:self.threads]) - w0) / 1e9 / (now - t0)
        idle_now = self._idle_s(self.cpus)
        idle = (idle_now - i0) / (now - t0)
        threads = decide(self.threads, self.max_threads, wait, idle)
        if threads != self.threads:
            log.info("OpenMP threads %d -> %d (run-queue wait %.2f CPUs, idle %.2f CPUs over "
                     "%.2f s)", self.threads, threads, wait, idle, now - t0)
            self.threads = threads
            self._set(threads)
            if self.on_change is not None:
                self.on_change(threads)
        self._start = (now, self._wait_ns(self.tids[:self.threads]), idle_now)

    def run(self, step: Callable, *args):
        """``step(*args)`` between ``before_step`` and ``after_step`` (the servicer's step
        call, on the forward thread)."""
        self.before_step()
        try:
            return step(*args)
        finally:
            self.after_step()


def governor_for(plan, runner, adaptive: bool,
                 on_change: Callable[[int], None] | None = None) -> ThreadGovernor | None:
    """The governor of a worker's forward thread (call it there, after warm-up), or None:
    ``--no-cpu-adaptive-threads``, ``--batch-invariant``, a GPU worker, one thread, or a
    machine where the threads' ids or their schedstat cannot be read (logged).

    Args:
        plan: the worker's ``cpu_threads.CpuPlan``; runner: its ``ModelRunner``.
    """
    from services.worker.cpu_threads import omp_thread_ids
    if not adaptive or plan.threads == 1 or runner.device.type != "cpu" or getattr(
            runner, "batch_invariant", False):
        return None
    cpus = set(plan.bind) if plan.bind else set(os.sched_getaffinity(0))
    try:
        tids = omp_thread_ids(plan.threads)
        run_delay_ns(tids), idle_seconds(cpus)
    except (RuntimeError, OSError, ValueError, IndexError) as e:
        log.warning("a fixed %d OpenMP threads (cannot watch them: %s)", plan.threads, e)
        return None
    import torch
    return ThreadGovernor(plan.threads, tids, cpus, torch.set_num_threads, on_change)
