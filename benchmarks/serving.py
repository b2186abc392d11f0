"""Open-loop serving benchmark: requests arrive on a schedule, whether or not earlier ones are done.

    # against a running stack (gRPC), 4 requests/s Poisson, 200 requests
    .venv/bin/python benchmarks/serving.py --address 127.0.0.1:50051 --request-rate 4
    # inter-token latency at batch 1 and 8, async scheduling off (it is on by default)
    .venv/bin/python benchmarks/serving.py --launch --max-concurrency 1 --num-prompts 8 \
        --serve-args=--no-async-scheduling
    # start the stack itself, sweep rates, write JSON and the latency-vs-load plot
    .venv/bin/python benchmarks/serving.py --launch --request-rate 1 2 4 inf \\
        --num-prompts 100 --json serving.json --plot serving.png
    # the same workload against vLLM's OpenAI server (its own venv, the same weights; over HTTP)
    .venv/bin/python benchmarks/serving.py --vllm-python VENV/bin/python --max-concurrency 1 \
        --num-prompts 8 --vllm-args="--kv-cache-dtype fp8"
    # the same workload over the OpenAI-compatible HTTP API
    .venv/bin/python benchmarks/serving.py --backend http --http-url http://127.0.0.1:8000 ...

Arrivals: a Poisson process at ``--request-rate`` requests/s (``inf``: all at once), optionally
capped at ``--max-concurrency`` requests in flight (the rest wait client-side, and their
waiting counts in their latency, as in vLLM's ``benchmark_serving``).

Dataset (seeded, ``--seed``): windows of real English text (the docstrings of Python's standard
library), tokenized with the served model's tokenizer. Lengths follow ShareGPT's shape — long
tailed — as log-normal draws: prompt median 170 tokens (σ 0.9), output median 150 tokens
(σ 0.8), clipped to ``--max-prompt-len`` / ``--max-output-len``. Output lengths are forced
(``ignore_eos``), so every run of a seed does the same work.

Reported per rate: req/s, output tok/s, and TTFT / ITL / e2e latency at p50 / p90 / p99 (ms),
measured by the client: TTFT = first token, ITL = gap between consecutive token-bearing
messages, e2e = last message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PROMPT_MEDIAN, PROMPT_SIGMA = 170, 0.9
OUTPUT_MEDIAN, OUTPUT_SIGMA = 150, 0.8


@dataclass
class WorkItem:
    prompt_token_ids: list[int]
    prompt: str  # the same window as text (for the HTTP backend)
    output_len: int


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0  # seconds
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str = ""


def make_dataset(tokenizer, num: int, seed: int, max_prompt_len: int,
                 max_output_len: int) -> list[WorkItem]:
    """``num`` seeded requests: log-normal prompt/output lengths, prompts cut from the corpus."""
    rng = random.Random(seed)
    from benchmarks.corpus import corpus_text

    ids = tokenizer(corpus_text())["input_ids"]
    items = []
    for _ in range(num):
        p = min(max_prompt_len, max(4, round(rng.lognormvariate(math.log(PROMPT_MEDIAN),
                                                                 PROMPT_SIGMA))))
        o = min(max_output_len, max(1, round(rng.lognormvariate(math.log(OUTPUT_MEDIAN),
                                                                 OUTPUT_SIGMA))))
        start = rng.randrange(0, len(ids) - p)
        window = ids[start:start + p]
        items.append(WorkItem(window, tokenizer.decode(window), o))
    return items


async def _grpc_one(client, item: WorkItem) -> Result:
    t0 = time.perf_counter()
    last, r = None, Result(ok=True)
    try:
        async for d in client.stream(prompt_token_ids=item.prompt_token_ids,
                                     max_tokens=item.output_len, ignore_eos=True,
                                     temperature=0):
            now = time.perf_counter()
            if d.token_ids:
                if last is None:
                    r.ttft = now - t0
                else:
                    r.itls.append(now - last)
                last = now
            if d.usage is not None:
                r.output_tokens = d.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        return Result(ok=False, error=f"{type(e).__name__}: {e}")
    r.e2e = time.perf_counter() - t0
    return r


async def _http_one(session, url: str, model: str, item: WorkItem) -> Result:
    t0 = time.perf_counter()
    last, r = None, Result(ok=True)
    body = {"model": model, "prompt": item.prompt, "max_tokens": item.output_len,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Result(ok=False, error=f"HTTP {resp.status}: {await resp.text()}")
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        r.ttft = now - t0
                    else:
                        r.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001
        return Result(ok=False, error=f"{type(e).__name__}: {e}")
    r.e2e = time.perf_counter() - t0
    return r


async def run_load(send, items: list[WorkItem], rate: float, max_concurrency: int | None,
                   seed: int, progress: bool = True) -> tuple[list[Result], float]:
    """Send ``items`` at Poisson ``rate`` (req/s; inf = at once); returns results and wall s."""
    from tqdm import tqdm

    rng = random.Random(seed + 1)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(items), desc=f"rate {rate:g}", disable=not progress, leave=False)

    async def one(item):
        if gate is None:
            r = await send(item)
        else:
            async with gate:
                r = await send(item)
        bar.update(1)
        return r

    tasks = []
    t0 = time.perf_counter()
    for item in items:
        tasks.append(asyncio.create_task(one(item)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    bar.close()
    return results, time.perf_counter() - t0


def percentiles(xs: list[float]) -> dict[str, float]:
    """p50/p90/p99 and mean, in milliseconds (nearest-rank on the sorted values)."""
    if not xs:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    s = sorted(xs)

    def rank(q):
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] * 1e3

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99),
            "mean": sum(s) / len(s) * 1e3}


def summarize(rate: float, results: list[Result], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": tokens / elapsed,
        "total_output_tokens": tokens,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles([x for r in ok for x in r.itls]),
        "e2e_ms": percentiles([r.e2e for r in ok]),
    }


def print_row(s: dict) -> None:
    print(f"rate {s['request_rate']!s:>5}: {s['completed']} ok / {s['failed']} failed in "
          f"{s['duration_s']:.1f}s | {s['request_throughput']:.2f} req/s, "
          f"{s['output_throughput']:.1f} tok/s | TTFT p50/p90/p99 {s['ttft_ms']['p50']:.0f}/"
          f"{s['ttft_ms']['p90']:.0f}/{s['ttft_ms']['p99']:.0f} ms | ITL "
          f"{s['itl_ms']['p50']:.0f}/{s['itl_ms']['p90']:.0f}/{s['itl_ms']['p99']:.0f} ms | e2e "
          f"{s['e2e_ms']['p50']:.0f}/{s['e2e_ms']['p90']:.0f}/{s['e2e_ms']['p99']:.0f} ms",
          flush=True)


def plot(rows: list[dict], path: Path) -> None:
    """Latency percentiles against achieved request throughput, one panel per latency."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("--plot needs matplotlib: .venv/bin/pip install -r benchmarks/requirements.txt")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = [r["request_throughput"] for r in rows]
    for ax, key, title in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("TTFT", "ITL", "e2e")):
        for q in ("p50", "p90", "p99"):
            ax.plot(x, [r[key][q] for r in rows], marker="o", label=q)
        ax.set(title=f"{title} vs load", xlabel="achieved requests/s", ylabel="ms")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def bench(args, address: str, items: list[WorkItem], model: str) -> list[dict]:
    rows = []
    if args.backend == "grpc":
        from pagedserve_client import AsyncClient

        client = AsyncClient(address, timeout=args.timeout)

        async def send(item):
            return await _grpc_one(client, item)
    else:
        import aiohttp

        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout))
        async with session.get(f"{args.http_url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]  # the name the server answers to

        async def send(item):
            return await _http_one(session, args.http_url, model, item)
    try:
        warm = await send(WorkItem(items[0].prompt_token_ids[:8], items[0].prompt[:40], 2))
        if not warm.ok:
            raise SystemExit(f"the warm-up request failed: {warm.error}")
        for rate in args.request_rate:
            results, elapsed = await run_load(send, items, rate, args.max_concurrency, args.seed,
                                              progress=not args.no_progress)
            rows.append(summarize(rate, results, elapsed))
            print_row(rows[-1])
    finally:
        if args.backend == "grpc":
            await client.close()
        else:
            await session.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", choices=["grpc", "http"], default="grpc")
    p.add_argument("--address", default="127.0.0.1:50051", help="router gRPC address")
    p.add_argument("--http-url", default="http://127.0.0.1:8000", help="router HTTP base URL")
    p.add_argument("--launch", action="store_true",
                   help="start `pagedserve serve` on free ports for the run (--model, --dtype)")
    p.add_argument("--model", default=None, help="model (default: packaged SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", help="with --launch")
    p.add_argument("--serve-args", default="",
                   help="with --launch: extra flags for pagedserve serve, e.g. "
                        "'--no-async-scheduling'")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="start vLLM's OpenAI server from this venv's python instead (HTTP; "
                        "compare.py's launcher: both cores, 2 GiB of KV cache, --dtype)")
    p.add_argument("--vllm-args", default="", help="with --vllm-python: extra vLLM flags")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests/s of the Poisson arrivals; several = a sweep; inf = at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="per request, seconds")
    p.add_argument("--json", type=Path, help="write the rows (one per rate) here")
    p.add_argument("--plot", type=Path, help="PNG of latency against load (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args()

    from services.router.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(a.model)
    items = make_dataset(tokenizer, a.num_prompts, a.seed, a.max_prompt_len, a.max_output_len)
    print(f"{len(items)} requests: prompt tokens mean "
          f"{sum(len(i.prompt_token_ids) for i in items) / len(items):.0f}, output tokens mean "
          f"{sum(i.output_len for i in items) / len(items):.0f}", flush=True)
    model = a.model or "SmolLM2-135M-Instruct"
    if a.vllm_python:
        import tempfile

        from compare import running_vllm, vllm_model_folder, vllm_preload

        a.backend = "http"
        log_path = Path(tempfile.mkstemp(prefix="serving-vllm-", suffix=".log")[1])
        with running_vllm(a.vllm_python, vllm_model_folder(a.model), a.dtype, threads_bind="0-1",
                          kvcache_gib=2, max_model_len=a.max_prompt_len + a.max_output_len,
                          extra=a.vllm_args.split(), log_path=log_path,
                          preload=vllm_preload(a.vllm_python)) as url:
            a.http_url = url
            rows = asyncio.run(bench(a, url, items, model))
    elif a.launch:
        from throughput import running_stack

        extra = ["--http-port", a.http_url.rsplit(":", 1)[1] if a.backend == "http" else "-1",
                 *a.serve_args.split()]
        with running_stack(a.model, a.dtype, extra) as address:
            rows = asyncio.run(bench(a, address, items, model))
    else:
        rows = asyncio.run(bench(a, a.address, items, model))
    out = {"num_prompts": a.num_prompts, "seed": a.seed, "backend": a.backend,
           "max_concurrency": a.max_concurrency, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
