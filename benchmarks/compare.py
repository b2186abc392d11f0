"""One workload, three ways, side by side: transformers' static batching, the pagedserve engine
in one process, and the full pagedserve stack over gRPC.

    .venv/bin/python benchmarks/compare.py                      # the fixed workload below
    .venv/bin/python benchmarks/compare.py --num-requests 16 --json compare.json   # quicker

The fixed workload (issue 7): 128 requests, prompt lengths uniform in 32–512 tokens, output
lengths uniform in 32–256 tokens forced with ignore_eos, prompts cut from real text (the
standard library's docstrings, see ``serving.corpus_text``), seed 0, SmolLM2-135M-Instruct in
bfloat16 on CPU, greedy.

- (a) transformers ``generate`` over static batches in arrival order, left-padded; each batch
  runs until its longest output, and only the requested output tokens are counted. The best
  of batch sizes 8, 32 and 64.
- (b) the engine in-process: ``Scheduler`` + ``ModelRunner``, no gRPC (each step still goes
  through the StepRequest encoding the services use).
- (c) the stack: ``pagedserve serve`` (three processes), every request sent at once over gRPC.

Prints each one's output tokens/s and the ratios b/a, c/a and c/b.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
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
    from serving import corpus_text

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


async def _drive(address: str, items: list[Item], metrics_url: str | None = None
                 ) -> tuple[float, float | None]:
    """Send every item at once; returns (output tokens/s, the worker's busy fraction or None).

    The busy fraction is the worker's summed step time (``pagedserve:worker_step_seconds``
    scraped from ``metrics_url`` before and after) over the wall time: what the stack leaves
    of the worker's time to the forward passes; the rest is the worker waiting for its next
    StepRequest (scheduler, gRPC hops) or the OS giving its cores to other processes.
    """
    from pagedserve_client import AsyncClient

    async with AsyncClient(address) as client:
        await client.generate(prompt_token_ids=items[0].prompt_token_ids[:8], max_tokens=2)
        busy0, cpu0 = _step_seconds(metrics_url), _cpu_seconds()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            client.generate(prompt_token_ids=it.prompt_token_ids, max_tokens=it.output_len,
                            ignore_eos=True, temperature=0) for it in items))
        elapsed = time.perf_counter() - t0
        busy1, cpu1 = _step_seconds(metrics_url), _cpu_seconds()
    n = sum(r.usage.completion_tokens for r in results)
    assert n == sum(it.output_len for it in items), "a request ended early"
    busy = None if busy0 is None or busy1 is None else (busy1 - busy0) / elapsed
    for name in cpu1:
        used = cpu1[name] - cpu0.get(name, 0.0)
        print(f"    CPU time of {name:9s}: {used:7.1f} s ({used / elapsed:6.1%} of one core)",
              flush=True)
    return n / elapsed, busy


def _cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds so far of this process ("client") and of each service
    process that ``pagedserve serve`` started (router, scheduler, worker), by name."""
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


def bench_stack(model: str | None, items: list[Item], dtype: str, extra: list[str]
                ) -> tuple[float, float | None]:
    """(c) Output tokens/s of ``pagedserve serve`` with every request in flight, and the
    worker's busy fraction (see ``_drive``)."""
    from throughput import running_stack

    from services.common.ports import free_port_range

    base = free_port_range(3)  # scheduler BASE, router BASE+1, worker rank 0 BASE+2
    with running_stack(model, dtype, ["--http-port", "-1", "--metrics-port", str(base),
                                      *extra]) as address:
        return asyncio.run(_drive(address, items, f"http://127.0.0.1:{base + 2}/metrics"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="folder or .gguf (default: packaged SmolLM2)")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--serve-args", default="", help="extra flags for pagedserve serve")
    p.add_argument("--skip", nargs="*", default=[], choices=["hf", "engine", "stack"])
    p.add_argument("--json", type=Path, help="write the figures here")
    a = p.parse_args()

    from services.common.model_files import resolve_model
    from services.router.tokenizer import load_tokenizer

    items = workload(load_tokenizer(a.model), a.num_requests, a.seed)
    total = sum(it.output_len for it in items)
    print(f"{len(items)} requests, {sum(len(i.prompt_token_ids) for i in items)} prompt tokens, "
          f"{total} output tokens, {a.dtype}", flush=True)
    res: dict = {"num_requests": a.num_requests, "seed": a.seed, "dtype": a.dtype,
                 "output_tokens": total}
    if "stack" not in a.skip:
        res["stack"], busy = bench_stack(a.model, items, a.dtype, a.serve_args.split())
        print(f"(c) pagedserve stack, gRPC       : {res['stack']:8.1f} output tok/s", flush=True)
        if busy is not None:
            res["stack_worker_busy"] = busy
            print(f"    worker busy (step time / wall): {busy:8.1%}", flush=True)
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
    for num, den in (("engine", "hf"), ("stack", "hf"), ("stack", "engine")):
        if num in res and den in res:
            res[f"{num}/{den}"] = res[num] / res[den]
            print(f"ratio {num}/{den}: {res[num] / res[den]:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
