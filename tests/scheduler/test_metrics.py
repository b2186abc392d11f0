"""The scheduler's Prometheus metrics follow the core scheduler and a fake clock exactly."""

import pytest

from services.scheduler.metrics import SchedulerMetrics
from tests.scheduler.factories import FakeWorker, make_request, make_scheduler, step_output

STEP = 0.25  # seconds of fake clock per engine step


def value(metrics: SchedulerMetrics, name: str, **labels) -> float:
    v = metrics.registry.get_sample_value(f"pagedserve:{name}", {"model_name": "m", **labels})
    return 0.0 if v is None else v


def drive(scheduler, metrics, requests, abort_after=None):
    """Arrive all at t=0, step until done (aborting ``abort_after=(request_id, step)``)."""
    worker = FakeWorker(scheduler)
    now, steps = 0.0, 0
    for r in requests:
        scheduler.add_request(r)
        metrics.observe_arrival(r.request_id, now)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        metrics.observe_scheduled(out, now)
        now += STEP
        steps += 1
        updates = scheduler.update_from_output(out, step_output(out, worker.execute(out)))
        metrics.observe_updates(updates, now)
        if abort_after and steps == abort_after[1]:
            update = scheduler.abort_request(abort_after[0])
            metrics.observe_updates([update], now)
    return steps


def test_counts_and_latencies_match_the_requests():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    metrics = SchedulerMetrics(scheduler, model_name="m")
    # 3 requests of 10-token prompts; budget 16 tokens/step -> the third waits one step
    requests = [make_request(i, 10, max_tokens=4, ignore_eos=True) for i in range(3)]
    steps = drive(scheduler, metrics, requests)

    assert value(metrics, "prompt_tokens_total") == 30
    assert value(metrics, "generation_tokens_total") == 12
    assert value(metrics, "request_success_total", finished_reason="length") == 3
    assert value(metrics, "request_success_total", finished_reason="stop") == 0
    # TTFT once per request; ITL once per later token; e2e and queue time once per request
    assert value(metrics, "time_to_first_token_seconds_count") == 3
    assert value(metrics, "inter_token_latency_seconds_count") == 9
    assert value(metrics, "e2e_request_latency_seconds_count") == 3
    assert value(metrics, "request_queue_time_seconds_count") == 3
    assert value(metrics, "iteration_tokens_total_count") == steps
    assert value(metrics, "iteration_tokens_total_sum") == 30 + 3 * 3  # prefill + decodes
    # every ITL here is exactly one step; e2e = TTFT + 3 steps
    assert value(metrics, "inter_token_latency_seconds_sum") == pytest.approx(9 * STEP)
    ttft = value(metrics, "time_to_first_token_seconds_sum")
    assert value(metrics, "e2e_request_latency_seconds_sum") == pytest.approx(ttft + 9 * STEP)
    # 16-token budget: step 1 = req-0's 10 + req-1's first 6 prompt tokens; step 2 = req-0's
    # decode + req-1's last 4 + req-2's 10 (15 tokens): first tokens after 1, 2 and 2 steps
    assert ttft == pytest.approx((1 + 2 + 2) * STEP)
    assert value(metrics, "request_queue_time_seconds_sum") == pytest.approx(1 * STEP)
    # idle now: gauges read the core scheduler
    assert value(metrics, "num_requests_running") == 0
    assert value(metrics, "num_requests_waiting") == 0
    assert value(metrics, "kv_cache_usage_perc") == 0


def test_gauges_and_core_counters_read_the_scheduler_at_scrape_time():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    metrics = SchedulerMetrics(scheduler, model_name="m")
    for i in range(3):
        scheduler.add_request(make_request(i, 8, max_tokens=4))
    assert value(metrics, "num_requests_waiting") == 3
    out = scheduler.schedule()
    scheduler.update_from_output(out, step_output(out, FakeWorker(scheduler).execute(out)))
    assert value(metrics, "num_requests_running") == 2
    assert value(metrics, "num_requests_waiting") == 1
    used = scheduler.block_manager.num_used_blocks / scheduler.block_manager.num_blocks
    assert value(metrics, "kv_cache_usage_perc") == pytest.approx(used) and used > 0
    assert value(metrics, "prefix_cache_queries_total") == scheduler.prefix_cache_queries_total > 0
    assert value(metrics, "num_preemptions_total") == scheduler.num_preemptions_total


def test_abort_counts_as_abort_and_ends_the_timing():
    scheduler = make_scheduler()
    metrics = SchedulerMetrics(scheduler, model_name="m")
    requests = [make_request(i, 6, max_tokens=8, ignore_eos=True) for i in range(2)]
    drive(scheduler, metrics, requests, abort_after=("req-1", 2))
    assert value(metrics, "request_success_total", finished_reason="abort") == 1
    assert value(metrics, "request_success_total", finished_reason="length") == 1
    assert value(metrics, "e2e_request_latency_seconds_count") == 2
    assert value(metrics, "generation_tokens_total") == 8 + 2
    assert metrics._timings == {} and metrics._queued == set()
