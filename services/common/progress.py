"""Start-up progress: every slow step of a start says what it does, that it still does it, and
how long it took.

``startup_step("compiling the forward")`` wraps one step (a GGUF conversion, the CPU kernel
build, the weight load, the forward's compile, waiting for another service). It logs on the
logger ``pagedserve.startup`` (``STARTUP_LOGGER``), at INFO:

- at the start: ``compiling the forward ...``
- every ``interval`` seconds while it runs (a timer thread): ``still compiling the forward:
  20 s``
- at the end: ``compiling the forward: done in 45.1 s``, or, when it raised, a WARNING
  ``compiling the forward: failed after 3.2 s (RuntimeError)`` (the exception goes on).

Steps nest (loading the model includes converting its GGUF file): a step is silent while a
step started inside it runs (same thread or asyncio task, a context variable), so one line
every ``interval`` seconds says where the start is.

``interval``: ``$PAGEDSERVE_STARTUP_PROGRESS_INTERVAL`` seconds (default 10; tests set it
small); ``waiting_step`` (a wait on another service, which reports its own progress) ticks
six times less often.

``pagedserve serve --demo`` shows these records on its terminal although the services' logs go
to a file (``services/cli/startup_echo.py``); without ``--demo`` they are lines of the
services' normal log. No torch here: every service imports this module.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

STARTUP_LOGGER = "pagedserve.startup"
INTERVAL_ENV = "PAGEDSERVE_STARTUP_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 10.0  # seconds between progress lines of a running step

startup_log = logging.getLogger(STARTUP_LOGGER)

_lock = threading.Lock()


class _Step:
    """A running step: how many steps it contains are running now (it is silent meanwhile)."""

    def __init__(self) -> None:
        self.children = 0


# The step the calling code runs inside (a context variable: asyncio tasks started inside a
# step are its children; concurrent tasks' steps are siblings, and each ticks).
_current: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("startup_step",
                                                                        default=None)


def progress_interval() -> float:
    """Seconds between progress lines: ``$PAGEDSERVE_STARTUP_PROGRESS_INTERVAL``, default 10.

    Raises:
        ValueError: the variable is set but is not a number > 0 (naming it and the value).
    """
    text = os.environ.get(INTERVAL_ENV)
    if not text:
        return DEFAULT_INTERVAL
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{INTERVAL_ENV}={text!r}: must be a number of seconds > 0")
    return value


@contextmanager
def startup_step(what: str, interval: float | None = None, *, detail: str = "",
                 log: logging.Logger = startup_log) -> Iterator[None]:
    """Log the start of step ``what``, a progress line every ``interval`` seconds while it
    runs (none while a step started inside it runs: that one ticks), and its duration when it
    ends (see the module note).

    Args:
        what: the step, as a gerund phrase ("building the CPU kernels").
        interval: seconds between progress lines; None = ``progress_interval()``.
        detail: said in brackets on the first line only ("once; saved for later starts").
        log: the logger (tests pass their own).

    Raises:
        ValueError: ``interval`` None and ``$PAGEDSERVE_STARTUP_PROGRESS_INTERVAL`` bad, or
            ``interval`` <= 0 (before the step runs). Whatever the step raises passes through.
    """
    every = progress_interval() if interval is None else interval
    if not 0 < every < float("inf"):
        raise ValueError(f"startup_step: interval must be > 0 seconds, got {interval}")
    step, parent = _Step(), _current.get()
    stop = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        n = 1
        while not stop.wait(max(0.0, start + n * every - time.monotonic())):
            with _lock:
                silent = step.children > 0
            if not silent:
                log.info("still %s: %.0f s", what, time.monotonic() - start)
            n += 1

    log.info("%s%s ...", what, f" ({detail})" if detail else "")
    if parent is not None:
        with _lock:
            parent.children += 1
    token = _current.set(step)
    ticker = threading.Thread(target=tick, name="startup-progress", daemon=True)
    ticker.start()
    failure: BaseException | None = None
    try:
        yield
    except BaseException as e:
        failure = e
        raise
    finally:
        stop.set()
        ticker.join()
        try:
            _current.reset(token)
        except ValueError:  # (left in another context than entered: nothing to restore)
            pass
        if parent is not None:
            with _lock:
                parent.children -= 1
        took = time.monotonic() - start
        if failure is None:
            log.info("%s: done in %.1f s", what, took)
        else:
            log.warning("%s: failed after %.1f s (%s)", what, took, type(failure).__name__)


WAIT_FACTOR = 6  # a wait on another service ticks this many times less often


def waiting_step(what: str) -> AbstractContextManager[None]:
    """``startup_step(f"waiting for {what}")`` with a progress line every ``WAIT_FACTOR``
    intervals (60 s by default): the service waited for reports its own progress.

    Raises:
        ValueError: ``$PAGEDSERVE_STARTUP_PROGRESS_INTERVAL`` bad.
    """
    return startup_step(f"waiting for {what}", WAIT_FACTOR * progress_interval())
