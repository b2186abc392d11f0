"""The ``pagedserve`` command: serve | router | scheduler | worker | generate | health.

``pagedserve serve`` starts worker, scheduler and router as separate processes on localhost.
It accepts every flag of every service and passes each to the services that define it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.cli.flags import (
    SERVICES,
    add_restart_flags,
    forwarded_argv,
    forwarded_env,
    serve_parser,
    service_module,
)
from services.cli.supervision import die_with_supervisor
from services.common.config import HelpFormatter, add_flag


def run_one_service(name: str, argv: list[str]) -> None:
    """``pagedserve router|scheduler|worker``: parse that service's flags and serve until
    SIGINT/SIGTERM. A worker of more than one rank without ``--rank`` starts and supervises
    all its ranks instead (services/cli/ranks.py)."""
    from services.common.grpc_utils import run_service
    from services.common.logs import setup_logging

    module = service_module(name)
    p = argparse.ArgumentParser(f"pagedserve {name}", formatter_class=HelpFormatter)
    module.add_args(p)
    if name == "worker":  # the rank launcher's: used with several ranks and no --rank
        add_restart_flags(p)
    args = p.parse_args(argv)
    setup_logging(args.log_level, name, args.log_format)
    if name == "worker" and args.rank is None and (
            args.tensor_parallel_size * args.pipeline_parallel_size > 1):
        run_service(name, _serve_ranks(args))
        return
    from services.common import tracing
    try:
        tracing.setup(args.otlp_traces_endpoint, f"pagedserve-{name}")
    except ValueError as e:  # e.g. an OTLP protocol other than grpc
        raise SystemExit(f"pagedserve {name}: {e}") from None
    try:
        run_service(name, module.serve(args))
    finally:
        tracing.shutdown()  # (the spans still queued are exported first)


async def _serve_ranks(args: argparse.Namespace) -> None:
    from services.cli.ranks import RankSupervisor
    from services.worker.server import world_size
    world_size(args)  # a --world-size that disagrees: ValueError
    await RankSupervisor(args, max_restarts=args.max_restarts,
                         restart_window=args.restart_window).run()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``pagedserve`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve", "generate", "health", *SERVICES}
    if not argv or argv[0] not in commands:
        asked_help = bool(argv) and argv[0] in ("-h", "--help")
        if argv and not asked_help:
            print(f"pagedserve: unknown command {argv[0]!r}", file=sys.stderr)
        print("usage: pagedserve {serve,generate,health,router,scheduler,worker} [flags]\n"
              "  serve       start the whole stack on this machine\n"
              "  generate    stream one completion from a running router\n"
              "  health      exit 0 when the service at --address is SERVING\n"
              "  router | scheduler | worker   run one service alone\n"
              "Run `pagedserve COMMAND --help` for its flags.",
              file=sys.stdout if asked_help else sys.stderr)
        raise SystemExit(0 if asked_help else 2)
    cmd, rest = argv[0], argv[1:]
    if cmd in SERVICES:
        die_with_supervisor()  # started by `pagedserve serve` or the rank launcher: die with it
        run_one_service(cmd, rest)
    elif cmd == "serve":
        from services.cli.launcher import run_stack
        ns = serve_parser().parse_args(rest)
        raise SystemExit(run_stack(ns, {n: forwarded_argv(n, ns) for n in SERVICES},
                                   {n: forwarded_env(n, ns) for n in SERVICES}))
    elif cmd == "generate":
        from services.cli.generate import main as generate_main
        generate_main(rest)
    elif cmd == "health":
        from services.common.grpc_utils import health_status
        from services.common.tls import add_tls_flags, client_credentials, tls_from_args
        p = argparse.ArgumentParser("pagedserve health")
        add_flag(p, "--address", default="127.0.0.1:50051", help="service host:port")
        add_flag(p, "--timeout", type=float, default=2.0, help="seconds")
        add_tls_flags(p)  # a service serving TLS: its CA (and, with mTLS, a client cert)
        ns = p.parse_args(rest)
        try:
            credentials = client_credentials(tls_from_args(ns))
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"pagedserve health: {e}") from None
        status = asyncio.run(health_status(ns.address, ns.timeout, credentials=credentials))
        ok = status == "SERVING"
        print(status)
        raise SystemExit(0 if ok else 1)

