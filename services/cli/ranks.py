"""``pagedserve worker --tensor-parallel-size N --pipeline-parallel-size M``: start and keep up
N*M rank processes on this machine.

Rank r runs ``pagedserve worker --rank r --world-size N*M --port PORT+r`` (every other flag as
given) with ``MASTER_ADDR=127.0.0.1`` and a fresh ``MASTER_PORT``. When any rank exits, the
others are stopped too (their process group is broken: a collective on a dead peer fails or
blocks) and the whole group is started again on the same gRPC ports, with a new rendezvous
port; the scheduler reconnects to it. A rank that exits before the group first became healthy
ends the supervisor (a bad flag or model would only crash again).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

from services.common.grpc_utils import check_health, stop_event_on_signals
from services.common.ports import free_port
from services.common.tls import client_credentials, tls_from_args

log = logging.getLogger(__name__)
SUPERVISOR_ENV = "PAGEDSERVE_RANK_SUPERVISOR_PID"  # set for the ranks a supervisor starts


def die_with_supervisor() -> None:
    """In a rank the supervisor started: get SIGTERM when the supervisor dies (Linux), or exit
    now if it already has."""
    supervisor = os.environ.pop(SUPERVISOR_ENV, None)
    if supervisor is None:
        return
    from services.cli.launcher import _die_with_parent
    _die_with_parent()
    if os.getppid() != int(supervisor):  # it died before the signal was armed
        raise SystemExit("worker rank: the supervisor has exited")


def rank_argv(args: argparse.Namespace) -> list[str]:
    """The worker flags of ``args`` as a command line, less the per-rank ones (set after)."""
    from services.cli import forwarded_argv
    return ["--host", args.host, *forwarded_argv("worker", args)]


class RankSupervisor:
    """Runs and restarts the rank processes of one worker group.

    Attributes:
        procs: the current rank processes, index = rank (tests kill one of them).
        restarts: how many times the group was restarted.
    """

    def __init__(self, args: argparse.Namespace, restart_delay: float = 0.5) -> None:
        self.args = args
        self.world_size = args.tensor_parallel_size * args.pipeline_parallel_size
        if args.port == 0:
            raise ValueError("--port 0 (any port) cannot be used when starting "
                             f"{self.world_size} ranks: rank r serves on --port + r")
        self.addresses = [f"{args.host}:{args.port + r}" for r in range(self.world_size)]
        self.procs: list[subprocess.Popen] = []
        self.restarts = 0
        self._restart_delay = restart_delay
        # the ranks serve TLS with this worker's --ssl-* flags: health checks use them too
        self._credentials = client_credentials(tls_from_args(args))

    def _start_group(self) -> None:
        # NOTE: no preexec_fn: Python code between fork and exec can crash (locks held by gRPC's
        # threads); each rank asks for its parent-death signal itself (die_with_supervisor).
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               SUPERVISOR_ENV: str(os.getpid())}
        base = rank_argv(self.args)
        metrics = self.args.metrics_port  # rank r: --metrics-port + r (-1 off, 0 any stay)
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "services.cli", "worker", *base, "--rank", str(r),
             "--world-size", str(self.world_size), "--port", str(self.args.port + r),
             "--metrics-port", str(metrics + r if metrics > 0 else metrics)],
            env=env, start_new_session=True)
            for r in range(self.world_size)]
        log.info("started %d worker ranks (pids %s) on %s", self.world_size,
                 [p.pid for p in self.procs], ", ".join(self.addresses))

    def _stop_group(self, grace: float = 3.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # e.g. stuck in a collective on a dead peer
                p.kill()
                p.wait()

    def _exited(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.poll() is not None]

    async def _wait_healthy(self, stop: asyncio.Event) -> bool:
        """True once every rank answers SERVING; False when a rank exited or stop was set."""
        for address in self.addresses:
            while not await check_health(address, timeout=1.0, credentials=self._credentials):
                if self._exited() or stop.is_set():
                    return False
                await asyncio.sleep(0.2)
        return True

    def _convert_once(self) -> None:
        """Convert a GGUF model here, once, rather than in every rank at the same time."""
        from services.common.model_files import resolve_model
        source = resolve_model(self.args.model)
        if source.is_gguf:
            from services.worker.loader import convert_gguf
            convert_gguf(source)

    async def run(self, ready: asyncio.Event | None = None,
                  stop: asyncio.Event | None = None) -> None:
        """Start the group, set ``ready`` once all ranks serve, restart it whenever a rank
        exits, until ``stop`` (or SIGINT/SIGTERM).

        Raises:
            RuntimeError: a rank exited before the group first became healthy.
        """
        stop = stop or stop_event_on_signals()
        await asyncio.to_thread(self._convert_once)
        first = True
        try:
            while not stop.is_set():
                self._start_group()
                healthy = await self._wait_healthy(stop)
                if first and not healthy and not stop.is_set():
                    codes = {r: self.procs[r].returncode for r in self._exited()}
                    raise RuntimeError(f"worker rank(s) exited during start-up: {codes}")
                if healthy and first:
                    first = False
                    log.info("all %d ranks serving", self.world_size)
                    if ready:
                        ready.set()
                while healthy and not stop.is_set() and not self._exited():
                    try:
                        await asyncio.wait_for(stop.wait(), timeout=0.2)
                    except TimeoutError:
                        pass
                if stop.is_set():
                    break
                log.error("worker rank(s) %s exited; restarting all %d ranks", self._exited(),
                          self.world_size)
                await asyncio.to_thread(self._stop_group)
                self.restarts += 1
                await asyncio.sleep(self._restart_delay)
        finally:  # each rank drains: it steps until its scheduler stream closes
            await asyncio.to_thread(self._stop_group,
                                    getattr(self.args, "shutdown_timeout", 0.0) + 3.0)
