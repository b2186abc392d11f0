"""The flags of the ``pagedserve`` commands: ``serve``'s parser (its own wiring flags plus every
service's) and what it forwards to each service it starts.
"""

from __future__ import annotations

import argparse

from services.cli.supervision import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_WINDOW
from services.common.config import HelpFormatter, add_flag, env_name, float_in, int_in
from services.common.metrics import SCHEDULER_PORT

SERVE_PORT = int_in(1, 65535)  # serve wires fixed ports together: no 0 (= any) here

SERVICES = ("worker", "scheduler", "router")  # start order
# Flags `serve` sets itself for each service (addresses and ports); all others are forwarded.
_WIRING = {"host", "port", "workers", "scheduler", "schedulers", "metrics_port", "help"}
# Router flags about choosing among several scheduler replicas: `serve` runs exactly one.
_REPLICA_ROUTING = {"scheduler_dns_refresh", "routing_policy", "prefix_affinity_blocks",
                    "cache_threshold", "balance_abs_threshold", "balance_rel_threshold"}
# Flags `serve` hands to a service in its environment (PAGEDSERVE_*), not on its command line,
# which any local user can read (ps).
_SECRETS = {"api_key", "usage_db"}  # (a database URL may hold a password)


def service_module(name: str):
    """``services.NAME.server``: the service's ``add_args`` and ``serve``."""
    import importlib
    return importlib.import_module(f"services.{name}.server")


def _service_parser(name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(f"pagedserve {name}", add_help=False)
    service_module(name).add_args(p)
    return p


def add_restart_flags(p: argparse.ArgumentParser) -> None:
    """The supervisor's flags (services/cli/supervision.py): ``serve``'s, and ``pagedserve
    worker``'s when it starts all the ranks itself."""
    add_flag(p, "--max-restarts", type=int_in(0), default=DEFAULT_MAX_RESTARTS,
             help="restarts of one service (after the stack was first healthy; the worker's "
                  "ranks count as one) allowed within --restart-window; one more exit stops "
                  "everything with code 1 (0: never restart)")
    add_flag(p, "--restart-window", type=float_in(0, lo_open=True),
             default=DEFAULT_RESTART_WINDOW,
             help="seconds over which a service's exits are counted; the backoff before a "
                  "restart is 1 s doubling per exit in this window, at most 30 s")


def serve_parser() -> argparse.ArgumentParser:
    """``pagedserve serve``'s parser: its own wiring flags plus the union of the services'."""
    p = argparse.ArgumentParser("pagedserve serve", formatter_class=HelpFormatter,
                                description="Start worker, scheduler and router on this machine.")
    add_flag(p, "--port", type=SERVE_PORT, default=50051, help="router (public gRPC) port")
    add_flag(p, "--scheduler-port", type=SERVE_PORT, default=50052, help="scheduler port")
    add_flag(p, "--worker-port", type=SERVE_PORT, default=50053,
             help="worker port (with several ranks: rank r on this port + r)")
    add_flag(p, "--startup-timeout", type=float_in(0, lo_open=True), default=900.0,
             help="seconds to wait for all services to become healthy")
    add_flag(p, "--metrics-port", type=int_in(-1, 65535), default=SCHEDULER_PORT,
             help="Prometheus ports: scheduler BASE, router BASE+1, worker rank r BASE+2+r, "
                  "serve's own (restart counts) BASE+2+world size (-1: off, 0: any free ports)")
    add_restart_flags(p)
    p.add_argument("--demo", action="store_true",
                   help="once healthy, stream answers to a few prompts sent at once")
    seen = {"port", "scheduler_port", "worker_port", "startup_timeout", "demo", "help",
            "metrics_port", "max_restarts", "restart_window", *_REPLICA_ROUTING}
    for name in SERVICES:
        for action in _service_parser(name)._actions:
            if action.dest in _WIRING or action.dest in seen:
                continue
            seen.add(action.dest)
            p._add_action(action)
    return p


def forwarded_argv(name: str, ns: argparse.Namespace) -> list[str]:
    """The command-line flags of service ``name`` taken from serve's parsed namespace."""
    argv: list[str] = []
    for action in _service_parser(name)._actions:
        if action.dest in _WIRING or action.dest in _SECRETS or not action.option_strings:
            continue
        value = vars(ns).get(action.dest)
        if isinstance(action, argparse._StoreTrueAction):
            argv += [action.option_strings[0]] if value else []
        elif isinstance(action, argparse.BooleanOptionalAction):
            if value is not None:  # --flag / --no-flag
                argv += [action.option_strings[0 if value else 1]]
        elif isinstance(value, list):  # nargs="+": the flag, then each value
            argv += [action.option_strings[0], *map(str, value)]
        elif value is not None:  # (a parsed value that is not a str gives its flag form)
            argv += [action.option_strings[0],
                     value.as_flag_value() if hasattr(value, "as_flag_value") else str(value)]
    return argv


def forwarded_env(name: str, ns: argparse.Namespace) -> dict[str, str]:
    """The secret flags of service ``name`` (``_SECRETS``) as ``PAGEDSERVE_*`` environment
    variables for its process."""
    env = {}
    for action in _service_parser(name)._actions:
        value = vars(ns).get(action.dest)
        if action.dest in _SECRETS and value is not None and action.option_strings:
            env[env_name(action.option_strings[0])] = (
                value.as_flag_value() if hasattr(value, "as_flag_value") else str(value))
    return env
