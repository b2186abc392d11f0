"""Offline throughput: the same N requests through the pagedserve stack and through
transformers' ``generate`` with static batches, in one command.

    .venv/bin/python benchmarks/throughput.py --num-requests 64 --input-len 128 --output-len 128

All three — the stack, the same engine in one process without gRPC, and transformers — use
the same model, dtype, prompts (windows of real text tokenized with the model's
tokenizer) and a fixed number of output tokens per request (ignore_eos), so tokens/s compare
like for like. The stack runs as separate processes (``pagedserve serve``) and is driven over
gRPC with all requests in flight at once. Prints the output-tokens/s figures and the ratios to
transformers, and writes them as JSON with --output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.ports import free_ports  # noqa: E402


def make_prompts(tokenizer, n: int, input_len: int) -> list[list[int]]:
    """n prompts of exactly input_len tokens: sliding windows over this repo's docs."""
    text = "\n".join(p.read_text() for p in sorted(ROOT.glob("**/*.md"))
                     if ".venv" not in p.parts)
    ids = tokenizer(text)["input_ids"]
    while len(ids) < input_len + n * 7:
        ids = ids + ids
    return [ids[i * 7: i * 7 + input_len] for i in range(n)]


def bench_transformers(model_dir, gguf_file, prompts, output_len, batch_size, dtype) -> float:
    """Output tokens/s of transformers' generate over static batches (all prompts equal length,
    so no padding)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file,
                                                 dtype=getattr(torch, dtype)).eval()
    cfg = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                           do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:1]), generation_config=cfg)  # warm-up
        t0 = time.perf_counter()
        n = 0
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i:i + batch_size])
            out = model.generate(batch, generation_config=cfg)
            n += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        return n / (time.perf_counter() - t0)


def bench_engine(model: str | None, prompts, output_len: int | list[int], dtype: str,
                 **runner_kwargs) -> float:
    """Output tokens/s of the engine in one process: Scheduler + ModelRunner, no gRPC (each
    step is the sampling rank's view, ``StepInput.for_rank``, as the services send).
    ``output_len``: one length for every prompt, or one per prompt (forced with ignore_eos);
    ``runner_kwargs`` go to ``WorkerConfig`` (e.g. ``batch_invariant=True``)."""
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    runner = ModelRunner(WorkerConfig(model=model, dtype=dtype, **runner_kwargs))
    lens = [output_len] * len(prompts) if isinstance(output_len, int) else output_len
    scheduler = loaded_scheduler(runner, prompts, lens)
    n, t0 = 0, time.perf_counter()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        res = runner.execute_step(out.for_rank(samples=True))
        updates = scheduler.update_from_output(out, res)
        n += sum(len(u.new_token_ids) for u in updates)
    assert n == sum(lens), "a request ended early"
    return n / (time.perf_counter() - t0)


def loaded_scheduler(runner, prompts, output_lens: list[int]):
    """A Scheduler sized for ``runner`` holding one greedy ``ignore_eos`` request per prompt,
    ``output_lens[i]`` tokens each."""
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.request import EngineSamplingParams, Request
    from services.scheduler.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_model_len=runner.max_model_len,
                                          block_size=runner.block_size),
                          runner.num_kv_blocks, runner.eos_token_ids,
                          sliding_windows=[g.sliding_window for g in runner.kv_cache_groups])
    for i, (p, n) in enumerate(zip(prompts, output_lens, strict=True)):
        scheduler.add_request(Request(f"r{i}", list(p), EngineSamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True)))
    return scheduler


async def _drive(address: str, prompts, output_len: int) -> tuple[float, int]:
    from pagedserve_client import AsyncClient

    async with AsyncClient(address) as client:
        await client.generate(prompt_token_ids=prompts[0], max_tokens=4)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            client.generate(prompt_token_ids=p, max_tokens=output_len, ignore_eos=True,
                            temperature=0) for p in prompts))
        elapsed = time.perf_counter() - t0
    n = sum(r.usage.completion_tokens for r in results)
    assert n == output_len * len(prompts), "a request ended early"
    return n / elapsed, n


@contextlib.contextmanager
def running_stack(model: str | None, dtype: str, extra: list[str]):
    """``pagedserve serve`` in a child process on free ports; yields the router's address once
    it is healthy, and stops the stack on exit.

    Raises:
        RuntimeError: the stack exited or was not healthy within 600 s.
    """
    port, sport, wport = free_ports(3)
    cmd = [sys.executable, "-m", "services.cli", "serve", "--port", str(port),
           "--scheduler-port", str(sport), "--worker-port", str(wport), "--dtype", dtype,
           "--metrics-port", "0",
           "--log-level", "WARNING", *(["--model", model] if model else []), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        from services.common.grpc_utils import check_health
        deadline = time.monotonic() + 600
        while not asyncio.run(check_health(address)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("stack did not start")
            time.sleep(1)
        yield address
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have died on its own
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def bench_stack(model: str | None, prompts, output_len: int, dtype: str, extra: list[str]) -> float:
    """Output tokens/s of the whole stack (three processes) with every request in flight."""
    with running_stack(model, dtype, extra) as address:
        tps, _ = asyncio.run(_drive(address, prompts, output_len))
        return tps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="folder or .gguf (default: packaged SmolLM2)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=32,
                   help="transformers' static batch size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both sides; float32 unless the CPU has native bf16 (AVX512-BF16/AMX)")
    p.add_argument("--output", default=None, help="write the figures as JSON here")
    p.add_argument("--serve-args", default="", help="extra flags for pagedserve serve")
    a = p.parse_args()

    from services.common.model_files import resolve_model
    from services.router.tokenizer import load_tokenizer

    src = resolve_model(a.model)
    prompts = make_prompts(load_tokenizer(a.model), a.num_requests, a.input_len)
    stack = bench_stack(a.model, prompts, a.output_len, a.dtype, a.serve_args.split())
    print(f"pagedserve stack (gRPC, 3 processes): {stack:8.1f} output tok/s", flush=True)
    engine = bench_engine(a.model, prompts, a.output_len, a.dtype)
    print(f"pagedserve engine (one process)     : {engine:8.1f} output tok/s", flush=True)
    hf = bench_transformers(src.folder, src.gguf_file, prompts, a.output_len,
                            a.hf_batch_size, a.dtype)
    print(f"transformers generate               : {hf:8.1f} output tok/s "
          f"(static batches of {a.hf_batch_size})")
    print(f"ratio stack / transformers          : {stack / hf:8.2f}x")
    print(f"ratio engine / transformers         : {engine / hf:8.2f}x")
    if a.output:
        Path(a.output).write_text(json.dumps(dict(
            vars(a), stack_tok_s=stack, engine_tok_s=engine, hf_tok_s=hf,
            stack_ratio=stack / hf, engine_ratio=engine / hf), indent=2))


if __name__ == "__main__":
    main()
