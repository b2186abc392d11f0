"""``pagedserve serve``: run worker, scheduler and router as child processes on localhost.

Starts them in dependency order, waits until each answers gRPC health SERVING, and stops them
all on Ctrl-C / SIGTERM (or when one of them dies): router and scheduler first, so they can
drain the requests in flight (``--shutdown-timeout``), then the worker.
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
from services.common.tls import client_credentials, tls_from_args

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when ``serve`` dies, however it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux/glibc: children then outlive a SIGKILLed serve
        pass


def _spawn(name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", name, *argv]
    env = {**os.environ, **env} if env else None  # secrets (--api-key) travel here, not argv
    # NOTE: own session, so a terminal's Ctrl-C reaches serve only and serve stops the children
    # in order; the parent-death signal covers a serve that is killed outright.
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent, env=env)


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


def run_stack(ns, service_argv: dict[str, list[str]],
              service_env: dict[str, dict[str, str]] | None = None) -> int:
    """Start the stack, optionally run the demo, and serve until interrupted. Returns the exit
    code (0 on Ctrl-C / SIGTERM).

    Args:
        service_argv: each service's forwarded flags.
        service_env: each service's extra environment (secret flags such as --api-key).
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
    # Prometheus: scheduler BASE, router BASE + 1, worker rank r BASE + 2 + r (-1 off, 0 any).
    base = getattr(ns, "metrics_port", -1)
    metrics = {name: base + offset if base > 0 else base
               for name, offset in (("scheduler", 0), ("router", 1), ("worker", 2))}
    metrics_ports = ([metrics["scheduler"], metrics["router"]]
                     + [metrics["worker"] + r for r in range(world)]) if base > 0 else []
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
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for name in ("worker", "scheduler", "router"):
            procs[name] = _spawn(name, wiring[name] + service_argv[name],
                                 (service_env or {}).get(name))
        addresses = {n: f"{host}:{p}" for n, p in ports.items()}
        error = asyncio.run(_wait_healthy(procs, addresses, ns.startup_timeout, credentials))
        if error:
            print(f"pagedserve serve: {error}", file=sys.stderr)
            return 1
        if ns.demo:
            from services.demo import run_demo
            keys = getattr(ns, "api_key", None)
            run_demo(addresses["router"], credentials=credentials,
                     api_key=keys.as_flag_value().split(",")[0] if keys else None)
        http_hint = (f"  curl http://{host}:{http_port}/v1/models   (OpenAI-compatible HTTP)\n"
                     if http_port > 0 else "")
        print(f"pagedserve: serving on {host}:{ns.port}. Try:\n"
              f"  .venv/bin/pagedserve generate --address {host}:{ns.port} "
              f"--chat \"What is the capital of France?\" --temperature 0 --max-tokens 20\n"
              f"{http_hint}Ctrl-C stops.", file=sys.stderr, flush=True)
        while True:
            for name, p in procs.items():
                if p.poll() is not None:
                    print(f"pagedserve serve: {name} exited with code {p.returncode}",
                          file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    finally:
        _stop_all(procs, drain=getattr(ns, "shutdown_timeout", 0.0))
