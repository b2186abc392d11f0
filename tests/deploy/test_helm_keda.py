"""helm/pagedserve with autoscaling.keda: a KEDA ScaledObject (keda.sh/v1alpha1) scaling the
engine StatefulSet or LeaderWorkerSet on the schedulers' waiting-requests gauge. The object is
validated against KEDA's CRD schema (vendored, trimmed:
tests/deploy/schemas/keda-scaledobject-v1alpha1.yaml) with jsonschema; the query, threshold,
activation and scale-to-zero values are checked field by field, and the values the chart refuses
to render are refused with a message naming them."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.deploy.conftest import CHART, output, run
from tests.deploy.test_helm import (
    HELM,
    KEDA_VALUES,
    LWS_VALUES,
    _by_kind,
    _env,
    _objects,
    _render,
    _values_file,
)

SCHEMA = yaml.safe_load(
    (Path(__file__).parent / "schemas" / "keda-scaledobject-v1alpha1.yaml").read_text())
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
KEDA_ON = {"autoscaling": {"keda": {"enabled": True,
                                    "prometheus": {"serverAddress": PROMETHEUS}}}}


def _keda(tmp_path: Path, *values: Path) -> tuple[dict, list[dict]]:
    objects = _objects(_render(tmp_path, *values))
    assert not [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]  # KEDA makes it
    return _by_kind(objects, "ScaledObject"), objects


def _refused(tmp_path: Path, values: dict) -> str:
    proc = run([*HELM, "template", "ps", str(CHART), "-f", str(_values_file(tmp_path, values))])
    assert proc.returncode != 0, output(proc)
    return proc.stderr


def test_scaled_object_matches_its_crd_schema_and_scales_the_statefulset(tmp_path):
    so, objects = _keda(tmp_path, _values_file(tmp_path, KEDA_ON))
    jsonschema.validate(so, SCHEMA)
    sts = _by_kind(objects, "StatefulSet", "-engine")
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                            "name": sts["metadata"]["name"]}
    assert "replicas" not in sts["spec"]  # KEDA's HPA owns it
    spec = so["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"],
            spec["cooldownPeriod"]) == (1, 4, 15, 300)
    [trigger] = spec["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    # the waiting gauge of the series the chart's ServiceMonitor scrapes from the engine Service
    svc = _by_kind(objects, "Service", "-engine")
    assert trigger["metadata"] == {
        "serverAddress": PROMETHEUS,
        "query": 'sum(pagedserve:num_requests_waiting{namespace="llm",'
                 f'service="{svc["metadata"]["name"]}"}})',
        "threshold": "8", "activationThreshold": "0"}
    scheduler = next(c for c in sts["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "scheduler")
    assert _env(scheduler)["PAGEDSERVE_METRICS_NAMES"] == "pagedserve"
    # the schema check can fail: a misspelt field and a number where KEDA wants a string
    broken = {**so, "spec": {**spec, "minReplicas": 0}}
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        jsonschema.validate(broken, SCHEMA)
    numeric = {**so, "spec": {**spec, "triggers": [
        {**trigger, "metadata": {**trigger["metadata"], "threshold": 8}}]}}
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
        jsonschema.validate(numeric, SCHEMA)


def test_scale_to_zero_on_vllms_gauge_with_a_wake_trigger(tmp_path):
    """ci/values-keda-scale-to-zero.yaml: 0..4 replicas on vllm:num_requests_waiting, woken by
    the gateway's request rate (no engine pod exports a gauge at zero)."""
    so, objects = _keda(tmp_path, KEDA_VALUES)
    jsonschema.validate(so, SCHEMA)
    spec = so["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["cooldownPeriod"]) == (0, 4,
                                                                                        600)
    waiting, wake = spec["triggers"]
    assert waiting["metadata"]["query"].startswith("sum(vllm:num_requests_waiting{")
    assert (waiting["metadata"]["threshold"], waiting["metadata"]["activationThreshold"]) == (
        "8", "0")
    assert wake["metadata"]["query"] == (
        'sum(rate(inference_model_request_total{model_name="smollm2"}[2m]))')
    assert wake["metadata"]["serverAddress"] == waiting["metadata"]["serverAddress"]
    sts = _by_kind(objects, "StatefulSet", "-engine")
    scheduler = next(c for c in sts["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "scheduler")
    assert _env(scheduler)["PAGEDSERVE_METRICS_NAMES"] == "vllm"
    proc = run([*HELM, "lint", str(CHART), "-f", str(KEDA_VALUES)])
    assert proc.returncode == 0, output(proc)


def test_scaled_object_scales_the_leaderworkerset_with_a_custom_query(tmp_path):
    query = 'max(pagedserve:num_requests_waiting{namespace="llm"})'
    values = {"autoscaling": {"enabled": False, "keda": {  # (the LWS values turn the HPA on)
        "enabled": True, "maxReplicaCount": 8,
        "prometheus": {"serverAddress": PROMETHEUS, "query": query, "threshold": 4,
                       "activationThreshold": 0.5}}}}
    so, objects = _keda(tmp_path, LWS_VALUES, _values_file(tmp_path, values))
    jsonschema.validate(so, SCHEMA)
    lws = _by_kind(objects, "LeaderWorkerSet")
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                            "kind": "LeaderWorkerSet",
                                            "name": lws["metadata"]["name"]}
    assert "replicas" not in lws["spec"]
    [trigger] = so["spec"]["triggers"]
    assert (trigger["metadata"]["query"], trigger["metadata"]["threshold"],
            trigger["metadata"]["activationThreshold"]) == (query, "4", "0.5")


@pytest.mark.parametrize(("values", "message"), [
    ({"autoscaling": {"enabled": True, **KEDA_ON["autoscaling"]}},
     "autoscaling.enabled (an HPA) and autoscaling.keda.enabled (KEDA makes its own HPA)"),
    ({"autoscaling": {"keda": {"enabled": True}}},
     "autoscaling.keda.enabled needs autoscaling.keda.prometheus.serverAddress"),
    ({"autoscaling": {"keda": {**KEDA_ON["autoscaling"]["keda"], "minReplicaCount": 0}}},
     "autoscaling.keda.minReplicaCount 0 needs autoscaling.keda.wake.query"),
    ({"autoscaling": {"keda": {**KEDA_ON["autoscaling"]["keda"], "minReplicaCount": 5}}},
     "autoscaling.keda.minReplicaCount (5) must not exceed maxReplicaCount (4)"),
    ({"autoscaling": {"keda": {**KEDA_ON["autoscaling"]["keda"], "minReplicaCount": -1}}},
     "minReplicaCount"),
    ({"engine": {"scheduler": {"metricsNames": "sglang"}}}, "metricsNames"),
])
def test_values_the_chart_refuses(tmp_path, values, message):
    assert message in _refused(tmp_path, values)


def test_keda_is_off_by_default(tmp_path):
    objects = _objects(_render(tmp_path))
    assert not [o for o in objects if o["kind"] == "ScaledObject"]
    assert _by_kind(objects, "StatefulSet", "-engine")["spec"]["replicas"] == 1
