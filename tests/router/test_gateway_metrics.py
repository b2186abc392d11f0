"""Router ``--metrics-names vllm``: the replicas' reports re-exported under vLLM's names
(``services/router/gateway_metrics.py``), scraped through Prometheus's own text parser."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.pb.pagedserve.v1 import engine_pb2
from services.router.gateway_metrics import GatewayGauges


@dataclass
class Replica:
    load: engine_pb2.LoadReport = field(default_factory=engine_pb2.LoadReport)
    num_pending: int = 0


def scrape(replicas, name="m") -> dict[str, tuple[str, dict, float]]:
    reg = CollectorRegistry()
    reg.register(GatewayGauges(lambda: replicas, lambda: name))
    text = generate_latest(reg).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        (sample,) = fam.samples
        out[fam.name] = (fam.type, sample.labels, sample.value)
    return out


def test_sums_the_replicas_reports_under_vllm_names():
    a = Replica(engine_pb2.LoadReport(num_running=3, num_waiting=2, kv_cache_usage=0.5), 4)
    b = Replica(engine_pb2.LoadReport(num_running=1, num_waiting=0, kv_cache_usage=0.25), 3)
    got = scrape([a, b], "smol")
    # b: 3 sent by this router, 1 reported: 2 more wait as far as the gateway should know
    assert got["vllm:num_requests_waiting"] == ("gauge", {"model_name": "smol", "engine": "0"},
                                                2 + 0 + 2)
    assert got["vllm:num_requests_running"][0::2] == ("gauge", 4)
    assert got["vllm:kv_cache_usage_perc"][0::2] == ("gauge", 0.375)
    assert got["vllm:gpu_cache_usage_perc"][0::2] == ("gauge", 0.375)


def test_no_replica_reads_zero():
    got = scrape([])
    assert {k: v[2] for k, v in got.items()} == {
        "vllm:num_requests_waiting": 0, "vllm:num_requests_running": 0,
        "vllm:kv_cache_usage_perc": 0, "vllm:gpu_cache_usage_perc": 0}
