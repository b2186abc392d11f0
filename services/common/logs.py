"""Logging set-up shared by the services (``--log-level``)."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str = "INFO", service: str = "pagedserve") -> None:
    """Configure the root logger to write ``time level service: message`` lines to stderr."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
