"""The router's usage accounting as one object: the ``--usage-db`` flag, the database, the
sink's writer thread, the recorder the requests' access log entries call, and its shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable

from services.common.config import add_flag
from services.router.usage.database import (
    Database,
    UsageDbUrl,
    default_url,
    open_database,
)
from services.router.usage.recorder import UsageRecorder
from services.router.usage.sink import UsageSink

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 5.0  # how long shutdown keeps retrying the queued rows' write


def add_usage_flag(p: argparse.ArgumentParser) -> None:
    """``--usage-db`` (env ``PAGEDSERVE_USAGE_DB``)."""
    add_flag(p, "--usage-db", type=UsageDbUrl, default=None,
             help="where each finished request's usage row is written: sqlite:///PATH, "
                  "postgresql://user:password@host/db, or none (default: "
                  "sqlite:///$PAGEDSERVE_CACHE_DIR/usage.sqlite3, i.e. "
                  "~/.cache/pagedserve/usage.sqlite3); GET /v1/usage sums it (docs/usage.md)")


class Usage:
    """Usage accounting of one router.

    Args:
        db: the database, or None (``--usage-db none``: only the token counter).
        model: returns the served model's name now.
        count_tokens: ``RouterMetrics.tokens_done`` (or None).
        sink_options: ``UsageSink``'s keyword arguments (batching, bounds, backoff).
    """

    def __init__(self, db: Database | None, model: Callable[[], str],
                 count_tokens: Callable[[str, int, int, int], None] | None = None,
                 **sink_options):
        self.db = db
        self.sink = UsageSink(db, **sink_options) if db is not None else None
        self.recorder = UsageRecorder(self.sink, model, count_tokens)

    def start(self, registry=None) -> Usage:
        """Start the writer thread; its counters go into ``registry`` (a Prometheus
        ``CollectorRegistry``) when given."""
        if self.sink is not None:
            if registry is not None:
                registry.register(self.sink.collector())
            self.sink.start()
            log.info("usage accounting to %s", self.db.name if self.db else "")
        return self

    async def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued (``UsageSink.close``), off the event loop."""
        if self.sink is not None:
            await asyncio.to_thread(self.sink.close, timeout)


def usage_from_args(args, model: Callable[[], str],
                    count_tokens: Callable[[str, int, int, int], None] | None = None) -> Usage:
    """The ``Usage`` of the router's flags (``--usage-db``; default: ``default_url()``), not
    started."""
    url = args.usage_db if args.usage_db is not None else default_url()
    return Usage(open_database(url), model, count_tokens)
