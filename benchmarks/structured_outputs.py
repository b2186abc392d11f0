"""The cost of structured outputs (issue 19): engine throughput with every request under a JSON
schema versus none, and grammar compile times for the acceptance tests' 5 schemas.

    .venv/bin/python benchmarks/structured_outputs.py                     # the fixed workload
    .venv/bin/python benchmarks/structured_outputs.py --num-requests 8 --json so.json  # smoke

Throughput: compare.py's workload (``compare.workload``: prompts of 32-512 tokens cut from
real text, 32-256 output tokens forced with ignore_eos, seed 0, greedy, SmolLM2-135M-Instruct)
through the engine in one process (Scheduler + ModelRunner, each step the sampling
rank's view ``StepInput.for_rank``, as the services send, as compare.py's (b)), once unconstrained and once with every
request under ``SCHEMA`` (compiled by the router's ``build_grammar``). A grammar that completes
before the request's output length allows only EOS from then on (ignore_eos keeps it going):
the report says how many output tokens were generated with the grammar still open ("live").
The goal is a ratio >= 0.9.

Compile times, per schema: the router's ``build_grammar`` (JSON Schema -> validated llguidance
grammar) cold and from its cache, and the worker's matcher creation cold (``LLMatcher`` over
the model's tokenizer, plus the first mask, where llguidance's lazy lexer does its work) and
cached (``deep_copy`` of the template matcher, plus the first mask), median of ``--repeat``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# Every request's schema in the throughput run: free strings, so a model can stay inside it.
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "keywords": {"type": "array", "items": {"type": "string"}},
    "summary": {"type": "string"}}, "required": ["title", "keywords", "summary"]}


def acceptance_schemas() -> dict[str, dict]:
    """The 5 schemas of tests/stack/test_structured_outputs.py."""
    from benchmarks.structured_output_schemas import SCHEMAS

    return SCHEMAS


def compile_times(schemas: dict[str, dict], lltok, repeat: int) -> dict[str, dict[str, float]]:
    """Per schema, milliseconds (medians): router cold / cached, worker cold / cached."""
    import llguidance

    from services.router.structured_output_grammar import GrammarCache, build_grammar

    def ms(fn) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    out = {}
    for name, schema in schemas.items():
        key = ("json", json.dumps(schema))
        grammar = build_grammar(*key)
        cache = GrammarCache()
        cache.compile(key)
        template = llguidance.LLMatcher(lltok, grammar, log_level=0)
        out[name] = {
            "router_cold_ms": ms(lambda k=key: build_grammar(*k)),
            "router_cached_ms": ms(lambda k=key, c=cache: c.compile(k)),
            "worker_cold_ms": ms(lambda g=grammar: llguidance.LLMatcher(
                lltok, g, log_level=0).compute_bitmask()),
            "worker_cached_ms": ms(lambda t=template: t.deep_copy().compute_bitmask()),
        }
    return out


def engine_run(runner, items, grammar: str) -> tuple[float, int, int]:
    """Output tokens/s of the workload through Scheduler + ModelRunner, every request with
    ``structured_output=grammar`` ("" = none); and (all output tokens, live ones: before each
    request's first EOS)."""
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.request import EngineSamplingParams, Request
    from services.scheduler.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_model_len=runner.max_model_len),
                          runner.num_kv_blocks, runner.eos_token_ids,
                          sliding_windows=[g.sliding_window for g in runner.kv_cache_groups])
    for i, it in enumerate(items):
        scheduler.add_request(Request(f"r{i}", list(it.prompt_token_ids), EngineSamplingParams(
            temperature=0, max_tokens=it.output_len, ignore_eos=True,
            structured_output=grammar)))
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        res = runner.execute_step(out.for_rank(samples=True))
        for u in scheduler.update_from_output(out, res):
            outputs.setdefault(u.request_id, []).extend(u.new_token_ids)
    elapsed = time.perf_counter() - t0
    total = sum(len(ids) for ids in outputs.values())
    assert total == sum(it.output_len for it in items), "a request ended early"
    eos = set(runner.eos_token_ids)
    live = sum(next((j for j, t in enumerate(ids) if t in eos), len(ids))
               for ids in outputs.values())
    return total / elapsed, total, live


def main() -> None:
    from compare import Item, add_workload_args, workload

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_workload_args(p, num_requests=128)
    p.add_argument("--repeat", type=int, default=5, help="timings per compile measurement")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    import llguidance.hf

    from services.common.tokenizer_loading import load_tokenizer
    from services.router.structured_output_grammar import build_grammar
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    tokenizer = load_tokenizer(args.model)
    runner = ModelRunner(WorkerConfig(model=args.model, dtype=args.dtype))
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=runner.vocab_size,
                                         eos_token=list(runner.eos_token_ids) or None)
    results: dict = {"compile": compile_times(acceptance_schemas(), lltok, args.repeat)}
    print(f"{'schema':10s} {'router cold':>12s} {'cached':>8s} {'worker cold':>12s} "
          f"{'cached':>8s}   (ms)")
    for name, t in results["compile"].items():
        print(f"{name:10s} {t['router_cold_ms']:12.2f} {t['router_cached_ms']:8.4f} "
              f"{t['worker_cold_ms']:12.2f} {t['worker_cached_ms']:8.2f}", flush=True)

    items = workload(tokenizer, args.num_requests, args.seed)
    grammar = build_grammar("json", json.dumps(SCHEMA))
    warm = [Item(items[0].prompt_token_ids[:8], 4)]
    for g in ("", grammar):  # warm-up: compiled kernels, the worker's llguidance tokenizer
        engine_run(runner, warm, g)
    free, total, _ = engine_run(runner, items, "")
    constrained, _, live = engine_run(runner, items, grammar)
    results["throughput"] = {"none_tok_s": free, "json_schema_tok_s": constrained,
                             "ratio": constrained / free, "output_tokens": total,
                             "live_tokens": live, "num_requests": len(items),
                             "dtype": args.dtype}
    print(f"engine, {len(items)} requests, {total} output tokens ({args.dtype}): "
          f"none {free:.1f} tok/s, JSON schema {constrained:.1f} tok/s, "
          f"ratio {constrained / free:.3f} (goal >= 0.9); {live} tokens "
          f"({live / total:.0%}) generated with the grammar open", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
