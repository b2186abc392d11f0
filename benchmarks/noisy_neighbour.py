"""Noisy neighbour: does one key flooding the router hurt another key's first-token latency?

    # the tiny random model (built into a temporary folder), 30 s per phase
    .venv/bin/python benchmarks/noisy_neighbour.py
    # SmolLM2-135M (the packaged model), longer phases, JSON out
    .venv/bin/python benchmarks/noisy_neighbour.py --model smollm2 --duration 60 --json nn.json

Two keys in an ``--api-keys-file`` (docs/tenants.md): ``quiet`` and ``flood``, each with a
``requests_per_minute`` limit. ``quiet`` sends gRPC streams at a steady ``--quiet-rate``
(requests/s, within its limit) and its TTFT (time to the first token, client side) is
measured. ``flood`` sends HTTP ``/v1/completions`` open-loop, ignoring ``Retry-After``.
Phases of ``--duration`` seconds each:

1. ``alone``: quiet only.
2. ``flood 1x``: flood at exactly its limit (every request admitted: the load the limit allows).
3. ``flood 10x``: flood at 10 times its limit, its bucket emptied first, so it is admitted at
   its limit throughout and nine in ten requests are refused with 429 + ``Retry-After``: the
   difference from phase 2 is what the refused excess costs.
4. with ``--with-burst``, ``flood 10x, full bucket``: the same after a minute's pause, so the
   flood first spends a full bucket (a minute's requests admitted at once: the burst a
   ``requests_per_minute`` limit allows).

Reported: quiet's p50 / p99 TTFT per phase and the ratios of p99 (10x over alone, 10x over 1x),
flood's counts of 200s, 429s (and how many carried ``Retry-After``) and other statuses, and
whether the router's usage table (``GET /v1/usage`` with a third, admin key; a fresh SQLite file)
sums to the usage fields of the flooding key's answers exactly.

The stack (worker, scheduler, router: ``benchmarks.stack_harness.InProcessStack``) runs in a
child process, so the clients' Python does not share the router's interpreter lock.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

QUIET_KEY, FLOOD_KEY, ADMIN_KEY = "sk-bench-quiet", "sk-bench-flood", "sk-bench-admin"
# The usage fields of the flooding key's answered requests, summed (checked against the
# router's usage table at the end: GET /v1/usage).
FLOOD_USAGE = {"prompt_tokens": 0, "completion_tokens": 0}


def _add_usage(answer: dict) -> None:
    for k in FLOOD_USAGE:
        FLOOD_USAGE[k] += answer["usage"][k]


def _serve(model: str, keys_file: str) -> None:
    """Child process: start the stack, print its addresses (one JSON line), serve until stdin
    closes."""
    from benchmarks.stack_harness import InProcessStack

    worker = ["--dtype", "float32", "--kv-cache-memory", "512MiB"]  # (SmolLM2: 8k tokens)
    stack = InProcessStack(None if model == "smollm2" else model, worker_argv=worker,
                           router_argv=["--api-keys-file", keys_file]).start()
    print(json.dumps({"address": stack.address, "http_url": stack.http_url}), flush=True)
    try:
        sys.stdin.readline()
    finally:
        stack.stop()


@contextlib.contextmanager
def _stack(a, model: str, keys: Path, tmp: Path):
    """The stack the keys file configures; yields its addresses (``address``, ``http_url``).
    ``--launch``: ``pagedserve serve`` (three processes); else ``InProcessStack`` in a child
    process."""
    if a.launch:
        from throughput import running_stack

        from services.common.ports import free_ports

        (http_port,) = free_ports(1)
        extra = ["--api-keys-file", str(keys), "--http-port", str(http_port),
                 "--kv-cache-memory", "512MiB"]
        with running_stack(None if model == "smollm2" else model, "float32", extra) as address:
            yield {"address": address, "http_url": f"http://127.0.0.1:{http_port}"}
        return
    log_path = tmp / "stack.log"
    print(f"stack log: {log_path}", flush=True)
    with open(log_path, "w") as log:
        child = subprocess.Popen([sys.executable, __file__, "--_serve", model, str(keys)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                 text=True)
    assert child.stdout is not None and child.stdin is not None
    try:
        line = child.stdout.readline()
        if not line:
            sys.exit(f"the stack did not start: see {log_path}")
        yield json.loads(line)
    finally:
        child.stdin.close()
        child.wait(120)


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` percentile (0..100), nearest rank; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


async def _quiet(address: str, rate: float, duration: float, prompt: list[int],
                 max_tokens: int) -> tuple[list[tuple[float, float]], int]:
    """Steady gRPC streams of the quiet key; ((start since the phase began, TTFT) in seconds
    per request, errors)."""
    from pagedserve_client import AsyncClient

    ttfts: list[tuple[float, float]] = []
    errors = 0

    async def one(c, t0: float):
        nonlocal errors
        start = time.perf_counter()
        try:
            async for delta in c.stream(prompt_token_ids=prompt, max_tokens=max_tokens,
                                        temperature=0, ignore_eos=True):
                if delta.token_ids:
                    ttfts.append((start - t0, time.perf_counter() - start))
                    break
        except Exception:  # noqa: BLE001 - counted and reported
            errors += 1

    async with AsyncClient(address, timeout=60, max_retries=0, api_key=QUIET_KEY) as c:
        await c.list_models()
        tasks = []
        t0 = time.perf_counter()
        for i in range(int(rate * duration)):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(c, t0)))
        await asyncio.gather(*tasks)
    return ttfts, errors


async def _flood(http_url: str, rate: float, duration: float, prompt: list[int],
                 max_tokens: int) -> dict[str, int]:
    """Open-loop HTTP completions of the flooding key; counts by outcome."""
    import aiohttp

    counts = {"sent": 0, "200": 0, "429": 0, "429_with_retry_after": 0, "other": 0}
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {FLOOD_KEY}"}

    async def one(session):
        counts["sent"] += 1
        try:
            async with session.post(f"{http_url}/v1/completions", json=body,
                                    headers=headers) as r:
                answer = await r.read()
                if r.status == 200:
                    _add_usage(json.loads(answer))
                if r.status in (200, 429):
                    counts[str(r.status)] += 1
                    counts["429_with_retry_after"] += r.status == 429 and int(
                        r.headers.get("Retry-After", "0")) >= 1
                else:
                    counts["other"] += 1
        except aiohttp.ClientError:
            counts["other"] += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = []
        t0 = time.perf_counter()
        for i in range(int(rate * duration)):  # (half a period after quiet's: no lockstep)
            await asyncio.sleep(max(0.0, t0 + (i + 0.5) / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session)))
        await asyncio.gather(*tasks)
    return counts


async def _phase(name: str, a, urls: dict, flood_rate: float) -> dict:
    prompt = list(range(100, 100 + a.prompt_len))
    quiet = _quiet(urls["address"], a.quiet_rate, a.duration, prompt, a.max_tokens)
    if flood_rate > 0:
        (ttfts, errors), flood = await asyncio.gather(
            quiet, _flood(urls["http_url"], flood_rate, a.duration, prompt, a.max_tokens))
    else:
        (ttfts, errors), flood = await quiet, None
    times = [t for _, t in ttfts]
    row = {"phase": name, "quiet_requests": len(ttfts), "quiet_errors": errors,
           "ttft_p50_ms": 1000 * _percentile(times, 50),
           "ttft_p99_ms": 1000 * _percentile(times, 99), "flood": flood}
    print(f"{name:>18}: quiet {len(ttfts)} ok / {errors} errors, TTFT p50 "
          f"{row['ttft_p50_ms']:.1f} ms, p99 {row['ttft_p99_ms']:.1f} ms"
          + (f"; flood {flood}" if flood else ""), flush=True)
    return row


async def _empty_bucket(http_url: str, prompt: list[int]) -> int:
    """Send the flooding key's requests (one token each, 8 at a time) until one is refused:
    its requests bucket is then empty. Returns how many were admitted."""
    import aiohttp

    body = {"prompt": prompt, "max_tokens": 1}
    headers = {"Authorization": f"Bearer {FLOOD_KEY}"}
    admitted = 0
    async with aiohttp.ClientSession() as session:
        async def one() -> int:
            async with session.post(f"{http_url}/v1/completions", json=body,
                                    headers=headers) as r:
                answer = await r.read()
                if r.status == 200:
                    _add_usage(json.loads(answer))
                return r.status
        while True:
            statuses = await asyncio.gather(*(one() for _ in range(8)))
            admitted += statuses.count(200)
            if 429 in statuses:
                return admitted


def _check_usage(http_url: str) -> bool:
    """Whether the router's usage table (``GET /v1/usage``, the flooding key) sums to the
    usage fields of the answers the flooding key got; printed either way."""
    import requests

    r = requests.get(f"{http_url}/v1/usage", params={"key_id": "flood"},
                     headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    r.raise_for_status()
    table = {k: sum(day[k] for day in r.json()["data"]) for k in FLOOD_USAGE}
    equal = table == FLOOD_USAGE
    print(f"usage table (flood key) {table} vs the answers' usage {FLOOD_USAGE}: "
          f"{'equal' if equal else 'DIFFERENT'}", flush=True)
    return equal


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="model folder, or 'smollm2' (packaged); default: a tiny random Llama")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per phase")
    p.add_argument("--quiet-rate", type=float, default=4.0,
                   help="quiet key's requests/s (its limit is twice that)")
    p.add_argument("--flood-limit", type=int, default=120,
                   help="flooding key's requests_per_minute (it sends 10x that in phase 3)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--launch", action="store_true",
                   help="run the stack as `pagedserve serve` (three processes) instead of "
                        "in one child process")
    p.add_argument("--with-burst", action="store_true",
                   help="also flood at 10x from a full bucket (after a minute's pause)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument("--_serve", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._serve:
        _serve(*a._serve)
        return
    tmp = Path(tempfile.mkdtemp(prefix="noisy-neighbour-"))
    model = a.model
    if model is None:
        from benchmarks.tiny_models import make_servable_tiny_llama
        model = make_servable_tiny_llama(tmp / "tiny")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps([
        {"id": "quiet", "key": QUIET_KEY, "requests_per_minute": int(a.quiet_rate * 120)},
        {"id": "flood", "key": FLOOD_KEY, "requests_per_minute": a.flood_limit},
        {"id": "admin", "key": ADMIN_KEY, "admin": True}]))
    # (a fresh usage table, inherited by the stack's processes)
    os.environ["PAGEDSERVE_USAGE_DB"] = f"sqlite:///{tmp / 'usage.sqlite3'}"
    with _stack(a, model, keys, tmp) as urls:
        warm = argparse.Namespace(**{**vars(a), "duration": 3.0})
        asyncio.run(_phase("warm-up", warm, urls, 0.0))  # (first requests: compile, caches)
        limit_rate = a.flood_limit / 60.0
        prompt = list(range(100, 100 + a.prompt_len))
        rows = []
        for name, flood_rate in (("alone", 0.0), ("flood 1x", limit_rate),
                                 ("flood 10x", 10 * limit_rate),
                                 *([("flood 10x, full bucket", 10 * limit_rate)]
                                   if a.with_burst else [])):
            if name == "flood 10x":  # its bucket empty: admitted at its limit from the start
                asyncio.run(_empty_bucket(urls["http_url"], prompt))
            if name == "flood 10x, full bucket":  # a minute for the bucket to refill
                time.sleep(60)
            time.sleep(2)  # (the previous phase's last requests end)
            rows.append(asyncio.run(_phase(name, a, urls, flood_rate)))
        alone, one_x, ten_x = (r["ttft_p99_ms"] for r in rows[:3])
        summary = {"p99_ratio_10x_over_alone": ten_x / alone,
                   "p99_ratio_10x_over_1x": ten_x / one_x}
        if a.with_burst:
            summary["p99_ratio_10x_full_bucket_over_alone"] = rows[3]["ttft_p99_ms"] / alone
        summary["usage_table_equals_responses"] = _check_usage(urls["http_url"])
        print("quiet p99 TTFT ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()),
              flush=True)
        if a.json:
            a.json.write_text(json.dumps({"args": {k: v for k, v in vars(a).items()
                                                   if k != "json" and k != "_serve"},
                                          "rows": rows, **summary}, indent=1, default=str))


if __name__ == "__main__":
    main()
