"""Per-key quotas through the whole stack (tiny model): --api-keys-file's limits refuse over
HTTP (429, Retry-After, OpenAI's body) and gRPC (RESOURCE_EXHAUSTED, retry-after metadata)
before the engine sees the request; one key's limits count both protocols; concurrency is
released however a request ends; a key's priority ceiling clamps its requests."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pagedserve_client import AsyncClient, Client
from services.router.replicas import ReplicaSet
from tests.stack_harness import InProcessStack

PROMPT = [1, 2, 3, 4, 5]
KEYS = [
    {"id": "http-rpm", "key": "sk-http-rpm", "requests_per_minute": 2},
    {"id": "grpc-rpm", "key": "sk-grpc-rpm", "requests_per_minute": 2},
    {"id": "shared", "key": "sk-shared", "requests_per_minute": 3},
    {"id": "tpm", "key": "sk-tpm", "tokens_per_minute": 100},
    {"id": "one-at-a-time", "key": "sk-conc", "max_concurrent_requests": 1},
    {"id": "low", "key": "sk-low", "max_priority": 2},
]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    stack = InProcessStack(tiny_model_dir,
                           worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB"],
                           scheduler_argv=["--max-num-batched-tokens", "256",
                                           "--scheduling-policy", "priority"],
                           router_argv=["--api-keys-file", str(path),
                                        "--api-key", "sk-plain"]).start()
    yield stack
    stack.stop()


def _http(stack, key: str | None, max_tokens: int = 4, path: str = "/v1/completions",
          **extra) -> tuple[int, dict, dict]:
    """POST a completion; (status, headers, JSON body)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}
    req = urllib.request.Request(f"{stack.http_url}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _grpc(stack, key: str, max_tokens: int = 4, **kw):
    with Client(stack.address, timeout=30, max_retries=0, api_key=key) as c:
        return c.generate(prompt_token_ids=PROMPT, max_tokens=max_tokens, temperature=0,
                          ignore_eos=True, **kw)


def _grpc_refusal(stack, key: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        _grpc(stack, key)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return e.value


def _retry_after(error: grpc.RpcError) -> int:
    return int(dict(error.trailing_metadata())["retry-after"])


def test_http_over_requests_per_minute_is_429_with_retry_after(stack):
    for _ in range(2):
        assert _http(stack, "sk-http-rpm")[0] == 200
    running_before = stack.stats().num_running + stack.stats().num_waiting
    status, headers, body = _http(stack, "sk-http-rpm")
    assert status == 429
    assert 1 <= int(headers["Retry-After"]) <= 30  # one request refills in 30 s
    error = body["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "requests_per_minute"
    assert "'http-rpm'" in error["message"] and "limit of 2" in error["message"]
    assert "sk-" not in error["message"]
    assert running_before == 0 == stack.stats().num_running + stack.stats().num_waiting
    # another key, and the plain --api-key, are not held back
    assert _http(stack, "sk-plain")[0] == 200
    assert _http(stack, "sk-wrong")[0] == 401


def test_grpc_over_requests_per_minute_is_resource_exhausted_with_retry_after(stack):
    for _ in range(2):
        assert len(_grpc(stack, "sk-grpc-rpm").token_ids) == 4
    error = _grpc_refusal(stack, "sk-grpc-rpm")
    assert 1 <= _retry_after(error) <= 30
    assert "requests_per_minute limit of 2" in error.details()


def test_the_limit_counts_http_and_grpc_together(stack):
    assert _http(stack, "sk-shared")[0] == 200
    assert len(_grpc(stack, "sk-shared").token_ids) == 4
    assert _http(stack, "sk-shared")[0] == 200
    _grpc_refusal(stack, "sk-shared")
    assert _http(stack, "sk-shared")[0] == 429
    metrics = urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=10).read().decode()
    assert ('pagedserve:router_quota_rejections_total{key_id="shared",'
            'limit="requests_per_minute"} 2.0') in metrics


def test_tokens_per_minute_charges_prompt_and_streamed_completion(stack):
    status, _, body = _http(stack, "sk-tpm", max_tokens=120, stream=False)
    assert status == 200 and body["usage"]["total_tokens"] == 125  # 25 over the minute's 100
    status, headers, body = _http(stack, "sk-tpm")
    assert status == 429 and body["error"]["code"] == "tokens_per_minute"
    # 26 tokens to refill (to one token) at 100/min: 15.6 s, rounded up (less time passed)
    assert 14 <= int(headers["Retry-After"]) <= 16
    assert "tokens_per_minute" in _grpc_refusal(stack, "sk-tpm").details()


async def _hold_one_stream(stack, key: str) -> tuple[list[int], BaseException | None, int]:
    """Stream a long request of ``key``; once its first tokens arrived, send a second one
    (gRPC) and an HTTP one; then drop the stream (client gone). Returns the first's tokens
    before the drop, the second's error and the HTTP status."""
    async with AsyncClient(stack.address, timeout=60, max_retries=0, api_key=key) as c:
        first = c.stream(prompt_token_ids=PROMPT, max_tokens=1000, temperature=0,
                         ignore_eos=True)
        got = list((await anext(first)).token_ids)
        second = await asyncio.gather(c.generate(prompt_token_ids=PROMPT, max_tokens=2),
                                      return_exceptions=True)
        status = (await asyncio.to_thread(_http, stack, key))[0]
        got += (await anext(first)).token_ids  # still running
        await first.aclose()  # the client goes away: its slot is released
        return got, second[0] if isinstance(second[0], BaseException) else None, status


def test_concurrency_is_limited_and_released_when_the_client_goes(stack):
    got, error, status = asyncio.run(_hold_one_stream(stack, "sk-conc"))
    assert len(got) >= 2
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent_requests limit of 1" in error.details()
    assert status == 429
    deadline = time.monotonic() + 10
    while _http(stack, "sk-conc")[0] == 429 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _http(stack, "sk-conc")[0] == 200
    stack.wait_idle()


def test_priority_is_clamped_to_the_keys_ceiling(stack, monkeypatch):
    seen: list[int] = []
    submit = ReplicaSet.submit

    def recording(self, *args, priority: int = 0, **kw):
        seen.append(priority)
        return submit(self, *args, priority=priority, **kw)
    monkeypatch.setattr(ReplicaSet, "submit", recording)
    _grpc(stack, "sk-low", priority=-7)
    _grpc(stack, "sk-low", priority=5)
    assert _http(stack, "sk-low", priority=-3)[0] == 200
    _grpc(stack, "sk-plain", priority=-7)  # no ceiling
    assert seen == [2, 5, 2, -7]
