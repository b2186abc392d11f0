"""The usage sink: finished requests' rows queued in memory and written in batches by one
writer thread, so that no request ever waits for the database.

``put`` (from the event loop) appends to a bounded queue and returns at once. The writer
thread writes the queue's head in batches of up to ``batch_rows`` every ``interval_s`` seconds
(sooner when a batch is full, or when ``flush`` asks). A failed write (the database down, a
lock, a full disk) keeps the rows queued: the connection is dropped and the batch retried
with backoff (``backoff_s`` doubling to ``max_backoff_s``); the outage is logged once when it
starts and once when it ends. Past ``max_queued`` rows a new row is dropped (counted, logged
once per outage). ``close`` writes what is queued (retrying until its timeout), then counts
what is left as dropped.

Counters (``collector``, in the router's registry):
``pagedserve:router_usage_rows_written_total``, ``pagedserve:router_usage_rows_retried_total``
(rows whose first write failed: each counted once however often it is retried) and
``pagedserve:router_usage_rows_dropped_total``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

from prometheus_client.core import CounterMetricFamily

from services.router.usage.database import Database, UsageRow, close_quietly

log = logging.getLogger(__name__)
DEFAULT_BATCH_ROWS = 500
DEFAULT_INTERVAL_S = 1.0
DEFAULT_MAX_QUEUED = 100_000  # rows (~1 KB each at most): ~100 MB in the worst case
DEFAULT_BACKOFF_S = 0.5
DEFAULT_MAX_BACKOFF_S = 5.0


class UsageSink:
    """A queue of usage rows and the thread that writes them to ``db``.

    Args:
        db: the database (``database.open_database``).
        batch_rows: most rows per write (one transaction).
        interval_s: seconds between writes while fewer rows than a batch wait.
        max_queued: most rows waiting; past it new rows are dropped.
        backoff_s / max_backoff_s: first and longest wait (seconds) before retrying a write.

    Attributes:
        written / retried / dropped: the counters (rows).
    """

    def __init__(self, db: Database, *, batch_rows: int = DEFAULT_BATCH_ROWS,
                 interval_s: float = DEFAULT_INTERVAL_S, max_queued: int = DEFAULT_MAX_QUEUED,
                 backoff_s: float = DEFAULT_BACKOFF_S,
                 max_backoff_s: float = DEFAULT_MAX_BACKOFF_S):
        self.db = db
        self.batch_rows, self.interval_s, self.max_queued = batch_rows, interval_s, max_queued
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.written = self.retried = self.dropped = 0
        self._rows: collections.deque[UsageRow] = collections.deque()
        self._progress = threading.Condition()  # guards the queue and the counters
        self._wake = threading.Event()  # write now (a full batch, a flush, close)
        self._closing = threading.Event()
        self._deadline = float("inf")  # (monotonic) when close gives up on the database
        self._failed_head = 0  # rows at the queue's head whose write has failed already
        self._put_seq = 0  # rows ever queued
        self._done_seq = 0  # rows ever taken off the queue (written, or dropped at close)
        self._dropping = False  # a drop was logged, not yet a successful write since
        self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)

    def start(self) -> UsageSink:
        """Start the writer thread (the database is first connected by it)."""
        self._thread.start()
        return self

    def put(self, row: UsageRow) -> bool:
        """Queue ``row``; never blocks on the database. False: the queue was full and the row
        was dropped (counted)."""
        with self._progress:
            if len(self._rows) >= self.max_queued:
                self.dropped += 1
                if not self._dropping:
                    self._dropping = True
                    log.warning("usage: %d rows wait for %s; dropping new rows until it "
                                "catches up", len(self._rows), self.db.name)
                return False
            self._rows.append(row)
            self._put_seq += 1
            full = len(self._rows) >= self.batch_rows
        if full:
            self._wake.set()
        return True

    @property
    def queued(self) -> int:
        """Rows waiting to be written."""
        with self._progress:
            return len(self._rows)

    def flush(self, timeout: float) -> bool:
        """Block (a thread, not the event loop) until every row queued before the call is
        written, at most ``timeout`` seconds. Returns whether they were."""
        with self._progress:
            target = self._put_seq
        self._wake.set()
        end = time.monotonic() + timeout
        with self._progress:
            while self._done_seq < target:
                left = end - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._progress.wait(min(left, 0.1))
        return True

    def close(self, timeout: float) -> None:
        """Write what is queued (retrying for up to ``timeout`` seconds), then stop the writer;
        rows still queued then are dropped (counted, logged). Blocks: call from a thread."""
        self._deadline = time.monotonic() + timeout
        self._closing.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout + 5.0)

    # ---- the writer thread --------------------------------------------------------------
    def _run(self) -> None:
        conn = None
        backoff = self.backoff_s
        outage_since: float | None = None
        failed = False  # the last write failed: retry after the backoff, not the interval
        try:
            try:  # at once: the table exists, and a database that cannot be reached is logged
                conn = self.db.connect()
            except Exception as e:  # noqa: BLE001 - any driver or OS error: retried later
                outage_since = time.monotonic()
                self._log_outage(e)
            while True:
                if not failed and not self._closing.is_set():
                    self._wake.wait(self.interval_s)
                self._wake.clear()
                conn, error = self._write_all(conn)
                failed = error is not None
                if error is None:
                    if outage_since is not None:
                        log.info("usage: %s is back after %.1f s; the queued rows are written",
                                 self.db.name, time.monotonic() - outage_since)
                        outage_since, backoff = None, self.backoff_s
                    if self._closing.is_set():
                        return
                    continue
                if outage_since is None:
                    outage_since = time.monotonic()
                    self._log_outage(error)
                if self._closing.is_set():
                    left = self._deadline - time.monotonic()
                    if left <= 0:
                        return
                    time.sleep(min(backoff, left))
                else:
                    self._closing.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
        finally:
            if conn is not None:
                close_quietly(conn)
            self._drop_rest()

    def _log_outage(self, error: Exception) -> None:
        log.warning("usage: cannot write to %s (%s: %s); rows stay queued and are retried",
                    self.db.name, type(error).__name__, error)

    def _write_all(self, conn):
        """Write the queue in batches until it is empty or a write fails:
        ``(connection or None, the error or None)``."""
        while True:
            with self._progress:
                batch = list(itertools.islice(self._rows, self.batch_rows))
            if not batch:
                return conn, None
            try:
                if conn is None:
                    conn = self.db.connect()
                self.db.insert(conn, batch)
            except Exception as e:  # noqa: BLE001 - any driver or OS error: retried later
                if conn is not None:
                    close_quietly(conn)
                with self._progress:
                    self.retried += max(0, len(batch) - self._failed_head)
                    self._failed_head = max(self._failed_head, len(batch))
                return None, e
            with self._progress:
                for _ in batch:
                    self._rows.popleft()
                self._failed_head = max(0, self._failed_head - len(batch))
                self.written += len(batch)
                self._done_seq += len(batch)
                self._dropping = False
                self._progress.notify_all()

    def _drop_rest(self) -> None:
        with self._progress:
            left = len(self._rows)
            if left:
                log.error("usage: %d rows could not be written to %s before shutdown; they are "
                          "lost", left, self.db.name)
                self.dropped += left
                self._done_seq += left
                self._rows.clear()
            self._progress.notify_all()

    def collector(self):
        """A Prometheus collector of the sink's counters (register it in a registry)."""
        return _Counters(self)


class _Counters:
    def __init__(self, sink: UsageSink):
        self.sink = sink

    def collect(self):
        for name, doc, value in (
                ("written", "Usage rows written to the usage database.", self.sink.written),
                ("retried", "Usage rows whose first write failed (then retried).",
                 self.sink.retried),
                ("dropped", "Usage rows dropped: the queue was full, or the database was "
                            "still down at shutdown.", self.sink.dropped)):
            c = CounterMetricFamily(f"pagedserve:router_usage_rows_{name}", doc)
            c.add_metric([], value)
            yield c
