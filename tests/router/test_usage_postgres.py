"""``UsageSink`` on a real PostgreSQL server (``tests.pg_server``; skipped with the reason where
the distribution's server binaries are missing): rows written and summed, and a server killed
mid-run (``pg_ctl stop -m immediate``) loses no row: they stay queued, are counted retried
once, and land when it is back."""

from __future__ import annotations

import time
from datetime import UTC, date, datetime

import pytest

from services.router.usage.database import PostgresDatabase, UsageDbUrl, UsageRow, open_database
from services.router.usage.sink import UsageSink
from tests.pg_server import server_or_skip


@pytest.fixture(scope="module")
def pg():
    yield from server_or_skip()


def _row(i: int) -> UsageRow:
    t = datetime(2026, 5, 1 + i % 2, 10, 0, tzinfo=UTC)
    return UsageRow("k", t.date(), f"r{i}", "/v1/completions", "m", "", 10, 4, i, t, t,
                    "stop", "200", "")


def _until(cond, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_rows_survive_a_killed_server(pg):
    db = open_database(UsageDbUrl(pg.url))
    assert isinstance(db, PostgresDatabase)
    sink = UsageSink(db, interval_s=0.05, backoff_s=0.1, max_backoff_s=0.3).start()
    try:
        for i in range(4):
            sink.put(_row(i))
        assert sink.flush(10.0) and sink.written == 4
        pg.stop("immediate")
        for i in range(4, 10):
            assert sink.put(_row(i))
        _until(lambda: sink.retried == 6)
        assert sink.written == 4 and sink.queued == 6
        pg.start()
        assert sink.flush(15.0)
        assert (sink.written, sink.retried, sink.dropped) == (10, 6, 0)
    finally:
        sink.close(5.0)
    conn = db.connect()
    try:
        sums = db.sums(conn, date(2026, 5, 1), date(2026, 5, 2))
        assert [(s.day.day, s.requests, s.prompt_tokens, s.cached_tokens, s.completion_tokens)
                for s in sums] == [(1, 5, 50, 20, 0 + 2 + 4 + 6 + 8),
                                   (2, 5, 50, 20, 1 + 3 + 5 + 7 + 9)]
    finally:
        conn.close()
