"""Pipeline parallelism (and TP x PP): greedy tokens equal one rank's, exactly (float32)."""

from __future__ import annotations

import pytest

from services.scheduler.worker_client import WorkerGroup
from tests.parallel.conftest import PROMPTS, ParallelStack, reference_greedy, stack_greedy

MAX_TOKENS = 6


def _count_steps_in_flight(monkeypatch) -> dict:
    """Track how many steps the (in-process) scheduler has sent but not received."""
    seen = {"now": 0, "most": 0}
    send, receive = WorkerGroup.send, WorkerGroup.receive

    async def counting_send(self, out):
        await send(self, out)
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])

    async def counting_receive(self, out):
        seen["now"] -= 1
        return await receive(self, out)
    monkeypatch.setattr(WorkerGroup, "send", counting_send)
    monkeypatch.setattr(WorkerGroup, "receive", counting_receive)
    return seen


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_pipeline_equals_single_rank(tiny_model, tp, pp, monkeypatch):
    seen = _count_steps_in_flight(monkeypatch)
    expected = reference_greedy(tiny_model, PROMPTS, MAX_TOKENS)
    # NOTE: a small token budget splits the prompts over several micro-batches (chunked
    # prefill), so two steps really are in flight at once with different requests.
    stack = ParallelStack(tiny_model, tp=tp, pp=pp, scheduler_argv=[
        "--max-num-batched-tokens", "8", "--long-prefill-token-threshold", "0"]).start()
    try:
        assert stack_greedy(stack, PROMPTS, MAX_TOKENS) == expected
        assert seen["most"] == pp, "the scheduler never had one step in flight per stage"
    finally:
        stack.stop()
