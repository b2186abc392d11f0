"""Beam search (issue 20): KV blocks a beam group holds, and its speed against greedy requests.

    .venv/bin/python benchmarks/beam_search.py                       # the fixed workload
    .venv/bin/python benchmarks/beam_search.py --num-prompts 2 --new-tokens 8   # smoke

Everything runs through the engine in one process (Scheduler + ModelRunner, each step the
sampling rank's view of the scheduler's step, ``StepInput.for_rank``, as the services send), SmolLM2-135M-Instruct float32.

Blocks: the peak number of KV blocks in use (after each schedule(), when a step holds the most)
for one beam_width 8 request of a 512-token prompt generating 64 tokens, against 8 independent
greedy requests of the same prompt with prefix caching off. ignore_eos keeps every hypothesis
and every request at 64 tokens. Expected: about prompt blocks + 8 x decode blocks against
8 x (prompt + decode) blocks.

Speed: beam_width 4 on ``--num-prompts`` prompts of compare.py's workload (32-512 tokens, real
text) against the same prompts as 4 independent greedy continuations each (prefix caching on
for both, so both share each prompt's blocks), ``--new-tokens`` tokens each with ignore_eos:
both compute the same number of tokens (4 per prompt per step). Reported as decoded tokens
per second (4 x new tokens x prompts over the run's wall time) and their ratio (beam / greedy).

With ``--vllm-python PATH`` (compare.py's vLLM CPU peer): the same beam requests over HTTP,
all at once, to ``pagedserve serve`` and to vLLM's OpenAI server (``use_beam_search``, ``n``
4, ``ignore_eos``), and how often their best hypotheses' texts agree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def run_engine(runner, requests, *, prefix_caching: bool = True) -> tuple[float, int, int]:
    """Run ``requests`` (scheduler Requests) to the end; returns (seconds, computed tokens,
    peak KV blocks in use)."""
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_model_len=runner.max_model_len,
                                          enable_prefix_caching=prefix_caching),
                          runner.num_kv_blocks, runner.eos_token_ids,
                          sliding_windows=[g.sliding_window for g in runner.kv_cache_groups],
                          vocab_size=runner.vocab_size)
    for r in requests:
        scheduler.add_request(r)
    bm = scheduler.block_manager
    peak = computed = 0
    t0 = time.perf_counter()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        computed += out.total_num_scheduled_tokens
        scheduler.update_from_output(out, runner.execute_step(out.for_rank(samples=True)))
    elapsed = time.perf_counter() - t0
    runner.execute_step(scheduler.schedule().for_rank(samples=True))  # (drop the finished)
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    return elapsed, computed, peak


def beam(rid: str, prompt: list[int], k: int, new_tokens: int):
    from services.scheduler.request import EngineSamplingParams, Request

    return Request(rid, list(prompt), EngineSamplingParams(
        temperature=0.0, max_tokens=new_tokens, ignore_eos=True, beam_width=k))


def greedy(rid: str, prompt: list[int], new_tokens: int):
    from services.scheduler.request import EngineSamplingParams, Request

    return Request(rid, list(prompt), EngineSamplingParams(
        temperature=0.0, max_tokens=new_tokens, ignore_eos=True))


async def http_beams(base_url: str, prompts: list[list[int]], k: int, new_tokens: int
                     ) -> tuple[float, list[str]]:
    """Every prompt's beam search at once through ``POST /v1/completions``; returns (wall
    seconds, each prompt's best hypothesis text). A short request warms the server first."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        async with http.get(f"{base_url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def send(prompt: list[int], n: int) -> str:
            body = {"model": model, "prompt": prompt, "max_tokens": n, "n": k,
                    "use_beam_search": True, "temperature": 0, "ignore_eos": True}
            async with http.post(f"{base_url}/v1/completions", json=body) as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    raise RuntimeError(f"{base_url}: HTTP {r.status}: {data}")
            assert len(data["choices"]) == k, data
            return data["choices"][0]["text"]

        await send(prompts[0][:8], 2)
        t0 = time.perf_counter()
        texts = await asyncio.gather(*(send(p, new_tokens) for p in prompts))
        return time.perf_counter() - t0, list(texts)


def bench_peers(args, prompts: list[list[int]], k: int, new_tokens: int) -> dict:
    """pagedserve serve and vLLM's server, the same beam requests over HTTP (see the module
    docstring)."""
    import tempfile

    from compare import running_vllm, vllm_model_folder, vllm_preload
    from throughput import running_stack

    from services.common.ports import free_port

    http_port = free_port()
    with running_stack(args.model, args.dtype, ["--http-port", str(http_port)]):
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 120
        while True:  # (the router's HTTP port may open after its gRPC health)
            try:
                ours, our_texts = asyncio.run(http_beams(url, prompts, k, new_tokens))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)
    log_path = Path(tempfile.mkstemp(prefix="beam-vllm-", suffix=".log")[1])
    with running_vllm(args.vllm_python, vllm_model_folder(args.model), args.dtype,
                      threads_bind="0-1", kvcache_gib=2, max_model_len=2048, extra=[],
                      log_path=log_path, preload=vllm_preload(args.vllm_python)) as url:
        theirs, their_texts = asyncio.run(http_beams(url, prompts, k, new_tokens))
    decode = k * new_tokens * len(prompts)
    agree = sum(a == b for a, b in zip(our_texts, their_texts, strict=True))
    print(f"HTTP, {len(prompts)} beam requests (n {k}, {new_tokens} tokens): pagedserve "
          f"{decode / ours:.1f} tok/s ({ours:.1f} s), vLLM {decode / theirs:.1f} tok/s "
          f"({theirs:.1f} s), ratio {theirs / ours:.3f}; best hypotheses agree "
          f"{agree}/{len(prompts)}", flush=True)
    return {"pagedserve_seconds": ours, "vllm_seconds": theirs, "ratio": theirs / ours,
            "pagedserve_tok_s": decode / ours, "vllm_tok_s": decode / theirs,
            "best_text_agreement": agree, "vllm_log": str(log_path)}


def main() -> None:
    from compare import add_workload_args, cpu_info, workload

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_workload_args(p)
    p.add_argument("--num-prompts", type=int, default=16, help="prompts of the speed run")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens each hypothesis has")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="also time the beam requests over HTTP against vLLM's server")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    from services.common.tokenizer_loading import load_tokenizer
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    tokenizer = load_tokenizer(args.model)
    runner = ModelRunner(WorkerConfig(model=args.model, dtype=args.dtype))
    results: dict = {"cpu": cpu_info(), "dtype": args.dtype}
    bs = runner.block_size
    long_prompt = workload(tokenizer, 1, args.seed, prompt_range=(512, 512))[0].prompt_token_ids
    run_engine(runner, [beam("warm", long_prompt[:40], 2, 4)])  # compiled kernels
    _, _, beam_peak = run_engine(runner, [beam("b", long_prompt, 8, args.new_tokens)])
    _, _, greedy_peak = run_engine(
        runner, [greedy(f"g{i}", long_prompt, args.new_tokens) for i in range(8)],
        prefix_caching=False)
    prompt_blocks, decode_blocks = -(-512 // bs), -(-args.new_tokens // bs)
    results["blocks"] = {
        "beam_width_8_peak": beam_peak, "eight_greedy_peak": greedy_peak,
        "ratio": beam_peak / greedy_peak, "block_size": bs,
        "prompt_blocks": prompt_blocks, "decode_blocks_per_sequence": decode_blocks}
    print(f"peak KV blocks, 512-token prompt, {args.new_tokens} new tokens (block_size {bs}): "
          f"beam_width 8 {beam_peak}, 8 greedy requests without prefix caching {greedy_peak}, "
          f"ratio {beam_peak / greedy_peak:.3f} (prompt {prompt_blocks} + 8 x {decode_blocks} "
          f"= {prompt_blocks + 8 * decode_blocks} vs 8 x {prompt_blocks + decode_blocks} = "
          f"{8 * (prompt_blocks + decode_blocks)})", flush=True)

    prompts = [it.prompt_token_ids for it in workload(tokenizer, args.num_prompts, args.seed)]
    k, n = 4, args.new_tokens
    beam_s, beam_tokens, _ = run_engine(runner, [beam(f"b{i}", p, k, n)
                                                 for i, p in enumerate(prompts)])
    greedy_s, greedy_tokens, _ = run_engine(runner, [greedy(f"g{i}.{j}", p, n)
                                                     for i, p in enumerate(prompts)
                                                     for j in range(k)])
    decode = k * n * len(prompts)  # tokens each run decodes
    results["speed"] = {
        "num_prompts": len(prompts), "beam_width": k, "new_tokens": n,
        "beam_seconds": beam_s, "greedy_seconds": greedy_s,
        "beam_decode_tok_s": decode / beam_s, "greedy_decode_tok_s": decode / greedy_s,
        "ratio": greedy_s / beam_s, "beam_computed_tokens": beam_tokens,
        "greedy_computed_tokens": greedy_tokens}
    print(f"{len(prompts)} prompts, {n} new tokens: beam_width {k} {decode / beam_s:.1f} tok/s "
          f"({beam_s:.1f} s), {k} greedy continuations each {decode / greedy_s:.1f} tok/s "
          f"({greedy_s:.1f} s), ratio {greedy_s / beam_s:.3f}", flush=True)
    if args.vllm_python:
        results["http"] = bench_peers(args, prompts, k, n)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
