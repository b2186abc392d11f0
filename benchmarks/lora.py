"""Multi-LoRA on the workload (issue 35): the base model alone, the same traffic spread over N
adapters in one stack (batched together each step), and each adapter as its own stack.

    .venv/bin/python benchmarks/lora.py --num-requests 64 --adapters 4 --rank 8

The requests are ``compare.py``'s workload (prompts 32-512 tokens, outputs 32-256 forced with
``ignore_eos``, greedy, seed 0) on SmolLM2 at ``--dtype`` (float32 unless told), every
request in flight at once through the router's gRPC API:

- (a) base: ``pagedserve serve``, every request on the base model;
- (b) mixed: ``serve --enable-lora --max-loras N --lora-modules a0=... aN-1=...``, request i
  on adapter ``i % N`` (random PEFT adapters of rank ``--rank`` on q/k/v/o/gate/up/down,
  made here with ``peft``), so every step mixes the N adapters;
- (c) separate: one ``serve --enable-lora`` per adapter, run one after the other, each with
  that adapter's share of the requests; its figure is all their output tokens over the sum of
  their wall times (N stacks sharing the machine's cores by taking turns).

Prints output tokens/s of each and the ratios (b)/(a) and (b)/(c); issue 35's goal is
(b)/(a) >= 0.8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def make_adapters(model_folder: str, out: Path, n: int, rank: int) -> list[str]:
    """``n`` random PEFT adapters (``tiny_models.make_peft_lora``) of the model in
    ``model_folder``, written under ``out``; returns their folders."""
    from benchmarks.tiny_models import make_peft_lora

    return [make_peft_lora(model_folder, out / f"a{i}", r=rank, seed=i) for i in range(n)]


async def _drive(address: str, items, models: list[str]) -> tuple[int, float]:
    """Every item at once through gRPC, item i on ``models[i % len(models)]`` ("" = base);
    returns (output tokens, wall seconds) after a short warm-up per model."""
    from pagedserve_client import AsyncClient

    async with AsyncClient(address) as client:
        for m in set(models):  # warm-up: each adapter loaded once
            await client.generate(prompt_token_ids=items[0].prompt_token_ids[:8], max_tokens=2,
                                  temperature=0, model=m)

        async def one(i: int, it) -> int:
            r = await client.generate(prompt_token_ids=it.prompt_token_ids,
                                      max_tokens=it.output_len, ignore_eos=True,
                                      temperature=0, model=models[i % len(models)])
            assert r.usage.completion_tokens == it.output_len
            return r.usage.completion_tokens

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))
        return sum(counts), time.perf_counter() - t0


def run(model: str | None, dtype: str, flags: list[str], items, models: list[str]
        ) -> tuple[int, float]:
    """One stack with ``flags``, driven as ``_drive``."""
    from throughput import running_stack

    with running_stack(model, dtype, flags) as address:
        return asyncio.run(_drive(address, items, models))


def main() -> None:
    from compare import add_workload_args, cpu_info, vllm_model_folder, workload
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p, num_requests=64)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--skip-separate", action="store_true", help="skip (c)")
    a = p.parse_args()
    folder = vllm_model_folder(a.model)  # converted safetensors + tokenizer
    items = workload(AutoTokenizer.from_pretrained(folder), a.num_requests, a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(folder, Path(tmp), a.adapters, a.rank)
        names = [f"a{i}" for i in range(a.adapters)]
        lora = ["--enable-lora", "--max-lora-rank", str(a.rank)]
        base_tok, base_s = run(folder, a.dtype, [], items, [""])
        print(f"(a) base           : {base_tok / base_s:8.1f} output tok/s", flush=True)
        modules = [f"{n}={path}" for n, path in zip(names, paths, strict=True)]
        mixed_tok, mixed_s = run(folder, a.dtype, [*lora, "--max-loras", str(a.adapters),
                                                   "--lora-modules", *modules], items, names)
        print(f"(b) {a.adapters} adapters mixed: {mixed_tok / mixed_s:8.1f} output tok/s",
              flush=True)
        separate = [] if a.skip_separate else list(zip(names, modules, strict=True))
        sep_tok = sep_s = 0.0
        for i, (name, module) in enumerate(separate):
            share = items[i::a.adapters]
            tok, s = run(folder, a.dtype, [*lora, "--max-loras", "1", "--lora-modules", module],
                         share, [name])
            sep_tok, sep_s = sep_tok + tok, sep_s + s
        if separate:
            print(f"(c) {a.adapters} stacks, one each: {sep_tok / sep_s:8.1f} output tok/s",
                  flush=True)
    result = {"cpu": cpu_info(), "dtype": a.dtype, "num_requests": a.num_requests,
              "adapters": a.adapters, "rank": a.rank, "base_tok_s": base_tok / base_s,
              "mixed_tok_s": mixed_tok / mixed_s,
              "separate_tok_s": sep_tok / sep_s if separate else None}
    print(f"mixed / base = {result['mixed_tok_s'] / result['base_tok_s']:.2f}x"
          + (f", mixed / separate = {result['mixed_tok_s'] / sep_tok * sep_s:.2f}x"
             if separate else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
