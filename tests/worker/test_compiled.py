"""The compiled forward (services/worker/compiled.py): one graph for every step shape, the same
hidden states as the eager model, and the cases that run eagerly."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput
from services.worker.compiled import CompiledForward, why_eager
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner

GREEDY = EngineSamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-compiled"))


def _steps(groups: int = 1) -> list[StepInput]:
    """Steps of every shape that could ask for a graph of its own: one token alone, one
    sequence with a one-block table, a chunked prefill beside decodes, a prefix-hit tail, many
    sequences, a request resumed from preemption. With ``groups`` KV cache groups, each group
    gets its own blocks (``b + 20 * g`` for block ``b``)."""
    toks = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((1, 5, 40, 70, 3))]
    steps = [
        StepInput(0, [NewRequest("one", toks[0], GREEDY, [0], 0, 1)], [], []),  # T = 1, B = 1
        StepInput(1, [], [CachedRequest("one", [7], [], False, 1, 1)], []),  # decode alone
        StepInput(2, [NewRequest("five", toks[1], GREEDY, [1], 0, 5),
                      NewRequest("forty", toks[2], GREEDY, [2, 3, 4], 0, 24)],  # chunk [0, 24)
                  [CachedRequest("one", [9], [], False, 2, 1)], []),
        StepInput(3, [NewRequest("hit", toks[3], GREEDY, [5, 6, 7, 8, 9], 48, 22)],  # tail
                  [CachedRequest("forty", [], [], False, 24, 16),
                   CachedRequest("five", [11], [], False, 5, 1)], []),
        StepInput(4, [NewRequest("three", toks[4], GREEDY, [10], 0, 3)],
                  [CachedRequest("one", [12], [], False, 3, 1),
                   CachedRequest("forty", [13], [], False, 40, 1),
                   CachedRequest("hit", [14], [], False, 70, 1)], ["five"]),
        StepInput(5, [], [CachedRequest("forty", toks[2] + [13, 15], [11, 12, 13], True, 0,
                                        42)], []),  # (resumed: its whole token list)
    ]
    for s in steps:
        for r in (*s.new_requests, *s.cached_requests):
            blocks = r.block_ids if isinstance(r, NewRequest) else r.new_block_ids
            blocks[:] = [b + 20 * g for g in range(groups) for b in blocks]
    return steps


def test_compiled_forward_equals_eager_with_one_graph_for_every_step(tiny_llama):
    """After the warm-up compile, no step recompiles (torch raises if one would), and each
    step's hidden states equal the eager model's at float32 (same ops, fused: only the
    float rounding of reordered reductions may differ)."""
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, attention_backend="cpu"))
    assert isinstance(runner.forward, CompiledForward) and runner.eager_reason is None
    assert runner.forward.compile_seconds is not None  # compiled at start, by the warm-up
    batch = runner.input_batch
    # NOTE: config.patch, not monkeypatch (see test_why_eager_names_each_reason)
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        for step in _steps():
            prepared = batch.prepare(batch.update(step))
            args = (prepared.input_ids, prepared.positions, runner.kv_caches,
                    runner.layer_metadata(prepared))
            compiled = runner.forward(*args)
            eager = runner.model(*args)
            assert compiled.shape == eager.shape == (prepared.input_ids.shape[0], 64)
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_several_kv_cache_groups_compile_to_one_graph_equal_to_eager(tiny_llama, monkeypatch):
    """Windows [W, 0, W] (W longer than any sequence): three groups of one layer, all sharing
    one K/V pair, so the graph takes three metadata objects and one cache three times; still
    no step recompiles and every step equals the eager model."""
    from services.worker.models.llama import LlamaConfig

    monkeypatch.setattr(LlamaConfig, "sliding_windows", property(lambda self: [4096, 0, 4096]))
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, attention_backend="cpu"))
    assert isinstance(runner.forward, CompiledForward) and runner.eager_reason is None
    assert len(runner.kv_cache_groups) == 3 and runner.num_kv_pairs == 1
    assert runner.kv_caches[0] is runner.kv_caches[1] is runner.kv_caches[2]
    batch = runner.input_batch
    # NOTE: config.patch, not monkeypatch (see test_why_eager_names_each_reason)
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        for step in _steps(groups=3):
            prepared = batch.prepare(batch.update(step))
            metas = runner.layer_metadata(prepared)
            assert len({id(m) for m in metas}) == 3
            args = (prepared.input_ids, prepared.positions, runner.kv_caches, metas)
            compiled = runner.forward(*args)
            eager = runner.model(*args)
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_enforce_eager_runs_the_plain_module(tiny_llama):
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=1 << 20, attention_backend="cpu",
                                      enforce_eager=True))
    assert runner.forward is runner.model and runner.eager_reason == "--enforce-eager"


def test_why_eager_names_each_reason():
    cpu = torch.device("cpu")
    assert why_eager(False, cpu, "cpu", 1) is None
    assert why_eager(True, cpu, "cpu", 1) == "--enforce-eager"
    assert "torch" in why_eager(False, cpu, "torch", 1)
    assert "cuda" in why_eager(False, torch.device("cuda", 0), "triton", 1)
    assert "parallel" in why_eager(False, cpu, "cpu", 2)
    from torch._inductor import config

    # NOTE: config.patch, not monkeypatch: monkeypatch's undo hides the config entry for good.
    with config.patch({"cpp.cxx": ("no-such-compiler-x",)}):
        assert "C++ compiler" in why_eager(False, cpu, "cpu", 1)
    assert why_eager(False, cpu, "cpu", 1) is None


def test_explicit_cpu_backend_compiles_in_a_fresh_process(tiny_llama):
    """``--attention-backend cpu`` (not auto, which loads the library while choosing) in a new
    process: the native library is loaded before Dynamo traces, not inside the trace."""
    import subprocess
    import sys

    code = ("from services.worker.config import WorkerConfig\n"
            "from services.worker.model_runner import ModelRunner\n"
            f"r = ModelRunner(WorkerConfig(model={str(tiny_llama)!r}, dtype='float32', "
            "device='cpu', kv_cache_memory=1 << 20, attention_backend='cpu'))\n"
            "assert r.eager_reason is None and r.forward.compile_seconds is not None\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


_RESTART = """
import sys, torch
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
r = ModelRunner(WorkerConfig(model=sys.argv[1], dtype='float32', device='cpu',
                             kv_cache_memory=4 << 20, attention_backend='cpu'))
print(r.forward.source)
batch = r.input_batch
from tests.worker.test_compiled import _steps
with torch.inference_mode():
    for step in _steps():
        p = batch.prepare(batch.update(step))
        args = (p.input_ids, p.positions, r.kv_caches, r.layer_metadata(p))
        torch.testing.assert_close(r.forward(*args), r.model(*args), rtol=1e-5, atol=1e-5)
"""


def _start(model, cache) -> tuple[str, str]:
    """A fresh process's ModelRunner on ``cache``: how it got its forward, and its stderr."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _RESTART, str(model)], capture_output=True,
                          text=True, timeout=900,
                          env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1], proc.stderr


def test_a_restart_loads_the_saved_artifact_and_a_bad_one_is_recompiled(
        tiny_llama, tmp_path, monkeypatch, caplog):
    """First start compiles and saves; a restart loads the artifact (no Dynamo trace) and its
    every step shape equals the eager model; a corrupt artifact is compiled again, with a
    warning, and replaced."""
    import services.worker.compiled as compiled

    assert _start(tiny_llama, tmp_path)[0] == "compiled"
    (artifact,) = (tmp_path / "aot").iterdir()
    assert _start(tiny_llama, tmp_path)[0] == "loaded"
    artifact.write_bytes(b"not a compiled function")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "_LOADED", {})  # as a new process would be
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=1 << 20, attention_backend="cpu"))
    assert runner.eager_reason is None, runner.eager_reason
    assert runner.forward.source == "compiled" and "could not load" in caplog.text
    assert artifact.stat().st_size > 1000
    monkeypatch.setattr(compiled, "_LOADED", {})
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=1 << 20, attention_backend="cpu"))
    assert runner.forward.source == "loaded"


def test_the_artifact_key_changes_with_what_the_graph_depends_on(tiny_llama):
    from services.worker.compiled import artifact_key

    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=1 << 20, attention_backend="cpu",
                                      enforce_eager=True))
    model = runner.model
    key = artifact_key(model, "cpu", 16)
    assert key == artifact_key(model, "cpu", 16)
    assert len({key, artifact_key(model, "cpu", 32), artifact_key(model, "torch", 16)}) == 3
    assert artifact_key(model, "cpu", 16, torch.int8) != key  # --kv-cache-dtype int8
    assert artifact_key(model, "cpu", 16, None, "pairs") != key  # kernels/kv_layout.py
    assert artifact_key(model, "cpu", 16, torch.float32) == key  # (the model's dtype)
    assert artifact_key(model.to(torch.bfloat16), "cpu", 16) != key
    model.to(torch.float32)
    eps = model.config.rms_norm_eps
    model.config.rms_norm_eps = eps * 2  # a constant baked into the graph
    try:
        assert artifact_key(model, "cpu", 16) != key
    finally:
        model.config.rms_norm_eps = eps


def test_models_of_one_class_with_other_constants_both_compile_ahead_of_time(tmp_path,
                                                                               monkeypatch):
    """Two configs of one model class in one process (the forward's code is shared, the norm
    eps and head size differ) both compile ahead of time: Dynamo treats their float constants
    as constants, not as an "automatic dynamic" float AOT compilation cannot trace."""
    import services.worker.compiled as compiled
    from tests.helpers import make_tiny_llama

    monkeypatch.setattr(compiled, "_LOADED", {})
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    first = make_tiny_llama(tmp_path / "a", rms_norm_eps=1e-6, head_dim=32)
    second = make_tiny_llama(tmp_path / "b", rms_norm_eps=1e-5)
    for path in (first, second):
        runner = ModelRunner(WorkerConfig(model=str(path), dtype="float32", device="cpu",
                                          kv_cache_memory=1 << 20, attention_backend="cpu"))
        assert runner.forward.source == "compiled", path
