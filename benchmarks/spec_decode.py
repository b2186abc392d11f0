"""Speculative decoding (issue 21): n-gram prompt lookup against plain decoding, in one run.

    .venv/bin/python benchmarks/spec_decode.py                  # the fixed workloads
    .venv/bin/python benchmarks/spec_decode.py --new-tokens 16 --quick    # smoke

Everything runs through the engine in one process (Scheduler + ModelRunner, each step the
sampling rank's view of the scheduler's step, ``StepInput.for_rank``, as the services send), SmolLM2-135M-Instruct float32, one
model runner for every mode (its ngram proposer only runs when a step asks for drafts), the
scheduler without async scheduling in every mode (speculation turns it off; the off mode runs
the same loop, so the ratio is the mechanism's). Modes:

- ``off``: no speculation;
- ``ngram``: ``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
  "prompt_lookup_min": 2}`` with the default ``disable_by_batch_size``;
- ``ngram-always``: the same with speculation at every batch size (the rule's cost model).

Workloads (greedy, chat template, ``--new-tokens`` each unless EOS):

- ``repeat``: repetitive requests — "repeat this paragraph with the names changed" and "this
  code with a small edit" (the model copies most of its prompt: prompt lookup's case) — at
  batch 1 (one after another), 8 and 64 (all at once; 64 = the 8 prompts x 8, so the prefix
  cache shares their prompts as a real burst of similar requests would);
- ``mixed``: compare.py's workload (32 requests of real text, prompts 32-512 tokens, outputs
  32-256 tokens), all at once — where speculation must not cost more than 5 %.

Reported per (workload, mode): output tokens/s over the run's wall time, mean ITL (per
request: (last token time - first token time) / (tokens - 1), averaged), the acceptance rate
(accepted / drafted) and tokens per step of a request that verified drafts. Modes alternate
(off, ngram, off, ngram, ...) and each figure is the best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PARAGRAPH = (
    "Alice met Bob at the station in the morning. Alice gave Bob a letter from her sister, and "
    "Bob read it twice before he put it in his coat. Then Alice and Bob walked to the market, "
    "where Alice bought apples and Bob bought bread. In the evening Bob wrote back to Alice's "
    "sister and thanked her for the news.")
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discount"):
            price = price - price * item["discount"]
        total = total + price
    total = total + total * tax_rate
    return round(total, 2)
'''
REQUESTS = [
    f"Repeat this paragraph exactly, but change the name Alice to Carol:\n\n{PARAGRAPH}",
    f"Repeat this paragraph exactly, but change the name Bob to David:\n\n{PARAGRAPH}",
    f"Rewrite this paragraph word for word, replacing Alice with Emma and Bob with Frank:"
    f"\n\n{PARAGRAPH}",
    f"Copy this paragraph, changing only 'station' to 'airport':\n\n{PARAGRAPH}",
    f"Rename the variable total to subtotal in this Python function and print it again:\n\n"
    f"```python\n{CODE}```",
    f"Rename the function total_price to order_total and show the whole code:\n\n"
    f"```python\n{CODE}```",
    f"Add a docstring to this function and show the whole code:\n\n```python\n{CODE}```",
    f"Change tax_rate to vat_rate everywhere in this code and repeat it:\n\n"
    f"```python\n{CODE}```",
]


def spec_config(mode: str, k: int):
    from services.common.spec_decode_config import SpeculativeConfig

    if mode == "off":
        return None
    return SpeculativeConfig("ngram", k, 4, 2,
                             **({"disable_by_batch_size": 1 << 30} if mode == "ngram-always"
                                else {}))


def run_engine(runner, prompts: list[list[int]], max_tokens: list[int], spec,
               batch: int) -> dict:
    """Run ``prompts`` in waves of ``batch`` (all at once for batch >= len); returns the
    figures of the module docstring."""
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.request import EngineSamplingParams, Request
    from services.scheduler.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_model_len=runner.max_model_len,
                                          max_num_batched_tokens=2048, speculative=spec),
                          runner.num_kv_blocks, runner.eos_token_ids,
                          sliding_windows=[g.sliding_window for g in runner.kv_cache_groups],
                          vocab_size=runner.vocab_size)
    times: dict[str, list[float]] = {}
    num_steps = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        for i in range(start, min(start + batch, len(prompts))):
            scheduler.add_request(Request(f"r{i}", list(prompts[i]), EngineSamplingParams(
                temperature=0.0, max_tokens=max_tokens[i])))
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            res = runner.execute_step(out.for_rank(samples=True))
            now = time.perf_counter()
            num_steps += 1
            for u in scheduler.update_from_output(out, res):
                times.setdefault(u.request_id, []).extend([now] * len(u.new_token_ids))
    elapsed = time.perf_counter() - t0
    runner.execute_step(scheduler.schedule().for_rank(samples=True))  # (drop the finished)
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    tokens = sum(len(t) for t in times.values())
    itls = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    stats = scheduler.spec_stats
    return {"seconds": elapsed, "tokens": tokens, "tok_s": tokens / elapsed,
            "itl_ms": 1000 * sum(itls) / len(itls), "steps": num_steps,
            "acceptance": (stats.num_accepted_tokens / stats.num_draft_tokens
                           if stats.num_draft_tokens else 0.0),
            "drafted": stats.num_draft_tokens,
            "tokens_per_verify": (1 + stats.num_accepted_tokens / stats.num_drafts
                                  if stats.num_drafts else 1.0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mixed-requests", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="batch 1 and 8 of two prompts only")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()

    import torch
    from compare import workload

    from services.common.spec_decode_config import SpeculativeConfig
    from services.router.tokenizer import load_tokenizer
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    torch.set_num_threads(2)
    tok = load_tokenizer(args.model)
    repeat = [list(tok.apply_chat_template([{"role": "user", "content": r}], tokenize=True,
                                           add_generation_prompt=True,
                                           return_dict=True)["input_ids"]) for r in REQUESTS]
    if args.quick:
        repeat = repeat[:2]
    runner = ModelRunner(WorkerConfig(model=args.model, dtype="float32", device="cpu",
                                      kv_cache_memory=2 << 30, max_num_seqs=256,
                                      speculative=SpeculativeConfig("ngram", args.k, 4, 2)))
    cases = [("repeat", 1, repeat), ("repeat", 8, repeat)]
    if not args.quick:
        cases.append(("repeat", 64, repeat * 8))
        items = workload(tok, args.mixed_requests, 0)
        cases.append(("mixed", len(items), [it.prompt_token_ids for it in items]))
    results = []
    for name, batch, prompts in cases:
        if name == "mixed":
            max_tokens = [it.output_len for it in items]
        else:
            max_tokens = [args.new_tokens] * len(prompts)
        modes = ["off", "ngram"] + (["ngram-always"] if batch > 1 and name == "repeat" else [])
        best: dict[str, dict] = {}
        run_engine(runner, prompts[:1], [8], None, 1)  # warm-up
        for _ in range(args.repeats):
            for mode in modes:
                r = run_engine(runner, prompts, max_tokens, spec_config(mode, args.k), batch)
                if mode not in best or r["tok_s"] > best[mode]["tok_s"]:
                    best[mode] = r
        for mode in modes:
            r = best[mode]
            r.update(workload=name, batch=batch, mode=mode,
                     speedup=r["tok_s"] / best["off"]["tok_s"],
                     itl_ratio=r["itl_ms"] / best["off"]["itl_ms"])
            results.append(r)
            print(f"{name:7s} batch {batch:3d} {mode:13s} {r['tok_s']:7.1f} tok/s "
                  f"({r['speedup']:.2f}x)  ITL {r['itl_ms']:6.1f} ms ({r['itl_ratio']:.2f}x)  "
                  f"acceptance {r['acceptance']:.2f}  tokens/verify "
                  f"{r['tokens_per_verify']:.2f}  {r['tokens']} tokens in {r['steps']} steps, "
                  f"{r['drafted']} drafted",
                  flush=True)
    print(f"CPU: {platform.processor() or platform.machine()}, torch threads "
          f"{torch.get_num_threads()}, {torch.backends.cpu.get_cpu_capability()}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
