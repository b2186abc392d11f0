"""cache_aware routing through the whole stack: 2 × (worker + scheduler, KV events on) behind
one router on the tiny model. Requests that share a prefix follow the replica whose KV events
say it holds it (and hit its cache there), and the router's predicted cached tokens equal the
replicas' reported ``num_cached_tokens`` when requests run one at a time.
"""

from __future__ import annotations

import random
import time

from pagedserve_client import Client

from tests.stack.test_metrics import get, scrape
from tests.stack_harness import MultiReplicaStack

BLOCK = 16
rng = random.Random(5)
EVENTS = ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}']


def tokens(n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def generate(address: str, prompt: list[int]):
    with Client(address) as c:
        r = c.generate(prompt_token_ids=prompt, temperature=0, max_tokens=4, ignore_eos=True)
    assert r.finish_reason == "length", r
    return r


def test_shared_prefixes_follow_the_replica_that_holds_them(tiny_model_dir):
    stack = MultiReplicaStack(
        tiny_model_dir, replicas=2, worker_argv=["--dtype", "float32", "--kv-cache-memory",
                                                 "32MiB"],
        scheduler_argv=["--max-num-batched-tokens", "256", *EVENTS],
        router_argv=["--http-port", "-1", "--routing-policy", "cache_aware"]).start()
    try:
        port = stack.router_args.metrics_port
        shared = [tokens(4 * BLOCK) for _ in range(3)]
        before = [stack.stats(i) for i in range(2)]
        for s in shared:  # each prefix is computed once, wherever it lands
            generate(stack.address, s + tokens(5))
        time.sleep(0.3)  # (the stored blocks' events reach the router)
        for s in shared:
            for _ in range(3):
                r = generate(stack.address, s + tokens(7))
                assert r.usage.num_cached_tokens >= 4 * BLOCK, r.usage
        after = [stack.wait_idle(i) for i in range(2)]
        hits = sum(a.prefix_cache_hits_total - b.prefix_cache_hits_total
                   for a, b in zip(after, before))
        assert hits >= 9 * 4 * BLOCK, hits
        m = scrape(port)
        predicted = sum(get(m, "pagedserve:router_predicted_cached_tokens_total", replica=a)
                        for a in stack.scheduler_addresses)
        reported = sum(get(m, "pagedserve:router_cached_tokens_total", replica=a)
                       for a in stack.scheduler_addresses)
        assert reported >= 9 * 4 * BLOCK
        assert predicted == reported, (predicted, reported)
    finally:
        stack.stop()
