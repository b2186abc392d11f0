"""The /metrics endpoints of the running stack: names as documented, values that follow the
requests sent (counts match, TTFT observed once per request)."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
import requests
from pagedserve_client import Client
from prometheus_client.parser import text_string_to_metric_families


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
