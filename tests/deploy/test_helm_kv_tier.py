"""helm/pagedserve with kvOffload: the KV tier on disk. The worker writes and reads block files
under kvOffload.mountPath, the scheduler lists, stats and deletes them at the path the worker
reports, so both containers of an engine pod mount one volume at the same path: an existing
claim, a claim the chart makes (ReadWriteMany, shared by every replica) or an emptyDir (per
pod). Rendered, validated with ``kubernetes-validate --strict`` and checked field by field."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import parse_bytes

from tests.deploy.conftest import CHART, output, run, unknown_env
from tests.deploy.test_helm import (
    HELM,
    LWS_VALUES,
    MIN_KUBE,
    _by_kind,
    _env,
    _kubernetes_validate,
    _objects,
    _render,
    _values_file,
)

TIER = "/var/lib/pagedserve/kv-tier"
# kvOffload values -> the volume source the engine pod must get
VOLUMES = {
    "claim-created": ({"enabled": True, "persistence": {"create": True}},
                      {"persistentVolumeClaim": {"claimName": "ps-pagedserve-kv-tier"}}),
    "existing-claim": ({"enabled": True, "existingClaim": "shared-kv"},
                       {"persistentVolumeClaim": {"claimName": "shared-kv"}}),
    "emptyDir": ({"enabled": True}, {"emptyDir": {}}),
}


def _engine(tmp_path: Path, kv: dict, **values) -> tuple[dict, list[dict], list[Path]]:
    """The engine pod spec rendered with ``kvOffload: kv`` (and other top-level values)."""
    files = _render(tmp_path, _values_file(tmp_path, {"kvOffload": kv, **values}))
    objects = _objects(files)
    sts = _by_kind(objects, "StatefulSet", "-engine")
    return sts["spec"]["template"]["spec"], objects, files


def _refused(tmp_path: Path, values: dict) -> str:
    proc = run([*HELM, "template", "ps", str(CHART), "-f", str(_values_file(tmp_path, values))])
    assert proc.returncode != 0, output(proc)
    return proc.stderr


@pytest.mark.parametrize("case", VOLUMES)
def test_kv_tier_volume_mounted_at_one_path_in_worker_and_scheduler(case, tmp_path):
    kv, source = VOLUMES[case]
    pod, objects, files = _engine(tmp_path, {**kv, "size": "20GiB"}, engine={"replicas": 3})
    for kube in (None, MIN_KUBE):
        proc = _kubernetes_validate(files, kube)
        assert proc.returncode == 0 and "passed" in proc.stdout, output(proc)
    proc = run([*HELM, "lint", str(CHART), "-f", str(tmp_path / "values.yaml")])
    assert proc.returncode == 0, output(proc)
    [volume] = [v for v in pod["volumes"] if v["name"] == "kv-tier"]
    assert {k: v for k, v in volume.items() if k != "name"} == source
    containers = {c["name"]: c for c in pod["containers"]}
    for name in ("scheduler", "worker"):
        mounts = [m for m in containers[name]["volumeMounts"] if m["name"] == "kv-tier"]
        # the scheduler deletes files too: writable, the same path, no subPath
        assert mounts == [{"name": "kv-tier", "mountPath": TIER}], (name, mounts)
    worker, scheduler = _env(containers["worker"]), _env(containers["scheduler"])
    assert worker["PAGEDSERVE_KV_OFFLOAD_DIR"] == TIER
    assert parse_bytes(scheduler["PAGEDSERVE_KV_OFFLOAD_SIZE"]) == 20 * 2**30
    assert scheduler["PAGEDSERVE_ENABLE_PREFIX_CACHING"] == "true"  # the tier needs it
    for name, c in containers.items():  # each variable is a flag of the service it is given to
        assert not unknown_env(name, _env(c)), (name, unknown_env(name, _env(c)))
    claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    if case != "claim-created":
        assert not claims
        return
    [pvc] = claims
    assert pvc["metadata"]["name"] == source["persistentVolumeClaim"]["claimName"]
    # one claim, not one per pod (no volumeClaimTemplates): every replica shares the blocks
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert "storageClassName" not in pvc["spec"]  # "" = the cluster's default class
    sts = _by_kind(objects, "StatefulSet", "-engine")
    assert "volumeClaimTemplates" not in sts["spec"] and sts["spec"]["replicas"] == 3


def test_kv_tier_claim_class_size_and_mount_path(tmp_path):
    pod, objects, _ = _engine(tmp_path, {
        "enabled": True, "mountPath": "/data/kv",
        "persistence": {"create": True, "storageClassName": "cephfs", "size": "200Gi"}})
    pvc = _by_kind(objects, "PersistentVolumeClaim", "-kv-tier")
    assert pvc["spec"]["storageClassName"] == "cephfs"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "200Gi"
    containers = {c["name"]: c for c in pod["containers"]}
    assert _env(containers["worker"])["PAGEDSERVE_KV_OFFLOAD_DIR"] == "/data/kv"
    assert _env(containers["scheduler"])["PAGEDSERVE_KV_OFFLOAD_SIZE"] == "4GiB"  # the default
    for c in containers.values():
        assert {"name": "kv-tier", "mountPath": "/data/kv"} in c["volumeMounts"], c["name"]


@pytest.mark.parametrize("kv", [{}, {"persistence": {"create": True}, "existingClaim": "x"}],
                         ids=["defaults", "claims-set-but-disabled"])
def test_kv_tier_disabled_renders_nothing(kv, tmp_path):
    files = _render(tmp_path, _values_file(tmp_path, {"kvOffload": {"enabled": False, **kv}}))
    text = "".join(f.read_text() for f in files)
    assert "kv-tier" not in text and "KV_OFFLOAD" not in text
    assert not [o for o in _objects(files) if o["kind"] == "PersistentVolumeClaim"]


def test_kv_tier_refuses_what_the_services_would(tmp_path):
    err = _refused(tmp_path, {"kvOffload": {"enabled": True},
                              "engine": {"scheduler": {"enablePrefixCaching": False}}})
    assert "kvOffload.enabled needs engine.scheduler.enablePrefixCaching" in err
    err = _refused(tmp_path, {"kvOffload": {"enabled": True, "existingClaim": "x",
                                            "persistence": {"create": True}}})
    assert "not both" in err
    # the worker refuses --kv-offload-dir with pipeline stages (a LeaderWorkerSet of 2 pods)
    proc = run([*HELM, "template", "ps", str(CHART), "-f", str(LWS_VALUES), "-f",
                str(_values_file(tmp_path, {"kvOffload": {"enabled": True}}))])
    assert proc.returncode != 0, output(proc)
    assert "engine.pipelineParallelSize 2" in proc.stderr, output(proc)


@pytest.mark.parametrize("kv, key", [
    ({"size": "4Gi"}, "size"),  # Kubernetes' unit: pagedserve's parse_bytes refuses it
    ({"mountPath": "kv-tier"}, "mountPath"),
    ({"persistence": {"accessModes": ["ReadOnlyMany"]}}, "accessModes"),
    ({"persistence": {"size": "50GiB"}}, "size"),  # pagedserve's unit: not a quantity
    ({"persistance": {}}, "persistance"),
])
def test_kv_tier_schema_refuses_bad_values(kv, key, tmp_path):
    assert key in _refused(tmp_path, {"kvOffload": {"enabled": True, **kv}})
