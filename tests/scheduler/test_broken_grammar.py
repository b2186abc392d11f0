"""The engine ends a request whose grammar broke in the worker (``StepOutput.
broken_request_ids``) with INTERNAL and the worker's message, frees its blocks, never outputs
the token that broke it, and leaves the other requests of the step alone (issue 56)."""

from __future__ import annotations

import asyncio

import grpc

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.common.step import StepOutput
from services.scheduler.engine import Engine, RouterSink
from tests.helpers import asynctest
from tests.scheduler.factories import FakeRanks, make_scheduler

MESSAGE = ("structured output (json_schema) cannot be honoured: the matcher refused token 90: "
           "Parser Error: Current row has 3999 items; max is 2000")


class GrammarBreakingRanks(FakeRanks):
    """Fake ranks whose driver reports request "req-0" broken at its third sampled token (the
    fake worker still sampled it, as the real one does: the engine must not output it)."""

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.samples = 0

    async def receive(self, out) -> StepOutput:
        result = await super().receive(out)
        if "req-0" in result.request_ids:
            self.samples += 1
            if self.samples == 3:
                result.broken_request_ids, result.broken_messages = ["req-0"], [MESSAGE]
        return result


@asynctest
async def test_a_broken_grammar_ends_its_request_with_internal_and_frees_its_blocks():
    scheduler = make_scheduler(64)
    engine = Engine(scheduler, GrammarBreakingRanks(scheduler))
    sink = RouterSink()
    params = EngineSamplingParams(max_tokens=8, ignore_eos=True).to_pb()
    for rid in ("req-0", "req-1"):
        engine.submit(sink, engine_pb2.SubmitRequest(
            request_id=rid, prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=params))
    loop = asyncio.ensure_future(engine.run())
    try:
        got: dict[str, list[engine_pb2.RequestOutput]] = {"req-0": [], "req-1": []}
        async with asyncio.timeout(10):
            while not all(g and g[-1].finish_reason for g in got.values()):
                for o in (await sink.queue.get()).outputs:
                    got[o.request_id].append(o)
        bad, good = got["req-0"], got["req-1"]
    finally:
        loop.cancel()
    final = bad[-1]
    assert final.error_code == grpc.StatusCode.INTERNAL.value[0]
    assert final.error_message == MESSAGE
    assert final.finish_reason != api_pb2.FINISH_REASON_STOP
    assert final.finish_reason != api_pb2.FINISH_REASON_LENGTH
    # two tokens output before the step that broke; that step's token is not
    assert sum(len(o.new_token_ids) for o in bad) == 2
    assert good[-1].error_code == 0 and good[-1].finish_reason == api_pb2.FINISH_REASON_LENGTH
    assert sum(len(o.new_token_ids) for o in good) == 8
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
