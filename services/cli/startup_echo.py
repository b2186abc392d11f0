"""``pagedserve serve --demo``: the services' start-up progress on serve's terminal.

Under ``--demo`` the services' logs go to a file (``services/cli/demo.py``), so the demo's
answers print clean. While the stack starts, ``StartupEcho`` follows that file from a thread
and prints on serve's stderr:

- each record of the start-up logger (``pagedserve.startup``, ``services/common/progress.py``)
  and each ERROR / CRITICAL record, as ``pagedserve: worker: compiling the forward ...``
  (either ``--log-format``: a JSON object or a text line);
- each line a service ends its start with (``pagedserve worker: ...``, ``run_service``'s one
  line for an error the user can fix);
- ``pagedserve: still starting: 40 s`` when nothing else was printed for an interval
  (``$PAGEDSERVE_STARTUP_PROGRESS_INTERVAL``, default 10 s): the steps nobody reports, such as
  a service's imports.

It stops once the stack serves or its start failed, after printing what the file holds by
then; the rest of the log stays in the file. Without ``--demo`` the services log on the
terminal themselves and nothing is echoed. ``print_own_steps`` shows serve's own steps (the
GGUF conversion it runs before starting several ranks).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO

from services.common.progress import STARTUP_LOGGER, progress_interval

# A text-format record (services/common/logs.py): "DATE TIME LEVEL SERVICE LOGGER [ID]: MSG".
_TEXT_RECORD = re.compile(r"^\S+ \S+ (\w+) (\S+) (\S+) \[[^\]]*\]: (.*)$")
_SHOWN_LEVELS = ("ERROR", "CRITICAL")  # shown from any logger


def startup_line(line: str) -> str | None:
    """What serve shows of one line of the services' log, without its ``pagedserve: ``
    prefix (``worker: loading ...``), or None when it is not shown (see the module note)."""
    line = line.rstrip("\r\n")
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except ValueError:
            return None
        if not isinstance(record, dict):
            return None
        level, service, logger = (str(record.get(k, "")) for k in ("level", "service", "logger"))
        message = str(record.get("message", ""))
    else:
        match = _TEXT_RECORD.match(line)
        if match is None:  # a service's last words (run_service: "pagedserve worker: ...")
            return line.removeprefix("pagedserve ") if line.startswith("pagedserve ") else None
        level, service, logger, message = match.groups()
    if logger == STARTUP_LOGGER:
        return f"{service}: {message}"
    if level in _SHOWN_LEVELS:
        return f"{service}: {level}: {message}"
    return None


class StartupEcho:
    """Follows the log file ``path`` from a thread and prints its start-up lines on ``out``
    (see the module note) until ``stop``.

    Args:
        path: the services' log file (``open_service_log``).
        out: where the lines go (serve's stderr).
        interval: seconds of silence before a ``still starting`` line; None =
            ``progress_interval()``.
        poll: seconds between reads of the file.

    Raises:
        ValueError: ``interval`` None and ``$PAGEDSERVE_STARTUP_PROGRESS_INTERVAL`` bad.
    """

    def __init__(self, path: str, out: IO[str] | None = None, interval: float | None = None,
                 poll: float = 0.1) -> None:
        self.path = path
        self.out = out or sys.stderr
        self.interval = progress_interval() if interval is None else interval
        self.poll = poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="startup-echo", daemon=True)
        self._start = self._last = time.monotonic()

    def start(self) -> StartupEcho:
        """Start following the file; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Print what the file holds by now and stop following it (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _say(self, text: str) -> None:
        print(f"pagedserve: {text}", file=self.out, flush=True)
        self._last = time.monotonic()

    def _run(self) -> None:
        pending = b""
        try:
            log = open(self.path, "rb")  # noqa: SIM115 -- read until stopped, closed below
        except OSError:
            return
        with log:
            while True:
                stopping = self._stop.is_set()  # (read once more after the stop: the last lines)
                pending += log.read()
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    shown = startup_line(raw.decode("utf-8", "replace"))
                    if shown is not None:
                        self._say(shown)
                if stopping:
                    return
                now = time.monotonic()
                if now - self._last >= self.interval:
                    self._say(f"still starting: {now - self._start:.0f} s")
                self._stop.wait(self.poll)


@contextlib.contextmanager
def echo_startup(service_log: IO[bytes] | None) -> Iterator[None]:
    """Within: the start-up lines of ``service_log`` (the file ``--demo``'s services log to)
    on serve's stderr; nothing when it is None (the services log on the terminal)."""
    if service_log is None:
        yield
        return
    echo = StartupEcho(service_log.name).start()
    try:
        yield
    finally:
        echo.stop()


def print_own_steps() -> None:
    """Show this process's start-up steps (``services/common/progress.py``) on stderr as
    ``pagedserve: converting ...``: serve configures no logging of its own."""
    log = logging.getLogger(STARTUP_LOGGER)
    if not any(getattr(h, "_pagedserve_serve", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("pagedserve: %(message)s"))
        handler._pagedserve_serve = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.INFO)
