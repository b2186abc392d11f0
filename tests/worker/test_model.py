"""Our Llama and ModelRunner against transformers at float32: logits, and exact greedy tokens.

``drive_greedy`` plays the scheduler: random physical block ids, a per-step token budget (so long
prompts are prefilled in chunks next to other requests' decodes), late arrivals, preemption by
recompute, and finished requests whose blocks go back to the free list.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from benchmarks.probes import run_ours
from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput
from services.worker.attention import select_backend
from services.worker.config import WorkerConfig
from services.worker.device import resolve_dtype
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from services.worker.models.llama import LlamaConfig
from tests.helpers import make_tiny_llama

NEW_TOKENS = 16
GREEDY = EngineSamplingParams(temperature=0.0)


VARIANTS = {
    "default": {},
    "tied-llama3-bias-headdim": dict(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True, head_dim=32,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, tiny_llama, tmp_path):
    path = tiny_llama if variant == "default" else make_tiny_llama(tmp_path, **VARIANTS[variant])
    ours, _, _ = load_model(str(path), torch.float32, "cpu")
    ref = HFLlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    token_ids = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = run_ours(ours, token_ids)
    with torch.inference_mode():
        expected = ref(torch.tensor([token_ids])).logits[0].float()
    assert logits.dtype == torch.float32 and logits.shape == (150, 512)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bfloat16_logits_are_as_accurate_as_transformers_bfloat16(tiny_llama, backend):
    """At bf16 the model keeps its residual stream in float32 (transformers rounds it to bf16
    at every add), and the native CPU kernels accumulate attention in float32 in their own
    order, so the logits are not transformers' bf16 logits bit for bit; they must be at least
    as close to the float32 truth as transformers' bf16 run is (measured on logits up to 5:
    max 0.115 (torch) / 0.121 (cpu) vs 0.153, mean 0.0158 / 0.0159 vs 0.0166)."""
    ours, _, _ = load_model(str(tiny_llama), torch.bfloat16, "cpu",
                            attn_backend=select_backend(backend, "cpu"))
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    assert ours.inv_freq.dtype == torch.float32
    streams = []
    for layer in ours.layers:  # each returns (branch output, residual stream)
        layer.register_forward_hook(lambda m, args, out: streams.append(out[1].dtype))
    token_ids = list(range(3, 80))
    logits = run_ours(ours, token_ids)
    assert logits.dtype == torch.float32
    assert streams == [torch.float32] * len(ours.layers)
    with torch.inference_mode():
        truth, hf_bf16 = (
            HFLlamaForCausalLM.from_pretrained(tiny_llama, dtype=dtype).eval()(
                torch.tensor([token_ids])).logits[0].float()
            for dtype in (torch.float32, torch.bfloat16))
    ours_err, hf_err = (logits - truth).abs(), (hf_bf16 - truth).abs()
    assert ours_err.max() <= hf_err.max()
    assert ours_err.mean() <= hf_err.mean()
    # and still the same model: within bf16's ~1e-2 relative step of transformers' bf16 run
    torch.testing.assert_close(logits, hf_bf16, atol=0.1, rtol=1.6e-2)


def test_config_from_transformers4_dict():
    cfg = LlamaConfig.from_hf({
        "vocab_size": 10, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 8, "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta) == (8, 8, 5e5)
    assert cfg.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    with pytest.raises(ValueError, match="rope_type"):
        LlamaConfig.from_hf({"vocab_size": 10, "hidden_size": 64, "intermediate_size": 96,
                             "num_hidden_layers": 2, "num_attention_heads": 8,
                             "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


@dataclass
class _Req:
    request_id: str
    tokens: list[int]
    arrival_step: int
    computed: int = 0
    sent: int = 0  # tokens the worker already holds
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    seen: bool = False
    resumed: bool = False
    done: bool = False


def drive_greedy(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
                 token_budget: int = 64, arrivals: list[int] | None = None,
                 preempt: tuple[int, int] | None = None, seed: int = 0) -> list[list[int]]:
    """Generate greedily through ``runner.execute_step`` like a vLLM-V1 scheduler would (the
    runner keeps the tokens it samples; a resumed request is sent its whole token list).

    ``arrivals[i]``: step at which prompt i joins; ``preempt = (step, i)``: at that step request
    i loses its blocks and is recomputed from token 0 (resumed_from_preemption). Each logical
    block takes one physical block per KV cache group, sent group by group; no block is
    released behind a sliding window (the kernels skip those blocks anyway).
    """
    rng = random.Random(seed)
    groups = len(runner.kv_cache_groups)

    def wire(blocks: list[list[int]]) -> list[int]:  # logical blocks -> group-by-group ids
        return [b[g] for g in range(groups) for b in blocks]

    free = list(range(runner.num_kv_blocks))
    rng.shuffle(free)
    arrivals = arrivals or [0] * len(prompts)
    reqs = [_Req(f"req-{i}", list(p), arrivals[i]) for i, p in enumerate(prompts)]
    finished: list[str] = []
    bs = runner.block_size
    step_id = 0
    while not all(r.done for r in reqs):
        if preempt is not None and step_id == preempt[0]:
            victim = reqs[preempt[1]]
            assert victim.seen and not victim.done
            free.extend(wire(victim.blocks))
            victim.blocks, victim.computed, victim.resumed = [], 0, True
        budget, new, cached, expect_sampled = token_budget, [], [], []
        for r in sorted(reqs, key=lambda r: r.seen):  # like the worker: new ones first
            if r.done or r.arrival_step > step_id or budget == 0:
                continue
            n = min(len(r.tokens) - r.computed, budget)
            added = [[free.pop() for _ in range(groups)]
                     for _ in range(-(-(r.computed + n) // bs) - len(r.blocks))]
            r.blocks += added
            if not r.seen:
                new.append(NewRequest(r.request_id, list(r.tokens), GREEDY, wire(r.blocks),
                                      r.computed, n))
            else:
                cached.append(CachedRequest(r.request_id,
                                            list(r.tokens) if r.resumed else r.tokens[r.sent:],
                                            wire(r.blocks if r.resumed else added), r.resumed,
                                            r.computed, n))
            r.seen, r.resumed, r.sent = True, False, len(r.tokens)
            r.computed += n
            budget -= n
            if r.computed == len(r.tokens):
                expect_sampled.append(r.request_id)
        out = runner.execute_step(StepInput(step_id, new, cached, finished))
        assert out.step_id == step_id and out.request_ids == expect_sampled
        finished = []
        by_id = {r.request_id: r for r in reqs}
        for request_id, token in zip(out.request_ids, out.sampled_token_ids, strict=True):
            r = by_id[request_id]
            r.tokens.append(token)
            r.sent = len(r.tokens)  # (the runner appended it)
            r.output.append(token)
            if len(r.output) == max_new_tokens:
                r.done = True
                free.extend(wire(r.blocks))
                finished.append(request_id)
        step_id += 1
    runner.execute_step(StepInput(step_id, [], [], finished))
    assert not runner.input_batch.requests
    return [r.output for r in reqs]


def hf_greedy(model: HFLlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None  # the engine stops on EOS, not the model
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def test_greedy_batch_equals_transformers_generate(tiny_llama):
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, attention_backend="torch"))
    assert (runner.dtype_name, runner.vocab_size, runner.max_model_len) == ("float32", 512, 1024)
    assert (runner.attention_backend_name, runner.device.type) == ("torch", "cpu")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 9, 40, 300)]
    # prompt 0 joins at step 3 (next to decodes and the 300-token prompt's prefill chunks);
    # prompt 2 is preempted at step 8, after some output, and recomputed.
    outputs = drive_greedy(runner, prompts, NEW_TOKENS, token_budget=64,
                           arrivals=[3, 0, 0, 0], preempt=(8, 2))
    ref = HFLlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    expected = [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]
    assert outputs == expected


def test_runner_rejects_inconsistent_steps(tiny_llama):
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=1 << 20))
    greedy = EngineSamplingParams(temperature=0.0)
    with pytest.raises(KeyError, match="nope"):
        runner.execute_step(StepInput(0, [], [CachedRequest("nope", [1], [], False, 0, 1)], []))
    with pytest.raises(ValueError, match="blocks"):  # 20 tokens need 2 blocks
        runner.execute_step(StepInput(1, [NewRequest("a", list(range(20)), greedy, [0], 0, 20)],
                                      [], []))
    with pytest.raises(ValueError, match="block ids"):
        runner.execute_step(StepInput(2, [NewRequest("b", [1, 2], greedy, [10**6], 0, 2)], [], []))
    out = runner.execute_step(StepInput(3, [NewRequest("c", [1, 2, 3], greedy, [4], 0, 2)], [],
                                        ["a", "b"]))
    assert out.request_ids == []  # chunk [0, 2) of 3 tokens: no sample yet
    out = runner.execute_step(StepInput(4, [], [CachedRequest("c", [], [], False, 2, 1)], []))
    assert out.request_ids == ["c"] and len(out.sampled_token_ids) == 1


def test_runner_kv_cache_sizing(tiny_llama):
    with pytest.raises(ValueError, match="KV cache"):
        ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                 kv_cache_memory=100))
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="bfloat16", device="cpu",
                                      block_size=32, kv_cache_memory=1 << 20))
    # K and V x 3 layers x 32 tokens x 2 kv heads x 16 dims x 2 bytes
    assert runner.bytes_per_block == 2 * 3 * 32 * 2 * 16 * 2
    assert runner.num_kv_blocks == (1 << 20) // runner.bytes_per_block
    assert runner.kv_caches[0][0].shape == (runner.num_kv_blocks, 32, 2, 16)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", torch.device("cpu"))


SMOLLM2_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three colours of the rainbow."}],
]


def test_smollm2_gguf_greedy_equals_transformers_generate():
    """The packaged default model: our runner (weights from the converted cache) against
    transformers reading the GGUF itself, both float32, the two chats in one batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.common.model_files import resolve_model

    source = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
               for chat in SMOLLM2_CHATS]
    runner = ModelRunner(WorkerConfig(model=None, dtype="float32", device="cpu",
                                      kv_cache_memory=64 << 20))
    assert runner.eos_token_ids == [2] and runner.model_name == "SmolLM2-135M-Instruct.Q4_1"
    outputs = drive_greedy(runner, prompts, NEW_TOKENS, token_budget=32)
    del runner
    ref = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.gguf_file,
                                               dtype=torch.float32).eval()
    expected = [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]
    assert outputs == expected, [tokenizer.decode(o) for o in outputs + expected]


def test_cuda_profiling_step_logic_on_cpu(tiny_llama, monkeypatch):
    """The CUDA sizing arithmetic and its dummy prefill + decode steps, with torch.cuda faked."""
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=1 << 20))
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 10 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 12 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 * gib, 100 * gib))
    kv_bytes = runner._profile_cuda(100, 8, 0.9, 100 * gib, non_torch_before=gib)
    dummy_blocks = 8  # 8 sequences of 12-13 tokens, one 16-token block each (room for +1)
    peak = 10 * gib - dummy_blocks * runner.bytes_per_block
    non_torch_increase = (100 - 80 - 12 - 1) * gib
    assert kv_bytes == int(0.9 * 100 * gib) - peak - non_torch_increase
    assert not runner.input_batch.requests


_TRITON_SCRIPT = """
import json, sys, torch
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from tests.worker.test_model import drive_greedy
runner = ModelRunner(WorkerConfig(model=sys.argv[1], dtype="float32", device="cpu",
                                  kv_cache_memory=1 << 20, attention_backend="triton",
                                  kv_cache_dtype=sys.argv[3]))
assert runner.model.layers[0].attn.backend.name == "triton"
print(json.dumps(drive_greedy(runner, json.loads(sys.argv[2]), 4, token_budget=24)))
"""


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e5m2"])
def test_triton_backend_greedy_interpreted(tiny_llama, kv_cache_dtype):
    """The CUDA attention path (Triton kernels) wired into the model, run by Triton's CPU
    interpreter in a subprocess (TRITON_INTERPRET must be set before triton is imported):
    transformers' greedy tokens, and over a quantized cache the native CPU kernels' tokens."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 37)]
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT, str(tiny_llama), json.dumps(prompts),
         kv_cache_dtype],
        cwd=root, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)},
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = json.loads(result.stdout.strip().splitlines()[-1])
    if kv_cache_dtype == "auto":
        ref = HFLlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
        assert outputs == [hf_greedy(ref, p, 4) for p in prompts]
    else:
        native = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32",
                                          kv_cache_memory=1 << 20, attention_backend="cpu",
                                          kv_cache_dtype=kv_cache_dtype))
        assert outputs == drive_greedy(native, prompts, 4, token_budget=24)
