"""Usage accounting through the stack (tiny model): every finished request over HTTP and gRPC
leaves one row whose tokens equal its response's ``usage`` exactly; the rows survive a router
restart; ``GET /v1/usage`` sums them per key and day; the token counter agrees. SQLite, then
PostgreSQL (a real server, ``tests.pg_server``; skipped with the reason where it cannot run),
killed mid-run: no request fails, the rows are counted retried and land once it is back."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from datetime import UTC, datetime

import grpc
import pytest
import requests

from services.common.pb.pagedserve.v1 import api_pb2, api_pb2_grpc
from services.router import server as router_server
from services.router.usage.database import TABLE, UsageDbUrl
from services.scheduler import server as scheduler_server
from services.worker import server as worker_server
from tests.pg_server import server_or_skip
from tests.stack.conftest import _leak_check
from tests.stack_harness import InProcessStack

# long enough to fill KV blocks: the second request with it reuses them (cached tokens > 0)
PROMPT = "the usage table counts every token " * 8


class RestartableStack(InProcessStack):
    """The in-process stack whose router alone can be stopped and started again (same flags,
    new ports)."""

    async def _start(self):
        self._stop = asyncio.Event()  # worker and scheduler
        self._tasks.append(await self._serve(worker_server, self.worker_args, self._stop))
        self.scheduler_args.workers = f"127.0.0.1:{self.worker_args.port}"
        self._tasks.append(await self._serve(scheduler_server, self.scheduler_args,
                                             self._stop))
        self.scheduler_address = self.router_args.scheduler = (
            f"127.0.0.1:{self.scheduler_args.port}")
        self._router_stop = asyncio.Event()
        self._router_task = await self._serve(router_server, self.router_args,
                                              self._router_stop)
        self._router_started(self.router_args)

    def restart_router(self) -> None:
        """Stop the router (its shutdown flushes the usage rows) and start a new one."""
        async def restart():
            self._router_stop.set()
            await self._router_task
            self._router_stop = asyncio.Event()
            self.router_args.port, self.router_args.http_port = 0, 0
            self._router_task = await self._serve(router_server, self.router_args,
                                                  self._router_stop)
            self._router_started(self.router_args)
        self._run(restart(), timeout=120)

    def stop(self) -> None:
        async def stop_router():
            self._router_stop.set()
            await asyncio.gather(self._router_task, return_exceptions=True)
        if getattr(self, "_router_task", None) is not None:
            self._run(stop_router(), timeout=60)
        super().stop()


@pytest.fixture(scope="module")
def usage_db(tmp_path_factory):
    return tmp_path_factory.mktemp("usage") / "usage.sqlite3"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, usage_db):
    s = RestartableStack(tiny_model_dir,
                         worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB"],
                         scheduler_argv=["--max-num-batched-tokens", "256", "--block-size", "16"],
                         router_argv=["--usage-db", f"sqlite:///{usage_db}"]).start()
    yield s
    s.stop()


def _rows(path, request_ids: list[str], timeout: float = 10.0) -> dict[str, tuple]:
    """request_id -> (key_id, route, prompt, cached, completion, finish_reasons, status) once
    every id has its row (a row is queued when its request ends and written within ~1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        with sqlite3.connect(path) as conn:
            try:
                rows = conn.execute(
                    "SELECT request_id, key_id, route, prompt_tokens, cached_tokens, "
                    f"completion_tokens, finish_reasons, status FROM {TABLE}").fetchall()
            except sqlite3.OperationalError:  # no table yet: the writer has not connected
                rows = []
        conn.close()
        found = {r[0]: r[1:] for r in rows if r[0] in request_ids}
        if len(found) == len(request_ids) or time.monotonic() > deadline:
            assert len(found) == len(request_ids), f"rows missing: {set(request_ids) - set(found)}"
            assert len([r for r in rows if r[0] in request_ids]) == len(request_ids)  # one each
            return found
        time.sleep(0.05)


def _http(stack, path: str, body: dict, request_id: str, stream: bool = False):
    r = requests.post(f"{stack.http_url}{path}", json=body, timeout=60, stream=stream,
                      headers={"X-Request-Id": request_id})
    assert r.status_code == 200, r.text
    if not stream:
        u = r.json()["usage"]
        return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], \
            u["completion_tokens"]
    usage = None
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], \
        usage["completion_tokens"]


def _grpc(stack, request_id: str, chat: bool = False, n: int = 1):
    params = api_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, n=n)
    with grpc.insecure_channel(stack.address) as ch:
        stub = api_pb2_grpc.GenerationServiceStub(ch)
        if chat:
            req = api_pb2.ChatRequest(request_id=request_id, sampling_params=params,
                                      messages=[api_pb2.ChatMessage(role="user", content=PROMPT)])
            finals = [m.delta for m in stub.Chat(req, timeout=60) if m.delta.finish_reason]
        else:
            req = api_pb2.GenerateRequest(request_id=request_id, prompt=PROMPT,
                                          sampling_params=params)
            finals = [m for m in stub.Generate(req, timeout=60) if m.finish_reason]
    first = next(f for f in finals if f.index == 0)
    return (first.usage.prompt_tokens, first.usage.num_cached_tokens,
            sum(f.usage.completion_tokens for f in finals))


def test_rows_equal_the_responses_usage_and_survive_a_restart(stack, usage_db):
    expected = {
        "h-cmpl": _http(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5,
                                                   "temperature": 0, "ignore_eos": True},
                        "h-cmpl"),
        "h-cmpl-again": _http(stack, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2},
            "h-cmpl-again"),
        "h-batch": _http(stack, "/v1/completions", {
            "prompt": [PROMPT, "another prompt"], "max_tokens": 2, "ignore_eos": True},
            "h-batch"),
        "h-chat-stream": _http(stack, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
            "h-chat-stream", stream=True),
        "g-gen": _grpc(stack, "g-gen", n=2),
        "g-chat": _grpc(stack, "g-chat", chat=True),
    }
    assert any(cached > 0 for _, cached, _ in expected.values())  # the prefix cache counted
    rows = _rows(usage_db, list(expected))
    for rid, (prompt, cached, completion) in expected.items():
        key_id, _route, *tokens, reasons, status = rows[rid]
        assert tuple(tokens) == (prompt, cached, completion), rid
        assert key_id == "anonymous" and status in ("200", "OK")
        assert set(reasons.split(",")) == {"length"}
    assert rows["g-chat"][1] == "/pagedserve.v1.GenerationService/Chat"
    assert rows["h-cmpl-again"][5] == "length,length"

    before = _report(stack)
    stack.restart_router()  # a new router on the same file: the rows are still there
    expected["g-after"] = _grpc(stack, "g-after")
    _rows(usage_db, list(expected))
    after = _report(stack)
    totals = [sum(t[i] for t in expected.values()) for i in range(3)]
    (day,) = [d for d in after["data"] if d["key_id"] == "anonymous"]
    assert day["day"] == datetime.now(UTC).date().isoformat()  # (a run across midnight: rare)
    # the table holds this test's requests only (a file of its own)
    assert [day["prompt_tokens"], day["cached_tokens"], day["completion_tokens"]] == totals
    assert day["requests"] == len(expected) == before["data"][0]["requests"] + 1
    _leak_check(stack)


def _report(stack, **params) -> dict:
    r = requests.get(f"{stack.http_url}/v1/usage", params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_usage_report_sums_exactly(stack, usage_db):
    with sqlite3.connect(usage_db) as conn:
        conn.execute(f"DELETE FROM {TABLE}")  # (this module's earlier rows)
    a = _http(stack, "/v1/completions", {"prompt": "one", "max_tokens": 2, "ignore_eos": True},
              "sum-1")
    b = _grpc(stack, "sum-2")
    _rows(usage_db, ["sum-1", "sum-2"])
    today = datetime.now(UTC).date().isoformat()
    report = _report(stack, start=today, end=today, key_id="anonymous")
    assert report["start"] == report["end"] == today
    assert report["data"] == [{
        "key_id": "anonymous", "day": today, "requests": 2, "prompt_tokens": a[0] + b[0],
        "cached_tokens": a[1] + b[1], "completion_tokens": a[2] + b[2],
        "total_tokens": a[0] + b[0] + a[2] + b[2]}]
    assert _report(stack, key_id="nobody")["data"] == []
    bad = requests.get(f"{stack.http_url}/v1/usage", params={"start": "2026-13-01"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "start"
    metrics = requests.get(f"{stack.http_url}/metrics", timeout=30).text
    assert 'pagedserve:router_tokens_total{key_id="anonymous",kind="completion"}' in metrics
    assert "pagedserve:router_usage_rows_written_total" in metrics


@pytest.fixture(scope="module")
def pg():
    yield from server_or_skip()


def _pg_rows(url: str, request_ids: list[str], timeout: float = 20.0) -> dict[str, tuple]:
    """As ``_rows``, from PostgreSQL."""
    import psycopg

    deadline = time.monotonic() + timeout
    while True:
        with psycopg.connect(url) as conn:
            try:
                rows = conn.execute(f"SELECT request_id, prompt_tokens, cached_tokens, "
                                    f"completion_tokens FROM {TABLE}").fetchall()
            except psycopg.errors.UndefinedTable:  # the router's writer has not connected yet
                rows = []
        found = {r[0]: r[1:] for r in rows if r[0] in request_ids}
        if len(found) == len(request_ids) or time.monotonic() > deadline:
            assert len(found) == len(request_ids), f"rows missing: {set(request_ids) - set(found)}"
            assert len(rows) == len(request_ids)  # one each, nothing else
            return found
        time.sleep(0.1)


def _counter(stack, name: str) -> float:
    text = requests.get(f"{stack.http_url}/metrics", timeout=30).text
    (line,) = [x for x in text.splitlines() if x.startswith(f"pagedserve:router_usage_rows_{name}")
               and not x.startswith("#")]
    return float(line.split()[-1])


def _until(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def test_postgres_loses_no_request_when_killed_and_survives_a_restart(stack, pg):
    stack.router_args.usage_db = UsageDbUrl(pg.url)
    stack.restart_router()
    body = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
    expected = {"pg-h1": _http(stack, "/v1/completions", body, "pg-h1"),
                "pg-g1": _grpc(stack, "pg-g1")}
    _pg_rows(pg.url, list(expected))
    pg.stop("immediate")  # the database dies mid-run: requests go on
    for i in range(3):
        expected[f"pg-h-down{i}"] = _http(stack, "/v1/completions", body, f"pg-h-down{i}")
        expected[f"pg-g-down{i}"] = _grpc(stack, f"pg-g-down{i}", chat=True)
    _until(lambda: _counter(stack, "retried") == 6)  # each row counted once however retried
    assert _counter(stack, "written") == 2
    down = requests.get(f"{stack.http_url}/v1/usage", timeout=30)
    assert down.status_code == 503 and down.json()["error"]["code"] == "unavailable"
    pg.start()
    rows = _pg_rows(pg.url, list(expected))
    assert rows == expected  # every request's row, its tokens as its response's usage
    assert (_counter(stack, "written"), _counter(stack, "dropped")) == (8, 0)
    stack.restart_router()  # a new router reads the same rows
    (day,) = _report(stack, key_id="anonymous")["data"]
    assert [day["requests"], day["prompt_tokens"], day["cached_tokens"],
            day["completion_tokens"]] == [len(expected)] + [
        sum(t[i] for t in expected.values()) for i in range(3)]
