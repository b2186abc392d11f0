"""``pagedserve serve``: run worker, scheduler and router as child processes on localhost, and
keep them running.

Starts them and waits until each answers gRPC health SERVING, in dependency order; a service
that exits during this start-up ends ``serve`` with code 1 at once (a bad flag or model would
only crash again). Once the stack has been healthy, a service that exits is restarted with the
same command line and ports, after a backoff of 1 s doubling up to 30 s; the scheduler
reconnects to a restarted worker and the router to a restarted scheduler by themselves. The
``--max-restarts + 1``-th exit of one service within ``--restart-window`` seconds stops the
others and ends ``serve`` with code 1, naming the service and its exit code (``--max-restarts
0``: the first exit). Each restart is logged on stderr and counted in
``pagedserve:service_restarts_total{service}`` on serve's own metrics port (``--metrics-port``
BASE + 2 + world size, after the worker ranks). With tensor/pipeline parallelism the worker is
its N*M rank processes, started, restarted and counted as one (services/cli/ranks.py). The
supervisor and its restart rule: services/cli/supervision.py.

Ctrl-C / SIGTERM (also during a backoff wait or a restart) stops them all: router and scheduler
first, so they can drain the requests in flight (``--shutdown-timeout``), then the worker. Each
child also gets SIGTERM from the kernel when ``serve`` dies, however it dies
(``die_with_supervisor``).
"""

from __future__ import annotations

import asyncio
import functools
import signal
import socket
import sys
from dataclasses import dataclass

from services.cli.flags import SERVICES
from services.cli.ranks import convert_once, rank_group
from services.cli.startup_echo import echo_startup, print_own_steps
from services.cli.supervision import ProcessGroup, ServeMetrics, Supervisor, spawn_cli
from services.common.metrics import start_metrics_server
from services.common.progress import progress_interval
from services.common.tls import client_credentials, tls_from_args


def ports_in_use(host: str, ports: list[int]) -> list[int]:
    """The ports of ``ports`` that something on ``host`` already listens on."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                busy.append(port)
    return busy


def _stop_all(supervisor: Supervisor, timeout: float = 10.0, drain: float = 0.0) -> None:
    """Stop the stack gracefully: router and scheduler first (they get ``drain`` seconds,
    --shutdown-timeout, to finish the requests in flight, plus ``timeout`` s to exit), then
    the worker, which keeps executing steps until its scheduler has drained. A second Ctrl-C
    / SIGTERM meanwhile kills what is left (and further ones are ignored: no traceback)."""
    try:
        supervisor.stop(["router", "scheduler"], drain + timeout)
        supervisor.stop(["worker"], timeout)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        supervisor.kill_all()


def _metrics_ports(ns, world: int) -> dict[str, int]:
    """Prometheus ports (-1 off, 0 any free port): scheduler BASE, router BASE + 1, worker rank
    r BASE + 2 + r (the worker gets its rank 0 port), serve itself BASE + 2 + world."""
    base = ns.metrics_port
    offsets = {"scheduler": 0, "router": 1, "worker": 2, "serve": 2 + world}
    return {name: base + offset if base > 0 else base for name, offset in offsets.items()}


@dataclass(frozen=True)
class StackLayout:
    """Where ``serve`` puts each service on this host (from its flags).

    Attributes:
        host: the address every service binds and is reached at.
        world: worker ranks (tensor x pipeline parallel size); rank r on ``--worker-port + r``.
        metrics: each service's Prometheus port (``_metrics_ports``).
        wiring: each service's address flags, set by ``serve`` (the worker's: rank 0's).
        addresses: each service's gRPC addresses (the worker's: one per rank).
        ports: every port the stack will listen on (HTTP and metrics included, when on).
    """

    host: str
    world: int
    metrics: dict[str, int]
    wiring: dict[str, list[str]]
    addresses: dict[str, list[str]]
    ports: list[int]


def stack_layout(ns, host: str = "127.0.0.1") -> StackLayout:
    """The stack's ports and addresses from ``serve``'s flags ``ns``. With tensor/pipeline
    parallelism serve starts every rank itself, as one unit; the scheduler gets all of their
    addresses."""
    world = ns.tensor_parallel_size * ns.pipeline_parallel_size
    rank_ports = [ns.worker_port + r for r in range(world)]
    metrics = _metrics_ports(ns, world)
    wiring = {
        "worker": ["--host", host, "--port", str(ns.worker_port),
                   "--metrics-port", str(metrics["worker"])],
        "scheduler": ["--host", host, "--port", str(ns.scheduler_port),
                      "--workers", ",".join(f"{host}:{p}" for p in rank_ports),
                      "--metrics-port", str(metrics["scheduler"])],
        "router": ["--host", host, "--port", str(ns.port),
                   "--scheduler", f"{host}:{ns.scheduler_port}",
                   "--metrics-port", str(metrics["router"])],
    }
    addresses = {"worker": [f"{host}:{p}" for p in rank_ports],
                 "scheduler": [f"{host}:{ns.scheduler_port}"], "router": [f"{host}:{ns.port}"]}
    ports = [*rank_ports, ns.scheduler_port, ns.port, *([ns.http_port] if ns.http_port > 0 else [])]
    if metrics["serve"] > 0:
        ports += [metrics["scheduler"], metrics["router"], metrics["serve"],
                  *(metrics["worker"] + r for r in range(world))]
    return StackLayout(host, world, metrics, wiring, addresses, ports)


def _check_flags(ns) -> None:
    """Flags that disagree, refused before any process starts.

    Raises:
        ValueError: the worker's flags disagree (``WorkerConfig``), or ``--nnodes`` > 1.
    """
    from services.worker.server import world_size
    world_size(ns)
    if ns.nnodes > 1:
        raise ValueError(f"--nnodes {ns.nnodes}: serve runs every rank on this host; for "
                         "several hosts run `pagedserve worker --nnodes N --node-rank K "
                         "--dist-init-addr HOST:PORT` on each host, and the scheduler and "
                         "router apart (README.md, Several hosts)")


def _check_ports_free(layout: StackLayout) -> None:
    """Raises ValueError naming the ports of the stack something already listens on."""
    busy = ports_in_use(layout.host, layout.ports)
    if busy:
        raise ValueError(f"port(s) {', '.join(map(str, busy))} on {layout.host} already in use "
                         "(another pagedserve still running?); stop it or choose --port, "
                         "--scheduler-port, --worker-port, --http-port and --metrics-port "
                         "(-1: off)")


def _start_serve_metrics(ns, layout: StackLayout):
    """``serve``'s own metrics (its restart counts) and their server (None when off).

    Raises:
        OSError: the port cannot be bound (the message says whose it is).
    """
    serve_metrics = ServeMetrics(SERVICES)
    try:
        server = start_metrics_server(serve_metrics.registry, ns.metrics_host or layout.host,
                                      layout.metrics["serve"])
    except OSError as e:
        raise OSError(f"serve's own metrics: {e}") from None
    if server is not None:
        print(f"pagedserve: serve's metrics on http://{layout.host}:{server.port}/metrics",
              file=sys.stderr, flush=True)
    return serve_metrics, server


def _spawner(ns, layout: StackLayout, service_argv: dict[str, list[str]],
             service_env: dict[str, dict[str, str]] | None, service_log):
    """``spawn(name)``: start service ``name`` (the worker's ranks as one group) with its
    wiring and forwarded flags."""
    def spawn(name: str) -> ProcessGroup:
        env = (service_env or {}).get(name)
        if name == "worker" and layout.world > 1:  # the ranks: their own --port, --metrics-port
            return rank_group(["--host", layout.host, *service_argv[name]], layout.world,
                              ns.worker_port, layout.metrics["worker"], env, stderr=service_log)
        return ProcessGroup([spawn_cli([name, *layout.wiring[name], *service_argv[name]], env,
                                       stderr=service_log)], [name])
    return spawn


def _signal_unit(supervisor: Supervisor, name: str, sig: int) -> None:
    """Send ``sig`` to the running processes of unit ``name`` (none yet: nothing)."""
    group = supervisor.procs.get(name)
    for p in group.procs if group is not None else ():
        if p.poll() is None:
            p.send_signal(sig)


def _on_healthy(ns, host: str, credentials) -> None:
    """Once the stack serves: the demo (``--demo``), and how to talk to it."""
    if ns.demo:
        from services.cli.demo import run_demo
        keys = ns.api_key
        run_demo(f"{host}:{ns.port}", credentials=credentials,
                 api_key=keys.as_flag_value().split(",")[0] if keys else None)
    http_hint = (f"  curl http://{host}:{ns.http_port}/v1/models   (OpenAI-compatible HTTP)\n"
                 if ns.http_port > 0 else "")
    print(f"pagedserve: serving on {host}:{ns.port}. Try:\n"
          f"  .venv/bin/pagedserve generate --address {host}:{ns.port} "
          f"--chat \"What is the capital of France?\" --temperature 0 --max-tokens 20\n"
          f"{http_hint}Ctrl-C stops.", file=sys.stderr, flush=True)


def _raise_interrupt(_signum, _frame):
    raise KeyboardInterrupt  # SIGTERM stops the stack like Ctrl-C


def run_stack(ns, service_argv: dict[str, list[str]],
              service_env: dict[str, dict[str, str]] | None = None) -> int:
    """Start the stack, optionally run the demo, and serve until interrupted, restarting
    services that exit (see the module docstring).

    Args:
        ns: serve's parsed flags.
        service_argv: each service's forwarded flags.
        service_env: each service's extra environment (secret flags such as --api-key).

    Returns:
        The exit code: 0 on Ctrl-C / SIGTERM; 1 on bad TLS files, flags that disagree, busy
        ports, a failed start-up, or a service that exited more often than --max-restarts
        allows.
    """
    try:  # the services' own TLS settings also serve for our health checks
        credentials = client_credentials(tls_from_args(ns))
        _check_flags(ns)
        layout = stack_layout(ns)
        _check_ports_free(layout)
        progress_interval()  # (a bad $PAGEDSERVE_STARTUP_PROGRESS_INTERVAL: refused here)
        serve_metrics, metrics_server = _start_serve_metrics(ns, layout)
    except (ValueError, OSError) as e:  # (FileNotFoundError: a TLS file)
        print(f"pagedserve serve: {e}", file=sys.stderr)
        return 1
    host = layout.host
    service_log = None  # --demo: the services' logs go to a file, the answers print clean
    if ns.demo:
        from services.cli.demo import open_service_log
        service_log = open_service_log()
    spawn = _spawner(ns, layout, service_argv, service_env, service_log)
    supervisor = Supervisor({n: functools.partial(spawn, n) for n in SERVICES}, layout.addresses,
                            ns.max_restarts, ns.restart_window, metrics=serve_metrics,
                            credentials=credentials)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    print_own_steps()
    if ns.api_keys_file:  # SIGHUP to serve: the router reloads its keys file
        signal.signal(signal.SIGHUP, lambda *_: _signal_unit(supervisor, "router",
                                                             signal.SIGHUP))
    try:
        with echo_startup(service_log):  # --demo: the start-up steps on this terminal too
            if layout.world > 1:
                convert_once(ns.model)  # a GGUF model: here, once, not in every rank at once
            supervisor.start()
            error = asyncio.run(supervisor.wait_healthy(ns.startup_timeout))
        if error:
            print(f"pagedserve serve: {error}", file=sys.stderr)
            return 1
        _on_healthy(ns, host, credentials)
        return supervisor.watch()
    except KeyboardInterrupt:
        return 0
    finally:
        _stop_all(supervisor, drain=ns.shutdown_timeout)
        if metrics_server is not None:
            metrics_server.close()
