"""``pagedserve worker --tensor-parallel-size N --pipeline-parallel-size M`` (no ``--rank``):
start and keep up N*M rank processes on this machine, or this host's share of them.

Rank r runs ``pagedserve worker --rank r --world-size N*M --port PORT+r`` (every other flag as
given) with ``MASTER_ADDR=127.0.0.1`` and a fresh ``MASTER_PORT``. Several hosts
(``--nnodes K --node-rank k --dist-init-addr HOST:PORT``, SGLang's flags): each host runs
this launcher for its N*M/K ranks (``local_ranks``), the i-th of them on ``PORT + i``, and
they all meet at rank 0's store on HOST:PORT (``services/worker/parallel/rendezvous.py``). Each
host's
launcher supervises its own ranks; a rank on another host that dies is noticed by the
heartbeat (or a failing collective) within ``--distributed-timeout``, so every rank of the
group exits and each host restarts its own. The ranks are one unit of
the process layer's supervisor (services/cli/supervision.py), the same one ``pagedserve serve``
runs: when any rank exits, the others are stopped too (their process group is broken: a
collective on a dead peer fails or blocks) and the whole group is started again on the same
gRPC ports, with a new rendezvous port, after the supervisor's backoff; the scheduler
reconnects to it. ``--max-restarts`` exits of the group within ``--restart-window`` are
restarted; one more ends the launcher with code 1. A rank that exits before the group first
became healthy ends it at once (a bad flag or model would only crash again).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading

from services.cli.flags import forwarded_argv
from services.cli.supervision import (
    BASE_DELAY,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_RESTART_WINDOW,
    ProcessGroup,
    Supervisor,
    spawn_cli,
)
from services.common.grpc_utils import stop_event_on_signals
from services.common.ports import free_port
from services.common.tls import client_credentials, tls_from_args

log = logging.getLogger(__name__)


def rank_argv(args: argparse.Namespace) -> list[str]:
    """The worker flags of ``args`` as a command line, less the per-rank ones (set after)."""
    return ["--host", args.host, *forwarded_argv("worker", args)]


def rank_group(argv: list[str], world: int, port: int, metrics_port: int,
               env: dict[str, str] | None = None, stderr=None,
               ranks: range | None = None, rendezvous: bool = True) -> ProcessGroup:
    """Start ranks ``ranks`` (default all ``world``) of ``pagedserve worker ARGV``: the i-th
    on ``port + i``, its metrics on ``metrics_port + i`` (-1 off and 0 any stay as they
    are). ``rendezvous``: set MASTER_ADDR / MASTER_PORT to a fresh local port (one host);
    False when ``argv`` names ``--dist-init-addr`` (several hosts)."""
    ranks = range(world) if ranks is None else ranks
    env = {**(env or {}),
           **({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())} if rendezvous
              else {})}
    procs = [spawn_cli(["worker", *argv, "--rank", str(r), "--world-size", str(world),
                        "--port", str(port + i),
                        "--metrics-port", str(metrics_port + i if metrics_port > 0
                                              else metrics_port)], env, stderr)
             for i, r in enumerate(ranks)]
    log.info("started worker ranks %d-%d of %d (pids %s) on ports %d-%d", ranks[0], ranks[-1],
             world, [p.pid for p in procs], port, port + len(ranks) - 1)
    return ProcessGroup(procs, [f"worker rank {r}" for r in ranks])


def local_ranks(args: argparse.Namespace) -> range:
    """The ranks this host starts: ``--node-rank`` k of ``--nnodes`` n gets ranks
    ``[k * W/n, (k + 1) * W/n)`` of world size W (stage-major: with W/n = tp size, one
    pipeline stage per host).

    Raises:
        ValueError: n does not divide W, k is not below n, or several hosts without
            ``--dist-init-addr`` (naming the flags and values).
    """
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    nnodes, node = args.nnodes, args.node_rank
    if world % nnodes:
        raise ValueError(f"--nnodes {nnodes} must divide the world size {world} "
                         "(--tensor-parallel-size x --pipeline-parallel-size)")
    if node >= nnodes:
        raise ValueError(f"--node-rank {node} must be below --nnodes {nnodes}")
    if nnodes > 1 and not args.dist_init_addr:
        raise ValueError(f"--nnodes {nnodes}: give every host --dist-init-addr HOST:PORT, "
                         "the address of rank 0's host (--node-rank 0) and a free port there")
    per_node = world // nnodes
    return range(node * per_node, (node + 1) * per_node)


def convert_once(model: str | None) -> None:
    """Convert a GGUF model here, once, rather than in every rank at the same time."""
    from services.common.model_files import resolve_model
    source = resolve_model(model)
    if source.is_gguf:
        from services.worker.checkpoint import convert_gguf
        convert_gguf(source)


class RankSupervisor:
    """Runs and restarts the rank processes of one worker group.

    Args:
        args: the worker's flags.
        base_delay: seconds before the first restart (the supervisor's backoff then doubles).
        max_restarts / restart_window: the restart rule (``--max-restarts`` /
            ``--restart-window``, ``pagedserve worker``'s own flags).

    Attributes:
        ranks: the ranks this host runs (all of them unless ``--nnodes`` > 1).
        addresses: the gRPC address of ``ranks[i]`` at index i.
    """

    def __init__(self, args: argparse.Namespace, base_delay: float = BASE_DELAY,
                 max_restarts: int = DEFAULT_MAX_RESTARTS,
                 restart_window: float = DEFAULT_RESTART_WINDOW) -> None:
        self.args = args
        self.world_size = args.tensor_parallel_size * args.pipeline_parallel_size
        self.ranks = local_ranks(args)
        if args.port == 0:
            raise ValueError("--port 0 (any port) cannot be used when starting "
                             f"{len(self.ranks)} ranks: rank r serves on --port + r")
        self.addresses = [f"{args.host}:{args.port + i}" for i in range(len(self.ranks))]
        argv = rank_argv(args)
        local = not args.dist_init_addr
        # the ranks serve TLS with this worker's --ssl-* flags: health checks use them too
        self.supervisor = Supervisor(
            {"worker": lambda: rank_group(argv, self.world_size, args.port, args.metrics_port,
                                          ranks=self.ranks, rendezvous=local)},
            {"worker": self.addresses},
            max_restarts, restart_window, base_delay,
            who="pagedserve worker", credentials=client_credentials(tls_from_args(args)))

    @property
    def procs(self) -> list:
        """The current rank processes, index i = ``ranks[i]`` (tests kill one of them)."""
        return self.supervisor.procs["worker"].procs

    @property
    def restarts(self) -> int:
        """How many times the group was restarted."""
        return self.supervisor.metrics.restarts("worker")

    def stop(self, grace: float = 3.0) -> None:
        """Stop every rank now: SIGTERM, then SIGKILL after ``grace`` seconds."""
        self.supervisor.stop(["worker"], grace)

    async def run(self, ready: asyncio.Event | None = None,
                  stop: asyncio.Event | None = None) -> None:
        """Start the group, set ``ready`` once all ranks serve, restart it whenever a rank
        exits, until ``stop`` (or SIGINT/SIGTERM).

        Raises:
            RuntimeError: a rank exited before the group first became healthy, or the group
                exited more often than --max-restarts allows.
        """
        stop = stop or stop_event_on_signals()
        await asyncio.to_thread(convert_once, self.args.model)
        halt = threading.Event()  # stops the supervision loop, which runs on a thread
        watch: asyncio.Future[int] | None = None
        try:
            self.supervisor.start()
            error = await self.supervisor.wait_healthy(stop=stop)
            if stop.is_set():
                return
            if error:  # e.g. "worker rank 1 exited with code 1 during start-up"
                raise RuntimeError(error)
            log.info("all %d ranks serving", self.world_size)
            if ready:
                ready.set()
            watch = asyncio.ensure_future(asyncio.to_thread(self.supervisor.watch, halt))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([watch, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            halt.set()
            if await watch:
                raise RuntimeError("the ranks exited more often than --max-restarts allows")
        finally:  # each rank drains: it steps until its scheduler stream closes
            halt.set()
            if watch is not None:  # the loop ends within a poll (it may be restarting the group)
                await asyncio.wait([watch])
            await asyncio.to_thread(self.stop, self.args.shutdown_timeout + 3.0)
