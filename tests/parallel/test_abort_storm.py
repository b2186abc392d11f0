"""The pipeline-parallel abort storm through the whole stack (issue 17, item 3).

With several steps in flight, cancelling the only request of a step that is still running used
to make the scheduler drop that step from its in-flight bookkeeping while the engine loop still
waited for it; the late result raised, the loop task died, and health kept answering SERVING
while every later request hung. Here: 200 concurrent streams of which half are cancelled at
random points, then 50 streams one at a time each cancelled after 1-12 tokens, then one normal
request, which must get the single-rank greedy tokens; health stays SERVING, no KV block is
leaked, and the engine loop never failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import pytest

from services.common.grpc_utils import health_status
from tests.parallel.conftest import ParallelStack, reference_greedy
from tests.stack_harness import _wait_idle

pytestmark = pytest.mark.slow


async def _stream(client, prompt: list[int], max_tokens: int, cancel_after: int | None
                  ) -> list[int]:
    """Stream one greedy request; leave after ``cancel_after`` tokens (cancels it)."""
    tokens: list[int] = []
    async with contextlib.aclosing(client.stream(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0,
            ignore_eos=True)) as deltas:
        async for delta in deltas:
            tokens += delta.token_ids
            if cancel_after is not None and len(tokens) >= cancel_after:
                break
    return tokens


async def _storm(address: str, rng: random.Random, final_prompt: list[int]) -> list[int]:
    from pagedserve_client import AsyncClient

    def prompt() -> list[int]:
        return [rng.randint(3, 200) for _ in range(rng.randint(1, 40))]

    async with AsyncClient(address, timeout=120) as client:
        await asyncio.gather(*(
            _stream(client, prompt(), rng.randint(8, 40), rng.randint(1, 20) if i % 2 else None)
            for i in range(200)))
        for _ in range(50):
            await _stream(client, prompt(), 40, rng.randint(1, 12))
        return await _stream(client, final_prompt, 16, None)


@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_abort_storm_keeps_serving(tiny_model, pp, caplog):
    caplog.set_level(logging.ERROR)
    final_prompt = [5, 17, 42, 9, 100, 3]
    expected = reference_greedy(tiny_model, [final_prompt], 16)[0]
    stack = ParallelStack(tiny_model, pp=pp).start()
    try:
        tokens = asyncio.run(_storm(stack.address, random.Random(pp), final_prompt))
        assert tokens == expected
        for address in (stack.scheduler_address, stack.address):
            assert asyncio.run(health_status(address, 5.0)) == "SERVING"
        stats = _wait_idle(stack.scheduler_address, 30)
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
        assert "engine loop failed" not in caplog.text
    finally:
        stack.stop()
