"""Multi-LoRA on the worker: greedy tokens of 3 random PEFT adapters of different ranks (one
rsLoRA, one targeting only some layers), alone and mixed in one step with base-model requests,
equal transformers + PEFT exactly at float32, eager and compiled; more adapters than slots
(swapping, the CPU LRU); a request whose adapter cannot be loaded fails alone, when new and
when its evicted adapter must be read again; TP=2."""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from services.common.lora import LoRARequest
from services.common.step import CachedRequest, NewRequest, StepInput
from services.worker.config import WorkerConfig
from services.worker.lora import LoRAConfig
from services.worker.model_runner import ModelRunner
from services.worker.server import worker_info
from tests.helpers import make_peft_lora
from tests.worker.lora_driver import GREEDY, reference_greedy, run_batch, tp_rank

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Three adapters of the tiny Llama: rank 4 (all 7 targets), rank 8 rsLoRA (all), rank
    16 (q, v, up, down only)."""
    root = tmp_path_factory.mktemp("adapters")
    return [
        LoRARequest(1, "four", make_peft_lora(tiny_llama, root / "four", 4, 1, lora_alpha=8)),
        LoRARequest(2, "eight", make_peft_lora(tiny_llama, root / "eight", 8, 2, lora_alpha=16,
                                               use_rslora=True)),
        LoRARequest(3, "sixteen", make_peft_lora(
            tiny_llama, root / "sixteen", 16, 3, lora_alpha=24,
            target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))),
    ]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in (5, 11, 20, 9)]


@pytest.fixture(scope="module")
def expected(tiny_llama, adapters, prompts):
    """Per adapter (None = the base model), transformers + PEFT's tokens of every prompt."""
    table = {None: reference_greedy(tiny_llama, None, prompts, NEW_TOKENS)}
    for a in adapters:
        table[a.lora_id] = reference_greedy(tiny_llama, a.path, prompts, NEW_TOKENS)
        assert table[a.lora_id] != table[None]  # (the adapter changes the answer)
    return table


def _runner(model, lora: LoRAConfig, eager: bool = True) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(model), dtype="float32", device="cpu",
                                    kv_cache_memory=4 << 20, max_num_seqs=16,
                                    max_num_batched_tokens=256, enforce_eager=eager, lora=lora))


def _check_mixed(runner, adapters, prompts, expected) -> None:
    """Each adapter alone, then all of them and the base model mixed in one batch."""
    for a in adapters:
        assert run_batch(runner, prompts, [a] * len(prompts), NEW_TOKENS,
                         tag=f"{a.name}-") == expected[a.lora_id]
    # mixed: every prompt under every adapter and the base model, interleaved
    choices = [None, *adapters]
    cases = [(p, choices[(i + j) % len(choices)]) for i, p in enumerate(prompts)
             for j in range(len(choices))]
    got = run_batch(runner, [p for p, _ in cases], [a for _, a in cases], NEW_TOKENS,
                    tag="mixed-")
    want = [expected[None if a is None else a.lora_id][prompts.index(p)] for p, a in cases]
    assert got == want


def test_adapters_alone_and_mixed_equal_peft_eager(tiny_llama, adapters, prompts, expected,
                                                   one_torch_thread):
    runner = _runner(tiny_llama, LoRAConfig(max_loras=3, max_lora_rank=16))
    _check_mixed(runner, adapters, prompts, expected)
    assert runner.lora is not None and runner.lora.loads == 3
    info = worker_info(runner)  # (what the scheduler reads)
    assert (info.max_loras, info.max_lora_rank, info.max_cpu_loras) == (3, 16, 3)


def test_adapters_alone_and_mixed_equal_peft_compiled(tiny_llama, adapters, prompts, expected):
    runner = _runner(tiny_llama, LoRAConfig(max_loras=3, max_lora_rank=16), eager=False)
    assert runner.eager_reason is None
    _check_mixed(runner, adapters, prompts, expected)
    # a one-token step (padded to two rows by the compiled forward) with an adapter
    assert run_batch(runner, prompts[:1], adapters[:1], NEW_TOKENS) == expected[1][:1]
    assert runner.forward.source in ("compiled", "loaded", "memory")  # (AOT, not the fallback)


def test_more_adapters_than_slots_swap(tiny_llama, adapters, prompts, expected,
                                       one_torch_thread):
    """2 slots, 2 adapters in CPU memory, 3 adapters: steps of two adapters at a time in a
    rotation evict slots and reload evicted adapters from disk; tokens stay exact. A step
    naming three is refused, naming both numbers."""
    runner = _runner(tiny_llama, LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2))
    for first, second in ((0, 1), (2, 0), (1, 2), (0, 2)):
        pair = [adapters[first], adapters[second], None]
        got = run_batch(runner, prompts[:3], pair, NEW_TOKENS, tag=f"{first}{second}-")
        assert got == [expected[adapters[first].lora_id][0],
                       expected[adapters[second].lora_id][1], expected[None][2]]
    assert runner.lora is not None and runner.lora.loads > 3  # (evicted ones were reloaded)
    with pytest.raises(ValueError, match="3 distinct LoRA adapters, more than --max-loras 2"):
        run_batch(runner, prompts[:3], adapters, NEW_TOKENS, tag="three-")


def test_an_id_reused_for_another_adapter_loads_that_adapter(tiny_llama, adapters, prompts,
                                                             expected, one_torch_thread):
    """A new scheduler numbers adapters from 1 again: an id the worker holds (in a slot and
    in CPU memory) under another adapter is read anew, not served with the old weights."""
    runner = _runner(tiny_llama, LoRAConfig(max_loras=2, max_lora_rank=16))
    first, second = adapters[0], adapters[1]
    assert run_batch(runner, prompts[:1], [first], NEW_TOKENS, tag="old-") == \
        [expected[first.lora_id][0]]
    reused = LoRARequest(first.lora_id, second.name, second.path)
    assert run_batch(runner, prompts[:1], [reused], NEW_TOKENS, tag="new-") == \
        [expected[second.lora_id][0]]
    assert runner.lora is not None and runner.lora.loads == 2


def _tokens(out) -> dict[str, int]:
    return dict(zip(out.request_ids, out.sampled_token_ids, strict=True))


def test_a_request_whose_adapter_cannot_be_loaded_fails_alone(tiny_llama, adapters, prompts,
                                                              expected, tmp_path,
                                                              one_torch_thread):
    """Each bad adapter (a rank above --max-lora-rank, NaN weights, no folder, a target the
    model lacks, no weights file) fails only its request: left out of the step and reported
    with an error naming the adapter and the problem, while a base-model request in the same
    step decodes;
    its later entries are ignored until the scheduler finishes it. The runner then serves a
    good adapter."""
    runner = _runner(tiny_llama, LoRAConfig(max_loras=1, max_lora_rank=8))
    lacking = Path(shutil.copytree(adapters[0].path, tmp_path / "lacking"))
    config = json.loads((Path(adapters[0].path) / "adapter_config.json").read_text())
    (lacking / "adapter_config.json").write_text(
        json.dumps({**config, "target_modules": ["q_proj", "lm_head"]}))
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "adapter_config.json").write_text(json.dumps(config))
    nan = Path(shutil.copytree(adapters[0].path, tmp_path / "nan"))
    tensors = load_file(nan / "adapter_model.safetensors")
    save_file({k: v.fill_(float("nan")) if "lora_B" in k and ".1." in k else v
               for k, v in tensors.items()}, nan / "adapter_model.safetensors")
    bad = [(adapters[2], r"'sixteen': .*rank 16 .*is above --max-lora-rank 8"),
           # (a NaN in a slot would reach every row of the step: 0 * NaN is NaN)
           (LoRARequest(12, "nan", str(nan)), r"'nan': layer 1 \w+ has NaN or infinite values"),
           (LoRARequest(9, "missing", str(tmp_path / "nowhere")),
            r"'missing': .*no such adapter folder"),
           (LoRARequest(10, "lacking", str(lacking)),
            r"'lacking': .*target module 'lm_head' is one the model lacks"),
           (LoRARequest(11, "no-weights", str(tmp_path / "no-weights")),
            r"'no-weights': .*missing adapter_model\.safetensors")]
    p, b = prompts[0], prompts[1]
    for k, (lora, message) in enumerate(bad):
        step = StepInput(3 * k, [NewRequest("bad", list(p), GREEDY, [0, 1], 0, len(p), lora),
                                 NewRequest("base", list(b), GREEDY, [2, 3], 0, len(b))], [], [])
        out = runner.execute_step(step)
        assert out.failed_request_ids == ["bad"] and len(out.failed_messages) == 1
        assert re.search(message, out.failed_messages[0]), out.failed_messages[0]
        assert _tokens(out) == {"base": expected[None][1][0]}
        out = runner.execute_step(StepInput(3 * k + 1, [], [  # (async scheduling's next step)
            CachedRequest("bad", [], [], False, len(p), 1),
            CachedRequest("base", [], [], False, len(b), 1)], []))
        assert _tokens(out) == {"base": expected[None][1][1]} and not out.failed_request_ids
        runner.execute_step(StepInput(3 * k + 2, [], [], ["bad", "base"]))
    assert run_batch(runner, prompts[:2], [adapters[0], None], NEW_TOKENS, tag="ok-") == [
        expected[1][0], expected[None][1]]


def test_an_evicted_adapter_that_cannot_be_read_again_fails_its_running_request(
        tiny_llama, adapters, prompts, expected, tmp_path, one_torch_thread):
    """One slot, one adapter in CPU memory: X's request decodes, then a request of another
    adapter takes the slot and the CPU LRU while X's waits, and X's folder is deleted. X's
    request's next step fails it (the runner drops it) and the base request beside it goes
    on; the other adapter's request then decodes with its own tokens."""
    runner = _runner(tiny_llama, LoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1))
    x = LoRARequest(21, "x", shutil.copytree(adapters[0].path, tmp_path / "x"))
    px, py, pb = prompts[0], prompts[1], prompts[2]

    def cached(rid: str, prompt: list[int], k: int) -> CachedRequest:
        return CachedRequest(rid, [], [], False, len(prompt) + k, 1)

    out = runner.execute_step(StepInput(0, [
        NewRequest("x", list(px), GREEDY, [0, 1], 0, len(px), x),
        NewRequest("b", list(pb), GREEDY, [2, 3], 0, len(pb))], [], []))
    assert _tokens(out) == {"x": expected[1][0][0], "b": expected[None][2][0]}
    out = runner.execute_step(StepInput(1, [
        NewRequest("y", list(py), GREEDY, [4, 5], 0, len(py), adapters[1])],
        [cached("b", pb, 0)], []))
    assert _tokens(out) == {"y": expected[2][1][0], "b": expected[None][2][1]}
    shutil.rmtree(x.path)
    out = runner.execute_step(StepInput(2, [], [cached("x", px, 0), cached("b", pb, 1)], []))
    assert out.failed_request_ids == ["x"]
    assert re.search(r"'x': .*no such adapter folder", out.failed_messages[0])
    assert _tokens(out) == {"b": expected[None][2][2]}
    out = runner.execute_step(StepInput(3, [], [cached("x", px, 1), cached("y", py, 0),
                                                cached("b", pb, 2)], []))
    assert _tokens(out) == {"y": expected[2][1][1], "b": expected[None][2][3]}
    runner.execute_step(StepInput(4, [], [], ["x", "y", "b"]))


def _tp2(model, prompts, loras, unreadable: str = "") -> tuple[list[list[int]], dict]:
    """``run_batch`` on a TP=2 group (gloo, two spawned ranks, ``lora_driver.tp_rank``; rank
    1 cannot read the adapter named ``unreadable``): the driver's tokens and failures."""
    from services.common.ports import free_port_range

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port_range(1)
    procs = [ctx.Process(target=tp_rank, args=(r, port, str(model), prompts, loras,
                                                NEW_TOKENS, results, unreadable))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = results.get(timeout=240)
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    return got


def test_tp2_shards_adapters_as_the_base_layers(tiny_llama, adapters, prompts, expected):
    """TP=2 (A/B cut as the base layers, the row-parallel update in the base layer's
    all-reduce): two adapters and the base model mixed in one batch."""
    loras = [adapters[1], adapters[2], None, adapters[1]]
    got, failed = _tp2(tiny_llama, prompts, loras)
    assert got == [expected[None if a is None else a.lora_id][i] for i, a in enumerate(loras)]
    assert failed == {}


def test_tp2_ranks_agree_on_an_adapter_only_one_of_them_cannot_load(tiny_llama, adapters,
                                                                    prompts, expected):
    """Rank 1 cannot read adapter "eight" (as if its files were unreadable on its host), the
    driver can: both leave its requests out (no collective hangs, no rank runs them), the
    driver reports them, and the other adapter's and the base model's rows are exact."""
    loras = [adapters[1], adapters[0], None, adapters[1]]
    got, failed = _tp2(tiny_llama, prompts, loras, unreadable="eight")
    assert got == [[], expected[1][1], expected[None][2], []]
    assert failed.keys() == {"r0", "r3"}
    assert all("'eight'" in m and "could not be loaded on another worker rank" in m
               for m in failed.values())


def test_a_preempted_request_resumes_with_its_adapter(tiny_llama, adapters, prompts, expected,
                                                      one_torch_thread):
    """Preempted after 3 tokens (its blocks freed, then resumed with its whole token list in
    other blocks, recomputed from 0) while a base-model request keeps decoding: both finish
    with transformers + PEFT's tokens."""
    runner = _runner(tiny_llama, LoRAConfig(max_loras=1, max_lora_rank=16))
    a, b = prompts[1], prompts[2]
    blocks = iter(range(runner.num_kv_blocks))
    step = StepInput(0, [NewRequest("a", list(a), GREEDY, [next(blocks), next(blocks)], 0,
                                    len(a), adapters[0]),
                         NewRequest("b", list(b), GREEDY, [next(blocks), next(blocks)], 0,
                                    len(b))], [], [])
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for k in range(NEW_TOKENS):
        out = runner.execute_step(step)
        for rid, t in zip(out.request_ids, out.sampled_token_ids, strict=True):
            tokens[rid].append(t)
        if k == 2:  # preempt "a": it is resumed at once, whole, into new blocks
            resumed = CachedRequest("a", a + tokens["a"], [next(blocks), next(blocks)], True,
                                    0, len(a) + len(tokens["a"]))
        else:
            resumed = CachedRequest("a", [], [], False, len(a) + k, 1)
        step = StepInput(k + 1, [], [resumed, CachedRequest("b", [], [], False, len(b) + k, 1)],
                         [])
    assert tokens == {"a": expected[1][1], "b": expected[None][2]}


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_other_families_equal_peft(family, tmp_path, prompts, one_torch_thread):
    """Qwen2 (q/k/v bias kept in the base layer) and Gemma 3 (GeGLU, q/k norms, sliding
    layers): one rsLoRA adapter's rows mixed with base-model rows equal transformers + PEFT."""
    from tests.helpers import make_tiny_gemma3, make_tiny_qwen2

    make = {"qwen2": make_tiny_qwen2, "gemma3": make_tiny_gemma3}[family]
    model = make(tmp_path / family)
    adapter = LoRARequest(5, "a", make_peft_lora(model, tmp_path / "a", 8, 5, lora_alpha=16,
                                                 use_rslora=True))
    want_lora = reference_greedy(model, adapter.path, prompts[:2], NEW_TOKENS)
    want_base = reference_greedy(model, None, prompts[2:], NEW_TOKENS)
    assert want_lora != reference_greedy(model, None, prompts[:2], NEW_TOKENS)
    runner = _runner(model, LoRAConfig(max_loras=1, max_lora_rank=8))
    assert run_batch(runner, prompts, [adapter, adapter, None, None], NEW_TOKENS) == (
        want_lora + want_base)


def test_per_module_ranks_and_alphas_equal_peft(tiny_llama, tmp_path, prompts, expected,
                                                one_torch_thread):
    """``rank_pattern`` / ``alpha_pattern`` (per-module r and alpha, which the router's check
    accepts): each module's own scale, mixed with base rows, equal transformers + PEFT."""
    path = make_peft_lora(tiny_llama, tmp_path / "patterns", 4, 7, lora_alpha=8,
                          rank_pattern={"q_proj": 8, "down_proj": 2},
                          alpha_pattern={"gate_proj": 32})
    want = reference_greedy(tiny_llama, path, prompts[:2], NEW_TOKENS)
    runner = _runner(tiny_llama, LoRAConfig(max_loras=1, max_lora_rank=8))
    adapter = LoRARequest(7, "patterns", path)
    assert run_batch(runner, prompts[:3], [adapter, adapter, None], NEW_TOKENS) == (
        want + expected[None][2:3])
