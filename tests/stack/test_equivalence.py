"""Greedy tokens through the full gRPC stack equal transformers' generate exactly, at float32."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest

from services.scheduler.server import scheduler_config
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from tests.stack.conftest import _leak_check, generate_at_once, hf_greedy
from tests.stack_harness import InProcessStack
from tests.worker.test_in_process_step import run_in_process

MAX_NEW = 24
LENGTHS = [5, 9, 40, 300]


@pytest.fixture(scope="module")
def prompts_and_expected(tiny_model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    return prompts, hf_greedy(tiny_model_dir, prompts, MAX_NEW)


def kv_bytes_per_block(model_dir: str, block_size: int = 16, dtype_bytes: int = 4) -> int:
    """Bytes of K and V for one block across all layers (the worker's sizing rule)."""
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return (2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim
            * dtype_bytes)


def _generate_all(address: str, prompts: list[list[int]]) -> list[list[int]]:
    """Send all prompts at once and collect greedy token ids."""
    results = generate_at_once(address, [dict(prompt_token_ids=ids, temperature=0,
                                              max_tokens=MAX_NEW, ignore_eos=True)
                                         for ids in prompts])
    for r in results:
        assert r.finish_reason == "length" and r.usage.completion_tokens == MAX_NEW
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def stack_runner(tiny_stack):
    """A ModelRunner in this process with the tiny stack's own worker flags."""
    return ModelRunner(WorkerConfig.from_args(tiny_stack.worker_args))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_in_process_equals_the_stack(tiny, stack_runner, prompts_and_expected,
                                                async_scheduling):
    """The stack's scheduler and worker configs, built from its own flags, run in this process
    (``Scheduler.schedule`` -> ``for_rank`` -> ``ModelRunner.execute_step``, no protobuf):
    the same tokens as the stack, with async scheduling off and on (the stack runs it on)."""
    prompts, _ = prompts_and_expected
    config = dataclasses.replace(
        scheduler_config(tiny.scheduler_args, max_model_len=stack_runner.max_model_len),
        async_scheduling=async_scheduling)
    assert config.max_steps_in_flight == (2 if async_scheduling else 1)
    assert run_in_process(stack_runner, config, prompts, MAX_NEW) == _generate_all(
        tiny.address, prompts)


@pytest.mark.parametrize("order", ["together", "alone", "reversed", "shuffled"])
def test_tiny_llama_greedy_matches_transformers(tiny, prompts_and_expected, order):
    prompts, expected = prompts_and_expected
    idx = list(range(len(prompts)))
    if order == "alone":
        got = [_generate_all(tiny.address, [p])[0] for p in prompts]
    else:
        if order == "reversed":
            idx.reverse()
        elif order == "shuffled":
            random.Random(1).shuffle(idx)
        out = _generate_all(tiny.address, [prompts[i] for i in idx])
        got = [None] * len(prompts)
        for i, ids in zip(idx, out):
            got[i] = ids
    for n, g, e in zip(LENGTHS, got, expected, strict=True):
        assert g == e, f"prompt of {n} tokens diverged from transformers"


def test_preemption_gives_identical_tokens(tiny_model_dir, prompts_and_expected):
    """A KV cache too small for all four prompts at once forces preemption by recompute."""
    prompts, expected = prompts_and_expected
    # 300+24 tokens need 21 blocks of 16; 24 blocks cannot hold all four requests together.
    stack = InProcessStack(tiny_model_dir, worker_argv=["--dtype", "float32", "--kv-cache-memory",
                                                        str(24 * kv_bytes_per_block(tiny_model_dir))],
                           scheduler_argv=["--max-num-batched-tokens", "512",
                                           "--max-model-len", "384"]).start()
    try:
        info = stack.info()
        assert info.num_kv_blocks == 24
        got = _generate_all(stack.address, prompts)
        assert got == expected
        assert stack.stats().num_preemptions_total > 0
        _leak_check(stack)
    finally:
        stack.stop()


def test_enforce_eager_stack_gives_identical_tokens(tiny_model_dir, prompts_and_expected):
    """The same greedy tokens with --enforce-eager (the module stack above compiles the
    forward; this one runs it eagerly)."""
    prompts, expected = prompts_and_expected
    stack = InProcessStack(tiny_model_dir,
                           worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB",
                                        "--enforce-eager"],
                           scheduler_argv=["--max-num-batched-tokens", "256"]).start()
    try:
        assert _generate_all(stack.address, prompts) == expected
        _leak_check(stack)
    finally:
        stack.stop()
