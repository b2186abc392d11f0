"""Logging set-up shared by the services (``--log-level``, ``--log-format``).

``json`` (the default) writes one JSON object per line to stderr::

    {"time": "2026-11-29T15:32:04.123Z", "level": "INFO", "service": "router",
     "logger": "services.router.server", "message": "...", "request_id": "abc"}

``request_id`` is present while a request is being handled: the router sets it from the
request's id (taken from the client's ``x-request-id`` gRPC metadata or ``request_id`` field);
the scheduler and workers log the ids their messages carry (the router↔scheduler and
scheduler↔worker links are shared streams, so the id travels inside each message). At INFO no
prompt text or token ids are logged; DEBUG may log sizes, never text.

Access log: the router writes one INFO line per public request when it ends, gRPC
(Generate, Chat) and OpenAI HTTP (``/v1/completions``, ``/v1/chat/completions``; a stream when
it ends) alike, on the logger ``pagedserve.access`` (``log_access``). In the JSON format its
fields are keys of their own::

    {"time": "...", "level": "INFO", "service": "router", "logger": "pagedserve.access",
     "message": "/v1/completions 200, 5 prompt + 8 completion tokens, 0.412 s",
     "request_id": "cmpl-3f2a...", "route": "/v1/completions", "status": 200,
     "prompt_tokens": 5, "completion_tokens": 8, "duration_ms": 412.3}

``status`` is the HTTP status (499: the client went away first) or the gRPC code name ("OK",
"INVALID_ARGUMENT", "CANCELLED", ...); ``error`` (the gRPC code name) is added when a stream
that had already answered 200 ended with an error event.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
import sys
import time

from services.common.config import LOG_LEVELS, add_flag

FORMATS = ("json", "text")
# The request being handled by this task (asyncio copies context into each task).
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "request_id", default=None)


_default_factory = logging.getLogRecordFactory()


def _record_factory(*args, **kwargs) -> logging.LogRecord:
    """Every record gets ``ctx_request_id``: the request this task handles, or None. (A record
    may also name one explicitly with ``extra={"request_id": ...}``, which wins.)"""
    record = _default_factory(*args, **kwargs)
    record.ctx_request_id = request_id_var.get()
    return record


logging.setLogRecordFactory(_record_factory)

# The access log's logger (see the module note).
access_log = logging.getLogger("pagedserve.access")
# Keys of an access log record's fields (the JSON format writes each as a key of its own).
ACCESS_FIELDS = ("route", "status", "prompt_tokens", "completion_tokens", "duration_ms", "error")


def log_access(route: str, status: int | str, *, request_id: str | None, prompt_tokens: int,
               completion_tokens: int, duration_s: float, error: str = "",
               level: int = logging.INFO) -> None:
    """Write the access log line of a public request that ended (never its text).

    Args:
        route: the HTTP path (``/v1/completions``) or gRPC method
            (``/pagedserve.v1.GenerationService/Generate``).
        status: the HTTP status (int) or the gRPC status code's name.
        request_id: the request's id (None when it had none yet, e.g. an unparsable body).
        prompt_tokens: tokens of the prompt (0 when the request was refused before
            tokenization).
        completion_tokens: tokens generated, all choices together.
        duration_s: seconds from arrival to the end of the response (of the stream).
        error: the gRPC code name of an error that ended a stream after its 200, else "".
    """
    fields = {"route": route, "status": status, "prompt_tokens": prompt_tokens,
              "completion_tokens": completion_tokens,
              "duration_ms": round(duration_s * 1000, 1)}
    if error:
        fields["error"] = error
    access_log.log(level, "%s %s, %d prompt + %d completion tokens, %.3f s%s", route, status,
                   prompt_tokens, completion_tokens, duration_s,
                   f", ended by {error}" if error else "",
                   extra={"request_id": request_id, "access": fields})


def record_request_id(record: logging.LogRecord) -> str | None:
    """The request a log record is about, if any."""
    return getattr(record, "request_id", None) or getattr(record, "ctx_request_id", None)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = record_request_id(record)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ms), level, service, logger, message,
    request_id (when known), an access log record's fields (``log_access``), and the exception
    text when there is one."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = record_request_id(record)
        if request_id:
            out["request_id"] = request_id
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            out.update((k, v) for k, v in access.items() if k in ACCESS_FIELDS)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def add_log_flags(p: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format`` (every service has both)."""
    add_flag(p, "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
             help="log verbosity")
    add_flag(p, "--log-format", default="json", choices=FORMATS,
             help="json: one JSON object per line (with request_id); text: plain lines")


def setup_logging(level: str = "INFO", service: str = "pagedserve", fmt: str = "json") -> None:
    """Configure the root logger: ``fmt`` ``"json"`` lines, or ``"text"`` lines
    ``time level service logger [request_id]: message``, on stderr.

    Raises:
        ValueError: ``fmt`` not in ``FORMATS``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s {service} %(name)s [%(request_id)s]: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        handlers=[handler], force=True)
