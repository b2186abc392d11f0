"""Per-key limits (services/router/quotas.py) on an injected clock, and the keys file
(services/router/api_keys_file.py): parsing, identification, reload (also by a real SIGHUP)."""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import os
import signal

import pytest

from services.router.api_keys_file import KeyRing, KeysFileError, parse_keys, reload_on_sighup
from services.router.auth import INVALID, MISSING, ApiKeys
from services.router.callers import Caller
from services.router.quotas import (
    Limits,
    QuotaExceeded,
    Quotas,
    TokenBucket,
    charge_tokens,
    clamp_priority,
)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _quotas(**limits) -> tuple[Quotas, Clock]:
    clock = Clock()
    q = Quotas(clock)
    q.configure({"a": Limits(**limits)})
    return q, clock


def _in_context(fn):
    """Run ``fn`` in a fresh context (as each request's task does)."""
    return contextvars.copy_context().run(fn)


def test_bucket_refills_continuously_up_to_its_capacity():
    b = TokenBucket(60, now=0.0)  # one per second
    b.take(60, 0.0)
    assert b.refill(0.5) == pytest.approx(0.5)
    assert b.seconds_until(1, 0.5) == pytest.approx(0.5)
    assert b.refill(1000.0) == 60.0
    b.take(100, 1000.0)  # may go negative
    assert b.level == -40.0 and b.seconds_until(1, 1000.0) == pytest.approx(41.0)


def test_requests_per_minute_refuses_with_the_wait_rounded_up():
    q, clock = _quotas(requests_per_minute=3)
    for _ in range(3):
        q.release(q.acquire("a"))
    with pytest.raises(QuotaExceeded) as e:
        q.acquire("a")
    assert e.value.limit == "requests_per_minute"
    assert e.value.retry_after == 20  # one request refills in 60/3 s
    assert "'a'" in e.value.message and "requests_per_minute limit of 3" in e.value.message
    clock.now += 19.5
    with pytest.raises(QuotaExceeded) as e:
        q.acquire("a")
    assert e.value.retry_after == 1
    clock.now += 0.5
    q.release(q.acquire("a"))
    assert q.rejections[("a", "requests_per_minute")] == 2


def test_tokens_per_minute_charges_prompt_and_completion_and_may_go_negative():
    q, clock = _quotas(tokens_per_minute=600)  # 10 tokens per second

    def one_request(prompt: int, completion: int):
        with q.admit("a"):
            charge_tokens(prompt)
            for _ in range(completion):
                charge_tokens(1)
    _in_context(lambda: one_request(500, 300))
    assert q.state("a").tokens.level == pytest.approx(-200)
    with pytest.raises(QuotaExceeded) as e:
        _in_context(lambda: one_request(1, 1))
    assert e.value.limit == "tokens_per_minute" and e.value.retry_after == 21  # 201 tokens
    body = e.value.openai_body()["error"]
    assert body["type"] == "rate_limit_error" and body["code"] == "tokens_per_minute"
    assert "tokens_per_minute limit of 600" in body["message"]
    clock.now += 21
    _in_context(lambda: one_request(1, 1))


def test_charges_outside_an_admitted_request_charge_nobody():
    q, _ = _quotas(tokens_per_minute=100)
    _in_context(lambda: charge_tokens(1000))
    assert q.state("a").tokens.level == 100


def test_concurrency_is_released_however_the_request_ends():
    q, _ = _quotas(max_concurrent_requests=2)
    first, second = q.acquire("a"), q.acquire("a")
    with pytest.raises(QuotaExceeded) as e:
        q.acquire("a")
    assert e.value.limit == "max_concurrent_requests" and e.value.retry_after == 1
    q.release(first)
    with pytest.raises(RuntimeError), q.admit("a"):
        raise RuntimeError("the request failed")
    q.release(second)
    assert q.state("a").running == 0


def test_a_refusal_takes_nothing_and_names_the_longest_wait():
    q, _ = _quotas(requests_per_minute=1, max_concurrent_requests=1)
    held = q.acquire("a")
    with pytest.raises(QuotaExceeded) as e:
        q.acquire("a")
    assert e.value.limit == "requests_per_minute" and e.value.retry_after == 60
    q.release(held)
    assert q.state("a").running == 0 and q.state("a").requests.level == pytest.approx(0)


def test_keys_without_limits_are_not_tracked():
    q = Quotas(Clock())
    q.configure({"free": Limits()})
    assert q.state("free") is None and q.acquire("free") is None
    assert q.acquire("unknown") is None


def test_priority_is_clamped_to_the_keys_ceiling_under_the_priority_policy():
    q, _ = _quotas(max_priority=2)

    def clamp(priority: int, policy: str) -> int:
        with q.admit("a"):
            return clamp_priority(priority, policy)
    assert _in_context(lambda: clamp(-5, "priority")) == 2
    assert _in_context(lambda: clamp(0, "priority")) == 2
    assert _in_context(lambda: clamp(7, "priority")) == 7
    assert _in_context(lambda: clamp(0, "fcfs")) == 0
    assert _in_context(lambda: clamp_priority(-5, "priority")) == -5  # no key admitted


def test_reconfigure_keeps_the_state_of_keys_that_stay():
    q, _clock = _quotas(requests_per_minute=2, tokens_per_minute=100)
    q.acquire("a")
    state = q.state("a")
    q.configure({"a": Limits(requests_per_minute=10, tokens_per_minute=50),
                 "b": Limits(max_concurrent_requests=1)})
    assert q.state("a") is state and state.running == 1
    assert state.requests.level == pytest.approx(1) and state.requests.capacity == 10
    assert state.tokens.level == 50  # at most the new capacity
    q.configure({"b": Limits(max_concurrent_requests=1)})
    assert q.state("a") is None
    q.release(state)  # a request of a removed key ends: harmless


def test_rejections_are_a_prometheus_counter():
    from prometheus_client import CollectorRegistry, generate_latest

    q, _ = _quotas(max_concurrent_requests=1)
    registry = CollectorRegistry()
    registry.register(q)
    q.acquire("a")
    for _ in range(3):
        with pytest.raises(QuotaExceeded):
            q.acquire("a")
    text = generate_latest(registry).decode()
    assert ('pagedserve:router_quota_rejections_total{key_id="a",'
            'limit="max_concurrent_requests"} 3.0') in text


# ---- the keys file ------------------------------------------------------------------------
def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


YAML = f"""
keys:
  - id: team-a
    key: sk-team-a
    requests_per_minute: 20
    tokens_per_minute: 50000
    max_concurrent_requests: 4
    max_priority: 2
  - id: ops
    key_sha256: {_sha("sk-ops")}
    admin: true
"""


def test_yaml_and_json_files_parse_the_same():
    specs = parse_keys(YAML)
    assert [s.id for s in specs] == ["team-a", "ops"]
    assert specs[0].limits == Limits(20, 50000, 4, 2) and not specs[0].admin
    assert specs[1].limits == Limits() and specs[1].admin
    assert specs[0].digest == hashlib.sha256(b"sk-team-a").digest()
    as_json = json.dumps([{"id": "team-a", "key": "sk-team-a", "requests_per_minute": 20,
                           "tokens_per_minute": 50000, "max_concurrent_requests": 4,
                           "max_priority": 2},
                          {"id": "ops", "key_sha256": _sha("sk-ops"), "admin": True}])
    assert parse_keys(as_json) == specs


@pytest.mark.parametrize("entries,message", [
    ([{"key": "k"}], "keys[0]: id: required"),
    ([{"id": "a"}], "keys[0] (id 'a'): key: give exactly one of key and key_sha256"),
    ([{"id": "a", "key": "k", "key_sha256": _sha("k")}], "key: give exactly one"),
    ([{"id": "a", "key_sha256": "abc"}], "key_sha256: must be 64 hex digits"),
    ([{"id": "a", "key": "k", "requests_per_minute": 0}],
     "keys[0] (id 'a'): requests_per_minute: must be an integer in [1, 2147483647], got 0"),
    ([{"id": "a", "key": "k", "tokens_per_minute": 1.5}], "tokens_per_minute: must be"),
    ([{"id": "a", "key": "k", "max_concurrent_requests": True}], "max_concurrent_requests"),
    ([{"id": "a", "key": "k", "max_priority": "high"}], "max_priority: must be an int32"),
    ([{"id": "a", "key": "k", "admin": "yes"}], "admin: must be true or false"),
    ([{"id": "a", "key": "k", "request_per_minute": 5}],
     "keys[0] (id 'a'): request_per_minute: unknown field"),
    ([{"id": "a", "key": "k"}, {"id": "a", "key": "j"}], "keys[1] (id 'a'): id: repeated"),
    ([{"id": "a", "key": "k"}, {"id": "b", "key_sha256": _sha("k")}],
     "keys[1] (id 'b'): key: the same key as an earlier entry"),
    ([{"id": "a b", "key": "k"}], "keys[0]: id: required"),
    (["sk-plain"], "keys[0]: must be a mapping"),
    ({"a": 1}, "must be a list of keys"),
])
def test_a_bad_entry_names_the_entry_and_the_field(entries, message):
    with pytest.raises(KeysFileError) as e:
        parse_keys(json.dumps(entries), "keys.json")
    assert message in str(e.value) and str(e.value).startswith("keys.json: ")
    assert "sk-" not in str(e.value).replace("sk-plain", "")


def test_not_yaml_is_refused():
    with pytest.raises(KeysFileError, match="not valid YAML or JSON"):
        parse_keys("keys: [unclosed", "k.yaml")


def test_the_ring_identifies_file_keys_and_api_keys(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(YAML)
    ring = KeyRing(ApiKeys("sk-plain"), str(path))
    assert ring.identify("Bearer sk-team-a") == Caller("team-a")
    assert ring.identify("Bearer sk-ops") == Caller("ops", admin=True)
    assert ring.identify("Bearer sk-plain") == Caller("default")
    assert ring.identify("Bearer sk-team-") == INVALID
    assert ring.identify(None) == MISSING
    assert "sk-" not in repr(ring)
    assert ring.quotas.state("team-a").limits.requests_per_minute == 20


def test_an_empty_file_refuses_everyone(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("[]")
    ring = KeyRing(None, str(path))
    assert ring and len(ring) == 0  # (the router puts the check in place: truthy)
    assert ring.identify("Bearer anything") == INVALID


def test_reload_keeps_the_old_keys_when_the_new_file_is_bad(tmp_path, caplog):
    path = tmp_path / "keys.yaml"
    path.write_text(YAML)
    ring = KeyRing(None, str(path))
    ring.quotas.acquire("team-a")
    state = ring.quotas.state("team-a")
    path.write_text("- id: team-a\n  key: sk-team-a\n  requests_per_minute: -1\n")
    assert not ring.reload()
    assert "requests_per_minute" in caplog.text and "kept" in caplog.text
    assert ring.identify("Bearer sk-ops") == Caller("ops", admin=True)
    path.write_text("- id: team-a\n  key: sk-team-a-2\n  requests_per_minute: 5\n")
    assert ring.reload()
    assert ring.identify("Bearer sk-ops") == INVALID
    assert ring.identify("Bearer sk-team-a") == INVALID
    assert ring.identify("Bearer sk-team-a-2") == Caller("team-a")
    assert ring.quotas.state("team-a") is state and state.running == 1  # its limit state kept


def test_sighup_reloads_the_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("- id: one\n  key: sk-one\n")
    ring = KeyRing(None, str(path))

    async def main():
        assert reload_on_sighup(ring)
        try:
            path.write_text("- id: two\n  key: sk-two\n")
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(100):
                if ring.ids == ["two"]:
                    return
                await asyncio.sleep(0.01)
        finally:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
    asyncio.run(main())
    assert ring.ids == ["two"] and ring.identify("Bearer sk-two") == Caller("two")


def test_serve_forwards_sighup_to_the_router_only():
    """``pagedserve serve`` with --api-keys-file passes SIGHUP on to its router process."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from services.cli.launcher import _signal_unit
    from services.cli.supervision import ProcessGroup

    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGHUP, lambda *_: (print('HUP', flush=True), sys.exit(0)))\n"
              "print('ready', flush=True)\n"
              "time.sleep(30)\n")
    procs = {name: subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                    text=True) for name in ("router", "scheduler")}
    try:
        for p in procs.values():
            assert p.stdout.readline() == "ready\n"
        supervisor = SimpleNamespace(procs={n: ProcessGroup([p], [n]) for n, p in procs.items()})
        _signal_unit(supervisor, "router", signal.SIGHUP)
        assert procs["router"].stdout.readline() == "HUP\n"
        assert procs["router"].wait(10) == 0
        assert procs["scheduler"].poll() is None
        _signal_unit(supervisor, "worker", signal.SIGHUP)  # not started: nothing
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


class _Aborted(Exception):
    pass


class _Context:
    """The parts of a grpc.aio servicer context the edge uses."""

    def __init__(self):
        self.trailing = ()
        self.code = None

    def set_trailing_metadata(self, metadata):
        self.trailing = metadata

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted


def test_grpc_unary_calls_run_as_the_caller_and_are_admitted():
    """A unary method (Embed) wrapped by the edge: the caller is set in the handler's context,
    the key's slot is held while it runs, and over the limit it aborts with retry-after."""
    import grpc

    from services.router.auth import _as_caller
    from services.router.callers import caller_var

    q, _ = _quotas(requests_per_minute=1, max_concurrent_requests=1)
    seen = []

    async def behavior(request, context):
        seen.append((caller_var.get(), q.state("a").running))
        return "response"
    handler = _as_caller(grpc.unary_unary_rpc_method_handler(behavior), Caller("a"), q)

    async def main():
        assert await handler.unary_unary("request", _Context()) == "response"
        context = _Context()
        with pytest.raises(_Aborted):
            await handler.unary_unary("request", context)
        return context
    context = asyncio.run(main())
    assert seen == [(Caller("a"), 1)] and q.state("a").running == 0
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(context.trailing)["retry-after"] == "60"
