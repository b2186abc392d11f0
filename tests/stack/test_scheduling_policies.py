"""Priority scheduling and load shedding through the whole stack (tiny Llama, float32)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from pagedserve_client import Client

from tests.stack.conftest import _leak_check
from tests.stack.test_equivalence import kv_bytes_per_block
from tests.stack_harness import InProcessStack

PROMPT = [(7 * i) % 400 + 3 for i in range(100)]  # 100 tokens + 60 out = 10 blocks of 16


def wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def full_cache_stack(tiny_model_dir):
    """12 KV blocks: one 160-token request fills the cache, so the others must wait (no
    long-prefill cap: a waiting request needs blocks for its whole 100-token prompt)."""
    stack = InProcessStack(tiny_model_dir, worker_argv=[
        "--dtype", "float32", "--kv-cache-memory", str(12 * kv_bytes_per_block(tiny_model_dir))],
        scheduler_argv=["--scheduling-policy", "priority", "--max-model-len", "192",
                        "--max-num-batched-tokens", "256", "--max-num-waiting-requests", "3",
                        "--no-enable-prefix-caching", "--long-prefill-token-threshold", "0"]).start()
    yield stack
    stack.stop()


def test_later_high_priority_request_finishes_before_waiting_low_priority_ones(full_cache_stack):
    stack = full_cache_stack
    finished: list[str] = []
    lock = threading.Lock()

    def run(name: str, priority: int, max_tokens: int = 60):
        with Client(stack.address) as c:
            r = c.generate(prompt_token_ids=PROMPT, temperature=0, max_tokens=max_tokens,
                           ignore_eos=True, priority=priority)
        assert r.finish_reason == "length"
        with lock:
            finished.append(name)

    threads = [threading.Thread(target=run, args=("low-running", 5))]
    threads[0].start()
    wait_for(lambda: stack.stats().num_running == 1)
    for name in ("low-waiting-1", "low-waiting-2"):
        threads.append(threading.Thread(target=run, args=(name, 5)))
        threads[-1].start()
    wait_for(lambda: stack.stats().num_waiting == 2)
    threads.append(threading.Thread(target=run, args=("high-late", -3)))
    threads[-1].start()
    for t in threads:
        t.join(120)
    assert finished[:2] == ["low-running", "high-late"], finished
    assert sorted(finished[2:]) == ["low-waiting-1", "low-waiting-2"]
    _leak_check(stack)


def test_full_queue_answers_resource_exhausted_at_once(full_cache_stack):
    stack = full_cache_stack
    threads = []
    errors: list[grpc.StatusCode] = []

    def run(max_tokens: int):
        try:
            with Client(stack.address) as c:
                c.generate(prompt_token_ids=PROMPT, temperature=0, max_tokens=max_tokens,
                           ignore_eos=True)
        except grpc.RpcError as e:  # pragma: no cover - reported by the assertion below
            errors.append(e.code())

    threads.append(threading.Thread(target=run, args=(60,)))
    threads[0].start()
    wait_for(lambda: stack.stats().num_running == 1)
    for _ in range(3):  # --max-num-waiting-requests 3
        threads.append(threading.Thread(target=run, args=(4,)))
        threads[-1].start()
    wait_for(lambda: stack.stats().num_waiting == 3)
    rejected_before = stack.stats().num_rejected_total
    t0 = time.monotonic()
    with Client(stack.address) as c, pytest.raises(grpc.RpcError) as err:
        c.generate(prompt_token_ids=PROMPT, max_tokens=4)
    assert time.monotonic() - t0 < 5.0  # refused at once, not after the queue drained
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-num-waiting-requests 3" in err.value.details()
    assert stack.stats().num_rejected_total == rejected_before + 1
    for t in threads:
        t.join(120)
    assert errors == []  # every queued request was served
    with Client(stack.address) as c:  # and the server keeps serving
        assert c.generate(prompt_token_ids=PROMPT, max_tokens=2).usage.completion_tokens == 2
    _leak_check(stack)


# NOTE: 768 tokens: exactly 3 steps of the 256-token budget (so, uncapped, no step has room
# for the short request before the long prompt's first token), or 12 steps of 64.
LONG = [(11 * i) % 450 + 3 for i in range(768)]


def first_token_order(stack: InProcessStack) -> list[str]:
    """Submit a long prompt, then (once it runs, so while it is still prefilling) a short one;
    return the order in which the two got their first token."""
    order: list[str] = []
    lock = threading.Lock()

    def run(name: str, prompt: list[int]):
        with Client(stack.address) as c:
            for delta in c.stream(prompt_token_ids=prompt, temperature=0, max_tokens=2,
                                  ignore_eos=True):
                if delta.token_ids:
                    with lock:
                        order.append(name)
                    break
    threads = [threading.Thread(target=run, args=("long", LONG)),
               threading.Thread(target=run, args=("short", PROMPT[:8]))]
    threads[0].start()
    wait_for(lambda: stack.stats().num_running == 1, timeout=60)
    threads[1].start()
    for t in threads:
        t.join(120)
    return order


def test_long_prefill_threshold_lets_a_later_short_request_start_first(tiny):
    """The tiny stack runs --max-num-batched-tokens 256 and the default threshold (a quarter
    of it, 64 tokens): the long prompt is chunked in 64 tokens a step and the short request
    runs beside it."""
    assert first_token_order(tiny) == ["short", "long"]


def test_without_the_threshold_the_long_prefill_takes_every_step(tiny_model_dir):
    """The control: with the cap off, the earlier long prompt takes the whole budget until its
    prefill is done, and the short request waits for it."""
    stack = InProcessStack(tiny_model_dir, worker_argv=["--dtype", "float32"],
                           scheduler_argv=["--max-num-batched-tokens", "256",
                                           "--long-prefill-token-threshold", "0"]).start()
    try:
        assert first_token_order(stack) == ["long", "short"]
    finally:
        stack.stop()
