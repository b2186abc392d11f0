"""``services.router.usage.sink.UsageSink`` on a real SQLite file: batching, a database that
fails (locked by another connection, or a path that cannot be created) and comes back,
the bounded queue, the counters, the flush at close."""

from __future__ import annotations

import sqlite3
import time
from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.router.usage.database import TABLE, SQLiteDatabase, UsageRow
from services.router.usage.sink import UsageSink


def _row(i: int, key_id: str = "k") -> UsageRow:
    now = datetime(2026, 12, 7, 12, 0, i % 60, tzinfo=UTC)
    return UsageRow(key_id=key_id, day=now.date(), request_id=f"r{i}", route="/v1/completions",
                    model="m", lora="", prompt_tokens=i, cached_tokens=0,
                    completion_tokens=2 * i, started=now, finished=now,
                    finish_reasons="length", status="200", error="")


class _Spy(SQLiteDatabase):
    """SQLite that records the size of each batch written."""

    def __init__(self, path, **kw):
        super().__init__(path, **kw)
        self.batches: list[int] = []

    def insert(self, conn, rows):
        super().insert(conn, rows)
        self.batches.append(len(rows))


def _table(path) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute(f"SELECT request_id, prompt_tokens, completion_tokens FROM {TABLE} "
                            "ORDER BY id").fetchall()


def _until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


@pytest.fixture
def sinks():
    made: list[UsageSink] = []
    yield made
    for s in made:
        s.close(1.0)


def test_rows_are_written_in_batches_off_the_caller(tmp_path, sinks):
    db = _Spy(str(tmp_path / "u.sqlite3"))
    sink = UsageSink(db, batch_rows=4, interval_s=30.0)
    sinks.append(sink.start())
    sink.put(_row(0))
    sink.put(_row(1))
    time.sleep(0.3)
    assert sink.written == 0 and sink.queued == 2  # less than a batch waits for the interval
    for i in range(2, 10):
        assert sink.put(_row(i))
    _until(lambda: sink.written == 10)  # a full batch wakes the writer (not after 30 s)
    assert sum(db.batches) == 10 and max(db.batches) == 4  # at most batch_rows per write
    assert _table(db.path) == [(f"r{i}", i, 2 * i) for i in range(10)]
    sink.put(_row(10))
    assert sink.flush(5.0) and sink.written == 11  # flush does not wait for the interval


def test_the_interval_writes_a_partial_batch(tmp_path, sinks):
    db = _Spy(str(tmp_path / "u.sqlite3"))
    sink = UsageSink(db, batch_rows=100, interval_s=0.2)
    sinks.append(sink.start())
    sink.put(_row(1))
    _until(lambda: sink.written == 1, timeout=5)
    assert db.batches == [1]


def test_a_locked_database_keeps_rows_queued_and_retries(tmp_path, sinks):
    path = str(tmp_path / "u.sqlite3")
    SQLiteDatabase(path).connect().close()  # the table exists
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the file
    sink = UsageSink(SQLiteDatabase(path, timeout_s=0.05), batch_rows=10, interval_s=0.05,
                     backoff_s=0.05, max_backoff_s=0.1)
    sinks.append(sink.start())
    started = time.monotonic()
    for i in range(5):
        assert sink.put(_row(i))
    assert time.monotonic() - started < 0.1  # put never waits for the database
    _until(lambda: sink.retried == 5)
    time.sleep(0.4)  # several more failed attempts: each row is counted once
    assert (sink.written, sink.retried, sink.queued) == (0, 5, 5)
    sink.put(_row(5))
    _until(lambda: sink.retried == 6)
    blocker.execute("ROLLBACK")
    blocker.close()
    _until(lambda: sink.written == 6)
    assert (sink.retried, sink.dropped, sink.queued) == (6, 0, 0)
    assert [r[0] for r in _table(path)] == [f"r{i}" for i in range(6)]


def test_a_path_that_cannot_be_opened_then_can(tmp_path, sinks):
    folder = tmp_path / "data"
    folder.write_text("a file where the folder should be")  # connect fails (even as root)
    path = str(folder / "u.sqlite3")
    sink = UsageSink(SQLiteDatabase(path), batch_rows=10, interval_s=0.05, backoff_s=0.05,
                     max_backoff_s=0.1)
    sinks.append(sink.start())
    for i in range(3):
        sink.put(_row(i))
    _until(lambda: sink.retried == 3)
    assert not sink.flush(0.2)
    folder.unlink()  # (the sink's next connect creates the folder)
    assert sink.flush(10.0)
    assert (sink.written, sink.retried, sink.dropped) == (3, 3, 0)
    assert len(_table(path)) == 3


def test_rows_over_the_bound_are_dropped_and_counted(tmp_path, sinks):
    folder = tmp_path / "data"
    folder.write_text("not a folder")
    sink = UsageSink(SQLiteDatabase(str(folder / "u.sqlite3")), batch_rows=2, interval_s=0.05,
                     max_queued=5, backoff_s=0.05, max_backoff_s=0.1)
    sinks.append(sink.start())
    accepted = [sink.put(_row(i)) for i in range(8)]
    assert accepted == [True] * 5 + [False] * 3
    assert sink.dropped == 3 and sink.queued == 5
    folder.unlink()  # (the sink's next connect creates the folder)
    assert sink.flush(10.0)
    assert sink.written == 5
    assert [r[0] for r in _table(str(folder / "u.sqlite3"))] == [f"r{i}" for i in range(5)]


def test_close_writes_what_is_queued(tmp_path):
    db = SQLiteDatabase(str(tmp_path / "u.sqlite3"))
    sink = UsageSink(db, batch_rows=100, interval_s=60.0).start()
    for i in range(3):
        sink.put(_row(i))
    sink.close(5.0)
    assert sink.written == 3 and len(_table(db.path)) == 3


def test_close_with_the_database_down_counts_the_rest_dropped(tmp_path):
    folder = tmp_path / "data"
    folder.write_text("not a folder")
    sink = UsageSink(SQLiteDatabase(str(folder / "u.sqlite3")), interval_s=0.05,
                     backoff_s=0.05, max_backoff_s=0.1).start()
    for i in range(4):
        sink.put(_row(i))
    started = time.monotonic()
    sink.close(0.3)
    assert time.monotonic() - started < 3.0
    assert (sink.written, sink.dropped, sink.queued) == (0, 4, 0)


def test_counters_in_a_registry(tmp_path, sinks):
    sink = UsageSink(SQLiteDatabase(str(tmp_path / "u.sqlite3")), interval_s=0.05)
    sinks.append(sink.start())
    registry = CollectorRegistry()
    registry.register(sink.collector())
    for i in range(3):
        sink.put(_row(i))
    assert sink.flush(5.0)
    text = generate_latest(registry).decode()
    assert "pagedserve:router_usage_rows_written_total 3.0" in text
    assert "pagedserve:router_usage_rows_retried_total 0.0" in text
    assert "pagedserve:router_usage_rows_dropped_total 0.0" in text
