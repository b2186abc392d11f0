"""The /metrics endpoints of the running stack: names as documented, values that follow the
requests sent (counts match, TTFT observed once per request)."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
import requests
from pagedserve_client import Client
from prometheus_client.parser import text_string_to_metric_families

from services.common.logs import record_request_id
from services.common.pb.pagedserve.v1 import api_pb2, api_pb2_grpc
from tests.stack_harness import InProcessStack


@pytest.fixture(scope="module")
def tiny_stack(tiny_model_dir):
    """conftest's tiny stack, its scheduler and router started with ``--metrics-names both``:
    the ``pagedserve:`` series as by default, and the ``vllm:`` ones gateways read."""
    stack = InProcessStack(tiny_model_dir,
                           worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB"],
                           scheduler_argv=["--max-num-batched-tokens", "256",
                                           "--metrics-names", "both"],
                           router_argv=["--metrics-names", "both"]).start()
    yield stack
    stack.stop()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` from http://127.0.0.1:port/metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def get(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_router_counts_requests_per_method_replica_and_code(tiny):
    port = tiny.router_args.metrics_port
    replica = tiny.router_args.scheduler
    before = scrape(port)
    with Client(tiny.address) as c:
        for _ in range(3):
            c.generate(prompt_token_ids=[5, 6, 7], max_tokens=2, temperature=0)
        with pytest.raises(grpc.RpcError) as err:
            c.generate(prompt_token_ids=[5, 6, 7], max_tokens=2, temperature=-1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        c.tokenize("hello")
    r = requests.post(f"{tiny.http_url}/v1/completions",
                      json={"model": "x", "prompt": "hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 404  # unknown model name
    after = scrape(port)

    def delta(name, **labels):
        return get(after, name, **labels) - get(before, name, **labels)

    assert delta("pagedserve:router_requests_total", method="Generate", code="OK") == 3
    assert delta("pagedserve:router_requests_total", method="Generate",
                 code="INVALID_ARGUMENT") == 1
    assert delta("pagedserve:router_requests_total", method="Tokenize", code="OK") == 1
    assert delta("pagedserve:router_requests_total", method="/v1/completions", code="404") == 1
    # the invalid request never reached a replica
    assert delta("pagedserve:router_replica_requests_total", replica=replica, code="OK") == 3
    assert get(after, "pagedserve:router_replicas_available") == 1


def test_router_serves_the_replicas_gauges_under_vllm_names_on_its_http_port(tiny):
    """A gateway (GIE's endpoint picker, production-stack) scrapes the endpoint it routes to:
    the router's HTTP port, where ``--metrics-names both`` adds the scheduler's queue and KV
    cache gauges under vLLM's names (router/gateway_metrics.py)."""
    def http_scrape():
        text = requests.get(f"{tiny.http_url}/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    with Client(tiny.address) as c:
        model = c.list_models()[0].id
        c.generate(prompt_token_ids=[5, 6, 7], max_tokens=2, temperature=0)
    got = http_scrape()
    assert got[("pagedserve:router_replicas_available", ())] == 1
    gauges = {name: v for (name, labels), v in got.items() if name.startswith("vllm:")}
    assert set(gauges) == {"vllm:num_requests_waiting", "vllm:num_requests_running",
                           "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}
    assert gauges["vllm:num_requests_waiting"] == gauges["vllm:num_requests_running"] == 0
    labels = {dict(lb)["model_name"] for (name, lb), _ in got.items() if name.startswith("vllm:")}
    assert labels == {model}


def test_scheduler_and_worker_metrics_follow_the_requests(tiny):
    sched_port, worker_port = tiny.scheduler_args.metrics_port, tiny.worker_args.metrics_port
    before, wbefore = scrape(sched_port), scrape(worker_port)
    prompts = [[3 + i, 40 + i, 77, 9, 12][: 3 + i % 3] for i in range(4)]
    with Client(tiny.address) as c:
        for p in prompts:
            r = c.generate(prompt_token_ids=p, max_tokens=5, ignore_eos=True, temperature=0)
            assert r.usage.completion_tokens == 5
    tiny.wait_idle()
    after, wafter = scrape(sched_port), scrape(worker_port)
    info = tiny.info()
    m = {"model_name": info.model}
    assert get(after, "pagedserve:cache_config_info", block_size=str(info.block_size),
               num_gpu_blocks=str(info.num_kv_blocks), cache_dtype="auto") == 1
    assert get(after, "pagedserve:model_config_info", dtype=info.dtype, quantization="none") == 1
    assert info.quantization == ""

    def delta(name, **labels):
        return get(after, name, **m, **labels) - get(before, name, **m, **labels)

    assert delta("pagedserve:request_success_total", finished_reason="length") == 4
    assert delta("pagedserve:generation_tokens_total") == 20
    assert delta("pagedserve:prompt_tokens_total") == sum(map(len, prompts))
    # TTFT once per request; ITL once per later token; queue time and e2e once per request
    assert delta("pagedserve:time_to_first_token_seconds_count") == 4
    assert delta("pagedserve:inter_token_latency_seconds_count") == 16
    assert delta("pagedserve:e2e_request_latency_seconds_count") == 4
    assert delta("pagedserve:request_queue_time_seconds_count") == 4
    steps = delta("pagedserve:iteration_tokens_total_count")
    assert steps >= 5 and delta("pagedserve:iteration_tokens_total_sum") == (
        sum(map(len, prompts)) + 4 * 4)  # prompts, then 4 decode tokens each
    assert delta("pagedserve:prefix_cache_queries_total") >= sum(map(len, prompts))
    assert get(after, "pagedserve:num_requests_running", **m) == 0
    assert get(after, "pagedserve:num_requests_waiting", **m) == 0
    assert get(after, "pagedserve:kv_cache_usage_perc", **m) == 0
    # --metrics-names both: the same under vLLM's names and labels (docs/fleet.md)
    v = {**m, "engine": "0"}
    assert get(after, "vllm:request_success_total", **v, finished_reason="length") == get(
        after, "pagedserve:request_success_total", **m, finished_reason="length") >= 4
    assert get(after, "vllm:time_to_first_token_seconds_count", **v) == get(
        after, "pagedserve:time_to_first_token_seconds_count", **m) >= 4
    assert get(after, "vllm:cache_config_info", block_size=str(info.block_size),
               num_gpu_blocks=str(info.num_kv_blocks), cache_dtype="auto", engine="0") == 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert (f"vllm:{gauge}", tuple(sorted(v.items()))) in after, gauge
    # the worker ran exactly the steps the scheduler scheduled, with the same tokens
    rank = {"rank": "0"}
    assert get(wafter, "pagedserve:worker_step_seconds_count", **rank) - get(
        wbefore, "pagedserve:worker_step_seconds_count", **rank) == steps
    assert get(wafter, "pagedserve:worker_batch_tokens_sum", **rank) - get(
        wbefore, "pagedserve:worker_batch_tokens_sum", **rank) == sum(map(len, prompts)) + 16


def test_request_id_reaches_every_service_log_and_no_prompt_text_at_info(tiny, caplog):
    """The client's x-request-id names the request in the router's, scheduler's and worker's
    log records (DEBUG); at INFO nothing carries the prompt's text."""
    import logging

    secret = "zebra-violet-quartz"
    with caplog.at_level(logging.DEBUG):
        with grpc.insecure_channel(tiny.address) as channel:
            req = api_pb2.GenerateRequest(
                prompt=f"tell me about {secret}",
                sampling_params=api_pb2.SamplingParams(max_tokens=2, temperature=0))
            responses = list(api_pb2_grpc.GenerationServiceStub(channel).Generate(
                req, metadata=(("x-request-id", "trace-me-42"),), timeout=60))
        assert responses[-1].request_id == "trace-me-42"
        tiny.wait_idle()
    tagged = {r.name.split(".")[1] for r in caplog.records
              if record_request_id(r) == "trace-me-42"}
    assert {"router", "scheduler", "worker"} <= tagged, tagged
    info_text = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert secret not in info_text and "trace-me-42" not in info_text  # ids ride as fields
