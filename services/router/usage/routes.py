"""``GET /v1/usage``: each key's requests and tokens per UTC day, read from the usage
database.

Query parameters (all optional): ``key_id`` (one key's rows only), ``start`` and ``end``
(``YYYY-MM-DD``, UTC days, both included; default: the first day of ``end``'s month, and
today; ``start`` after ``end``: no day, an empty answer). A bad one is a 400 naming it.

Who may read it: a caller whose key is an admin key (``Caller.admin``), else 403. A router that
checks no keys (no ``--api-key``, no keys file: every caller is ``callers.ANONYMOUS``) answers
everyone, as it does every other route. Rows still queued are written first (up to
``FLUSH_TIMEOUT_S``), so the answer counts every request finished before it was asked, unless
the database is down (503).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, date, datetime
from typing import Annotated, Literal

from aiohttp import web
from pydantic import BaseModel, Field, ValidationError, field_validator

from services.router.callers import ANONYMOUS, caller_var
from services.router.openai.errors import OpenAIError, bad_request
from services.router.openapi import Route
from services.router.usage.database import DaySums, close_quietly

log = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 2.0
MAX_KEY_ID_CHARS = 256
_DATE = Field(default=None, pattern=r"^\d{4}-\d{2}-\d{2}$",
              json_schema_extra={"format": "date"},
              description="a UTC day, YYYY-MM-DD")


class UsageQuery(BaseModel):
    """The query parameters of ``GET /v1/usage``."""

    key_id: Annotated[str | None, Field(default=None, min_length=1,
                                        max_length=MAX_KEY_ID_CHARS,
                                        description="only this key's usage")]
    start: Annotated[str | None, _DATE]
    end: Annotated[str | None, _DATE]

    @field_validator("start", "end")
    @classmethod
    def _a_day(cls, value: str | None) -> str | None:
        if value is not None:
            date.fromisoformat(value)  # ValueError: e.g. 2026-02-30
        return value


class UsageDay(BaseModel):
    """One key's usage on one UTC day."""

    key_id: str
    day: date
    requests: int = Field(description="requests finished that day (errors included)")
    prompt_tokens: int
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")
    completion_tokens: int
    total_tokens: int = Field(description="prompt_tokens + completion_tokens")


class UsageReport(BaseModel):
    """The answer of ``GET /v1/usage``: one entry per key and day with requests, ordered by
    key then day."""

    object: Literal["usage"] = "usage"
    start: date
    end: date
    data: list[UsageDay]


class UsageErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None
    code: str | None


class UsageErrorBody(BaseModel):
    """OpenAI's error body ``{"error": {...}}``."""

    error: UsageErrorDetail


USAGE_ROUTE = Route("GET", "/v1/usage", "Tokens used per API key and UTC day (admin key only)",
                response=UsageReport, query=UsageQuery, error=UsageErrorBody,
                errors={400: "a query parameter is invalid (named in param)",
                        401: "missing or invalid API key",
                        403: "the key is not an admin key",
                        404: "usage accounting is off (--usage-db none)",
                        503: "the usage database is unavailable"},
                tags=("usage",))


def parse_query(query) -> tuple[str | None, date, date]:
    """``(key_id, start, end)`` of a request's query (a mapping of strings).

    Raises:
        OpenAIError: 400 naming the parameter: not a ``YYYY-MM-DD`` day, ``key_id`` empty or
            longer than ``MAX_KEY_ID_CHARS``.
    """
    try:
        q = UsageQuery.model_validate({k: query[k] for k in ("key_id", "start", "end")
                                       if k in query})
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else None
        what = ("a UTC day YYYY-MM-DD" if name in ("start", "end")
                else f"1 to {MAX_KEY_ID_CHARS} characters")
        raise bad_request(f"{name} must be {what}, got {query.get(name, '')!r}"[:300],
                          name) from None
    end = date.fromisoformat(q.end) if q.end else datetime.now(UTC).date()
    start = date.fromisoformat(q.start) if q.start else end.replace(day=1)
    return q.key_id, start, end


async def usage_report(request: web.Request, usage) -> web.Response:
    """GET /v1/usage over ``usage`` (the router's ``service.Usage``, or None: accounting
    off).

    Raises:
        OpenAIError: 403 not an admin key, 400 a bad parameter, 404 accounting off, 503 the
            database unavailable.
    """
    caller = caller_var.get()
    if not (caller.admin or caller is ANONYMOUS):
        raise OpenAIError(403, f"key {caller.key_id!r} may not read usage: GET /v1/usage "
                          "needs an admin key", code="permission_denied")
    key_id, start, end = parse_query(request.query)
    if usage is None or usage.db is None:
        raise OpenAIError(404, "usage accounting is off: the router runs with --usage-db none",
                          code="not_found")
    try:
        sums = await asyncio.to_thread(_read, usage, start, end, key_id)
    except Exception as e:  # noqa: BLE001 - any driver or OS error: the database is down
        log.warning("GET /v1/usage: cannot read %s (%s)", usage.db.name, type(e).__name__)
        raise OpenAIError(503, f"the usage database is unavailable ({type(e).__name__})",
                          "server_error", code="unavailable") from None
    report = UsageReport(start=start, end=end, data=[
        UsageDay(key_id=s.key_id, day=s.day, requests=s.requests,
                 prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens,
                 completion_tokens=s.completion_tokens,
                 total_tokens=s.prompt_tokens + s.completion_tokens) for s in sums])
    return web.json_response(report.model_dump(mode="json"))


def _read(usage, start: date, end: date, key_id: str | None) -> list[DaySums]:
    """Write the queued rows (bounded wait), then sum the table (a thread)."""
    if usage.sink is not None:
        usage.sink.flush(FLUSH_TIMEOUT_S)
    conn = usage.db.connect()
    try:
        return usage.db.sums(conn, start, end, key_id)
    finally:
        close_quietly(conn)
