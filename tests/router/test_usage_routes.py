"""``GET /v1/usage`` on a live aiohttp server over a real SQLite table, without a stack: who
may read it (admin keys; everyone when the router checks no keys), its sums, its 400s and
503, and a schemathesis run against its OpenAPI declaration (``usage.routes.USAGE_ROUTE``)."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime

import pytest
import requests
from aiohttp import web

from services.router.callers import Caller, caller_var
from services.router.openapi import document
from services.router.usage.database import SQLiteDatabase, UsageRow
from services.router.usage.routes import USAGE_ROUTE, usage_report
from services.router.usage.service import Usage


@web.middleware
async def _edge(request: web.Request, handler):
    """The test's stand-in for the edge that checks keys: ``X-Test-Key: id[,admin]``."""
    key = request.headers.get("X-Test-Key")
    if key is not None:
        key_id, _, admin = key.partition(",")
        caller_var.set(Caller(key_id, admin=admin == "admin"))
    return await handler(request)


class _Server:
    def __init__(self, usage):
        self.usage = usage
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> str:
        app = web.Application(middlewares=[_edge])
        app.add_routes([web.get("/v1/usage", self._answer)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def _answer(self, request):
        from services.router.openai.errors import OpenAIError
        try:
            return await usage_report(request, self.usage)
        except OpenAIError as e:  # (openai.http's error middleware does this in the router)
            return web.json_response(e.body(), status=e.status)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _row(key: str, day: int, prompt: int, cached: int, completion: int) -> UsageRow:
    t = datetime(2026, 11, day, 8, tzinfo=UTC)
    return UsageRow(key, t.date(), "r", "/v1/completions", "m", "", prompt, cached, completion,
                    t, t, "stop", "200", "")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = SQLiteDatabase(str(tmp_path_factory.mktemp("u") / "u.sqlite3"))
    usage = Usage(db, lambda: "m").start()
    assert usage.sink is not None
    for r in (_row("a", 1, 10, 2, 5), _row("a", 1, 1, 0, 1), _row("b", 2, 7, 7, 0)):
        usage.sink.put(r)
    s = _Server(usage)
    yield s
    s.stop()
    usage.sink.close(2.0)


def _get(server, key: str | None = None, **params):
    headers = {"X-Test-Key": key} if key else {}
    return requests.get(f"{server.url}/v1/usage", params=params, headers=headers, timeout=30)


def test_an_admin_reads_the_sums(server):
    r = _get(server, "ops,admin", start="2026-11-01", end="2026-11-30")
    assert r.status_code == 200
    assert r.json() == {"object": "usage", "start": "2026-11-01", "end": "2026-11-30", "data": [
        {"key_id": "a", "day": "2026-11-01", "requests": 2, "prompt_tokens": 11,
         "cached_tokens": 2, "completion_tokens": 6, "total_tokens": 17},
        {"key_id": "b", "day": "2026-11-02", "requests": 1, "prompt_tokens": 7,
         "cached_tokens": 7, "completion_tokens": 0, "total_tokens": 7}]}
    reversed_range = _get(server, "ops,admin", start="2026-11-30", end="2026-11-01")
    assert reversed_range.status_code == 200 and reversed_range.json()["data"] == []
    only_b = _get(server, "ops,admin", start="2026-11-01", end="2026-11-30", key_id="b").json()
    assert [d["key_id"] for d in only_b["data"]] == ["b"]


def test_other_keys_are_refused_and_no_keys_is_open(server):
    r = _get(server, "team-a", start="2026-11-01", end="2026-11-30")
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    assert _get(server, None, start="2026-11-01", end="2026-11-30").status_code == 200


def test_bad_parameters_name_themselves(server):
    for params, param in (({"start": "2026-11-31"}, "start"), ({"end": "11/30/2026"}, "end"),
                          ({"key_id": ""}, "key_id")):
        r = _get(server, "ops,admin", **params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, params


def test_a_database_that_cannot_be_read_is_503(tmp_path):
    folder = tmp_path / "f"
    folder.write_text("not a folder")
    usage = Usage(SQLiteDatabase(str(folder / "u.sqlite3")), lambda: "m")  # (no writer)
    s = _Server(usage)
    try:
        r = _get(s)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        assert _get(s, **{"start": "x"}).status_code == 400  # checked before the database
    finally:
        s.stop()
    off = _Server(Usage(None, lambda: "m"))
    try:
        assert _get(off).status_code == 404
    finally:
        off.stop()


def test_the_route_keeps_to_its_openapi_declaration(server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_dict(document([USAGE_ROUTE], "usage", "1"))
    operation = schema["/v1/usage"]["GET"]
    statuses = []

    @given(case=operation.as_strategy())
    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call_and_validate(base_url=server.url)
        statuses.append(response.status_code)

    check()
    assert statuses and all(s < 500 for s in statuses)
    assert _get(server).status_code == 200  # still serving
