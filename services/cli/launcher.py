"""``pagedserve serve``: run worker, scheduler and router as child processes on localhost, and
keep them running.

Starts them in dependency order and waits until each answers gRPC health SERVING; a service that
exits during this start-up ends ``serve`` with code 1 at once (a bad flag or model would only
crash again). Once the stack has been healthy, a service that exits is restarted with the same
command line and ports, after a backoff of 1 s doubling up to 30 s; the scheduler reconnects to a
restarted worker and the router to a restarted scheduler by themselves. The
``--max-restarts + 1``-th exit of one service within ``--restart-window`` seconds stops the others
and ends ``serve`` with code 1, naming the service and its exit code (``--max-restarts 0``: the
first exit). Each restart is logged on stderr and counted in
``pagedserve:service_restarts_total{service}`` on serve's own metrics port (``--metrics-port``
BASE + 2 + world size, after the worker ranks). See services/supervision.py for the policy.

Ctrl-C / SIGTERM (also during a backoff wait or a restart) stops them all: router and scheduler
first, so they can drain the requests in flight (``--shutdown-timeout``), then the worker. Each
child also gets SIGTERM from the kernel when ``serve`` dies, however it dies
(``die_with_serve``).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

from services.common.grpc_utils import check_health
from services.common.metrics import start_metrics_server
from services.common.tls import client_credentials, tls_from_args
from services.cli.supervision import RestartPolicy, ServeMetrics

_PR_SET_PDEATHSIG = 1
SERVE_PID_ENV = "PAGEDSERVE_SERVE_PID"  # set for the services serve starts: serve's pid
SERVICES = ("worker", "scheduler", "router")  # start order


def _die_with_parent() -> None:
    """Get SIGTERM when the parent process dies, however it dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux/glibc: children then outlive a SIGKILLed serve
        pass


def die_with_serve() -> None:
    """In a service ``serve`` started (``SERVE_PID_ENV`` set): get SIGTERM when serve dies, or
    exit now if it already has. Called first thing by ``pagedserve worker|scheduler|router``.

    Raises:
        SystemExit: serve died before the signal was armed.
    """
    serve_pid = os.environ.pop(SERVE_PID_ENV, None)  # popped: not inherited by worker ranks
    if serve_pid is None:
        return
    _die_with_parent()
    if os.getppid() != int(serve_pid):
        raise SystemExit("pagedserve: pagedserve serve has exited")


def _spawn(name: str, argv: list[str], env: dict[str, str] | None = None,
           stderr=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", name, *argv]
    # secrets (--api-key) travel in the environment, not argv
    env = {**os.environ, **(env or {}), SERVE_PID_ENV: str(os.getpid())}
    # NOTE: own session, so a terminal's Ctrl-C reaches serve only and serve stops the children
    # in order. No preexec_fn: once serve has threads (metrics server, gRPC) Python code between
    # fork and exec is unsafe, so the child arms its parent-death signal itself (die_with_serve).
    # stderr: where the child's logs go (a file under --demo); None: serve's own stderr
    return subprocess.Popen(cmd, start_new_session=True, env=env, stderr=stderr)


def ports_in_use(host: str, ports: list[int]) -> list[int]:
    """The ports of ``ports`` that something on ``host`` already listens on."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                busy.append(port)
    return busy


def _terminate(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM ``procs``, wait up to ``timeout`` seconds for them to exit, then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _stop_all(procs: dict[str, subprocess.Popen], timeout: float = 10.0,
              drain: float = 0.0) -> None:
    """Stop the stack gracefully: router and scheduler first (they get ``drain`` seconds,
    --shutdown-timeout, to finish the requests in flight, plus ``timeout`` s to exit), then
    the worker, which keeps executing steps until its scheduler has drained. A second Ctrl-C
    / SIGTERM meanwhile kills what is left."""
    try:
        _terminate([p for n, p in procs.items() if n != "worker"], drain + timeout)
        _terminate([p for n, p in procs.items() if n == "worker"], timeout)
    except KeyboardInterrupt:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


async def _wait_healthy(procs, addresses: dict[str, str], timeout: float,
                        credentials=None) -> str | None:
    """None when every service is SERVING; else why not. ``credentials``: TLS channel
    credentials when the services serve TLS (the services' own certificate and CA)."""
    deadline = time.monotonic() + timeout
    for name, address in addresses.items():
        while not await check_health(address, timeout=1.0, credentials=credentials):
            for n, p in procs.items():
                if p.poll() is not None:
                    return f"{n} exited with code {p.returncode} during start-up"
            if time.monotonic() > deadline:
                return f"{name} at {address} not healthy after {timeout:.0f}s"
            await asyncio.sleep(0.5)
        print(f"pagedserve: {name} is serving on {address}", file=sys.stderr, flush=True)
    return None


def _metrics_ports(ns, world: int) -> dict[str, int]:
    """Prometheus ports (-1 off, 0 any free port): scheduler BASE, router BASE + 1, worker rank
    r BASE + 2 + r (the worker gets its rank 0 port), serve itself BASE + 2 + world."""
    base = getattr(ns, "metrics_port", -1)
    offsets = {"scheduler": 0, "router": 1, "worker": 2, "serve": 2 + world}
    return {name: base + offset if base > 0 else base for name, offset in offsets.items()}


def _give_up_message(name: str, code: int, policy: RestartPolicy) -> str:
    why = "--max-restarts 0" if policy.max_restarts == 0 else (
        f"{policy.recent_crashes} exits within {policy.window:g}s, more than --max-restarts "
        f"{policy.max_restarts} allows; giving up")
    return f"pagedserve serve: {name} exited with code {code} ({why})"


def _supervise(procs: dict[str, subprocess.Popen], spawn, policies: dict[str, RestartPolicy],
               metrics: ServeMetrics, poll: float = 0.2) -> int:
    """Restart the services of ``procs`` that exit, as their policy allows; return 1 when one
    gives up (never returns otherwise). ``spawn(name)`` starts service ``name`` again."""
    due: dict[str, float] = {}  # service -> monotonic time of its pending restart
    while True:
        now = time.monotonic()
        for name, p in procs.items():
            if name in due:
                if now >= due[name]:
                    del due[name]
                    procs[name] = spawn(name)  # NOTE: a signal before this store: the new
                    metrics.restarted(name)    # child still dies with serve (die_with_serve)
                continue
            if p.poll() is None:
                continue
            delay = policies[name].on_crash()
            if delay is None:
                print(_give_up_message(name, p.returncode, policies[name]), file=sys.stderr,
                      flush=True)
                return 1
            due[name] = now + delay
            print(f"pagedserve serve: {name} exited with code {p.returncode}; restarting it in "
                  f"{delay:g}s (restart {policies[name].recent_crashes} of at most "
                  f"{policies[name].max_restarts} within {policies[name].window:g}s)",
                  file=sys.stderr, flush=True)
        time.sleep(poll)


def run_stack(ns, service_argv: dict[str, list[str]],
              service_env: dict[str, dict[str, str]] | None = None) -> int:
    """Start the stack, optionally run the demo, and serve until interrupted, restarting
    services that exit (see the module docstring).

    Args:
        ns: serve's parsed flags.
        service_argv: each service's forwarded flags.
        service_env: each service's extra environment (secret flags such as --api-key).

    Returns:
        The exit code: 0 on Ctrl-C / SIGTERM; 1 on bad TLS files, busy ports, a failed
        start-up, or a service that exited more often than --max-restarts allows.
    """
    try:  # the services' own TLS settings also serve for our health checks
        credentials = client_credentials(tls_from_args(ns))
    except (ValueError, FileNotFoundError) as e:
        print(f"pagedserve serve: {e}", file=sys.stderr)
        return 1
    host = "127.0.0.1"
    ports = {"worker": ns.worker_port, "scheduler": ns.scheduler_port, "router": ns.port}
    # NOTE: with tensor/pipeline parallelism the worker starts every rank, rank r on
    # --worker-port + r; the scheduler gets all of their addresses.
    world = getattr(ns, "tensor_parallel_size", 1) * getattr(ns, "pipeline_parallel_size", 1)
    rank_ports = [ns.worker_port + r for r in range(world)]
    metrics = _metrics_ports(ns, world)
    metrics_ports = ([metrics["scheduler"], metrics["router"], metrics["serve"]]
                     + [metrics["worker"] + r for r in range(world)]
                     if metrics["serve"] > 0 else [])
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
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str) -> subprocess.Popen:
        return _spawn(name, wiring[name] + service_argv[name], (service_env or {}).get(name),
                      stderr=service_log)

    def on_signal(_signum, _frame):
        raise KeyboardInterrupt  # SIGTERM stops the stack like Ctrl-C

    http_port = getattr(ns, "http_port", -1)  # > 0: the router's OpenAI-compatible HTTP port
    busy = ports_in_use(host, list(ports.values()) + rank_ports[1:]
                        + ([http_port] if http_port > 0 else []) + metrics_ports)
    if busy:
        print(f"pagedserve serve: port(s) {', '.join(map(str, busy))} on {host} already in use "
              "(another pagedserve still running?); stop it or choose --port, "
              "--scheduler-port, --worker-port, --http-port and --metrics-port (-1: off)",
              file=sys.stderr)
        return 1
    serve_metrics = ServeMetrics()
    try:
        metrics_server = start_metrics_server(
            serve_metrics.registry, getattr(ns, "metrics_host", None) or host, metrics["serve"])
    except OSError as e:
        print(f"pagedserve serve: serve's own metrics: {e}", file=sys.stderr)
        return 1
    if metrics_server is not None:
        print(f"pagedserve: serve's metrics on http://{host}:{metrics_server.port}/metrics",
              file=sys.stderr, flush=True)
    service_log = None  # --demo: the services' logs go to a file, the answers print clean
    if ns.demo:
        from services.cli.demo import open_service_log
        service_log = open_service_log()
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for name in SERVICES:
            procs[name] = spawn(name)
        addresses = {n: f"{host}:{p}" for n, p in ports.items()}
        error = asyncio.run(_wait_healthy(procs, addresses, ns.startup_timeout, credentials))
        if error:
            print(f"pagedserve serve: {error}", file=sys.stderr)
            return 1
        if ns.demo:
            from services.cli.demo import run_demo
            keys = getattr(ns, "api_key", None)
            run_demo(addresses["router"], credentials=credentials,
                     api_key=keys.as_flag_value().split(",")[0] if keys else None)
        http_hint = (f"  curl http://{host}:{http_port}/v1/models   (OpenAI-compatible HTTP)\n"
                     if http_port > 0 else "")
        print(f"pagedserve: serving on {host}:{ns.port}. Try:\n"
              f"  .venv/bin/pagedserve generate --address {host}:{ns.port} "
              f"--chat \"What is the capital of France?\" --temperature 0 --max-tokens 20\n"
              f"{http_hint}Ctrl-C stops.", file=sys.stderr, flush=True)
        policies = {n: RestartPolicy(getattr(ns, "max_restarts", 0),
                                   getattr(ns, "restart_window", 60.0)) for n in SERVICES}
        return _supervise(procs, spawn, policies, serve_metrics)
    except KeyboardInterrupt:
        return 0
    finally:
        _stop_all(procs, drain=getattr(ns, "shutdown_timeout", 0.0))
        if metrics_server is not None:
            metrics_server.close()
