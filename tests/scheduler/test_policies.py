"""Priority scheduling, the long-prefill cap and load shedding."""

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import QueueFullError
from tests.scheduler.factories import (
    FakeWorker,
    expected_output,
    make_request,
    make_requests,
    make_scheduler,
    run_to_completion,
    step_output,
)


def prioritized(index: int, prompt_len: int, priority: int, **sampling) -> Request:
    r = make_request(index, prompt_len, **sampling)
    r.priority = priority
    return r


def test_config_rejects_unknown_policy_and_negative_limits():
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy="lifo")
    for name in ("long_prefill_token_threshold", "max_num_waiting_requests",
                 "max_num_waiting_tokens"):
        with pytest.raises(ValueError, match=name):
            SchedulerConfig(**{name: -1})


def test_fcfs_refuses_a_priority():
    s = make_scheduler()
    with pytest.raises(ValueError, match=r"priority must be 0 unless .* got 2"):
        s.add_request(prioritized(0, 4, 2))


def test_priority_admits_lower_value_first_then_arrival():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    order = [(0, 5), (1, 1), (2, 5), (3, 1), (4, 0)]  # (index, priority)
    for i, prio in order:
        s.add_request(prioritized(i, 4, prio, max_tokens=2))
    w = FakeWorker(s)
    admitted = []
    while s.has_unfinished_requests():
        out = s.schedule()
        admitted += [r.request_id for r in out.new_requests]
        s.update_from_output(out, step_output(out, w.execute(out)))
    assert admitted == ["req-4", "req-1", "req-3", "req-0", "req-2"]


def test_later_high_priority_request_finishes_before_waiting_low_priority_ones():
    """The issue's acceptance case: the cache is full, low-priority requests wait, and a later
    high-priority one overtakes them."""
    s = make_scheduler(8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                       max_model_len=32, scheduling_policy="priority")
    w = FakeWorker(s)
    running = [prioritized(i, 12, 1, max_tokens=6, ignore_eos=True) for i in range(2)]
    for r in running:
        s.add_request(r)
    # both running: 8 of 8 blocks
    s.update_from_output(out := s.schedule(), step_output(out, w.execute(out)))
    waiting = [prioritized(i, 12, 1, max_tokens=6, ignore_eos=True) for i in range(2, 5)]
    for r in waiting:
        s.add_request(r)
    urgent = prioritized(9, 12, 0, max_tokens=6, ignore_eos=True)
    s.add_request(urgent)
    finish_order = [u.request_id for u in run_to_completion(s, w) if u.finish_reason]
    assert finish_order.index("req-9") < min(finish_order.index(r.request_id) for r in waiting)
    for r in [*running, *waiting, urgent]:
        assert (r.output_token_ids, r.finish_reason) == expected_output(r, 32)


def test_priority_preempts_the_lowest_priority_running_request():
    s = make_scheduler(8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                       max_model_len=32, scheduling_policy="priority")
    w = FakeWorker(s)
    low = prioritized(0, 7, 5, max_tokens=20, ignore_eos=True)  # arrives first
    high = prioritized(1, 7, 0, max_tokens=20, ignore_eos=True)
    s.add_request(low)
    s.add_request(high)
    while not s.num_preemptions_total:
        s.update_from_output(out := s.schedule(), step_output(out, w.execute(out)))
    assert low.num_preemptions == 1 and high.num_preemptions == 0
    run_to_completion(s, w)
    for r in (low, high):
        assert (r.output_token_ids, r.finish_reason) == expected_output(r, 32)


def test_preempted_request_keeps_its_place_in_line():
    s = make_scheduler(8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                       max_model_len=32, scheduling_policy="priority")
    w = FakeWorker(s)
    a = prioritized(0, 7, 1, max_tokens=20, ignore_eos=True)
    b = prioritized(1, 7, 2, max_tokens=20, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    while not s.num_preemptions_total:
        s.update_from_output(out := s.schedule(), step_output(out, w.execute(out)))
    late = prioritized(2, 4, 2, max_tokens=2)  # same priority as b, arrives after it
    s.add_request(late)
    assert [r.request_id for r in s.waiting] == ["req-1", "req-2"]


def test_long_prefill_cap_keeps_decodes_moving():
    s = make_scheduler(64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                       max_model_len=128, long_prefill_token_threshold=8)
    w = FakeWorker(s)
    decoder = make_request(0, 4, max_tokens=30, ignore_eos=True)
    s.add_request(decoder)
    s.update_from_output(out := s.schedule(), step_output(out, w.execute(out)))
    s.add_request(long := make_request(1, 100, max_tokens=2))
    steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = s.schedule()
        assert out.num_scheduled_tokens["req-0"] == 1  # the decode runs every step
        assert out.num_scheduled_tokens["req-1"] <= 8
        s.update_from_output(out, step_output(out, w.execute(out)))
        steps += 1
    assert steps == -(-100 // 8)
    run_to_completion(s, w)
    assert (long.output_token_ids, long.finish_reason) == expected_output(long, 128)


def test_without_the_cap_an_older_long_prefill_takes_the_whole_budget():
    """The control for the test above: the starvation that the cap prevents."""
    s = make_scheduler(64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                       max_model_len=128)
    w = FakeWorker(s)
    s.add_request(make_request(0, 100, max_tokens=2))
    s.add_request(make_request(1, 4, max_tokens=30, ignore_eos=True))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"req-0": 32}
    s.update_from_output(out, step_output(out, w.execute(out)))


def test_load_shedding_by_request_count():
    s = make_scheduler(max_num_seqs=1, max_num_waiting_requests=2)
    for r in make_requests(2, 4):
        s.add_request(r)
    with pytest.raises(QueueFullError, match=r"2 requests waiting \(--max-num-waiting-requests 2"):
        s.add_request(make_request(2, 4))
    assert s.num_rejected_total == 1 and s.get_request("req-2") is None
    # req-0 admitted
    s.update_from_output(out := s.schedule(), step_output(out, FakeWorker(s).execute(out)))
    s.add_request(make_request(3, 4))  # room again


def test_load_shedding_by_tokens_always_takes_one_request():
    s = make_scheduler(max_num_seqs=1, max_num_waiting_tokens=10)
    s.add_request(make_request(0, 50))  # longer than the limit, but the queue is empty
    with pytest.raises(QueueFullError, match=r"50 tokens waiting, this request adds 4"):
        s.add_request(make_request(1, 4))
    run_to_completion(s)


def test_waiting_token_count_follows_the_queue():
    s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    reqs = make_requests(3, 5, max_tokens=2)
    for r in reqs:
        s.add_request(r)
    assert s.waiting.num_tokens == 15
    s.abort_request("req-2")
    assert s.waiting.num_tokens == 10
    run_to_completion(s)
    assert s.waiting.num_tokens == 0


@pytest.mark.parametrize(("flag", "value"), [
    ("--max-num-waiting-requests", -1), ("--max-num-waiting-tokens", -3),
    ("--long-prefill-token-threshold", -5), ("--max-num-seqs", 0),
])
def test_scheduler_config_out_of_range_fails_before_waiting_for_workers(flag, value):
    """argparse already refuses these on the command line (tests/test_flags.py); serve() checks
    again for callers that build the namespace themselves (the in-process test stack)."""
    import argparse
    import asyncio

    from services.scheduler import server

    p = argparse.ArgumentParser()
    server.add_args(p)
    # NOTE: no worker listens at this address: serve() must fail on the value, not wait
    args = p.parse_args(["--port", "0", "--workers", "127.0.0.1:1"])
    setattr(args, flag[2:].replace("-", "_"), value)
    with pytest.raises(ValueError, match=f"^{flag}: .*got {value}"):
        asyncio.run(asyncio.wait_for(server.serve(args), timeout=10))


def test_long_prefill_threshold_defaults_to_a_quarter_of_the_budget():
    import argparse

    from services.scheduler import server

    p = argparse.ArgumentParser()
    server.add_args(p)
    config = server.scheduler_config(p.parse_args(["--max-num-batched-tokens", "1000"]), 4096)
    assert config.long_prefill_token_threshold == 250
    assert server.scheduler_config(p.parse_args(["--long-prefill-token-threshold", "0"]),
                                   4096).long_prefill_token_threshold == 0
