"""Beam search through the whole stack equals transformers' ``generate(num_beams=k)``.

Token ids and scores are read with the gRPC SDK (``Choice.token_ids`` / ``beam_score``); the
OpenAI routes are checked against them. The tiny stack runs with prefix caching on; a second
stack runs with prefix caching off and a KV cache small enough that beam groups are preempted,
on a tiny model whose EOS is a token it likes (so hypotheses finish early and the stop rules
matter). SmolLM2 cases are in test_smollm2.py (its stack is started once there).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from itertools import product
from pathlib import Path

import pytest
import requests
import torch
from pagedserve_client import Client

from tests.helpers import hf_beam_search, make_servable_tiny_llama
from tests.stack.conftest import _leak_check, generate_at_once, hf_greedy
from tests.stack_harness import InProcessStack

NEW_TOKENS = 32
CASES = list(product((2, 4, 8), (0.5, 1.0, 2.0), ("true", "false")))
HF_EARLY = {"true": True, "false": False, "never": "never"}


def prompt_of(i: int, n: int = 11) -> list[int]:
    return [(i * 7919 + j * 104729) % 49000 + 100 for j in range(n)]


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def beam_kw(prompt: list[int], k: int, length_penalty: float = 1.0,
            early_stopping: str = "false", n: int | None = None,
            max_tokens: int = NEW_TOKENS) -> dict:
    return {"prompt_token_ids": prompt, "use_beam_search": True, "n": n or k, "beam_width": k,
            "length_penalty": length_penalty, "early_stopping": HF_EARLY[early_stopping],
            "max_tokens": max_tokens}


def beam_search(address: str, prompt: list[int], k: int, *args, **kwargs):
    with Client(address) as c:
        return c.generate(**beam_kw(prompt, k, *args, **kwargs))


def assert_equal(result, expected, eos: int = 2) -> None:
    """The SDK result's choices equal transformers' hypotheses: ids exactly, scores 1e-4."""
    assert [c.token_ids for c in result.choices] == [ids for ids, _ in expected]
    for c, (ids, score) in zip(result.choices, expected, strict=True):
        assert abs(c.beam_score - score) < 1e-4, (c.beam_score, score)
        assert c.finish_reason == ("stop" if ids[-1] == eos else "length")
        assert c.usage.completion_tokens == len(ids)


def test_beam_search_alone_and_mixed_with_greedy(tiny, hf_tiny, tiny_model_dir):
    """Every (k, length_penalty, early_stopping) case, first one alone, then all at once
    beside greedy requests; equal to transformers either way."""
    expected = {case: hf_beam_search(hf_tiny, prompt_of(i), case[0], case[0], NEW_TOKENS,
                                     case[1], HF_EARLY[case[2]])
                for i, case in enumerate(CASES)}
    assert_equal(beam_search(tiny.address, prompt_of(0), *CASES[0]), expected[CASES[0]])
    greedy_prompts = [prompt_of(100 + i, 5 + 7 * i) for i in range(4)]
    greedy_expected = hf_greedy(tiny_model_dir, greedy_prompts, NEW_TOKENS, ignore_eos=False)

    def greedy(prompt):
        with Client(tiny.address) as c:
            return c.generate(prompt_token_ids=prompt, temperature=0, max_tokens=NEW_TOKENS)
    with ThreadPoolExecutor(len(CASES) + len(greedy_prompts)) as pool:
        beams = [pool.submit(beam_search, tiny.address, prompt_of(i), *case)
                 for i, case in enumerate(CASES)]
        greedies = list(pool.map(greedy, greedy_prompts))
        for case, future in zip(CASES, beams, strict=True):
            assert_equal(future.result(), expected[case])
    assert [g.token_ids for g in greedies] == greedy_expected


def test_fewer_hypotheses_than_beams_and_the_openai_routes(tiny, hf_tiny):
    """n < beam_width returns the best n; /v1/completions and /v1/chat/completions (whole and
    streamed) give the same texts as the SDK."""
    prompt = prompt_of(50)
    expected = hf_beam_search(hf_tiny, prompt, 4, 2, NEW_TOKENS)
    result = beam_search(tiny.address, prompt, 4, n=2)
    assert_equal(result, expected)
    texts = [c.text for c in result.choices]
    body = {"model": tiny.info().model, "prompt": prompt, "max_tokens": NEW_TOKENS, "n": 2,
            "use_beam_search": True, "beam_width": 4}
    r = requests.post(f"{tiny.http_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["text"] for c in choices] == texts
    with requests.post(f"{tiny.http_url}/v1/completions", json={**body, "stream": True},
                       stream=True, timeout=60) as r:
        chunks = [json.loads(line[len(b"data: "):]) for line in r.iter_lines()
                  if line.startswith(b"data: {")]
    streamed = {c["index"]: c["text"] for ch in chunks for c in ch["choices"]}
    assert [streamed[0], streamed[1]] == texts
    chat = requests.post(f"{tiny.http_url}/v1/chat/completions", json={
        "model": tiny.info().model, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8, "n": 2, "use_beam_search": True}, timeout=60)
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 2


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 0.7), ("top_p", 0.5), ("logit_bias", {"5": 1}), ("stop", ["x"])])
def test_incompatible_fields_are_400(tiny, field, value):
    body = {"model": tiny.info().model, "prompt": "hi", "max_tokens": 4, "n": 2,
            "use_beam_search": True, field: value}
    r = requests.post(f"{tiny.http_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """A tiny servable Llama whose EOS is a token its greedy continuation of ``prompt_of(0)``
    picks 4th: beams end early here. Returns (folder, transformers model)."""
    from transformers import AutoModelForCausalLM

    folder = make_servable_tiny_llama(tmp_path_factory.mktemp("eos-llama"), seed=3)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = model.generate(torch.tensor([prompt_of(0)]), do_sample=False, max_new_tokens=4,
                         pad_token_id=0)[0, -1].item()
    for name in ("config.json", "generation_config.json"):
        path = Path(folder) / name
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": eos}))
    model.generation_config.eos_token_id = model.config.eos_token_id = eos
    return folder, model


@pytest.fixture(scope="module")
def small_stack(eos_model):
    """Prefix caching off, 48 KV blocks of 16 tokens: one k = 8 group of 32 new tokens needs
    up to 25 (1 prompt block + 8 x 3), so three at once preempt."""
    stack = InProcessStack(eos_model[0], worker_argv=[
        "--dtype", "float32", "--kv-cache-memory", str(48 * 12288), "--max-model-len", "128"],
        scheduler_argv=["--no-enable-prefix-caching", "--max-model-len", "128"]).start()
    yield stack
    stack.stop()


def test_preempted_groups_without_prefix_caching_equal_transformers(small_stack, eos_model):
    _, model = eos_model
    cases = [(8, 1.0, "false"), (8, 2.0, "true"), (8, 0.5, "false"), (4, 1.0, "true"),
             (4, 2.0, "false"), (2, 0.5, "true")]
    expected = [hf_beam_search(model, prompt_of(i % 2), k, k, NEW_TOKENS, lp, HF_EARLY[es])
                for i, (k, lp, es) in enumerate(cases)]
    assert any(ids[-1] == model.config.eos_token_id for e in expected for ids, _ in e)
    before = small_stack.stats().num_preemptions_total
    results = generate_at_once(small_stack.address, [beam_kw(prompt_of(i % 2), *case)
                                                     for i, case in enumerate(cases)])
    for result, e in zip(results, expected, strict=True):
        assert_equal(result, e, model.config.eos_token_id)
    assert small_stack.stats().num_preemptions_total > before, "no group was preempted"
    _leak_check(small_stack)
    port = small_stack.scheduler_args.metrics_port
    metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    copied = next(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("pagedserve:beam_blocks_copied_total"))
    assert copied > 0
    assert "pagedserve:kv_cache_shared_blocks" in metrics


def test_a_search_that_cannot_fit_is_400(small_stack):
    body = {"model": small_stack.info().model, "prompt": prompt_of(1), "max_tokens": 90,
            "n": 8, "use_beam_search": True}
    r = requests.post(f"{small_stack.http_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "beam_width 8" in r.json()["error"]["message"]
    assert "KV blocks" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "beam_width"
    body["max_tokens"] = 8
    r = requests.post(f"{small_stack.http_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    _leak_check(small_stack)
