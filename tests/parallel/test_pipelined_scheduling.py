"""The core scheduler with several steps in flight (pipeline parallelism), pure Python."""

from __future__ import annotations

from collections import deque

import pytest

from tests.scheduler.factories import (
    FakeWorker,
    expected_output,
    make_requests,
    make_scheduler,
    step_output,
)


def _run(max_steps_in_flight: int, num_kv_blocks: int = 64, n: int = 6,
         async_scheduling: bool = False):
    """Drive the scheduler with up to ``max_steps_in_flight`` steps sent ahead; the fake worker
    applies each step as it is sent (workers run steps in order), results come back later."""
    s = make_scheduler(num_kv_blocks, max_num_batched_tokens=16, max_model_len=32,
                       pipeline_parallel_size=1 if async_scheduling else max_steps_in_flight,
                       long_prefill_token_threshold=8,
                       async_scheduling=async_scheduling)
    w = FakeWorker(s)
    requests = make_requests(n, 11, max_tokens=7)
    for r in requests:
        s.add_request(r)
    pending: deque = deque()
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    most_in_flight = look_ahead = 0
    while s.has_unfinished_requests() or pending:
        while len(pending) < max_steps_in_flight and s.has_unfinished_requests():
            out = s.schedule()
            if out.total_num_scheduled_tokens == 0 and not out.finished_request_ids:
                break
            owing = {rid for o, _ in pending for rid in o.sampled_req_ids}
            if async_scheduling:
                look_ahead += len(owing & out.num_scheduled_tokens.keys())
            else:
                assert not owing & out.num_scheduled_tokens.keys(), "scheduled before its token"
            pending.append((out, w.execute(out)))
        most_in_flight = max(most_in_flight, len(pending))
        out, sampled = pending.popleft()
        for u in s.update_from_output(out, step_output(out, sampled)):
            outputs[u.request_id] += u.new_token_ids
    assert s.block_manager.num_free_blocks == num_kv_blocks
    assert (look_ahead > 0) == async_scheduling
    return requests, outputs, most_in_flight, s


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_kv_blocks", [64, 12])  # 12: preemptions while steps are in flight
def test_two_steps_in_flight_give_the_serial_outputs(num_kv_blocks, async_scheduling):
    requests, outputs, most_in_flight, s = _run(2, num_kv_blocks,
                                                async_scheduling=async_scheduling)
    assert most_in_flight == 2
    for r in requests:
        assert outputs[r.request_id] == expected_output(r, 32)[0]
    if num_kv_blocks == 12:
        assert s.num_preemptions_total > 0


def test_a_second_step_in_flight_has_nothing_for_requests_awaiting_tokens():
    s = make_scheduler(pipeline_parallel_size=2)
    for r in make_requests(3, 4):
        s.add_request(r)
    first = s.schedule()
    assert s.schedule().num_scheduled_tokens == {}  # everything is in the first step
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        make_scheduler(pipeline_parallel_size=0)
    s.update_from_output(first, step_output(first, {}))
    with pytest.raises(ValueError, match="applied before"):
        s.update_from_output(first, step_output(first, {}))
