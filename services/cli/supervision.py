"""The process layer's one supervisor: start child processes, and keep them running.

Used by ``pagedserve serve`` (units: the worker's ranks, the scheduler, the router) and by
``pagedserve worker`` with more than one rank and no ``--rank`` (one unit: the ranks).

- A unit is a ``ProcessGroup``: processes started and stopped together. A service is a group of
  one; the N*M ranks of a worker are one group, since a rank cannot go on without its peers (a
  collective on a dead peer fails or blocks): when one exits, the others are stopped too.
- ``Supervisor`` starts every unit, then waits until each answers gRPC health SERVING, in
  order. A unit that exits during this start-up ends the supervisor (a bad flag or model would
  only crash again). Afterwards ``supervise`` restarts a unit that exits, whole, with the same
  command line and ports, as its ``RestartPolicy`` allows.
- ``RestartPolicy``: one per unit. Each exit is recorded; the restart waits
  ``base_delay * 2 ** (k - 1)`` seconds (capped at ``max_delay``), k = the exits within the
  last ``window`` seconds, so a unit that stayed up for a window starts again at
  ``base_delay``. The ``max_restarts + 1``-th exit within one window gives up
  (``max_restarts`` 0: the first). The same rule as systemd's ``StartLimitBurst`` /
  ``StartLimitIntervalSec``.
- ``ServeMetrics``: the supervisor's own Prometheus registry, with
  ``pagedserve:service_restarts_total{service}``.
- A child gets SIGTERM from the kernel when its supervisor dies, however it dies:
  ``spawn_cli`` marks it, and ``die_with_supervisor`` (called first thing by
  ``pagedserve worker|scheduler|router``) arms the signal.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter

from services.common.grpc_utils import check_health

DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_WINDOW = 60.0  # seconds
BASE_DELAY, MAX_DELAY = 1.0, 30.0  # seconds: the first restart's backoff, and its cap
SUPERVISOR_PID_ENV = "PAGEDSERVE_SUPERVISOR_PID"  # set for the children: the supervisor's pid
_PR_SET_PDEATHSIG = 1


class RestartPolicy:
    """Exponential backoff with a crash limit per time window, for one unit.

    Args:
        max_restarts: restarts allowed within ``window`` (0 = never restart).
        window: seconds over which crashes are counted.
        base_delay, max_delay: seconds before the first restart, and the most ever waited.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 window: float = DEFAULT_RESTART_WINDOW, base_delay: float = BASE_DELAY,
                 max_delay: float = MAX_DELAY, clock: Callable[[], float] = time.monotonic):
        if max_restarts < 0 or window <= 0 or base_delay < 0 or max_delay < base_delay:
            raise ValueError("RestartPolicy: need max_restarts >= 0, window > 0 and "
                             "0 <= base_delay <= max_delay")
        self.max_restarts = max_restarts
        self.window = window
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._clock = clock
        self._crashes: deque[float] = deque()

    @property
    def recent_crashes(self) -> int:
        """Crashes within the last ``window`` seconds."""
        self._forget_old(self._clock())
        return len(self._crashes)

    def on_crash(self) -> float | None:
        """Record a crash now. Returns the seconds to wait before restarting, or ``None`` when
        this crash exceeds ``max_restarts`` within ``window`` (give up)."""
        now = self._clock()
        self._forget_old(now)
        self._crashes.append(now)
        attempt = len(self._crashes)
        if attempt > self.max_restarts:
            return None
        return min(self.max_delay, self.base_delay * 2 ** (attempt - 1))

    def _forget_old(self, now: float) -> None:
        while self._crashes and self._crashes[0] <= now - self.window:
            self._crashes.popleft()


class ServeMetrics:
    """The supervisor's own metrics (its children export theirs on their own ports)."""

    def __init__(self, units: Iterable[str] = ("worker", "scheduler", "router")) -> None:
        self.registry = CollectorRegistry()
        self._restarts = Counter("pagedserve:service_restarts",
                                 "Times pagedserve serve restarted a service that exited.",
                                 ["service"], registry=self.registry)
        for name in units:  # 0 from the start: rate() needs a base
            self._restarts.labels(service=name)

    def restarted(self, service: str) -> None:
        """Count one restart of ``service`` (worker, scheduler or router)."""
        self._restarts.labels(service=service).inc()

    def restarts(self, service: str) -> int:
        """Restarts of ``service`` so far."""
        return int(self.registry.get_sample_value("pagedserve:service_restarts_total",
                                                  {"service": service}) or 0)


def die_with_parent() -> None:
    """Get SIGTERM when the parent process dies, however it dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux/glibc: children then outlive a SIGKILLed supervisor
        pass


def die_with_supervisor() -> None:
    """In a process a supervisor started (``SUPERVISOR_PID_ENV`` set): get SIGTERM when the
    supervisor dies, or exit now if it already has.

    Raises:
        SystemExit: the supervisor died before the signal was armed.
    """
    supervisor = os.environ.pop(SUPERVISOR_PID_ENV, None)  # popped: not inherited further
    if supervisor is None:
        return
    die_with_parent()
    if os.getppid() != int(supervisor):
        raise SystemExit("pagedserve: the process that started this one has exited")


def spawn_cli(argv: list[str], env: dict[str, str] | None = None,
              stderr=None) -> subprocess.Popen:
    """Start ``python -m services.cli ARGV`` as a supervised child.

    ``env``: extra environment (secrets such as --api-key travel here, not in argv);
    ``stderr``: where the child's logs go (None: the supervisor's own stderr).
    """
    # NOTE: own session, so a terminal's Ctrl-C reaches the supervisor only, which stops the
    # children in order. No preexec_fn: once the supervisor has threads (metrics server, gRPC)
    # Python code between fork and exec is unsafe, so the child arms its parent-death signal
    # itself (die_with_supervisor).
    env = {**os.environ, **(env or {}), SUPERVISOR_PID_ENV: str(os.getpid())}
    return subprocess.Popen([sys.executable, "-m", "services.cli", *argv],
                            start_new_session=True, env=env, stderr=stderr)


def terminate(procs: Iterable[subprocess.Popen], timeout: float) -> None:
    """SIGTERM ``procs``, wait up to ``timeout`` seconds for them to exit, then SIGKILL."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # e.g. stuck in a collective on a dead peer
            p.kill()
            p.wait()


class ProcessGroup:
    """Processes started together that live and die together (one unit of a supervisor).

    Args:
        procs: the processes, e.g. index = rank.
        names: what each is, for the log line when one exits (``worker rank 1``).
        grace: seconds the others get to exit once one has, before SIGKILL.
    """

    def __init__(self, procs: list[subprocess.Popen], names: list[str] | None = None,
                 grace: float = 3.0) -> None:
        self.procs = procs
        self.names = names or [f"process {i}" for i in range(len(procs))]
        self.grace = grace
        self.returncode: int | None = None
        self.exited: str | None = None  # the name of the one that exited first

    def poll(self) -> int | None:
        """None while every process runs. Once one has exited: stop the others (they cannot
        go on alone) and return the first one's exit code, as ``Popen.poll`` would."""
        if self.returncode is None:
            for name, p in zip(self.names, self.procs, strict=True):
                if p.poll() is not None:
                    self.returncode, self.exited = p.returncode, name
                    if len(self.procs) > 1:
                        print(f"pagedserve: {name} exited with code {p.returncode}; stopping "
                              "the others of its group", file=sys.stderr, flush=True)
                    terminate(self.procs, self.grace)
                    break
        return self.returncode


class Supervised(Protocol):
    """What ``supervise`` watches: a ``ProcessGroup`` (tests pass fakes)."""

    returncode: int | None

    def poll(self) -> int | None: ...


Unit = TypeVar("Unit", bound=Supervised)


def _give_up_message(who: str, name: str, code: int | None, policy: RestartPolicy) -> str:
    why = "--max-restarts 0" if policy.max_restarts == 0 else (
        f"{policy.recent_crashes} exits within {policy.window:g}s, more than --max-restarts "
        f"{policy.max_restarts} allows; giving up")
    return f"{who}: {name} exited with code {code} ({why})"


def supervise(procs: dict[str, Unit], spawn: Callable[[str], Unit],
              policies: dict[str, RestartPolicy], metrics: ServeMetrics, poll: float = 0.2,
              stop: threading.Event | None = None, who: str = "pagedserve serve") -> int:
    """Restart the units of ``procs`` that exit, as their policy allows (``procs`` is updated
    in place). ``spawn(name)`` starts unit ``name`` again; ``who`` prefixes the log lines.

    Returns:
        1 when a unit exits more often than its policy allows; 0 once ``stop`` is set.
    """
    due: dict[str, float] = {}  # unit -> monotonic time of its pending restart
    while stop is None or not stop.is_set():
        now = time.monotonic()
        for name, p in procs.items():
            if name in due:
                if now >= due[name]:
                    del due[name]
                    procs[name] = spawn(name)  # NOTE: a signal before this store: the new
                    metrics.restarted(name)    # child still dies with us (die_with_supervisor)
                continue
            if p.poll() is None:
                continue
            delay = policies[name].on_crash()
            if delay is None:
                print(_give_up_message(who, name, p.returncode, policies[name]),
                      file=sys.stderr, flush=True)
                return 1
            due[name] = now + delay
            print(f"{who}: {name} exited with code {p.returncode}; restarting it in "
                  f"{delay:g}s (restart {policies[name].recent_crashes} of at most "
                  f"{policies[name].max_restarts} within {policies[name].window:g}s)",
                  file=sys.stderr, flush=True)
        time.sleep(poll)
    return 0


class Supervisor:
    """Starts units of processes, waits until they serve, and keeps them running.

    Args:
        spawners: unit name -> a function that starts it, in start (and health) order.
        health: unit name -> the gRPC addresses that must answer SERVING for it to be up.
        max_restarts, window, base_delay: each unit's ``RestartPolicy``.
        metrics: where restarts are counted (default: a registry of these units, not served).
        who: the prefix of the log lines (``pagedserve serve``).
        credentials: TLS channel credentials for the health checks (the units' own).
    """

    def __init__(self, spawners: dict[str, Callable[[], ProcessGroup]],
                 health: dict[str, list[str]], max_restarts: int = DEFAULT_MAX_RESTARTS,
                 window: float = DEFAULT_RESTART_WINDOW, base_delay: float = BASE_DELAY,
                 metrics: ServeMetrics | None = None, who: str = "pagedserve serve",
                 credentials=None) -> None:
        self._spawners = spawners
        self._health = health
        self.policies = {n: RestartPolicy(max_restarts, window, base_delay,
                                          max(base_delay, MAX_DELAY)) for n in spawners}
        self.metrics = metrics or ServeMetrics(spawners)
        self.who = who
        self._credentials = credentials
        self.procs: dict[str, ProcessGroup] = {}

    def start(self) -> None:
        """Start every unit (they come up in parallel; ``wait_healthy`` waits in order)."""
        for name, spawn in self._spawners.items():
            self.procs[name] = spawn()

    async def wait_healthy(self, timeout: float | None = None,
                           stop: asyncio.Event | None = None) -> str | None:
        """None once every unit serves; else why not (a unit exited, ``timeout`` seconds
        passed, or ``stop`` was set). Prints a line per unit that serves."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for name, addresses in self._health.items():
            for address in addresses:
                while not await check_health(address, timeout=1.0,
                                             credentials=self._credentials):
                    if stop is not None and stop.is_set():
                        return "stopped"
                    for n, p in self.procs.items():
                        if p.poll() is not None:
                            return (f"{p.exited or n} exited with code {p.returncode} "
                                    "during start-up")
                    if deadline is not None and time.monotonic() > deadline:
                        return f"{name} at {address} not healthy after {timeout:.0f}s"
                    await asyncio.sleep(0.2)
            print(f"pagedserve: {name} is serving on {', '.join(addresses)}", file=sys.stderr,
                  flush=True)
        return None

    def watch(self, stop: threading.Event | None = None, poll: float = 0.2) -> int:
        """``supervise`` these units: 1 when one gives up, 0 once ``stop`` is set."""
        return supervise(self.procs, lambda name: self._spawners[name](), self.policies,
                         self.metrics, poll, stop, self.who)

    def stop(self, names: Iterable[str], timeout: float) -> None:
        """Stop the processes of units ``names``: SIGTERM, then SIGKILL after ``timeout``."""
        terminate([p for n in names if n in self.procs for p in self.procs[n].procs], timeout)

    def kill_all(self) -> None:
        """SIGKILL whatever is left (a second Ctrl-C while stopping)."""
        for group in self.procs.values():
            for p in group.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
