"""Load and soak: thousands of mixed streaming requests through a real stack, then checks.

    .venv/bin/python benchmarks/soak.py            # = make soak: 2,000 requests, 256 streams
    .venv/bin/python benchmarks/soak.py --requests 300 --concurrency 64 --output soak.json

Starts worker, scheduler and router as separate processes (``pagedserve worker|scheduler|
router``) on a tiny random-weight Llama (SmolLM2's tokenizer and vocabulary; ``--model`` for
another) and drives the router with the Python SDK's ``AsyncClient``: ``--requests`` streaming
requests, at most ``--concurrency`` in flight, prompt lengths 1..``--max-prompt-len`` and output
lengths from a mix of short and long (``ignore_eos``, so each finished request must have exactly
``max_tokens`` tokens), and a ``--cancel-fraction`` of them cancelled by the client after a
random number of tokens (leaving the stream, which cancels the RPC).

Checks, after the drain:

- every request got a terminal response: finished with all its tokens, an explicit gRPC error,
  or the cancellation it asked for. ``lost`` counts the others (a stream that ended without a
  final message, a final message with the wrong token count, or a stream that stalled: no
  message for ``--stall-timeout`` seconds); it must be 0.
- the scheduler's free KV blocks equal its total (``GetEngineStats``): no request kept blocks.
- each service's RSS (psutil) grows less than ``--max-rss-growth`` between the moment request
  ``--rss-at`` completed and the end (``--no-rss-check`` skips this check; short runs are too
  noisy for it).

Prints the figures and writes them as JSON (``--output``): requests sent, peak concurrency,
finished, cancelled, errors by code, lost, blocks free/total, RSS per service at ``--rss-at``
and at the end, wall time. Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.ports import free_ports  # noqa: E402

CLI = [sys.executable, "-m", "services.cli"]
SERVICES = ("worker", "scheduler", "router")


@dataclass
class Figures:
    """What one soak run measured (written as JSON)."""

    requests_sent: int = 0
    peak_concurrency: int = 0
    finished: int = 0
    cancelled: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    lost_examples: list[str] = field(default_factory=list)
    output_tokens: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    rss_at_mark_mib: dict[str, float] = field(default_factory=dict)
    rss_end_mib: dict[str, float] = field(default_factory=dict)
    rss_growth: dict[str, float] = field(default_factory=dict)  # (end - mark) / mark
    # RSS (MiB) per service every --rss-every requests ended: a leak grows steadily, allocator
    # warm-up levels off
    rss_series_mib: dict[str, list[float]] = field(default_factory=dict)
    wall_s: float = 0.0
    config: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the checks that failed


def _health(address: str) -> str:
    out = subprocess.run(CLI + ["health", "--address", address, "--timeout", "1"],
                         capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip()


class Stack:
    """worker, scheduler and router as processes on free ports; ``pids`` by service name."""

    def __init__(self, model: str, kv_cache_memory: str, max_num_seqs: int, log_dir: Path):
        wport, sport, rport = free_ports(3)
        self.address = f"127.0.0.1:{rport}"
        self.scheduler = f"127.0.0.1:{sport}"
        common = ["--metrics-port", "0", "--log-level", "WARNING"]
        argv = {
            "worker": ["--port", str(wport), "--model", model, "--kv-cache-memory",
                       kv_cache_memory],
            "scheduler": ["--port", str(sport), "--workers", f"127.0.0.1:{wport}",
                          "--max-num-seqs", str(max_num_seqs)],
            "router": ["--port", str(rport), "--http-port", "-1", "--scheduler", self.scheduler,
                       "--model", model],
        }
        self.procs: dict[str, subprocess.Popen] = {}
        # NOTE: a fixed glibc mmap threshold (setting it turns off glibc's dynamic threshold):
        # freed large buffers (a step's logits, sampler scratch) go back to the OS at once
        # instead of staying in the heap, so RSS tracks live memory and a leak is not hidden
        # in (or faked by) how much transient memory the last steps happened to leave behind.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        for name in SERVICES:
            log = open(log_dir / f"{name}.log", "w")
            self.procs[name] = subprocess.Popen(CLI + [name, *argv[name], *common], cwd=ROOT,
                                                stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def wait_serving(self, timeout: float) -> None:
        """Raises RuntimeError: a service exited, or the router is not SERVING in time."""
        deadline = time.monotonic() + timeout
        while _health(self.address) != "SERVING":
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"exited during start-up: {dead}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"router {self.address} not serving after {timeout:.0f}s")
            time.sleep(0.5)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def rss_mib(pids: dict[str, int]) -> dict[str, float]:
    """Resident set size of each process in MiB."""
    import psutil
    return {name: psutil.Process(pid).memory_info().rss / 2**20 for name, pid in pids.items()}


def engine_stats(address: str):
    import grpc

    from services.common.pb.pagedserve.v1 import engine_pb2, engine_pb2_grpc
    with grpc.insecure_channel(address) as ch:
        return engine_pb2_grpc.EngineServiceStub(ch).GetEngineStats(
            engine_pb2.GetEngineStatsRequest(), timeout=10)


def wait_drained(address: str, timeout: float):
    """The scheduler's stats once nothing runs or waits (or after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine_stats(address)
        if (s.num_running == 0 and s.num_waiting == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


@dataclass(slots=True)
class Plan:
    """One request: its prompt, how many tokens it asks for, and when (if) it cancels."""

    prompt_token_ids: list[int]
    max_tokens: int
    cancel_after: int | None  # leave the stream after this many tokens; None = read to the end


def make_plans(n: int, cancel_fraction: float, max_prompt_len: int, vocab: int,
               seed: int, max_output_len: int = 256) -> list[Plan]:
    """Mixed lengths: prompts uniform in [1, max_prompt_len]; outputs (L = max_output_len)
    70% short (1..L/8), 25% medium (L/8..L/2), 5% long (L/2..L)."""
    rng = random.Random(seed)
    plans = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt_len))]
        kind = rng.random()
        short, medium = max(max_output_len // 8, 1), max(max_output_len // 2, 2)
        max_tokens = (rng.randint(1, short) if kind < 0.7 else
                      rng.randint(short, medium) if kind < 0.95 else
                      rng.randint(medium, max_output_len))
        cancel = None
        if rng.random() < cancel_fraction:
            max_tokens = max(max_tokens, 8)
            cancel = rng.randint(1, max_tokens - 1)
        plans.append(Plan(prompt, max_tokens, cancel))
    return plans


async def drive(address: str, plans: list[Plan], concurrency: int, stall_timeout: float,
                figures: Figures, mark: int, on_mark, every: int, on_every) -> None:
    """Send every plan as a streaming request, at most ``concurrency`` at once; count outcomes
    into ``figures``; call ``on_mark()`` once ``mark`` requests have ended, and ``on_every()``
    each time another ``every`` have."""
    import grpc
    from pagedserve_client import AsyncClient

    in_flight = 0
    ended = 0
    sem = asyncio.Semaphore(concurrency)

    def lost(i: int, why: str) -> None:
        figures.lost += 1
        if len(figures.lost_examples) < 10:
            figures.lost_examples.append(f"request {i}: {why}")

    async def one(i: int, plan: Plan, client: AsyncClient) -> tuple[str, int]:
        """("finished" | "cancelled" | "stalled" | "no-final", tokens received)."""
        tokens, final = 0, None
        stream = client.stream(prompt_token_ids=plan.prompt_token_ids,
                               max_tokens=plan.max_tokens, ignore_eos=True, temperature=1.0,
                               seed=i)
        async with contextlib.aclosing(stream):
            while True:
                try:
                    delta = await asyncio.wait_for(anext(stream), stall_timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    return "stalled", tokens
                tokens += len(delta.token_ids)
                if delta.finish_reason:
                    final = delta
                if plan.cancel_after is not None and tokens >= plan.cancel_after:
                    return "cancelled", tokens
        return ("finished", tokens) if final is not None else ("no-final", tokens)

    async def run(i: int, plan: Plan, client: AsyncClient) -> None:
        nonlocal in_flight, ended
        async with sem:
            in_flight += 1
            figures.requests_sent += 1
            figures.peak_concurrency = max(figures.peak_concurrency, in_flight)
            try:
                outcome, tokens = await one(i, plan, client)
                figures.output_tokens += tokens
                if outcome == "cancelled":
                    figures.cancelled += 1
                elif outcome == "finished" and tokens == plan.max_tokens:
                    figures.finished += 1
                else:
                    lost(i, f"{outcome} with {tokens}/{plan.max_tokens} tokens")
            except grpc.RpcError as e:
                code = e.code().name
                figures.errors_by_code[code] = figures.errors_by_code.get(code, 0) + 1
            finally:
                in_flight -= 1
                ended += 1
                if ended == mark:
                    on_mark()
                if ended % every == 0:
                    on_every()

    async with AsyncClient(address) as client:
        await asyncio.gather(*(run(i, p, client) for i, p in enumerate(plans)))


def make_model(folder: Path) -> str:
    from benchmarks.tiny_models import make_servable_tiny_llama
    return make_servable_tiny_llama(folder, max_position_embeddings=4096)


def run(args: argparse.Namespace) -> Figures:
    """Start the stack, drive it, drain, check; the stack is stopped before returning."""
    figures = Figures(config={k: v for k, v in vars(args).items() if k != "output"})
    with tempfile.TemporaryDirectory(prefix="pagedserve-soak-") as tmp:
        tmp = Path(tmp)
        model = args.model or make_model(tmp / "tiny")
        stack = Stack(model, args.kv_cache_memory, args.max_num_seqs, tmp)
        try:
            stack.wait_serving(args.startup_timeout)
            plans = make_plans(args.requests, args.cancel_fraction, args.max_prompt_len,
                               args.vocab, args.seed, args.max_output_len)
            mark = min(args.rss_at, args.requests)
            t0 = time.monotonic()
            def sample() -> None:
                for name, v in rss_mib(stack.pids).items():
                    figures.rss_series_mib.setdefault(name, []).append(round(v, 1))

            asyncio.run(drive(stack.address, plans, args.concurrency, args.stall_timeout,
                              figures, mark,
                              lambda: figures.rss_at_mark_mib.update(rss_mib(stack.pids)),
                              args.rss_every, sample))
            s = wait_drained(stack.scheduler, 60)
            figures.wall_s = round(time.monotonic() - t0, 1)
            figures.blocks_free, figures.blocks_total = s.num_free_blocks, s.num_total_blocks
            figures.rss_end_mib = rss_mib(stack.pids)
        finally:
            stack.stop()
            if args.keep_logs:
                for name in SERVICES:
                    print(f"--- {name} log (last 20 lines)", file=sys.stderr)
                    lines = (tmp / f"{name}.log").read_text().splitlines()
                    print("\n".join(lines[-20:]), file=sys.stderr)
    for name, mark_rss in figures.rss_at_mark_mib.items():
        figures.rss_growth[name] = round(figures.rss_end_mib[name] / mark_rss - 1, 4)
    figures.rss_at_mark_mib = {k: round(v, 1) for k, v in figures.rss_at_mark_mib.items()}
    figures.rss_end_mib = {k: round(v, 1) for k, v in figures.rss_end_mib.items()}
    accounted = figures.finished + figures.cancelled + sum(figures.errors_by_code.values())
    if figures.lost or accounted != args.requests:
        figures.failures.append(f"lost {figures.lost} of {args.requests} requests")
    if figures.blocks_free != figures.blocks_total:
        figures.failures.append(f"KV blocks leaked: {figures.blocks_free} free of "
                                f"{figures.blocks_total}")
    if args.rss_check:
        grown = {k: g for k, g in figures.rss_growth.items() if g >= args.max_rss_growth}
        if grown:
            figures.failures.append(f"RSS grew >= {args.max_rss_growth:.0%}: {grown}")
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="requests in all")
    p.add_argument("--concurrency", type=int, default=256, help="streams in flight at most")
    p.add_argument("--cancel-fraction", type=float, default=0.1,
                   help="share of requests the client cancels mid-stream")
    p.add_argument("--max-prompt-len", type=int, default=200, help="longest prompt (tokens)")
    p.add_argument("--max-output-len", type=int, default=256,
                   help="longest output (tokens); see make_plans for the mix")
    p.add_argument("--vocab", type=int, default=49152, help="prompt token ids are < this")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--model", default=None,
                   help="model folder (default: a tiny random Llama built in a temp dir)")
    # NOTE: small enough that by --rss-at every block has been used and cached: the
    # scheduler's prefix-cache index (bounded by the block count) is full before the RSS mark.
    p.add_argument("--kv-cache-memory", default="32MiB", help="worker KV cache size")
    p.add_argument("--max-num-seqs", type=int, default=256, help="scheduler max_num_seqs")
    p.add_argument("--stall-timeout", type=float, default=120.0,
                   help="a stream with no message for this many seconds is lost (and closed)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--rss-at", type=int, default=500,
                   help="RSS is compared between this many requests ended and the end")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--rss-every", type=int, default=250,
                   help="sample the RSS series every this many requests ended")
    p.add_argument("--rss-check", action=argparse.BooleanOptionalAction, default=True,
                   help="fail when a service's RSS grew by --max-rss-growth or more")
    p.add_argument("--keep-logs", action="store_true", help="print the services' log tails")
    p.add_argument("--output", default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    figures = run(args)
    text = json.dumps(asdict(figures), indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    for failure in figures.failures:
        print(f"soak FAILED: {failure}", file=sys.stderr)
    return 1 if figures.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
