"""Issue 35's acceptance criterion through the whole stack (router --enable-lora, scheduler
--max-loras, workers --enable-lora): greedy tokens of each adapter's requests, alone and mixed in
one batch with base-model requests, equal transformers + PEFT exactly at float32, with prefix
caching on and under preemption.

- A tiny random Llama with three random PEFT adapters of different ranks (4, 8, 16), target
  modules, alphas and scaling (rsLoRA, a ``rank_pattern``), and a KV cache of 16 blocks: the
  same two prompts under each adapter and the base model, each twice, all sent at once, cannot
  run together, so the scheduler preempts (its preemption counter must grow); a second round
  hits the prefix cache of each (adapter, prompt). No KV block leaks.
- SmolLM2 (the packaged model, float32) with one random adapter, its requests mixed with base
  requests of the same prompts.
"""

from __future__ import annotations

import random

import pytest

from tests.helpers import make_peft_lora
from tests.stack.conftest import _leak_check, generate_at_once
from tests.stack.test_equivalence import kv_bytes_per_block
from tests.stack_harness import InProcessStack
from tests.worker.lora_driver import reference_greedy, smollm2_lora_reference

MAX_NEW = 12
NUM_BLOCKS = 16
# 14 + 12 and 30 + 12 tokens: each prompt is admitted on 1 or 2 blocks and needs a 2nd or 3rd
# while it decodes, so 16 requests at once run out of the 16 blocks and preempt.
LENGTHS = (14, 30)
MODELS = ("r4", "", "r8", "r16")  # "" = the base model


def _greedy_request(ids: list[int], model: str, max_tokens: int = MAX_NEW) -> dict:
    return {"prompt_token_ids": ids, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "model": model}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r4": make_peft_lora(tiny_model_dir, root / "r4", r=4, lora_alpha=8),
        "r8": make_peft_lora(tiny_model_dir, root / "r8", r=8, seed=1, lora_alpha=32,
                             use_rslora=True, target_modules=("q_proj", "v_proj", "down_proj")),
        "r16": make_peft_lora(tiny_model_dir, root / "r16", r=16, seed=2, lora_alpha=16,
                              rank_pattern={"o_proj": 4},
                              target_modules=("k_proj", "o_proj", "gate_proj", "up_proj"))}


@pytest.fixture(scope="module")
def prompts_and_expected(tiny_model_dir, adapters):
    """(prompts, model name -> transformers (+ PEFT) greedy tokens of each prompt)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 49152) for _ in range(n)] for n in LENGTHS]
    want = {model: reference_greedy(tiny_model_dir, adapters.get(model), prompts, MAX_NEW)
            for model in MODELS}
    answers = [want[model] for model in MODELS]  # (every adapter changes them, differently)
    assert all(a != b for i, a in enumerate(answers) for b in answers[i + 1:])
    return prompts, want


@pytest.fixture(scope="module")
def small_stack(tiny_model_dir, adapters):
    """Three adapter slots on the workers and the scheduler, 16 KV blocks."""
    stack = InProcessStack(
        tiny_model_dir,
        worker_argv=["--dtype", "float32", "--enforce-eager", "--kv-cache-memory",
                     str(NUM_BLOCKS * kv_bytes_per_block(tiny_model_dir)),
                     "--enable-lora", "--max-loras", "3", "--max-lora-rank", "16"],
        scheduler_argv=["--max-num-batched-tokens", "256", "--max-model-len", "128",
                        "--max-loras", "3"],
        router_argv=["--enable-lora", "--lora-modules",
                     *(f"{name}={path}" for name, path in adapters.items())]).start()
    try:
        assert stack.info().num_kv_blocks == NUM_BLOCKS
        yield stack
    finally:
        stack.stop()


def test_each_adapter_alone_equals_peft(small_stack, prompts_and_expected):
    prompts, want = prompts_and_expected
    for model in MODELS:
        for i, ids in enumerate(prompts):
            (got,) = generate_at_once(small_stack.address, [_greedy_request(ids, model)])
            assert got.token_ids == want[model][i], (model, i)
    _leak_check(small_stack)


def test_adapters_and_base_mixed_under_preemption_equal_peft(small_stack, prompts_and_expected):
    prompts, want = prompts_and_expected
    cases = [(model, i) for _ in range(2) for i in range(len(prompts)) for model in MODELS]
    for round_ in range(2):  # the second round hits the prefix cache of (adapter, prompt)s
        before = small_stack.stats().num_preemptions_total
        got = generate_at_once(small_stack.address,
                               [_greedy_request(prompts[i], model) for model, i in cases])
        assert [r.token_ids for r in got] == [want[model][i] for model, i in cases]
        assert small_stack.stats().num_preemptions_total > before, "nothing was preempted"
        if round_ == 1:
            assert sum(r.usage.num_cached_tokens for r in got) > 0, "no prefix-cache hit"
        _leak_check(small_stack)


SMOL_PROMPTS = [[1, 4093, 314, 253, 1345, 28, 7180, 30], [504, 2143, 418, 2530, 2067]]
SMOL_NEW = 8


def test_smollm2_adapter_mixed_with_base_equals_peft(tmp_path):
    want_base, want_lora = smollm2_lora_reference(tmp_path / "smol", SMOL_PROMPTS, SMOL_NEW)
    assert want_lora != want_base
    stack = InProcessStack(
        None, worker_argv=["--dtype", "float32", "--enforce-eager", "--kv-cache-memory", "64MiB",
                           "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"],
        scheduler_argv=["--max-model-len", "256"],
        router_argv=["--enable-lora", "--max-lora-rank", "8",
                     "--lora-modules", f"smol={tmp_path / 'smol'}"]).start()
    try:
        cases = [(model, i) for i in range(len(SMOL_PROMPTS)) for model in ("smol", "")]
        got = generate_at_once(stack.address, [_greedy_request(SMOL_PROMPTS[i], model, SMOL_NEW)
                                               for model, i in cases])
        want = {"smol": want_lora, "": want_base}
        assert [r.token_ids for r in got] == [want[model][i] for model, i in cases]
        _leak_check(stack)
    finally:
        stack.stop()
