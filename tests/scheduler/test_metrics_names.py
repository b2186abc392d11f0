"""``--metrics-names``: the /metrics exposition, parsed as a gateway parses it
(``prometheus_client.parser.text_string_to_metric_families``), carries the names, types and
labels GIE's model-server protocol, llm-d's scorers and production-stack's router read, with the
values of vLLM's semantics; ``pagedserve`` (the default) is what it was."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.cli.flags import forwarded_argv, serve_parser
from services.common.lora import LoRARequest
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.metrics_names import VLLM_FAMILIES, exposed_registry
from tests.scheduler.factories import FakeWorker, make_request, make_scheduler, step_output

# GIE's model-server protocol (gateway-api-inference-extension,
# docs/proposals/003-model-server-protocol): name -> type, required labels.
GIE = {"vllm:num_requests_waiting": ("gauge", set()),
       "vllm:num_requests_running": ("gauge", set()),
       "vllm:kv_cache_usage_perc": ("gauge", set()),
       "vllm:cache_config_info": ("gauge", {"block_size", "num_gpu_blocks"}),
       "vllm:lora_requests_info": ("gauge", {"running_lora_adapters", "waiting_lora_adapters",
                                             "max_lora"})}
# production-stack's router (vllm_router/stats/engine_stats.py) matches sample names.
PRODUCTION_STACK = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                    "vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_hit_rate",
                    "vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total")
# Dashboards and autoscalers (vLLM's Grafana dashboard, KEDA queries): counters and histograms.
OTHERS = {"vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
          "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
          "vllm:request_success": "counter", "vllm:num_preemptions": "counter",
          "vllm:time_to_first_token_seconds": "histogram",
          "vllm:inter_token_latency_seconds": "histogram",
          "vllm:e2e_request_latency_seconds": "histogram",
          "vllm:request_queue_time_seconds": "histogram",
          "vllm:iteration_tokens_total": "histogram"}
A, B = LoRARequest(1, "a", "/adapters/a"), LoRARequest(2, "b", "/adapters/b")


def scrape(metrics: SchedulerMetrics, names: str) -> dict:
    """{family name: family} of the text exposition served for ``--metrics-names names``."""
    text = generate_latest(exposed_registry(metrics.registry, names)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert len(families) == text.count("# TYPE ")  # no family twice
    return families


def busy_scheduler():
    """2 running (one with LoRA adapter a), 1 waiting (adapter b), a prefix-cache hit, finished
    requests behind them: every family has a sample."""
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2, max_loras=2,
                               enable_prefix_caching=True)
    metrics = SchedulerMetrics(scheduler, model_name="m",
                               cache_config={"block_size": "4", "num_gpu_blocks": "64",
                                             "cache_dtype": "auto"},
                               model_config={"dtype": "float32", "quantization": "none"})
    worker, now = FakeWorker(scheduler), 0.0

    def step():
        out = scheduler.schedule()
        metrics.observe_scheduled(out, now)
        updates = scheduler.update_from_output(out, step_output(out, worker.execute(out)))
        metrics.observe_updates(updates, now + 0.25)

    done = [make_request(i, 8, max_tokens=3, ignore_eos=True) for i in range(2)]
    for r in done:
        scheduler.add_request(r)
        metrics.observe_arrival(r.request_id, now)
    while scheduler.has_unfinished_requests():
        step()
        now += 0.25
    for i, lora in ((10, A), (11, None), (12, B)):
        r = make_request(i, 8, max_tokens=4)
        r.prompt_token_ids[:] = done[0].prompt_token_ids  # the same prompt: prefix hits
        r.lora = lora
        scheduler.add_request(r)
        metrics.observe_arrival(r.request_id, now, None if lora is None else lora.name)
    step()
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    assert scheduler.prefix_cache_hits_total > 0
    return scheduler, metrics


def only(family):
    """The value of a family's one series (of its ``_total`` sample for a counter)."""
    samples = [s for s in family.samples if not s.name.endswith("_created")]
    assert len(samples) == 1, samples
    return samples[0]


def test_vllm_names_carry_gies_protocol_with_vllms_types_labels_and_values():
    scheduler, metrics = busy_scheduler()
    before = time.time()
    families = scrape(metrics, "vllm")
    for name, (kind, labels) in GIE.items():
        assert families[name].type == kind, name
        assert labels <= only(families[name]).labels.keys(), name
    assert only(families["vllm:num_requests_waiting"]).value == 1
    assert only(families["vllm:num_requests_running"]).value == 2
    usage = only(families["vllm:kv_cache_usage_perc"]).value
    assert usage == pytest.approx(scheduler.block_manager.usage) and 0 < usage <= 1
    cache = only(families["vllm:cache_config_info"])
    assert (cache.labels["block_size"], cache.labels["num_gpu_blocks"], cache.value) == (
        "4", "64", 1)
    lora = only(families["vllm:lora_requests_info"])  # the EPP keeps the newest by value
    assert lora.labels == {"running_lora_adapters": "a", "waiting_lora_adapters": "b",
                           "max_lora": "2"}
    assert before <= lora.value <= time.time()
    # vLLM v1's labels: model_name and engine on the engine's series (GIE may filter on them)
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens"):
        assert only(families[name]).labels == {"model_name": "m", "engine": "0"}, name
    for name, kind in OTHERS.items():
        assert families[name].type == kind, name


def test_vllm_names_as_production_stacks_router_reads_them():
    """It keeps the last sample of each name: one series per name, the scheduler's values."""
    scheduler, metrics = busy_scheduler()
    scheduler.prefix_cache_tier_hits_total = 3  # (as after loads from a KV tier on disk)
    text = generate_latest(exposed_registry(metrics.registry, "vllm")).decode()
    seen: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            seen.setdefault(s.name, []).append(s.value)
    assert {n: len(seen.get(n, [])) for n in PRODUCTION_STACK} == dict.fromkeys(
        PRODUCTION_STACK, 1)
    hits, queries = scheduler.prefix_cache_hits_total, scheduler.prefix_cache_queries_total
    assert seen["vllm:gpu_prefix_cache_hits_total"] == seen["vllm:prefix_cache_hits_total"] == [
        hits]  # both tiers, as vLLM counts every hit
    assert seen["vllm:gpu_prefix_cache_queries_total"] == [queries]
    assert seen["vllm:gpu_prefix_cache_hit_rate"] == [pytest.approx(hits / queries)]
    assert seen["vllm:gpu_cache_usage_perc"] == seen["vllm:kv_cache_usage_perc"]
    assert seen["vllm:num_requests_running"] == [2] and seen["vllm:num_requests_waiting"] == [1]


def test_histograms_and_counters_keep_their_samples_under_the_vllm_name():
    _, metrics = busy_scheduler()
    families = scrape(metrics, "both")
    for name in ("time_to_first_token_seconds", "request_success", "iteration_tokens_total"):
        ours, theirs = families["pagedserve:" + name], families["vllm:" + name]
        assert theirs.type == ours.type
        assert [(s.name.replace("pagedserve:", "vllm:"), {**s.labels, "engine": "0"}, s.value)
                for s in ours.samples] == [(s.name, s.labels, s.value) for s in theirs.samples]
    ttft = {s.name: s.value for s in families["vllm:time_to_first_token_seconds"].samples}
    assert ttft["vllm:time_to_first_token_seconds_count"] == 4  # 2 done + the 2 running


def test_pagedserve_is_unchanged_vllm_keeps_our_own_families_and_both_has_both():
    _, metrics = busy_scheduler()
    assert exposed_registry(metrics.registry, "pagedserve") is metrics.registry
    ours = scrape(metrics, "pagedserve")
    assert all(n.startswith("pagedserve:") for n in ours)
    assert {"pagedserve:num_requests_waiting", "pagedserve:model_config_info",
            "pagedserve:lora_requests"} <= ours.keys()
    vllm = scrape(metrics, "vllm")
    # (the text format gives a counter's or histogram's _created samples a family of their own)
    shared = {n for n in ours
              if n.removeprefix("pagedserve:").removesuffix("_created") in VLLM_FAMILIES}
    assert len(shared) >= 15
    # a vllm: name only where vLLM has the metric; ours (no vLLM meaning) stay pagedserve:
    assert {n for n in vllm if n.startswith("pagedserve:")} == ours.keys() - shared
    assert {n.replace("pagedserve:", "vllm:") for n in shared} <= vllm.keys()
    assert "vllm:model_config_info" not in vllm and "vllm:lora_requests" not in vllm
    assert scrape(metrics, "both").keys() == ours.keys() | vllm.keys()
    # pagedserve: keeps our tier label
    tiers = {s.labels["tier"] for s in ours["pagedserve:prefix_cache_hits"].samples}
    assert tiers == {"ram", "disk"}
    with pytest.raises(ValueError, match="--metrics-names must be one of pagedserve, vllm, both"):
        exposed_registry(metrics.registry, "sglang")


def test_serve_passes_metrics_names_to_the_scheduler_and_router(monkeypatch, capsys):
    """One flag for both services that export vLLM's names (the router: its replicas' gauges,
    router/gateway_metrics.py); the worker has none."""
    ns = serve_parser().parse_args(["--metrics-names", "vllm"])
    for service in ("scheduler", "router"):
        argv = forwarded_argv(service, ns)
        assert argv[argv.index("--metrics-names") + 1] == "vllm"
    assert "--metrics-names" not in forwarded_argv("worker", ns)
    assert serve_parser().parse_args([]).metrics_names == "pagedserve"
    monkeypatch.setenv("PAGEDSERVE_METRICS_NAMES", "both")  # the Helm chart's way
    assert serve_parser().parse_args([]).metrics_names == "both"
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--metrics-names", "sglang"])
    assert "argument --metrics-names: invalid choice: 'sglang'" in capsys.readouterr().err
