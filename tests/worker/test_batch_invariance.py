"""A request's greedy tokens and raw logprobs do not depend on how its steps were shaped.

- By default at bfloat16 (compiled and eager): a prefix-cache hit and another chunk size give
  bitwise the same output (the native attention kernel and the native linear layers, float32
  LM head included, are row-invariant; oneDNN's bf16 matmul is not on a Xeon with AMX).
- ``--batch-invariant``: also beside 32 random other requests and after preemption, at float32
  (whose default, MKL's sgemm, is not row-invariant) as at bfloat16, compiled and eager.

A tiny random-weight Llama with SmolLM2's vocabulary (so logits are wide), through
``ModelRunner`` directly (tests/worker/invariance_driver.py plays the scheduler)."""

from __future__ import annotations

import random

import pytest

from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from tests.worker.invariance_driver import Shape, generate

PROMPT_LENS = (70, 200)
MAX_TOKENS = 8


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def tiny_wide(tmp_path_factory) -> str:
    from tests.helpers import make_tiny_llama
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-wide"), vocab_size=4096))


def _runner(path: str, dtype: str, eager: bool, batch_invariant: bool) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=path, dtype=dtype, kv_cache_memory=64 << 20,
                                    enforce_eager=eager, max_num_seqs=64,
                                    batch_invariant=batch_invariant))


def _check(runner: ModelRunner, shapes: dict[str, Shape]) -> None:
    for prompt in _prompts(runner.vocab_size):
        alone = generate(runner, prompt, MAX_TOKENS, vocab=runner.vocab_size)
        for name, shape in shapes.items():
            got = generate(runner, prompt, MAX_TOKENS, shape, vocab=runner.vocab_size)
            assert got[0] == alone[0], (name, len(prompt))
            assert got[1] == alone[1], (name, len(prompt))  # logprobs, bitwise


DEFAULT_SHAPES = {"chunk7": Shape(chunk=7), "chunk64": Shape(chunk=64),
                  "prefix48": Shape(prefix=48), "prefix64_chunk5": Shape(prefix=64, chunk=5)}


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_default_bf16_output_is_independent_of_prefix_hits_and_chunking(tiny_wide, eager):
    _check(_runner(tiny_wide, "bfloat16", eager, batch_invariant=False), DEFAULT_SHAPES)


BATCH_SHAPES = {**DEFAULT_SHAPES, "beside32": Shape(others=32),
                "beside32_chunk7": Shape(others=32, chunk=7),
                "preempted": Shape(preempt_after=3), "prefix_preempted": Shape(prefix=48,
                                                                             preempt_after=5)}


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_output_is_independent_of_the_batch(tiny_wide, dtype, eager):
    _check(_runner(tiny_wide, dtype, eager, batch_invariant=True), BATCH_SHAPES)


@pytest.mark.parametrize("dtype, batch_invariant, native", [
    ("float32", False, None), ("bfloat16", False, True), ("float16", False, True),
    ("float32", True, True)])
def test_which_linear_layers_run_on_the_native_kernel(tiny_wide, dtype, batch_invariant, native):
    import torch
    from torch import nn

    from kernels.cpu_attention import cpu_isa
    from services.worker.loader import load_model
    from services.worker.packed_linear import PackedLinear

    if native is None:  # float32: native where the kernels' AVX2 float32 body runs, else MKL
        native = cpu_isa() == "avx2"

    net, _, _ = load_model(tiny_wide, getattr(torch, dtype), "cpu",
                           batch_invariant=batch_invariant)
    linears = [m for m in net.modules() if isinstance(m, nn.Linear | PackedLinear)]
    assert linears and all(isinstance(m, PackedLinear) == native for m in linears)
    if native:
        assert isinstance(net.lm_head, PackedLinear) and net.lm_head.out_dtype == torch.float32


def test_batch_invariant_needs_the_native_cpu_backend(tiny_wide):
    with pytest.raises(ValueError, match="--batch-invariant needs the native CPU attention"):
        ModelRunner(WorkerConfig(model=tiny_wide, dtype="float32", attention_backend="torch",
                                 batch_invariant=True))
