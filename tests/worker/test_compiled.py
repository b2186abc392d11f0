"""The compiled forward (services/worker/compiled.py): one graph for every step shape, the same
hidden states as the eager model, and the cases that run eagerly."""

from __future__ import annotations

import pytest
import torch

from services.worker.compiled import CompiledForward, why_eager
from services.worker.model_runner import ModelRunner
from services.worker.step_input import CachedRequest, NewRequest, SamplingOptions, StepInput

GREEDY = SamplingOptions(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-compiled"))


def _steps() -> list[StepInput]:
    """Steps of every shape that could ask for a graph of its own: one token alone, one
    sequence with a one-block table, a chunked prefill beside decodes, a prefix-hit tail, many
    sequences, a request resumed from preemption."""
    toks = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((1, 5, 40, 70, 3))]
    return [
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
        StepInput(5, [], [CachedRequest("forty", [15], [11, 12, 13], True, 0, 42)], []),
    ]


def test_compiled_forward_equals_eager_with_one_graph_for_every_step(tiny_llama, monkeypatch):
    """After the warm-up compile, no step recompiles (torch raises if one would), and each
    step's hidden states equal the eager model's at float32 (same ops, fused: only the
    float rounding of reordered reductions may differ)."""
    runner = ModelRunner(str(tiny_llama), dtype="float32", device="cpu",
                         kv_cache_memory=4 << 20, attention_backend="cpu")
    assert isinstance(runner.forward, CompiledForward) and runner.eager_reason is None
    assert runner.forward.compile_seconds is not None  # compiled at start, by the warm-up
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    batch = runner.input_batch
    with torch.inference_mode():
        for step in _steps():
            prepared = batch.prepare(batch.update(step))
            args = (prepared.input_ids, prepared.positions, runner.kv_caches,
                    prepared.attn_metadata)
            compiled = runner.forward(*args)
            eager = runner.model(*args)
            assert compiled.shape == eager.shape == (prepared.input_ids.shape[0], 64)
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_enforce_eager_runs_the_plain_module(tiny_llama):
    runner = ModelRunner(str(tiny_llama), dtype="float32", device="cpu",
                         kv_cache_memory=1 << 20, attention_backend="cpu", enforce_eager=True)
    assert runner.forward is runner.model and runner.eager_reason == "--enforce-eager"


def test_why_eager_names_each_reason(monkeypatch):
    cpu = torch.device("cpu")
    assert why_eager(False, cpu, "cpu", 1) is None
    assert why_eager(True, cpu, "cpu", 1) == "--enforce-eager"
    assert "torch" in why_eager(False, cpu, "torch", 1)
    assert "cuda" in why_eager(False, torch.device("cuda", 0), "triton", 1)
    assert "parallel" in why_eager(False, cpu, "cpu", 2)
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", ("no-such-compiler-x",))
    assert "C++ compiler" in why_eager(False, cpu, "cpu", 1)


def test_explicit_cpu_backend_compiles_in_a_fresh_process(tiny_llama):
    """``--attention-backend cpu`` (not auto, which loads the library while choosing) in a new
    process: the native library is loaded before Dynamo traces, not inside the trace."""
    import subprocess
    import sys

    code = ("from services.worker.model_runner import ModelRunner\n"
            f"r = ModelRunner({str(tiny_llama)!r}, dtype='float32', device='cpu', "
            "kv_cache_memory=1 << 20, attention_backend='cpu')\n"
            "assert r.eager_reason is None and r.forward.compile_seconds is not None\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
