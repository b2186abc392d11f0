"""The scheduler's step, as is, runs on the worker in one process: ``Scheduler.schedule()`` ->
``StepInput.for_rank`` -> ``ModelRunner.execute_step`` -> ``Scheduler.update_from_output``
(no protobuf in between), with async scheduling off and on, keeping as many steps in flight
as the engine loop does. The tokens equal transformers' float32 greedy ``generate`` (the
reference ``tests/worker/test_model.py`` ties the runner to, and the stack tests the stack)."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from transformers import LlamaForCausalLM

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import EngineSamplingParams, Request
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner

NEW_TOKENS = 8


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None  # (ignore_eos below)
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def run_in_process(runner: ModelRunner, config: SchedulerConfig, prompts: list[list[int]],
                   max_tokens: int) -> list[list[int]]:
    """Greedy outputs of ``prompts`` (ignore_eos, ``max_tokens`` each) through ``Scheduler``
    and ``runner`` in this process, as the engine loop runs them: the scheduler's step, through
    ``for_rank``, straight to ``execute_step`` and its ``StepOutput`` straight back, with
    ``config.max_steps_in_flight`` steps in flight. Checks that nothing was recomputed and
    that the runner holds no request afterwards."""
    scheduler = Scheduler(config, runner.num_kv_blocks, runner.eos_token_ids)
    for i, p in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", p, EngineSamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending: deque = deque()  # (step, its StepOutput): executed in order, applied later
    while scheduler.has_unfinished_requests() or pending:
        while (len(pending) < config.max_steps_in_flight
               and scheduler.has_unfinished_requests()):
            step = scheduler.schedule()
            if step.total_num_scheduled_tokens == 0 and not step.finished_request_ids:
                break
            pending.append((step, runner.execute_step(step.for_rank(samples=True))))
        step, output = pending.popleft()
        for u in scheduler.update_from_output(step, output):
            outputs[u.request_id] += u.new_token_ids
            if u.new_token_ids:  # greedy: the sampled token is the most likely one
                assert u.logprobs is not None and u.logprobs.top_token_ids == u.new_token_ids
    # NOTE: a request the runner owed a token and sent none would be recomputed (preempted),
    # hiding a step the runner got wrong (e.g. its own samples sent again)
    assert scheduler.num_preemptions_total == 0
    runner.execute_step(scheduler.schedule().for_rank(samples=True))  # (drop the finished)
    assert not runner.input_batch.requests
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_schedulers_step_runs_on_the_runner_as_is(tiny_llama, one_torch_thread,
                                                     async_scheduling):
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, attention_backend="torch"))
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                             block_size=runner.block_size, async_scheduling=async_scheduling)
    assert config.max_steps_in_flight == (2 if async_scheduling else 1)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 9, 40)]
    # (40 tokens: a prefill chunked over two steps)
    got = run_in_process(runner, config, prompts, NEW_TOKENS)
    ref = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert got == [_hf_greedy(ref, p, NEW_TOKENS) for p in prompts]
