"""Speculative decoding through the whole stack: greedy token ids with it on equal
transformers' (and the stack's with it off) exactly at float32, for both proposers, alone and
in mixed batches, with stop strings, max_tokens inside an accepted run, prefix hits and
preemption; seeded sampling stays reproducible; no KV block leaks.

The prompts end by repeating the start of the model's own continuation, so prompt lookup
always finds drafts (a tiny random-weight Llama does not repeat itself, so they are rejected:
the rejection paths). The draft model is another tiny random-weight Llama with the same
vocabulary (drafts rejected too), or the target's own weights (every draft accepted: the
accepted-run paths); the metrics check which. Prompt lookup's accepted runs on real text are
the SmolLM2 case. SmolLM2 cases are in
test_spec_smollm2.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from pagedserve_client import Client

from tests.helpers import make_servable_tiny_llama
from tests.stack.conftest import _leak_check, generate_at_once, hf_greedy
from tests.stack_harness import InProcessStack

NEW_TOKENS = 40
NGRAM = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, '
         '"prompt_lookup_min": 1}')


def prompt_of(i: int, n: int = 12) -> list[int]:
    return [(i * 7919 + j * 104729) % 49000 + 100 for j in range(n)]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    """Base prompts followed by 16 tokens of the model's own greedy continuation and then its
    first 2-4 tokens again."""
    base = [prompt_of(i, 3 + 5 * i) for i in range(6)]
    cont = hf_greedy(tiny_model_dir, base, 16)
    return [b + c + c[:2 + i % 3] for i, (b, c) in enumerate(zip(base, cont, strict=True))]


def draft_config(folder: str, k: int = 3) -> str:
    return f'{{"method": "draft_model", "model": "{folder}", "num_speculative_tokens": {k}}}'


def spec_stack(model: str, spec: str, kv: str = "64MiB", sched=()) -> InProcessStack:
    return InProcessStack(model, worker_argv=[
        "--dtype", "float32", "--kv-cache-memory", kv, "--speculative-config", spec],
        scheduler_argv=["--max-num-batched-tokens", "256", "--speculative-config", spec,
                        *sched]).start()


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory) -> str:
    return make_servable_tiny_llama(tmp_path_factory.mktemp("draft-llama"), seed=11)


@pytest.fixture(scope="module", params=["ngram", "draft_model", "draft_model_same"])
def spec(request, tiny_model_dir, other_draft_dir):
    """A tiny stack with speculation on: prompt lookup, a draft model of other weights, or
    one of the target's own weights."""
    config = {"ngram": NGRAM, "draft_model": draft_config(other_draft_dir),
              "draft_model_same": draft_config(tiny_model_dir, 4)}[request.param]
    stack = spec_stack(tiny_model_dir, config)
    stack.accepts_all = request.param == "draft_model_same"
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def expected(tiny_model_dir, prompts):
    return hf_greedy(tiny_model_dir, prompts, NEW_TOKENS, ignore_eos=False)


def greedy(address: str, prompt: list[int], **kwargs):
    with Client(address) as c:
        return c.generate(prompt_token_ids=prompt, temperature=0,
                          **{"max_tokens": NEW_TOKENS, **kwargs})


def metric(stack: InProcessStack, name: str) -> float:
    port = stack.scheduler_args.metrics_port
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(f"pagedserve:{name}"))


def test_greedy_equals_transformers_alone_and_mixed(spec, expected, prompts):
    drafted = metric(spec, "spec_decode_num_draft_tokens_total")
    accepted = metric(spec, "spec_decode_num_accepted_tokens_total")
    assert greedy(spec.address, prompts[0]).choices[0].token_ids == expected[0]
    drafted = metric(spec, "spec_decode_num_draft_tokens_total") - drafted
    accepted = metric(spec, "spec_decode_num_accepted_tokens_total") - accepted
    assert drafted > 0, "nothing was drafted"
    if spec.accepts_all:  # (greedy drafts of the target's own weights)
        assert accepted == drafted

    def sampled(seed):
        with Client(spec.address) as c:
            return c.generate(prompt_token_ids=prompts[1], temperature=1.0, seed=seed,
                              max_tokens=NEW_TOKENS)
    with ThreadPoolExecutor(len(prompts) + 2) as pool:
        samples = [pool.submit(sampled, seed) for seed in (1, 2)]
        results = list(pool.map(lambda p: greedy(spec.address, p), prompts))
        for s in samples:  # the sampled requests beside them ran to their end too
            c = s.result().choices[0]
            assert c.usage.completion_tokens >= 1 and (
                c.finish_reason == "stop" or c.usage.completion_tokens == NEW_TOKENS), c
    assert [r.choices[0].token_ids for r in results] == expected
    _leak_check(spec)


def test_stop_strings_and_max_tokens_equal_speculation_off(spec, tiny, prompts):
    text = greedy(tiny.address, prompts[3]).choices[0].text
    stops = [text[len(text) // 3:len(text) // 3 + 3], text[-4:]]
    for kwargs in [{"max_tokens": n} for n in (1, 2, 3, 5, 7, 9)] + [
            {"stop": [s]} for s in stops] + [{"stop": stops, "include_stop_str_in_output": True}]:
        on, off = greedy(spec.address, prompts[3], **kwargs), greedy(tiny.address, prompts[3],
                                                                     **kwargs)
        a, b = on.choices[0], off.choices[0]
        assert (a.token_ids, a.text, a.finish_reason, a.usage.completion_tokens) == (
            b.token_ids, b.text, b.finish_reason, b.usage.completion_tokens), kwargs
    _leak_check(spec)


def test_prefix_hits_and_seeded_sampling(spec, expected, prompts):
    first = greedy(spec.address, prompts[5])
    again = greedy(spec.address, prompts[5])
    assert first.choices[0].token_ids == again.choices[0].token_ids == expected[5]
    assert again.choices[0].usage.num_cached_tokens > 0

    def seeded():
        with Client(spec.address) as c:
            return c.generate(prompt_token_ids=prompts[2], temperature=0.8, top_p=0.9, seed=7,
                              max_tokens=NEW_TOKENS).choices[0].token_ids
    assert seeded() == seeded()
    _leak_check(spec)


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def small_spec(request, tiny_model_dir, other_draft_dir):
    """A KV cache of 24 blocks of 16 tokens (the draft's layers share it): six requests of up
    to 98 tokens (7 blocks) at once preempt."""
    config = NGRAM if request.param == "ngram" else draft_config(tiny_model_dir)
    per_block = 12288 * (2 if request.param == "draft_model" else 1)
    stack = spec_stack(tiny_model_dir, config, kv=str(24 * per_block),
                       sched=["--max-model-len", "128", "--no-enable-prefix-caching"])
    yield stack
    stack.stop()


def test_preemption_equals_transformers(small_spec, tiny_model_dir):
    base = [prompt_of(20 + i, 4 + 3 * i) for i in range(6)]
    prompts = [b + c + c[:3] for b, c in zip(base, hf_greedy(tiny_model_dir, base, 16),
                                             strict=True)]
    want = hf_greedy(tiny_model_dir, prompts, 60)
    before = small_spec.stats().num_preemptions_total
    results = generate_at_once(small_spec.address, [
        dict(prompt_token_ids=p, temperature=0, max_tokens=60, ignore_eos=True)
        for p in prompts])
    assert [r.choices[0].token_ids for r in results] == want
    assert small_spec.stats().num_preemptions_total > before, "nothing was preempted"
    _leak_check(small_spec)
