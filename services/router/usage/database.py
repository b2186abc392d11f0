"""The usage database: ``--usage-db`` URLs, the one table, and the writes and sums on it.

URL forms (SQLAlchemy's for SQLite): ``sqlite:///PATH`` (a relative path; ``sqlite:////abs``
an absolute one), ``postgresql://user:password@host:port/dbname?...`` (or ``postgres://``; any
libpq connection URI, driven by psycopg 3), ``none`` (no accounting). Default:
``$PAGEDSERVE_CACHE_DIR/usage.sqlite3`` (``~/.cache/pagedserve/usage.sqlite3``).

Both backends hold the same table, ``pagedserve_usage`` (created when missing, with the index
``pagedserve_usage_key_day`` on ``(key_id, day)``); ``day`` is the UTC date the request
finished, ``started`` / ``finished`` UTC timestamps (SQLite: ISO 8601 text; PostgreSQL:
``timestamptz``).
"""

from __future__ import annotations

import argparse
import sqlite3
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from services.common.model_files import cache_root

TABLE = "pagedserve_usage"
# The columns of a row, in the order ``UsageRow`` holds them.
COLUMNS = ("key_id", "day", "request_id", "route", "model", "lora", "prompt_tokens",
           "cached_tokens", "completion_tokens", "started", "finished", "finish_reasons",
           "status", "error")
SQLITE_TIMEOUT_S = 5.0  # how long a write waits for another connection's lock
PG_CONNECT_TIMEOUT_S = 5  # libpq connect_timeout (seconds), unless the URL sets one


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One finished request.

    Attributes:
        key_id: the caller's key id (``services.router.callers``).
        day: the UTC date it finished.
        request_id: its id ("" when it was refused before it had one).
        route: the HTTP path or gRPC method.
        model: the served model's name.
        lora: the LoRA adapter it ran with, "" for none.
        prompt_tokens / cached_tokens / completion_tokens: as its response's ``usage``
            (cached: prompt tokens served from the prefix cache).
        started / finished: UTC timestamps (timezone-aware).
        finish_reasons: each choice's finish reason in choice order, comma-separated
            ("stop", "length,stop"); "" when none finished.
        status: the final HTTP status ("200") or gRPC code name ("OK").
        error: the gRPC code name of an error that ended a stream after its status was sent.
    """

    key_id: str
    day: date
    request_id: str
    route: str
    model: str
    lora: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    started: datetime
    finished: datetime
    finish_reasons: str
    status: str
    error: str


@dataclass(frozen=True, slots=True)
class DaySums:
    """One key's usage on one UTC day (a row of ``Database.sums``)."""

    key_id: str
    day: date
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class UsageDbUrl:
    """A parsed ``--usage-db`` value (argparse type). Its ``str``/``repr`` hide a password.

    Attributes:
        kind: "sqlite", "postgresql" or "none".
        target: the SQLite file's path, or the PostgreSQL URL ("" for none).

    Raises:
        argparse.ArgumentTypeError: another scheme, or an SQLite URL without a path.
    """

    __slots__ = ("_text", "kind", "target")

    def __init__(self, text: str):
        self._text = text.strip()
        scheme = self._text.partition("://")[0].lower()
        if self._text.lower() == "none":
            self.kind, self.target = "none", ""
        elif scheme == "sqlite":
            path = self._text[len("sqlite:///"):] if self._text.startswith("sqlite:///") else ""
            if not path or path == ":memory:":
                raise argparse.ArgumentTypeError(
                    f"an SQLite URL needs a file: sqlite:///PATH, got {text!r}")
            self.kind, self.target = "sqlite", path
        elif scheme in ("postgresql", "postgres"):
            self.kind, self.target = "postgresql", self._text
        else:
            raise argparse.ArgumentTypeError(
                "must be sqlite:///PATH, postgresql://... or none, got "
                f"{redact(text)!r}")

    def as_flag_value(self) -> str:
        """The URL as given (password included: for a child process's environment)."""
        return self._text

    def __repr__(self) -> str:
        return redact(self._text)

    __str__ = __repr__


def default_url() -> UsageDbUrl:
    """``sqlite:///$PAGEDSERVE_CACHE_DIR/usage.sqlite3`` (read when called)."""
    return UsageDbUrl(f"sqlite:///{cache_root() / 'usage.sqlite3'}")


def redact(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<unparsable URL>"


def open_database(url: UsageDbUrl) -> Database | None:
    """The database ``url`` names (nothing is connected yet), or None for ``none``."""
    if url.kind == "none":
        return None
    if url.kind == "sqlite":
        return SQLiteDatabase(url.target)
    return PostgresDatabase(url.target)


class Database:
    """One backend. ``connect`` gives a connection with the table created; ``insert`` and
    ``sums`` use one (from a single thread at a time). Errors are the driver's own
    (``sqlite3.Error``, ``psycopg.Error``, ``OSError``): the caller retries."""

    name = ""  # the URL, password hidden (for logs)
    placeholder = "?"

    def connect(self):
        raise NotImplementedError

    def _schema(self) -> list[str]:
        raise NotImplementedError

    def _values(self, row: UsageRow) -> tuple:
        raise NotImplementedError

    def _create(self, conn) -> None:
        cur = conn.cursor()
        for statement in self._schema():
            cur.execute(statement)
        conn.commit()

    def insert(self, conn, rows: list[UsageRow]) -> None:
        """Insert ``rows`` in one transaction (all or none)."""
        marks = ", ".join([self.placeholder] * len(COLUMNS))
        sql = f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({marks})"
        try:
            cur = conn.cursor()
            cur.executemany(sql, [self._values(r) for r in rows])
            conn.commit()
        except BaseException:
            _rollback_quietly(conn)
            raise

    def sums(self, conn, start: date, end: date, key_id: str | None = None) -> list[DaySums]:
        """Each key's requests and tokens per UTC day from ``start`` to ``end`` (inclusive),
        ordered by key then day; only ``key_id``'s when given."""
        p = self.placeholder
        where = f"day >= {p} AND day <= {p}" + (f" AND key_id = {p}" if key_id else "")
        args: list = [self._day(start), self._day(end)] + ([key_id] if key_id else [])
        cur = conn.cursor()
        cur.execute(f"SELECT key_id, day, COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), "
                    f"SUM(completion_tokens) FROM {TABLE} WHERE {where} "
                    "GROUP BY key_id, day ORDER BY key_id, day", args)
        rows = cur.fetchall()
        _rollback_quietly(conn)  # (ends the read transaction)
        return [DaySums(key, day if isinstance(day, date) else date.fromisoformat(day),
                        int(n), int(prompt), int(cached), int(completion))
                for key, day, n, prompt, cached, completion in rows]

    def _day(self, d: date):
        return d


class SQLiteDatabase(Database):
    """A file (its folder created when missing), in WAL mode: reads go on while a batch is
    written."""

    def __init__(self, path: str, timeout_s: float = SQLITE_TIMEOUT_S):
        self.path, self.timeout_s = path, timeout_s  # (timeout: for another one's lock)
        self.name = f"sqlite:///{path}"

    def connect(self):
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=self.timeout_s, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            self._create(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _schema(self) -> list[str]:
        return [f"CREATE TABLE IF NOT EXISTS {TABLE} ("
                "id INTEGER PRIMARY KEY AUTOINCREMENT, key_id TEXT NOT NULL, "
                "day TEXT NOT NULL, request_id TEXT NOT NULL, route TEXT NOT NULL, "
                "model TEXT NOT NULL, lora TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, "
                "cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
                "started TEXT NOT NULL, finished TEXT NOT NULL, "
                "finish_reasons TEXT NOT NULL, status TEXT NOT NULL, error TEXT NOT NULL)",
                f"CREATE INDEX IF NOT EXISTS {TABLE}_key_day ON {TABLE} (key_id, day)"]

    def _values(self, row: UsageRow) -> tuple:
        return (row.key_id, row.day.isoformat(), row.request_id, row.route, row.model,
                row.lora, row.prompt_tokens, row.cached_tokens, row.completion_tokens,
                row.started.isoformat(), row.finished.isoformat(), row.finish_reasons,
                row.status, row.error)

    def _day(self, d: date):
        return d.isoformat()


class PostgresDatabase(Database):
    """A PostgreSQL database through psycopg 3 (imported when first connected)."""

    placeholder = "%s"

    def __init__(self, url: str):
        self.url = url
        self.name = redact(url)

    def connect(self):
        import psycopg

        if "connect_timeout" in self.url:
            conn = psycopg.connect(self.url)
        else:
            conn = psycopg.connect(self.url, connect_timeout=PG_CONNECT_TIMEOUT_S)
        try:
            self._create(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _schema(self) -> list[str]:
        return [f"CREATE TABLE IF NOT EXISTS {TABLE} ("
                "id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key_id TEXT NOT NULL, "
                "day DATE NOT NULL, request_id TEXT NOT NULL, route TEXT NOT NULL, "
                "model TEXT NOT NULL, lora TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, "
                "cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
                "started TIMESTAMPTZ NOT NULL, finished TIMESTAMPTZ NOT NULL, "
                "finish_reasons TEXT NOT NULL, status TEXT NOT NULL, error TEXT NOT NULL)",
                f"CREATE INDEX IF NOT EXISTS {TABLE}_key_day ON {TABLE} (key_id, day)"]

    def _values(self, row: UsageRow) -> tuple:
        return (row.key_id, row.day, row.request_id, row.route, row.model, row.lora,
                row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.started,
                row.finished, row.finish_reasons, row.status, row.error)


def close_quietly(conn) -> None:
    """Close a connection that may already be broken."""
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is dropped
        pass


def _rollback_quietly(conn) -> None:
    try:
        conn.rollback()
    except Exception:  # noqa: BLE001 - the connection is broken: the caller's error says why
        pass
