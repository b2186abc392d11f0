"""A seeded request draws what it would have drawn without a preemption: a step that was in
flight when the scheduler preempted it (async scheduling) drew from its generator, and the
resume rewinds the generator past that draw (``sampling_rows.rewind_generator``)."""

from __future__ import annotations

import pytest

from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner

PROMPT = [5, 17, 99, 3, 250, 41, 7]
SEEDED = EngineSamplingParams(temperature=1.0, seed=1234)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny forwards: one thread."""


@pytest.fixture(scope="module")
def runner(tiny_llama) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                    kv_cache_memory=4 << 20, attention_backend="torch",
                                    max_num_seqs=8))


def decode(runner, rid, tokens, step_id):
    out = runner.execute_step(StepInput(step_id, [], [
        CachedRequest(rid, [], [], False, len(tokens) - 1, 1)], []))
    return out.sampled_token_ids[0]


def test_a_resume_after_a_dropped_step_draws_the_same_tokens(runner):
    blocks = list(range(4))
    out = runner.execute_step(StepInput(0, [NewRequest("a", PROMPT, SEEDED, blocks, 0,
                                                       len(PROMPT))], [], []))
    plain = PROMPT + out.sampled_token_ids
    for step in range(1, 6):
        plain.append(decode(runner, "a", plain, step))
    runner.execute_step(StepInput(6, [], [], ["a"]))

    out = runner.execute_step(StepInput(7, [NewRequest("b", PROMPT, SEEDED, blocks, 0,
                                                       len(PROMPT))], [], []))
    tokens = PROMPT + out.sampled_token_ids
    for step in (8, 9):
        tokens.append(decode(runner, "b", tokens, step))
    dropped = decode(runner, "b", tokens, 10)  # in flight when "b" was preempted: dropped
    assert dropped == plain[len(tokens)]
    out = runner.execute_step(StepInput(11, [], [  # the resume recomputes prompt + outputs
        CachedRequest("b", list(tokens), blocks, True, 0, len(tokens))], []))
    tokens += out.sampled_token_ids
    for step in (12, 13):
        tokens.append(decode(runner, "b", tokens, step))
    runner.execute_step(StepInput(14, [], [], ["b"]))
    assert tokens == plain
