"""Routing policies over 3 scheduler replicas on a multi-turn workload over 16 shared system
prompts: round_robin, prefix_affinity and cache_aware against one replica.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/cache_aware_routing.py [--quick] \\
        [--model PATH] [--replicas 3 --num-systems 16 --conversations-per-system 3 --turns 3 \\
         --system-len 256 --user-len 32 --output-len 16 --concurrency 6 --json out.json]

The workload is ``multi_turn.py``'s: ``--num-systems`` system prompts of ``--system-len``
tokens of real text, ``--conversations-per-system`` conversations on each (conversation c
starts with system prompt c mod num_systems), each of ``--turns`` turns that resend the whole
transcript (system, user messages, the model's answers) plus a new user message; turn 1 of
every conversation, then turn 2, ..., each turn's conversations in a random order (``--seed``;
the same in every run: a fixed order would line round_robin's cycle up with the conversations
or against them), ``--concurrency`` requests in flight, greedy, ``--output-len`` tokens
(ignore_eos). Every run gets a fresh stack of ``--replicas`` x (worker
+ scheduler, KV events on: ``--kv-events-config``) behind one router with the policy under test
(``MultiReplicaStack``), and the single-replica baseline one worker + scheduler; each worker's
KV pool (``--kv-cache-memory``) holds the whole working set, so no policy loses blocks to
eviction.

Prints per run: the prefix hit rate (sum of the replicas' reported ``num_cached_tokens`` over
the sum of prompt tokens), TTFT p50 / p90 (to the first streamed token), wall time; for
cache_aware the router's predicted cached tokens against the replicas' reported ones
(``pagedserve:router_predicted_cached_tokens_total`` / ``..._cached_tokens_total``); then the
acceptance checks of issue 55: cache_aware's hit rate >= 90 % of one replica's, its TTFT p50
<= 0.5 x round_robin's and <= prefix_affinity's, prediction within 5 % of the reports.

``--kv-events-config ''`` starts the schedulers without KV events: cache_aware then routes as
prefix_affinity (and predicts nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import multi_turn
from stack_harness import MultiReplicaStack

POLICIES = ("round_robin", "prefix_affinity", "cache_aware")
EVENTS = '{"enable_kv_cache_events": true, "publisher": "null"}'


def router_counters(port: int) -> dict[str, float]:
    """The router's predicted and reported cached tokens (summed over replicas)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {"predicted": 0.0, "reported": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pagedserve:router_predicted_cached_tokens_total":
                out["predicted"] += s.value
            elif s.name == "pagedserve:router_cached_tokens_total":
                out["reported"] += s.value
    return out


async def drive(address: str, a, systems, users) -> dict:
    """Every conversation turn by turn (``multi_turn.drive``), each turn's conversations in the
    seeded random order, ``a.concurrency`` requests in flight. Returns the per-request records
    and the wall time."""
    rng = random.Random(a.seed)
    order = []
    for t in range(a.turns):
        convs = list(range(len(users)))
        rng.shuffle(convs)
        order += [(t, c) for c in convs]
    return await multi_turn.drive(address, a, systems, users, order)


def run(a, policy: str, replicas: int, max_len: int, systems, users) -> dict:
    """One stack with ``replicas`` replicas routed by ``policy`` through the whole workload."""
    worker = ["--dtype", a.dtype, "--kv-cache-memory", a.kv_cache_memory,
              "--max-model-len", str(max_len)]
    scheduler = ["--max-model-len", str(max_len)]
    if a.kv_events_config:
        scheduler += ["--kv-events-config", a.kv_events_config]
    stack = MultiReplicaStack(a.model, replicas=replicas, worker_argv=worker,
                              scheduler_argv=scheduler,
                              router_argv=["--http-port", "-1", "--routing-policy", policy]
                              ).start()
    try:
        r = asyncio.run(drive(stack.address, a, systems, users))
        stats = [stack.wait_idle(i) for i in range(replicas)]
        counters = router_counters(stack.router_args.metrics_port)
    finally:
        stack.stop()
    recs = r["records"]
    ttfts = sorted(x["ttft_s"] for x in recs)
    prompt = sum(x["prompt_tokens"] for x in recs)
    cached = sum(x["cached_tokens"] for x in recs)
    return {"policy": policy, "replicas": replicas, "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": cached / prompt,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))], "wall_s": r["wall_s"],
            "predicted_cached_tokens": counters["predicted"],
            "reported_cached_tokens": counters["reported"],
            "steps_per_replica": [s.num_steps_total for s in stats],
            "preemptions": sum(s.num_preemptions_total for s in stats)}


def checks(runs: dict) -> list[tuple[str, bool]]:
    """Issue 55's acceptance checks on the runs' figures."""
    ca, one = runs["cache_aware"], runs["single"]
    out = [(f"hit rate {ca['hit_rate']:.3f} >= 0.9 x single replica's {one['hit_rate']:.3f}",
            ca["hit_rate"] >= 0.9 * one["hit_rate"])]
    if "round_robin" in runs:
        rr = runs["round_robin"]["ttft_p50_s"]
        out.append((f"TTFT p50 {ca['ttft_p50_s']:.3f} s <= 0.5 x round_robin's {rr:.3f} s",
                    ca["ttft_p50_s"] <= 0.5 * rr))
    if "prefix_affinity" in runs:
        pa = runs["prefix_affinity"]["ttft_p50_s"]
        out.append((f"TTFT p50 {ca['ttft_p50_s']:.3f} s <= prefix_affinity's {pa:.3f} s",
                    ca["ttft_p50_s"] <= pa))
    pred, rep = ca["predicted_cached_tokens"], ca["reported_cached_tokens"]
    out.append((f"predicted {pred:.0f} cached tokens within 5 % of the reported {rep:.0f}",
                rep > 0 and abs(pred - rep) <= 0.05 * rep))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="folder, .gguf or packaged name (default: packaged SmolLM2)")
    p.add_argument("--quick", action="store_true",
                   help="a smaller workload (2 conversations per system, 2 turns, 128-token "
                        "system prompts) for a smoke run")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated policies to run (cache_aware is always run)")
    p.add_argument("--num-systems", type=int, default=16)
    p.add_argument("--conversations-per-system", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=32, help="shortest user message (tokens)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--seed", type=int, default=0, help="the turns' conversation order")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--kv-cache-memory", default="1GiB", help="each worker's KV pool")
    p.add_argument("--kv-events-config", default=EVENTS,
                   help="the schedulers' --kv-events-config ('' for none: events off)")
    p.add_argument("--json", default=None, help="write the figures as JSON here")
    a = p.parse_args()
    if a.quick:
        a.conversations_per_system, a.turns, a.system_len = 2, 2, 128
    a.num_conversations = a.num_systems * a.conversations_per_system

    from services.router.tokenizer import load_tokenizer

    systems, users = multi_turn.texts(load_tokenizer(a.model), a)
    longest = max(len(systems[c % len(systems)]) + sum(len(u) for u in users[c])
                  + (a.turns - 1) * a.output_len for c in range(len(users)))
    max_len = longest + a.output_len + 16
    print(f"model {a.model or 'SmolLM2-135M-Instruct'}: {a.num_conversations} conversations "
          f"x {a.turns} turns over {a.num_systems} system prompts of {a.system_len} tokens; "
          f"{a.replicas} replicas, concurrency {a.concurrency}; KV events "
          f"{'on' if a.kv_events_config else 'off'}", flush=True)
    policies = [x for x in a.policies.split(",") if x and x != "cache_aware"] + ["cache_aware"]
    runs = {}
    for name, policy, replicas in [("single", "round_robin", 1),
                                   *((x, x, a.replicas) for x in policies)]:
        r = runs[name] = run(a, policy, replicas, max_len, systems, users)
        extra = (f"  predicted {r['predicted_cached_tokens']:.0f} / reported "
                 f"{r['reported_cached_tokens']:.0f} cached tokens"
                 if policy == "cache_aware" else "")
        print(f"{name:16s} hit rate {r['hit_rate']:.3f} ({r['cached_tokens']} of "
              f"{r['prompt_tokens']} prompt tokens)  TTFT p50 {r['ttft_p50_s']:.3f} s p90 "
              f"{r['ttft_p90_s']:.3f} s  wall {r['wall_s']:.1f} s  steps "
              f"{r['steps_per_replica']}{extra}", flush=True)
    results = checks(runs)
    for text, ok in results:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    if a.json:
        Path(a.json).write_text(json.dumps(
            {"args": vars(a), "checks": [{"check": t, "pass": ok} for t, ok in results],
             "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
