"""Scheduler behaviour: the scheduling rule (docs/architecture.md), preemption, diffs, finishing.

Every run goes through FakeWorker (factories.py), which rebuilds the worker's view from the
diffs and checks it and the fake KV cache at every step, on top of what each test asserts.
"""

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import EngineSamplingParams, FinishReason, RequestStatus
from tests.scheduler.factories import (
    FakeWorker,
    expected_output,
    fake_token,
    make_request,
    make_requests,
    make_scheduler,
    run_to_completion,
    step_output,
)


def outputs_by_id(requests):
    return {r.request_id: (r.output_token_ids, r.finish_reason) for r in requests}


# --- construction and admission checks -----------------------------------------------------


@pytest.mark.parametrize(
    "field", ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"]
)
def test_config_rejects_non_positive(field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: 0})


def test_startup_refuses_cache_smaller_than_one_max_len_request():
    with pytest.raises(ValueError) as err:
        make_scheduler(7, block_size=4, max_model_len=32)
    assert str(err.value) == (
        "KV cache has 7 blocks (28 tokens) but max_model_len=32 needs 8 blocks; "
        "raise --kv-cache-memory or lower --max-model-len"
    )
    make_scheduler(8, block_size=4, max_model_len=32)  # exactly fits
    make_scheduler(8, block_size=4, max_model_len=29)  # ceil(29 / 4) = 8


def test_add_request_validation():
    s = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request(make_request(0, 0))
    with pytest.raises(ValueError, match="no room for output"):
        s.add_request(make_request(1, 16))
    s.add_request(make_request(2, 15))
    with pytest.raises(ValueError, match="request_id 'req-2' is already running"):
        s.add_request(make_request(2, 3))
    assert s.num_waiting == 1 and s.has_unfinished_requests()


# --- the scheduling rule --------------------------------------------------------------------


def test_a_stage_that_does_not_sample_is_sent_the_new_tokens():
    """Under pipeline parallelism the step carries each request's new tokens (the earlier
    stages need them); the last stage's view (``for_rank``) drops them."""
    s = make_scheduler(block_size=4, pipeline_parallel_size=2)
    s.add_request(make_request(0, 10, max_tokens=3))
    w = FakeWorker(s)
    out = s.schedule()
    s.update_from_output(out, step_output(out, w.execute(out)))
    out = s.schedule()
    (cached,) = out.cached_requests
    assert cached.new_token_ids == [fake_token("req-0", 10)]
    assert out.for_rank(samples=False) is out
    assert out.for_rank(samples=True).cached_requests[0].new_token_ids == []
    assert cached.new_token_ids == [fake_token("req-0", 10)]  # (the step itself unchanged)


def test_single_request_prefill_then_decode_with_diffs():
    s = make_scheduler(block_size=4)
    r = make_request(0, 10, max_tokens=3)
    s.add_request(r)
    w = FakeWorker(s)

    out = s.schedule()
    assert out.num_scheduled_tokens == {"req-0": 10} and out.total_num_scheduled_tokens == 10
    (new,) = out.new_requests
    assert out.cached_requests == []
    assert new.prompt_token_ids == r.prompt_token_ids and new.block_ids == [0, 1, 2]
    assert new.num_computed_tokens == 0 and new.sampling_params is r.sampling_params
    (update,) = s.update_from_output(out, step_output(out, w.execute(out)))
    t0 = fake_token("req-0", 10)
    assert (update.new_token_ids, update.finish_reason) == ([t0], None)
    assert (update.num_prompt_tokens, update.num_output_tokens) == (10, 1)
    assert r.num_computed_tokens == 10 and r.num_tokens == 11

    out = s.schedule()
    assert out.num_scheduled_tokens == {"req-0": 1} and out.new_requests == []
    (cached,) = out.cached_requests
    # (one stage: the worker appended t0 itself, so the step does not carry it)
    assert cached.new_token_ids == [] and cached.new_block_ids == []  # slot 10: block 2
    assert cached.num_computed_tokens == 10 and not cached.resumed_from_preemption
    s.update_from_output(out, step_output(out, w.execute(out)))

    out = s.schedule()  # slot 11 still in block 2; then slot 12 would need block 3
    assert out.cached_requests[0].new_block_ids == []
    (update,) = s.update_from_output(out, step_output(out, w.execute(out)))
    assert update.finish_reason is FinishReason.LENGTH and update.num_output_tokens == 3
    assert r.status is RequestStatus.FINISHED and r.block_ids == []
    assert s.num_running == 0 and not s.has_unfinished_requests()
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert s.get_request("req-0") is None

    out = s.schedule()  # the finish reaches the workers with the next step
    assert out.finished_request_ids == {"req-0"} and out.total_num_scheduled_tokens == 0
    w.execute(out)
    assert w.states == {}
    assert s.schedule().finished_request_ids == set()


def test_continuous_batching_join_next_step_leave_at_once():
    s = make_scheduler()
    w = FakeWorker(s)
    a = make_request(0, 6, max_tokens=3)
    s.add_request(a)
    w.step()
    b = make_request(1, 5, max_tokens=4)
    s.add_request(b)
    out = s.schedule()  # a decodes, b prefills: one mixed batch
    assert out.num_scheduled_tokens == {"req-0": 1, "req-1": 5}
    assert [n.request_id for n in out.new_requests] == ["req-1"]
    assert [c.request_id for c in out.cached_requests] == ["req-0"]
    s.update_from_output(out, step_output(out, w.execute(out)))
    updates = w.step()  # a's third token: a finishes and leaves in this very update
    assert {u.request_id: u.finish_reason for u in updates} == {
        "req-0": FinishReason.LENGTH,
        "req-1": None,
    }
    assert s.running == [b]
    out = s.schedule()
    assert out.finished_request_ids == {"req-0"} and out.num_scheduled_tokens == {"req-1": 1}
    s.update_from_output(out, step_output(out, w.execute(out)))
    run_to_completion(s, w)
    assert outputs_by_id([a, b]) == {
        r.request_id: expected_output(r, 128) for r in (a, b)
    }


def test_chunked_prefill_of_a_prompt_longer_than_the_budget():
    s = make_scheduler(block_size=8, max_num_batched_tokens=32, max_model_len=256)
    w = FakeWorker(s)
    r = make_request(0, 100, max_tokens=2)
    s.add_request(r)
    seen = []
    for _ in range(4):
        out = s.schedule()
        data = (out.new_requests or out.cached_requests)[0]
        seen.append((out.num_scheduled_tokens["req-0"], data.num_computed_tokens))
        updates = s.update_from_output(out, step_output(out, w.execute(out)))
        if data.num_computed_tokens + out.num_scheduled_tokens["req-0"] < 100:
            assert updates == [] and r.output_token_ids == []
            assert r.status is RequestStatus.RUNNING
        if out.cached_requests:
            assert data.new_token_ids == []  # nothing new to tell mid-prefill
            assert len(data.new_block_ids) == 4 or data.num_computed_tokens == 96
    assert seen == [(32, 0), (32, 32), (32, 64), (4, 96)]
    assert len(r.block_ids[0]) == 13 and r.num_output_tokens == 1
    run_to_completion(s, w)
    assert r.output_token_ids == expected_output(r, 256)[0]


def test_mid_prefill_sampled_token_is_ignored():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request(0, 20))
    out = s.schedule()
    assert s.update_from_output(out, step_output(out, {"req-0": 42})) == []
    assert s.get_request("req-0").output_token_ids == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_missing_sampled_token_recomputes_the_request(async_scheduling):
    """A token the worker owed and did not send (a worker bug): the request is recomputed from
    its whole token list, as after a preemption, and still ends with the right tokens."""
    s = make_scheduler(async_scheduling=async_scheduling,  # (two steps in flight either way)
                       pipeline_parallel_size=1 if async_scheduling else 2)
    w = FakeWorker(s)
    r = make_request(0, 6, max_tokens=3)
    s.add_request(r)
    out = s.schedule()
    w.execute(out)  # the worker samples (and keeps) a token the scheduler never gets
    ahead = s.schedule()
    w.execute(ahead)
    assert s.update_from_output(out, step_output(out, {})) == []
    assert r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0
    # stale: a new epoch
    assert s.update_from_output(ahead, step_output(ahead, {"req-0": 99})) == []
    resumed = s.schedule()
    assert resumed.cached_requests[0].resumed_from_preemption
    assert resumed.cached_requests[0].new_token_ids == r.all_token_ids
    s.update_from_output(resumed, step_output(resumed, w.execute(resumed)))
    run_to_completion(s, w)
    assert r.output_token_ids == expected_output(r, 128)[0]
    run_to_completion(s, w)
    assert r.output_token_ids == expected_output(r, 128)[0]


def test_token_budget_and_max_num_seqs_are_respected():
    s = make_scheduler(128, max_num_seqs=3, max_num_batched_tokens=20, max_model_len=64)
    w = FakeWorker(s)
    reqs = make_requests(10, 8, max_tokens=5)
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    # FIFO admission until the budget runs out: 8 + 8 + 4 (a partial chunk).
    assert out.num_scheduled_tokens == {"req-0": 8, "req-1": 8, "req-2": 4}
    s.update_from_output(out, step_output(out, w.execute(out)))
    while s.has_unfinished_requests():
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= 20
        assert len(out.num_scheduled_tokens) <= 3 and s.num_running <= 3
        s.update_from_output(out, step_output(out, w.execute(out)))
    assert all(r.num_output_tokens == 5 for r in reqs)


def test_running_requests_go_first_then_waiting_get_the_rest():
    s = make_scheduler(max_num_batched_tokens=10)
    w = FakeWorker(s)
    s.add_request(make_request(0, 4))
    w.step()
    s.add_request(make_request(1, 30))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"req-0": 1, "req-1": 9}


def test_admission_is_fifo_in_arrival_order():
    s = make_scheduler(max_num_seqs=2)
    w = FakeWorker(s)
    for r in make_requests(5, 3, max_tokens=2):
        s.add_request(r)
    order = []
    while s.has_unfinished_requests():
        out = s.schedule()
        order += [n.request_id for n in out.new_requests]
        s.update_from_output(out, step_output(out, w.execute(out)))
    assert order == [f"req-{i}" for i in range(5)]


# --- preemption -----------------------------------------------------------------------------


def test_preemption_victim_is_latest_arrival_and_everyone_finishes():
    # 8 blocks of 4 slots; 4 requests each growing to 16 tokens (4 blocks): 16 > 8 blocks.
    s = make_scheduler(8, block_size=4, max_model_len=32)
    w = FakeWorker(s)
    reqs = make_requests(4, 4, max_tokens=12)
    for r in reqs:
        s.add_request(r)
    while True:
        out = s.schedule()
        if s.num_preemptions_total:  # (the first step that preempted)
            break
        s.update_from_output(out, step_output(out, w.execute(out)))
    # All four cross into their 3rd block together: req-0 and req-1 take req-3's two blocks,
    # then req-2 finds none and is itself the tail. Victims go tail first, each to the front.
    assert [r.request_id for r in reqs if r.num_preemptions] == ["req-2", "req-3"]
    assert list(s.waiting) == reqs[2:]
    for victim in reqs[2:]:
        assert victim.status is RequestStatus.PREEMPTED and victim.num_preemptions == 1
        assert victim.num_computed_tokens == 0 and victim.block_ids == []
        assert victim.num_output_tokens == 5  # keeps its output (slot 8 needed a 3rd block)
    assert s.num_preemptions_total == 2 and s.running == reqs[:2]
    assert set(out.num_scheduled_tokens) == {"req-0", "req-1"}
    victim = reqs[3]
    s.update_from_output(out, step_output(out, w.execute(out)))

    resumed = None
    while s.has_unfinished_requests():
        out = s.schedule()
        for c in out.cached_requests:
            if c.resumed_from_preemption and c.request_id == "req-3":
                req3 = s.get_request("req-3")
                num_scheduled = out.num_scheduled_tokens["req-3"]
                resumed = (c, list(req3.block_ids[0]), num_scheduled, req3.num_tokens)
        s.update_from_output(out, step_output(out, w.execute(out)))
        s.block_manager.check_invariants(s.requests.values())
    data, table, num_scheduled, num_tokens = resumed
    assert data.new_block_ids == table and data.num_computed_tokens == 0
    # the whole token list when it resumed (the workers replace theirs)
    assert data.new_token_ids == victim.all_token_ids[:num_tokens]
    assert num_scheduled == num_tokens  # recomputes prompt + all outputs so far in one go
    assert all(r.num_output_tokens == 12 and r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert outputs_by_id(reqs) == {r.request_id: expected_output(r, 32) for r in reqs}
    assert s.block_manager.num_free_blocks == 8


def test_preempting_run_matches_an_unconstrained_run():
    def run(num_blocks):
        s = make_scheduler(num_blocks, block_size=2, max_model_len=24, max_num_batched_tokens=9)
        reqs = make_requests(6, 5, max_tokens=15)
        for r in reqs:
            s.add_request(r)
        run_to_completion(s)
        return s, outputs_by_id(reqs)

    tight, tight_out = run(12)
    roomy, roomy_out = run(200)
    assert tight.num_preemptions_total > 0 and roomy.num_preemptions_total == 0
    assert tight_out == roomy_out
    assert all(len(tokens) == 15 for tokens, _ in tight_out.values())


def test_self_preemption_no_admission_that_step_and_fifo_blocking():
    s = make_scheduler(8, block_size=4, max_model_len=32)
    w = FakeWorker(s)
    a = make_request(0, 4, max_tokens=20)
    b = make_request(1, 24, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    w.step()  # a: 1 block, b: 6 blocks; 1 free
    s.add_request(c := make_request(2, 2, max_tokens=1))
    assert s.num_preemptions_total == 0
    out = s.schedule()  # a takes the last block; b needs a 7th: b is the tail, preempts itself
    assert s.num_preemptions_total == 1 and b.num_preemptions == 1
    assert b.status is RequestStatus.PREEMPTED and out.num_scheduled_tokens == {"req-0": 1}
    assert list(s.waiting) == [b, c]  # c would fit, but no admission in a preempting step
    s.update_from_output(out, step_output(out, w.execute(out)))
    # b needs 7 blocks, 6 are free until a finishes: c (1 block) must not skip ahead of b.
    while b.status is not RequestStatus.RUNNING:
        assert c.status is RequestStatus.WAITING and list(s.waiting) == [b, c]
        w.step()
    assert a.status is RequestStatus.FINISHED
    run_to_completion(s, w)
    assert outputs_by_id([a, b, c]) == {r.request_id: expected_output(r, 32) for r in (a, b, c)}


# --- abort ----------------------------------------------------------------------------------


def test_abort_running_frees_blocks_and_tells_the_worker():
    s = make_scheduler()
    w = FakeWorker(s)
    a, b = make_requests(2, 6)
    s.add_request(a)
    s.add_request(b)
    w.step()
    used = s.block_manager.num_blocks - s.block_manager.num_free_blocks
    update = s.abort_request("req-0")
    assert (update.request_id, update.new_token_ids, update.finish_reason) == (
        "req-0", [], FinishReason.ABORT
    )
    assert update.num_prompt_tokens == 6 and update.num_output_tokens == 1
    assert a.status is RequestStatus.FINISHED and a.block_ids == []
    assert s.block_manager.num_blocks - s.block_manager.num_free_blocks == used - 2
    assert s.abort_request("req-0") is None and s.abort_request("nope") is None
    out = s.schedule()
    assert out.finished_request_ids == {"req-0"} and set(out.num_scheduled_tokens) == {"req-1"}
    s.update_from_output(out, step_output(out, w.execute(out)))


def test_abort_waiting_never_seen_is_not_sent():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request(0, 4))
    s.add_request(make_request(1, 4))
    s.abort_request("req-1")
    out = s.schedule()
    assert out.finished_request_ids == set() and s.num_waiting == 0


def test_abort_while_step_in_flight_ignores_its_token():
    s = make_scheduler()
    w = FakeWorker(s)
    s.add_request(make_request(0, 4))
    s.add_request(make_request(1, 4))
    out = s.schedule()
    sampled = w.execute(out)
    s.abort_request("req-0")
    updates = s.update_from_output(out, step_output(out, sampled))
    assert [u.request_id for u in updates] == ["req-1"]
    assert s.schedule().finished_request_ids == {"req-0"}


def test_a_request_awaiting_its_token_is_not_scheduled_again_and_a_step_applies_once():
    """Schedule-time accounting: once scheduled to its end, a request has nothing to compute
    until its token arrives; applying the same step twice is refused."""
    s = make_scheduler()
    s.add_request(make_request(0, 4))
    out = s.schedule()
    assert s.get_request("req-0").num_computed_tokens == 4  # counted when scheduled
    assert s.schedule().num_scheduled_tokens == {}
    updates = s.update_from_output(out, step_output(out, {"req-0": 11}))
    assert [u.new_token_ids for u in updates] == [[11]]
    assert s.schedule().num_scheduled_tokens == {"req-0": 1}
    with pytest.raises(ValueError, match="applied before"):
        s.update_from_output(out, step_output(out, {"req-0": 11}))


def test_a_lost_step_whose_requests_were_all_aborted_does_not_block():
    """A worker failure: the step comes back late (or never) after the engine aborted
    everything; scheduling goes on, and the late result changes nothing."""
    s = make_scheduler()
    s.add_request(make_request(0, 4))
    lost = s.schedule()
    s.abort_request("req-0")
    s.add_request(make_request(1, 4))
    out = s.schedule()
    assert out.finished_request_ids == {"req-0"} and out.num_scheduled_tokens == {"req-1": 4}
    assert s.update_from_output(lost, step_output(lost, {"req-0": 11})) == []
    assert len(s.update_from_output(out, step_output(out, {"req-1": 11}))) == 1
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks - 1


def test_a_result_from_before_a_preemption_is_ignored():
    """Preempted while its step was in flight, then resumed: the old step's token is stale
    (the request recomputes from scratch) and is not appended."""
    s = make_scheduler()
    s.add_request(make_request(0, 4))
    first = s.schedule()
    request = s.get_request("req-0")
    s.running.remove(request)
    s.state.preempt(request)
    resumed = s.schedule()
    assert resumed.num_scheduled_tokens == {"req-0": 4}
    assert s.update_from_output(first, step_output(first, {"req-0": 11})) == []
    assert request.output_token_ids == []
    updates = s.update_from_output(resumed, step_output(resumed, {"req-0": 12}))
    assert [u.new_token_ids for u in updates] == [[12]]


# --- finishing ------------------------------------------------------------------------------


def _run_one(eos=(0,), max_model_len=128, prompt_len=5, **sampling):
    s = make_scheduler(max_model_len=max_model_len, eos_token_ids=eos)
    r = make_request(0, prompt_len, **sampling)
    s.add_request(r)
    updates = run_to_completion(s)
    assert updates[-1].finish_reason is r.finish_reason
    assert [t for u in updates for t in u.new_token_ids] == r.output_token_ids
    return r


def test_eos_stops_and_stays_in_the_output():
    eos = fake_token("req-0", 8)  # the 4th output token
    r = _run_one(eos=(eos,), max_tokens=10)
    assert r.finish_reason is FinishReason.STOP and r.status is RequestStatus.FINISHED
    assert r.num_output_tokens == 4 and r.output_token_ids[-1] == eos


def test_ignore_eos_runs_to_max_tokens():
    eos = fake_token("req-0", 8)
    r = _run_one(eos=(eos,), max_tokens=10, ignore_eos=True)
    assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 10


def test_stop_token_ids_stop_even_with_ignore_eos():
    stop = fake_token("req-0", 6)
    r = _run_one(max_tokens=10, stop_token_ids=[stop], ignore_eos=True)
    assert r.finish_reason is FinishReason.STOP and r.num_output_tokens == 2


@pytest.mark.parametrize("stop_kind", ["eos", "stop_token_ids"])
def test_min_tokens_holds_a_stop_token_back(stop_kind):
    # Prompt of 5: output index i sits at position 5 + i. A stop token at output index 3 is
    # the 4th token: min_tokens=4 means it cannot finish there, min_tokens=3 means it can.
    stop = fake_token("req-0", 8)
    kwargs = ({"eos": (stop,)} if stop_kind == "eos" else
              {"stop_token_ids": [stop], "ignore_eos": True})
    r = _run_one(max_tokens=10, min_tokens=4, **kwargs)
    assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 10
    assert r.output_token_ids[3] == stop
    r = _run_one(max_tokens=10, min_tokens=3, **kwargs)
    assert r.finish_reason is FinishReason.STOP and r.num_output_tokens == 4


def test_sampling_params_are_trusted_and_a_malformed_one_still_ends():
    """The router checks them once (tests/router/test_validation.py: min_tokens > max_tokens,
    min_p 1.5, ... are INVALID_ARGUMENT there); the scheduler takes them as they are. A
    malformed one (a router bug) cannot wedge a request: max_tokens still ends it."""
    r = _run_one(max_tokens=4, min_tokens=9, eos=(fake_token("req-0", 6),))  # EOS at output 2
    assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 4
    r = _run_one(max_tokens=3, min_tokens=-1, min_p=1.5, repetition_penalty=0.0)
    assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 3


def test_stop_wins_over_length_on_the_same_token():
    r = _run_one(eos=(fake_token("req-0", 7),), max_tokens=3)
    assert r.finish_reason is FinishReason.STOP and r.num_output_tokens == 3


def test_max_tokens_none_fills_to_max_model_len():
    r = _run_one(max_model_len=20, prompt_len=7)
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 20


def test_max_model_len_caps_a_larger_max_tokens():
    r = _run_one(max_model_len=20, prompt_len=19, max_tokens=50)
    assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 1


def test_schedule_cost_does_not_grow_with_waiting_queue():
    """Admission stops at the first request that cannot run; the rest are never looked at."""
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=6, max_num_waiting_requests=0)
    for r in make_requests(2000, 4, max_tokens=3):
        s.add_request(r)
    calls = 0
    can_allocate = s.block_manager.can_allocate

    def counting(request, num_new_tokens, computed_block_ids=()):
        nonlocal calls
        calls += 1
        return can_allocate(request, num_new_tokens, computed_block_ids)

    s.block_manager.can_allocate = counting
    w = FakeWorker(s)
    for _ in range(10):
        calls = 0
        w.step()
        assert calls <= 3  # the (at most 2) running requests + one failed admission check
    assert s.num_waiting > 1990


def test_logprobs_ride_along_with_their_token_only():
    """update_from_output puts a request's logprobs on its RequestUpdate; a mid-prefill
    chunk's (discarded) token takes its logprobs with it."""
    from services.common.step import SampledLogprobs
    from tests.scheduler.factories import FakeWorker, make_request, make_scheduler

    s = make_scheduler(max_num_batched_tokens=6)
    long, short = make_request(0, 8, logprobs=1), make_request(1, 2)
    s.add_request(long)
    s.add_request(short)
    w = FakeWorker(s)
    out = s.schedule()  # long gets 6 of 8 prompt tokens: no token yet
    sampled = w.execute(out)
    n = len(sampled)
    lp = SampledLogprobs([1] * n, [-0.25] * n, list(sampled.values()), [-0.25] * n)
    assert [u.request_id for u in s.update_from_output(out, step_output(out, sampled,
                                                                        logprobs=lp))] == []
    out = s.schedule()
    sampled = w.execute(out)
    lp = SampledLogprobs([1 if rid == "req-0" else -1 for rid in sampled], [-0.5],
                         [sampled["req-0"]], [-0.5])
    updates = {u.request_id: u for u in s.update_from_output(out, step_output(out, sampled,
                                                                              logprobs=lp))}
    got = updates["req-0"].logprobs  # (one per new token, at its position)
    assert (got.start, got.logprobs, got.top_token_ids, got.top_logprobs) == (
        8, [-0.5], [sampled["req-0"]], [-0.5])
    assert updates["req-1"].logprobs is None


def test_prompt_logprobs_skip_the_cache_and_are_passed_on_once():
    """A prompt_logprobs request computes its whole prompt even when it is cached; each prompt
    token's logprobs reach the router once, chunk by chunk (a recomputed chunk repeats none)."""
    from services.common.step import Logprobs
    from services.scheduler.request import Request
    from tests.scheduler.factories import FakeWorker, make_scheduler, run_to_completion

    s = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(100, 112))
    run_to_completion(s, [Request("req-0", prompt, EngineSamplingParams(max_tokens=1))])
    s.add_request(Request("req-1", prompt, EngineSamplingParams(max_tokens=2,
                                                                prompt_logprobs=1)))
    w = FakeWorker(s)
    out = s.schedule()
    assert out.new_requests[0].num_computed_tokens == 0  # no prefix-cache hit
    assert out.num_scheduled_tokens["req-1"] == 8

    def chunk(start, n):
        return [Logprobs("req-1", start, [-1.0] * n, [5] * n, [-1.0] * n)]
    # mid-prefill
    (u,) = s.update_from_output(out, step_output(out, w.execute(out),
                                                 prompt_logprobs=chunk(1, 7)))
    assert u.new_token_ids == [] and (u.prompt_logprobs.start, len(u.prompt_logprobs.logprobs)
                                      ) == (1, 7)
    out = s.schedule()
    # the worker repeats tokens 5..7 (as after a recompute): only 8..11 go on
    (u,) = s.update_from_output(out, step_output(out, w.execute(out),
                                                 prompt_logprobs=chunk(5, 7)))
    assert len(u.new_token_ids) == 1 and u.prompt_logprobs.start == 8
    assert len(u.prompt_logprobs.logprobs) == 4 and u.prompt_logprobs.top_token_ids == [5] * 4
    assert not s.get_request("req-1").needs_prompt_logprobs
