"""helm/pagedserve and the fleet's contracts (docs/fleet.md): ``tracing.otlpTracesEndpoint``
reaches every service, ``router.metricsNames`` the routers. KV events:
``router.routingPolicy: cache_aware`` turns the schedulers' event stream on (the routers
subscribe to it), ``engine.scheduler.kvEventsConfig`` sets it outright (e.g. a ZMQ publisher for
an outside indexer), and neither leaves it off. The value the scheduler gets is parsed with the
scheduler's own flag parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler.kv_events_config import KVEventsConfig
from tests.deploy.test_helm import _by_kind, _env, _objects, _render, _values_file

ZMQ = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'


def _scheduler_env(tmp_path: Path, values: dict) -> dict[str, str]:
    objects = _objects(_render(tmp_path, _values_file(tmp_path, values)))
    sts = _by_kind(objects, "StatefulSet", "-engine")
    [scheduler] = [c for c in sts["spec"]["template"]["spec"]["containers"]
                   if c["name"] == "scheduler"]
    return _env(scheduler)


@pytest.mark.parametrize(("values", "publisher"), [
    ({"router": {"routingPolicy": "cache_aware"}}, "null"),
    ({"engine": {"scheduler": {"kvEventsConfig": ZMQ}}}, "zmq"),
    ({"router": {"routingPolicy": "cache_aware"},
      "engine": {"scheduler": {"kvEventsConfig": ZMQ}}}, "zmq"),
])
def test_events_on(tmp_path, values, publisher):
    env = _scheduler_env(tmp_path, values)
    config = KVEventsConfig.parse(env["PAGEDSERVE_KV_EVENTS_CONFIG"])
    assert config is not None and config.enable_kv_cache_events
    assert config.publisher == publisher


def test_events_off_by_default(tmp_path):
    assert "PAGEDSERVE_KV_EVENTS_CONFIG" not in _scheduler_env(tmp_path, {})


def test_router_metrics_names(tmp_path):
    """router.metricsNames reaches the routers (their gateway gauges: docs/fleet.md)."""
    objects = _objects(_render(tmp_path, _values_file(tmp_path, {"router": {
        "metricsNames": "vllm"}})))
    [router] = _by_kind(objects, "Deployment", "-router")["spec"]["template"]["spec"][
        "containers"]
    assert _env(router)["PAGEDSERVE_METRICS_NAMES"] == "vllm"


def test_tracing_endpoint_reaches_every_service(tmp_path):
    """tracing.otlpTracesEndpoint: every router, scheduler and worker exports its spans there;
    unset, none gets the variable (tracing off)."""
    def envs(values):
        objects = _objects(_render(tmp_path, _values_file(tmp_path, values)))
        router = _by_kind(objects, "Deployment", "-router")["spec"]["template"]["spec"]
        engine = _by_kind(objects, "StatefulSet", "-engine")["spec"]["template"]["spec"]
        return {c["name"]: _env(c) for c in [*router["containers"], *engine["containers"]]}

    on = envs({"tracing": {"otlpTracesEndpoint": "http://otel-collector:4317"}})
    assert set(on) == {"router", "scheduler", "worker"}
    assert {e.get("PAGEDSERVE_OTLP_TRACES_ENDPOINT") for e in on.values()} == {
        "http://otel-collector:4317"}
    assert all("PAGEDSERVE_OTLP_TRACES_ENDPOINT" not in e for e in envs({}).values())
