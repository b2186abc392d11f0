"""``--kv-cache-dtype int8 | fp8`` through the whole stack on the tiny Llama (float32).

A quantized cache holds twice to four times the tokens of the same ``--kv-cache-memory``;
the scheduler reports it (``GetEngineInfo``, ``cache_config_info``); a request's greedy tokens
are the same alone, beside others, after a prefix-cache hit and through preemption (the KV
write and read are per row); the native and torch backends read the cache alike; a backend that
cannot read it is refused at start, naming the flag.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from services.worker.attention import resolve_kv_cache_dtype
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from tests.stack.conftest import _leak_check
from tests.stack.test_equivalence import MAX_NEW, _generate_all, kv_bytes_per_block
from tests.stack.test_metrics import get, scrape
from tests.stack_harness import InProcessStack
from tests.worker.invariance_driver import Shape, generate

LENGTHS = [5, 9, 40, 300]


def int8_bytes_per_block(model_dir: str, block_size: int = 16) -> int:
    """K and V bytes of one int8 block over all layers: head_dim int8 values + a 1-byte scale
    code per (token, KV head) row."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * (head_dim + 1)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_cache_capacity_metrics_and_same_tokens_in_any_batch(
        tiny_model_dir, prompts, kv_cache_dtype):
    memory = 64 << 20
    # the int8 cache beside int8 weights: both quantizations in one stack, both reported
    weights = ["--quantization", "int8"] if kv_cache_dtype == "int8" else []
    stack = InProcessStack(tiny_model_dir,
                           worker_argv=["--dtype", "float32", "--kv-cache-memory", str(memory),
                                        "--kv-cache-dtype", kv_cache_dtype, *weights],
                           scheduler_argv=["--max-num-batched-tokens", "256"]).start()
    try:
        info = stack.info()
        per_block = (int8_bytes_per_block(tiny_model_dir) if kv_cache_dtype == "int8"
                     else kv_bytes_per_block(tiny_model_dir, dtype_bytes=1))
        assert info.num_kv_blocks == memory // per_block
        full = memory // kv_bytes_per_block(tiny_model_dir)  # float32 blocks in that memory
        ratio = kv_bytes_per_block(tiny_model_dir) / per_block  # 4 D / (D + 1) for int8, 4
        assert info.num_kv_blocks / full == pytest.approx(ratio, rel=1e-3)
        assert ratio == 4 or kv_cache_dtype == "int8"
        assert info.kv_cache_dtype == kv_cache_dtype
        samples = scrape(stack.scheduler_args.metrics_port)
        assert get(samples, "pagedserve:cache_config_info", block_size="16",
                   num_gpu_blocks=str(info.num_kv_blocks), cache_dtype=kv_cache_dtype) == 1
        quantization = weights[1] if weights else "none"
        assert info.quantization == (weights[1] if weights else "")
        assert get(samples, "pagedserve:model_config_info", dtype="float32",
                   quantization=quantization) == 1

        together = _generate_all(stack.address, prompts)
        alone = [_generate_all(stack.address, [p])[0] for p in prompts]
        assert alone == together
        # the 300-token prompt again: a prefix-cache hit of its first 18 blocks
        assert _generate_all(stack.address, [prompts[-1]])[0] == together[-1]
        assert stack.stats().prefix_cache_hits_total > 0
        _leak_check(stack)
    finally:
        stack.stop()

    # preemption by recompute: a cache too small for all four at once
    small = InProcessStack(tiny_model_dir,
                           worker_argv=["--dtype", "float32", "--kv-cache-memory",
                                        str(24 * per_block), "--kv-cache-dtype", kv_cache_dtype,
                                        *weights],
                           scheduler_argv=["--max-num-batched-tokens", "512",
                                           "--max-model-len", "384"]).start()
    try:
        assert small.info().num_kv_blocks == 24
        assert _generate_all(small.address, prompts) == together
        assert small.stats().num_preemptions_total > 0
        _leak_check(small)
    finally:
        small.stop()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e5m2"])
def test_a_request_is_bitwise_the_same_in_any_step_shape(tiny_model_dir, kv_cache_dtype):
    """bf16 on the native kernels over a quantized cache: the tokens and logprobs of a request
    alone, chunked, after a prefix-cache hit, beside others and resumed after preemption are
    bitwise equal (the KV write and read are per row)."""
    runner = ModelRunner(WorkerConfig(model=tiny_model_dir, dtype="bfloat16",
                                      kv_cache_memory=16 << 20, attention_backend="cpu",
                                      enforce_eager=True, kv_cache_dtype=kv_cache_dtype))
    assert runner.kv_caches[0][0].dtype == resolve_kv_cache_dtype(kv_cache_dtype,
                                                                  torch.bfloat16, "cpu")
    prompt = [random.Random(3).randrange(3, 500) for _ in range(70)]
    alone = generate(runner, prompt, 12)
    for shape in (Shape(chunk=9), Shape(prefix=32), Shape(others=3), Shape(preempt_after=5)):
        assert generate(runner, prompt, 12, shape) == alone, shape


def test_native_and_torch_backends_read_an_int8_cache_alike(tiny_model_dir, prompts):
    """Greedy tokens of the in-process runner, eager, float32: the same on both backends."""
    outs = []
    for backend in ("cpu", "torch"):
        runner = ModelRunner(WorkerConfig(model=tiny_model_dir, dtype="float32",
                                          kv_cache_memory=32 << 20, attention_backend=backend,
                                          enforce_eager=True, kv_cache_dtype="int8"))
        assert runner.kv_caches[0][0].dtype == torch.int8
        outs.append([generate(runner, p, MAX_NEW)[0] for p in prompts])
    assert outs[0] == outs[1]


def test_refused_where_the_backend_cannot_read_it():
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8: the triton attention backend "
                                         "reads float8_e4m3 on GPUs of compute capability >= 8.9"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, "triton", (8, 0))
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, "triton", (9, 0)) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, "triton", (8, 0)) == \
        torch.float8_e5m2
    assert resolve_kv_cache_dtype("int8", torch.bfloat16, "triton", (7, 5)) == torch.int8
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp4'"):
        resolve_kv_cache_dtype("fp4", torch.bfloat16, "cpu")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "triton") == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32, "cpu") == torch.float8_e4m3fn
