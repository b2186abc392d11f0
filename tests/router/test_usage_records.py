"""Usage accounting's pieces without a stack: ``--usage-db`` URLs, the row a finished
request's ``RequestLog`` gives (key id, tokens as the response counts them, finish reasons),
the token counter, and ``GET /v1/usage``'s query checks."""

from __future__ import annotations

import argparse
from datetime import UTC, date, datetime

import pytest
from prometheus_client import generate_latest

from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import api_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.callers import Caller, caller_var
from services.router.generation import PreparedRequest, RequestLog
from services.router.metrics import RouterMetrics
from services.router.openai.errors import OpenAIError
from services.router.usage.database import SQLiteDatabase, UsageDbUrl, default_url, redact
from services.router.usage.recorder import UsageRecorder
from services.router.usage.routes import parse_query
from services.router.validation import TextOptions

STOP, LENGTH = api_pb2.FINISH_REASON_STOP, api_pb2.FINISH_REASON_LENGTH


def test_urls():
    assert UsageDbUrl("sqlite:////var/x/u.db").target == "/var/x/u.db"
    assert UsageDbUrl("sqlite:///rel/u.db").target == "rel/u.db"
    assert UsageDbUrl("none").kind == "none"
    pg = UsageDbUrl("postgresql://acct:s3cret@db:5432/usage")
    assert pg.kind == "postgresql" and "s3cret" not in repr(pg) and "s3cret" not in str(pg)
    assert pg.as_flag_value() == "postgresql://acct:s3cret@db:5432/usage"
    assert redact("postgres://u:pw@h/d") == "postgres://u:***@h/d"
    for bad in ("mysql://h/d", "sqlite://", "sqlite:///:memory:", "usage.db"):
        with pytest.raises(argparse.ArgumentTypeError):
            UsageDbUrl(bad)


def test_default_is_in_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    url = default_url()
    assert url.kind == "sqlite" and url.target == str(tmp_path / "usage.sqlite3")


class _Sink:
    def __init__(self):
        self.rows = []

    def put(self, row):
        self.rows.append(row)
        return True


def _prepared(n: int, prompt_len: int, lora: LoRARequest | None = None) -> PreparedRequest:
    return PreparedRequest("req-1", list(range(prompt_len)), params=EngineSamplingParams(),
                           text=TextOptions(), n=n, lora=lora)


def _final(index: int, reason: int, completion: int, cached: int) -> api_pb2.GenerateResponse:
    return api_pb2.GenerateResponse(index=index, finish_reason=reason, usage=api_pb2.Usage(
        prompt_tokens=9, completion_tokens=completion, num_cached_tokens=cached))


def test_a_finished_request_gives_one_row_counted_as_its_response():
    sink, metrics = _Sink(), RouterMetrics()
    recorder = UsageRecorder(sink, lambda: "tiny", metrics.tokens_done)
    entry = RequestLog("/v1/chat/completions", usage=recorder)
    token = caller_var.set(Caller("team-a"))  # (the edge that checked the key)
    try:
        entry.accepted(_prepared(2, 9, LoRARequest(1, "sql", "/a")))
    finally:
        caller_var.reset(token)  # an edge that resets it before the entry is done
    entry.observe(api_pb2.GenerateResponse(index=1, token_ids=[5, 6]))
    entry.observe(_final(1, LENGTH, 4, 8))
    entry.observe(_final(0, STOP, 3, 6))
    entry.done(200)
    [row] = sink.rows
    # prompt once, completions summed, cached as choice 0 reported (as ResponseBuilder.usage)
    assert (row.key_id, row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
        "team-a", 9, 6, 7)
    assert (row.model, row.lora, row.route, row.request_id) == (
        "tiny", "sql", "/v1/chat/completions", "req-1")
    assert (row.finish_reasons, row.status, row.error) == ("stop,length", "200", "")
    assert row.started <= row.finished and row.finished.tzinfo is UTC
    assert row.day == row.finished.date()
    text = generate_latest(metrics.registry).decode()
    for kind, n in (("prompt", 9), ("cached", 6), ("completion", 7)):
        assert f'pagedserve:router_tokens_total{{key_id="team-a",kind="{kind}"}} {n}.0' in text


def test_a_completion_batch_counts_each_prompts_first_choice_cached():
    sink = _Sink()
    entry = RequestLog("/v1/completions", usage=UsageRecorder(sink, lambda: "m"))
    for _ in range(2):  # two prompts, best_of 2: candidates p * 2 + i
        entry.accepted(_prepared(2, 9))
    entry.prompt_tokens = 18
    for index, cached in enumerate((4, 9, 5, 9)):
        entry.observe(_final(index, STOP, 1, cached))
    entry.done(200)
    assert (sink.rows[0].cached_tokens, sink.rows[0].completion_tokens) == (9, 4)
    assert sink.rows[0].key_id == "anonymous" and sink.rows[0].lora == ""


def test_refused_keys_and_errors():
    sink = _Sink()
    recorder = UsageRecorder(sink, lambda: "m")
    RequestLog("/v1/completions", usage=recorder).done(401)
    RequestLog("/pagedserve.v1.GenerationService/Generate", usage=recorder).done(
        "UNAUTHENTICATED")
    assert sink.rows == []  # no key: nothing to charge
    entry = RequestLog("/pagedserve.v1.GenerationService/Generate", usage=recorder)
    token = caller_var.set(Caller("team-b"))
    try:
        entry.done("INVALID_ARGUMENT")  # never accepted: the key as the request ends
    finally:
        caller_var.reset(token)
    [row] = sink.rows
    assert (row.key_id, row.status, row.prompt_tokens, row.request_id, row.finish_reasons) == (
        "team-b", "INVALID_ARGUMENT", 0, "", "")


def test_a_failing_sink_never_fails_the_request(caplog):
    class Broken:
        def put(self, row):
            raise RuntimeError("boom")

    RequestLog("/v1/completions", usage=UsageRecorder(Broken(), lambda: "m")).done(200)
    assert "could not record" in caplog.text


def _query(**q):
    return parse_query(q)


def test_query_defaults_and_checks():
    key, start, end = _query()
    today = datetime.now(UTC).date()
    assert key is None and end == today and start == today.replace(day=1)
    assert _query(key_id="a", start="2026-01-05", end="2026-02-01") == (
        "a", date(2026, 1, 5), date(2026, 2, 1))
    for q, param in (({"start": "2026-1-5"}, "start"), ({"end": "2026-02-30"}, "end"),
                     ({"start": "x"}, "start"), ({"key_id": ""}, "key_id"),
                     ({"key_id": "k" * 300}, "key_id")):
        with pytest.raises(OpenAIError) as e:
            _query(**q)
        assert (e.value.status, e.value.param) == (400, param), q
    # a reversed range is an empty one (not an error: each value is a valid day)
    assert _query(start="2026-03-02", end="2026-03-01")[1:] == (date(2026, 3, 2),
                                                                 date(2026, 3, 1))


def test_sums_per_key_and_day(tmp_path):
    from services.router.usage.database import UsageRow

    db = SQLiteDatabase(str(tmp_path / "u.sqlite3"))
    conn = db.connect()

    def row(key, day, p, c, g):
        t = datetime(2026, 3, day, 23, 59, tzinfo=UTC)
        return UsageRow(key, t.date(), "r", "/v1/completions", "m", "", p, c, g, t, t, "stop",
                        "200", "")

    db.insert(conn, [row("a", 1, 5, 1, 2), row("a", 1, 7, 0, 3), row("a", 2, 1, 1, 1),
                     row("b", 1, 10, 0, 0), row("a", 4, 1, 0, 0)])
    sums = db.sums(conn, date(2026, 3, 1), date(2026, 3, 2))
    assert [(s.key_id, s.day.day, s.requests, s.prompt_tokens, s.cached_tokens,
             s.completion_tokens) for s in sums] == [
        ("a", 1, 2, 12, 1, 5), ("a", 2, 1, 1, 1, 1), ("b", 1, 1, 10, 0, 0)]
    assert [s.key_id for s in db.sums(conn, date(2026, 3, 1), date(2026, 3, 31), "b")] == ["b"]
    conn.close()


def test_serve_forwards_the_url_in_the_environment_only():
    from services.cli.flags import forwarded_argv, forwarded_env, serve_parser

    url = "postgresql://acct:s3cret@db/usage"
    ns = serve_parser().parse_args(["--usage-db", url])
    assert forwarded_env("router", ns)["PAGEDSERVE_USAGE_DB"] == url
    assert not any("s3cret" in a for a in forwarded_argv("router", ns))  # (ps shows argv)
