"""``--batch-invariant`` through the whole stack (tiny Llama, float32, compiled as by default):
a request's tokens and logprobs are bitwise the same sent alone and sent at once with 32
random others, greedy and seeded. The per-shape cases (chunk sizes, prefix hits, preemption,
bf16, eager) are tests/worker/test_batch_invariance.py's; this checks the flag reaches the
worker and holds with the scheduler's own step shapes."""

from __future__ import annotations

import random

import pytest
from pagedserve_client import Client

from tests.stack.conftest import _leak_check, generate_at_once
from tests.stack_harness import InProcessStack


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    s = InProcessStack(tiny_model_dir,
                       worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB",
                                    "--batch-invariant"],
                       scheduler_argv=["--max-num-batched-tokens", "256"]).start()
    yield s
    _leak_check(s)
    s.stop()


@pytest.mark.parametrize("sampling", [{"temperature": 0},
                                      {"temperature": 1.0, "seed": 77}],
                         ids=["greedy", "seeded"])
def test_a_request_alone_and_among_32_others_is_bitwise_the_same(stack, sampling):
    rng = random.Random(5)
    request = dict(prompt_token_ids=[rng.randrange(3, 500) for _ in range(90)], max_tokens=12,
                   ignore_eos=True, logprobs=4, **sampling)
    others = [dict(prompt_token_ids=[rng.randrange(3, 500) for _ in range(rng.randrange(5, 200))],
                   max_tokens=rng.randrange(4, 20), ignore_eos=True, temperature=1.0)
              for _ in range(32)]
    with Client(stack.address) as c:
        alone = c.generate(**request)
    # the others first, so the request's prompt shares its steps with their prefills and decodes
    among = generate_at_once(stack.address, [*others[:16], request, *others[16:]])[16]
    assert among.token_ids == alone.token_ids
    assert among.logprobs == alone.logprobs
