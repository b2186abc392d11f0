"""Async scheduling (the scheduler builds step N+1 while step N runs; the worker keeps its own
sampled tokens) gives exactly the tokens of scheduling one step at a time, through the whole
stack, at float32: greedy output equals transformers' with preemption, stop token ids, stop
strings, max_tokens, n > 1, prefix-cache hits and aborts, with ``--async-scheduling`` (the
default) and ``--no-async-scheduling``. PP=2 runs async-off by design (tests/parallel)."""

from __future__ import annotations

import logging
import re
import random

import pytest

from pagedserve_client import Client
from tests.stack.conftest import _leak_check, generate_at_once, hf_greedy
from tests.stack.test_equivalence import kv_bytes_per_block
from tests.stack_harness import InProcessStack

MAX_NEW = 24
LENGTHS = [5, 9, 40, 300]


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    return prompts, hf_greedy(tiny_model_dir, prompts, MAX_NEW)


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module", params=["async", "no-async"])
def stack(request, tiny_model_dir):
    # 24 blocks of 16 tokens: the four prompts cannot all run at once (preemption).
    logger, seen = logging.getLogger("services.scheduler.server"), _Messages()
    level = logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.INFO)
    try:
        stack = InProcessStack(tiny_model_dir, worker_argv=[
            "--dtype", "float32", "--kv-cache-memory",
            str(24 * kv_bytes_per_block(tiny_model_dir))],
            scheduler_argv=["--max-num-batched-tokens", "512", "--max-model-len", "384",
                            f"--{request.param}-scheduling"]).start()
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    # the scheduler runs the mode asked for (2 steps in flight with look-ahead, or 1 without)
    want = ("scheduling: 2 steps in flight, async scheduling on" if request.param == "async"
            else "scheduling: 1 steps in flight, async scheduling off")
    assert want in seen.messages, seen.messages
    yield stack
    stack.stop()


@pytest.fixture
def tiny(stack):
    yield stack
    _leak_check(stack)


def _greedy_kw(ids: list[int], **kw) -> dict:
    return {"prompt_token_ids": ids, "temperature": 0, "max_tokens": MAX_NEW,
            "ignore_eos": True, **kw}


def _greedy(address: str, ids: list[int], **kw):
    with Client(address) as c:
        return c.generate(**_greedy_kw(ids, **kw))


def test_greedy_with_preemption_equals_transformers(tiny, expected):
    prompts, want = expected
    before = tiny.stats().num_preemptions_total
    got = [r.token_ids for r in generate_at_once(tiny.address, [_greedy_kw(p) for p in prompts])]
    assert got == want
    assert tiny.stats().num_preemptions_total > before


def test_stop_token_ids_and_max_tokens_end_where_they_should(tiny, expected):
    prompts, want = expected
    ids, full = prompts[1], want[1]
    stop = full[6]
    cut = full.index(stop) + 1
    r = _greedy(tiny.address, ids, stop_token_ids=[stop])
    assert (r.token_ids, r.finish_reason, r.stop_reason) == (full[:cut], "stop", stop)
    r = _greedy(tiny.address, ids, max_tokens=3)
    assert (r.token_ids, r.finish_reason, r.stop_reason) == (full[:3], "length", None)
    r = _greedy(tiny.address, ids, max_tokens=1)
    assert (r.token_ids, r.finish_reason) == (full[:1], "length")


def test_a_stop_string_cuts_the_text(tiny, expected):
    prompts, _ = expected
    full = _greedy(tiny.address, prompts[2])
    text = full.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    r = _greedy(tiny.address, prompts[2], stop=[stop])
    assert r.finish_reason == "stop" and r.text == text[:text.index(stop)]
    assert r.token_ids == full.token_ids[:len(r.token_ids)]


def test_greedy_choices_and_prefix_hits_repeat_the_tokens(tiny, expected):
    prompts, want = expected
    r = _greedy(tiny.address, prompts[2], n=3)
    assert [c.token_ids for c in r.choices] == [want[2]] * 3
    hits = tiny.stats().prefix_cache_hits_total
    assert _greedy(tiny.address, prompts[2]).token_ids == want[2]
    assert tiny.stats().prefix_cache_hits_total > hits


def test_aborted_streams_leave_the_rest_exact(tiny, expected):
    prompts, want = expected
    with Client(tiny.address) as c:
        for k in (1, 2, 5):
            for i, _delta in enumerate(c.stream(prompt_token_ids=prompts[3], temperature=0,
                                                max_tokens=MAX_NEW, ignore_eos=True)):
                if i + 1 == k:
                    break  # cancels the request
    assert _greedy(tiny.address, prompts[0]).token_ids == want[0]


REGEX = r"[a-z]{2,6}( [a-z]{2,6}){2,5}"  # at most 41 characters: a random model finishes it


def _constrained_kw(ids: list[int], seed: int) -> dict:
    return {"prompt_token_ids": ids, "temperature": 1.0, "seed": seed, "max_tokens": 64,
            "n": 2, "structured_outputs": {"regex": REGEX}}


def _constrained(address: str, ids: list[int], seed: int):
    with Client(address) as c:
        return c.generate(**_constrained_kw(ids, seed))


def test_structured_outputs_survive_preemption_and_look_ahead(tiny, expected):
    """Sampled under a grammar (n=2), the four prompts give exactly the same valid texts one
    at a time and all at once beside the four greedy ones that preempt (the worker rebuilds a
    resumed request's matcher from its outputs; with async scheduling each token must be
    consumed before the next step's mask)."""
    prompts, want = expected
    alone = [_constrained(tiny.address, p, 2 * i) for i, p in enumerate(prompts)]
    before = tiny.stats().num_preemptions_total
    results = generate_at_once(tiny.address, [_greedy_kw(p) for p in prompts]
                               + [_constrained_kw(p, 2 * i) for i, p in enumerate(prompts)])
    greedy = [r.token_ids for r in results[:len(prompts)]]
    together = results[len(prompts):]
    assert tiny.stats().num_preemptions_total > before
    assert greedy == want
    with Client(tiny.address) as c:
        for a, b in zip(alone, together, strict=True):
            for x, y in zip(a.choices, b.choices, strict=True):
                # the output's own text (a random prompt may end in half a UTF-8 character,
                # which the choice's text completes)
                text = c.detokenize(x.token_ids)
                assert re.fullmatch(REGEX, text) and x.finish_reason == "stop", text
                assert (y.text, y.token_ids) == (x.text, x.token_ids)
