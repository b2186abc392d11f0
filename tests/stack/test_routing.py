"""Routing across scheduler replicas through the whole stack: 2 × (worker + scheduler) behind
one router on the tiny model.

prefix_affinity sends requests that share a prefix to one replica, where they hit its prefix
cache (and the other replica sees no hit); unrelated prompts spread over both; the n choices of
one request run on one replica (under round_robin too); after one replica's scheduler stops,
every new request succeeds on the other, and the router stops serving only when none is left.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve_client import Client

from tests.stack_harness import MultiReplicaStack

BLOCK = 16
MAX_NEW = 4
rng = random.Random(11)
SHARED = [rng.randrange(3, 500) for _ in range(3 * BLOCK)]  # 3 full blocks
WORKER = ["--dtype", "float32", "--kv-cache-memory", "32MiB"]
SCHEDULER = ["--max-num-batched-tokens", "256"]


def random_prompt(length: int = 2 * BLOCK + 3) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(length)]


def generate(address: str, prompt: list[int], **kwargs):
    with Client(address) as c:
        r = c.generate(prompt_token_ids=prompt, temperature=0, max_tokens=MAX_NEW,
                       ignore_eos=True, **kwargs)
    assert r.finish_reason == "length", r
    return r


def router_health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=5).status


def make_stack(model_dir, policy: str) -> MultiReplicaStack:
    return MultiReplicaStack(model_dir, replicas=2, worker_argv=WORKER,
                             scheduler_argv=SCHEDULER,
                             router_argv=["--http-port", "-1", "--routing-policy", policy]
                             ).start()


@pytest.fixture(scope="module")
def affinity(tiny_model_dir):
    stack = make_stack(tiny_model_dir, "prefix_affinity")
    yield stack
    stack.stop()


def test_a_shared_prefix_lands_on_one_replica_and_hits_its_cache(affinity):
    before = [affinity.stats(i) for i in range(2)]
    generate(affinity.address, SHARED + [7, 8, 9])  # fills the cache of the prefix's replica
    hits = [generate(affinity.address, SHARED + random_prompt(5 + i)) for i in range(4)]
    assert all(r.usage.num_cached_tokens >= 3 * BLOCK for r in hits)
    after = [affinity.wait_idle(i) for i in range(2)]
    gained = [after[i].prefix_cache_hits_total - before[i].prefix_cache_hits_total
              for i in range(2)]
    assert sorted(gained) == [0, 4 * 3 * BLOCK], gained  # all on one replica, none on the other


def test_unrelated_prompts_spread_over_both_replicas(affinity):
    before = [affinity.stats(i) for i in range(2)]
    prompts = [random_prompt() for _ in range(12)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: generate(affinity.address, p), prompts))
    after = [affinity.wait_idle(i) for i in range(2)]
    for b, a in zip(before, after):
        assert a.num_steps_total > b.num_steps_total
        assert a.prefix_cache_queries_total > b.prefix_cache_queries_total


def check_choices_run_on_one_replica(stack: MultiReplicaStack) -> None:
    """Three n=3 requests: each one's 3 prompt lookups all on one replica, never split."""
    before = [stack.stats(i) for i in range(2)]
    for _ in range(3):
        with Client(stack.address) as c:
            r = c.generate(prompt_token_ids=random_prompt(), n=3, seed=1, max_tokens=MAX_NEW,
                           ignore_eos=True)
        assert len(r.choices) == 3
    after = [stack.wait_idle(i) for i in range(2)]
    queries = [a.prefix_cache_queries_total - b.prefix_cache_queries_total
               for a, b in zip(after, before)]
    per_request = 3 * (2 * BLOCK + 3)
    assert sum(queries) == 3 * per_request, queries
    assert all(q % per_request == 0 for q in queries), queries  # never split


def test_the_choices_of_one_request_run_on_one_replica(affinity):
    check_choices_run_on_one_replica(affinity)


def test_requests_after_a_replica_stops_all_succeed_on_the_other(tiny_model_dir):
    stack = make_stack(tiny_model_dir, "round_robin")
    try:
        for p in (random_prompt() for _ in range(4)):  # both replicas serve
            generate(stack.address, p)
        assert all(stack.wait_idle(i).num_steps_total > 0 for i in range(2))
        check_choices_run_on_one_replica(stack)  # round_robin would split them otherwise
        stack.stop_replica(0)
        # NOTE: the router learns of the broken stream from gRPC a moment after the
        # scheduler's server stopped.
        time.sleep(0.5)
        survivor_before = stack.stats(1).num_steps_total
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: generate(stack.address, p),
                                    [random_prompt() for _ in range(8)]))
        assert len(results) == 8
        assert stack.wait_idle(1).num_steps_total > survivor_before
        assert router_health(stack.address) == health_pb2.HealthCheckResponse.SERVING
        stack.stop_replica(1)  # none left: the router stops serving
        deadline = time.monotonic() + 10
        while (router_health(stack.address) == health_pb2.HealthCheckResponse.SERVING
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert router_health(stack.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        stack.stop()
