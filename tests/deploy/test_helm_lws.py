"""helm/pagedserve with engine.multiHost: one engine replica on two pods as a LeaderWorkerSet
(ci/values-lws-pp2.yaml: PP=2 across the pods, TP=4 inside each). The LWS object is validated
against its CRD's schema (vendored, trimmed: tests/deploy/schemas/leaderworkerset-v1.yaml) with
jsonschema, and its two pod templates with ``kubernetes-validate --strict`` as the templates of
v1 PodTemplates; the wiring (who reaches whom on which port) is checked field by field."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

from tests.deploy.conftest import CHART, output, run
from tests.deploy.test_helm import (
    HELM,
    LWS_VALUES,
    _by_kind,
    _env,
    _kubernetes_validate,
    _objects,
    _render,
    _values_file,
)

SCHEMA = yaml.safe_load((Path(__file__).parent / "schemas" / "leaderworkerset-v1.yaml").read_text())


def _lws(tmp_path: Path, *extra: Path) -> tuple[dict, list[dict]]:
    objects = _objects(_render(tmp_path, LWS_VALUES, *extra))
    assert not [o for o in objects if o["kind"] == "StatefulSet"]  # the LWS replaces it
    return _by_kind(objects, "LeaderWorkerSet"), objects


def test_leaderworkerset_matches_its_crd_schema_and_its_pods_are_valid(tmp_path):
    lws, _ = _lws(tmp_path)
    jsonschema.validate(lws, SCHEMA)
    files = []
    for role in ("leaderTemplate", "workerTemplate"):
        path = tmp_path / f"{role}.yaml"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
            "template": lws["spec"]["leaderWorkerTemplate"][role]}))
        files.append(path)
    proc = _kubernetes_validate(files)
    assert proc.returncode == 0 and "passed" in proc.stdout, output(proc)
    # the schema check can fail: a misspelt field is refused
    broken = {**lws, "spec": {**lws["spec"], "startupPolicy": "LeaderFirst"}}
    try:
        jsonschema.validate(broken, SCHEMA)
        raise AssertionError("an unknown startupPolicy passed the schema")
    except jsonschema.ValidationError as e:
        assert "LeaderFirst" in str(e)


def test_two_hosts_one_stage_each(tmp_path):
    lws, objects = _lws(tmp_path)
    name = lws["metadata"]["name"]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = {c["name"]: c for c in template["leaderTemplate"]["spec"]["containers"]}
    [worker] = template["workerTemplate"]["spec"]["containers"]
    assert set(leader) == {"scheduler", "worker"} and worker["name"] == "worker"
    for c in (leader["worker"], worker):
        env = _env(c)
        assert (env["PAGEDSERVE_TENSOR_PARALLEL_SIZE"], env["PAGEDSERVE_PIPELINE_PARALLEL_SIZE"],
                env["PAGEDSERVE_NNODES"]) == ("4", "2", "2")
        assert env["PAGEDSERVE_PIPELINE_LAYER_PARTITION"] == "41,39"
        # every pod meets at the leader pod of its own group, on the rendezvous port
        assert env["PAGEDSERVE_DIST_INIT_ADDR"] == (
            f"{name}-$(GROUP_INDEX).{name}.llm.svc.cluster.local:29500")
        node_rank = next(e for e in c["env"] if e["name"] == "PAGEDSERVE_NODE_RANK")
        assert node_rank["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']")
        names = [e["name"] for e in c["env"]]  # $(GROUP_INDEX) is defined before its use
        assert names.index("GROUP_INDEX") < names.index("PAGEDSERVE_DIST_INIT_ADDR")
    scheduler = _env(leader["scheduler"])
    assert scheduler["PAGEDSERVE_WORKERS"].split(",") == [
        *(f"127.0.0.1:{50053 + i}" for i in range(4)),
        *(f"{name}-$(GROUP_INDEX)-1.{name}.llm.svc.cluster.local:{50053 + i}" for i in range(4))]
    assert [e["name"] for e in leader["scheduler"]["env"]][0] == "GROUP_INDEX"
    # the routers find only the leaders (the schedulers) through the engine Service
    svc = _by_kind(objects, "Service", "-engine")
    assert svc["spec"]["selector"].items() <= template["leaderTemplate"]["metadata"][
        "labels"].items()
    assert not svc["spec"]["selector"].items() <= template["workerTemplate"]["metadata"][
        "labels"].items()
    hpa = _by_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                             "kind": "LeaderWorkerSet", "name": name}
    assert "replicas" not in lws["spec"]  # the HPA owns it


def test_pipeline_stages_need_multi_host(tmp_path):
    bad = _values_file(tmp_path, {"engine": {"pipelineParallelSize": 2}})
    proc = run([*HELM, "template", "ps", str(CHART), "-f", str(bad)])
    assert proc.returncode != 0, output(proc)
    assert "engine.pipelineParallelSize 2 needs engine.multiHost.enabled" in proc.stderr
    bad = _values_file(tmp_path, {"engine": {"pipelineLayerPartition": "10;20"}})
    proc = run([*HELM, "template", "ps", str(CHART), "-f", str(bad)])
    assert proc.returncode != 0 and "pipelineLayerPartition" in proc.stderr, output(proc)
