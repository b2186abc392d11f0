"""SmolLM2-135M-Instruct (the packaged GGUF) through the whole stack equals transformers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from pagedserve_client import Client

from benchmarks.probes import chat_prompts
from services.common.model_files import resolve_model
from tests.helpers import hf_beam_search
from tests.stack.conftest import _leak_check, hf_greedy
from tests.stack_harness import InProcessStack

CHATS = ["What is the capital of France?", "Write a haiku about autumn.",
         "List three prime numbers.", "Explain gravity to a child."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smol_stack():
    stack = InProcessStack(None, worker_argv=["--dtype", "float32",
                                              "--kv-cache-memory", "512MiB"]).start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def hf_smol():
    """transformers' SmolLM2 (float32) from the packaged GGUF, loaded once for this module."""
    import torch
    from transformers import AutoModelForCausalLM

    src = resolve_model(None)
    return AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file,
                                                dtype=torch.float32).eval()


def hf_chat_greedy(hf_smol, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy ids for ``prompts`` (ending with EOS, as the engine's do)."""
    src = resolve_model(None)
    return hf_greedy(src.folder, prompts, new_tokens, gguf_file=src.gguf_file,
                     ignore_eos=False, model=hf_smol)


def greedy_chat(address: str, chat: str, max_tokens: int):
    with Client(address) as c:
        return c.generate(messages=[{"role": "user", "content": chat}], temperature=0,
                          max_tokens=max_tokens)


def test_smollm2_greedy_chat_matches_transformers(smol_stack, hf_smol):
    prompts = chat_prompts(CHATS)
    expected = hf_chat_greedy(hf_smol, prompts, NEW_TOKENS)
    with ThreadPoolExecutor(len(CHATS)) as pool:
        results = list(pool.map(lambda c: greedy_chat(smol_stack.address, c, NEW_TOKENS),
                                CHATS))
    for chat, prompt, r, e in zip(CHATS, prompts, results, expected, strict=True):
        assert r.usage.prompt_tokens == len(prompt), f"chat template differs for {chat!r}"
        assert r.token_ids == e, f"{chat!r}: {r.text!r}"
        assert r.finish_reason == ("length" if len(e) == NEW_TOKENS else "stop")
    assert "Paris" in results[0].text
    _leak_check(smol_stack)


def test_smollm2_beam_search_matches_transformers(smol_stack, hf_smol):
    """Beam search (k = 2, 4, 8, three length penalties, both early_stopping values) of three
    chats at once: the hypotheses and scores equal transformers' generate(num_beams=k)."""
    import torch

    model = hf_smol
    cases = [(2, 1.0, "false"), (4, 0.5, "true"), (8, 2.0, "false")]
    prompts = chat_prompts(CHATS[:3])
    with torch.inference_mode():
        expected = [hf_beam_search(model, p, k, k, NEW_TOKENS, lp, es == "true")
                    for p, (k, lp, es) in zip(prompts, cases, strict=True)]

    def one(i):
        k, lp, es = cases[i]
        with Client(smol_stack.address) as c:
            return c.generate(prompt_token_ids=prompts[i], use_beam_search=True, n=k,
                              length_penalty=lp, early_stopping=es == "true", max_tokens=NEW_TOKENS)
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(one, range(len(cases))))
    for r, e in zip(results, expected, strict=True):
        assert [c.token_ids for c in r.choices] == [ids for ids, _ in e]
        assert all(abs(c.beam_score - s) < 1e-4 for c, (_, s) in zip(r.choices, e, strict=True))
    _leak_check(smol_stack)


REPEAT = ("Repeat this sentence exactly, but change the name Alice to Carol: Alice met Bob at "
          "the station, and Alice gave Bob a letter from her sister before Alice left.")


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def smol_spec_stack(request, tmp_path_factory):
    """SmolLM2 with speculative decoding: prompt lookup, or a tiny random-weight draft model
    of SmolLM2's vocabulary (few drafts accepted; run eagerly, as a draft is)."""
    from tests.helpers import make_servable_tiny_llama

    if request.param == "ngram":
        config = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                  '"prompt_lookup_min": 2}')
    else:
        draft = make_servable_tiny_llama(tmp_path_factory.mktemp("smol-draft"), seed=5)
        config = f'{{"model": "{draft}", "num_speculative_tokens": 3}}'
    stack = InProcessStack(None, worker_argv=["--dtype", "float32", "--kv-cache-memory",
                                              "512MiB", "--speculative-config", config],
                           scheduler_argv=["--speculative-config", config]).start()
    stack.method = request.param
    yield stack
    stack.stop()


def test_smollm2_speculative_greedy_matches_transformers(smol_spec_stack, hf_smol):
    """Greedy chats (a repetitive one among them: prompt lookup's case) with speculation on,
    alone and all at once, equal transformers' greedy generate token for token."""
    chats = [REPEAT, *CHATS[:3]]
    new_tokens = 48
    expected = hf_chat_greedy(hf_smol, chat_prompts(chats), new_tokens)

    def one(chat):
        return greedy_chat(smol_spec_stack.address, chat, new_tokens)
    assert one(chats[0]).token_ids == expected[0]
    with ThreadPoolExecutor(len(chats)) as pool:
        results = list(pool.map(one, chats))
    assert [r.token_ids for r in results] == expected
    port = smol_spec_stack.scheduler_args.metrics_port
    import requests
    metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    def counter(name):
        return next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith(f"pagedserve:spec_decode_num_{name}_total"))
    assert counter("draft_tokens") > 0
    if smol_spec_stack.method == "ngram":  # (the repeated sentence: many drafts are right)
        assert counter("accepted_tokens") > 0.3 * counter("draft_tokens")
    _leak_check(smol_spec_stack)
