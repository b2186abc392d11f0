"""helm/pagedserve: `helm lint --strict` and `helm template` (helm-python-sdk, through
tests/deploy/helm_cli.py), `kubernetes-validate --strict` on every rendered manifest, and what the
rendered objects must be."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from services.common.grpc_utils import LIVENESS
from tests.deploy.conftest import CHART, output, run, tool, unknown_env

CI_VALUES = CHART / "ci" / "values-cuda-tp4.yaml"
LWS_VALUES = CHART / "ci" / "values-lws-pp2.yaml"
KEDA_VALUES = CHART / "ci" / "values-keda-scale-to-zero.yaml"
HELM = [sys.executable, "-m", "tests.deploy.helm_cli"]
# Everything optional switched on, on top of the defaults.
ALL_ON = {"autoscaling": {"enabled": True}, "podDisruptionBudget": {"enabled": True},
          "serviceMonitor": {"enabled": True}}
# Custom resources: kubernetes-validate knows only the built-in APIs (its schemas are bundled in
# the wheel, offline) and says "Couldn't find schema" for these; they are checked structurally
# below instead (test_service_monitor_selects_the_metrics_ports).
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"),
             ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
             ("keda.sh/v1alpha1", "ScaledObject")}  # (test_helm_keda.py)
MIN_KUBE = "1.27.0"  # Chart.yaml kubeVersion (native gRPC probes)


def _values_file(tmp_path: Path, values: dict) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _render(tmp_path: Path, *values_files: Path, name: str = "ps") -> list[Path]:
    out = tmp_path / "rendered"
    argv = [*HELM, "template", name, str(CHART), "--namespace", "llm", "--output-dir", str(out)]
    for f in values_files:
        argv += ["-f", str(f)]
    proc = run(argv)
    assert proc.returncode == 0, output(proc)
    files = sorted(out.rglob("*.yaml"))
    assert files
    return files


def _objects(files: list[Path]) -> list[dict]:
    return [doc for f in files for doc in yaml.safe_load_all(f.read_text()) if doc]


VALUE_SETS = {"default": [], "cuda-tp4": [CI_VALUES], "lws-pp2": [LWS_VALUES],
              "keda": [KEDA_VALUES]}


@pytest.mark.parametrize("case", VALUE_SETS)
def test_helm_lint_strict(case):
    argv = [*HELM, "lint", str(CHART)]
    for f in VALUE_SETS[case]:
        argv += ["-f", str(f)]
    proc = run(argv)
    assert proc.returncode == 0, output(proc)


def test_helm_lint_fails_on_broken_chart(tmp_path):
    chart = tmp_path / "pagedserve"
    shutil.copytree(CHART, chart)
    svc = chart / "templates" / "router-service.yaml"
    svc.write_text(svc.read_text().replace("{{ .Values.router.service.type }}",
                                           "{{ .Values.router.service.type }", 1))
    proc = run([*HELM, "lint", str(chart)])
    assert proc.returncode != 0, output(proc)
    assert "router-service.yaml" in proc.stderr and "parse error" in proc.stderr, output(proc)


def test_helm_lint_and_template_refuse_values_outside_the_schema(tmp_path):
    bad = _values_file(tmp_path, {"engine": {"tensorParallelSize": 0}})
    proc = run([*HELM, "lint", str(CHART), "-f", str(bad)])
    assert proc.returncode != 0 and "tensorParallelSize" in proc.stderr, output(proc)
    proc = run([*HELM, "template", "ps", str(CHART), "-f", str(bad)])
    assert proc.returncode != 0 and "tensorParallelSize" in proc.stderr, output(proc)
    typo = _values_file(tmp_path, {"engine": {"tensorParalelSize": 2}})
    proc = run([*HELM, "lint", str(CHART), "-f", str(typo)])
    assert proc.returncode != 0 and "tensorParalelSize" in proc.stderr, output(proc)


def _kubernetes_validate(files, kube_version=None):
    argv = [tool("kubernetes-validate"), "--strict"]
    if kube_version:
        argv += ["-k", kube_version]
    return run(argv + [str(f) for f in files])


@pytest.mark.parametrize("case", [*VALUE_SETS, "all-optional-objects"])
def test_rendered_manifests_pass_kubernetes_validate_strict(case, tmp_path):
    values = [*VALUE_SETS.get(case, [])]
    if case == "all-optional-objects":
        values = [CI_VALUES, _values_file(tmp_path, ALL_ON)]
    files = _render(tmp_path, *values)
    objects = _objects(files)
    crds = [o for o in objects if (o["apiVersion"], o["kind"]) in CRD_KINDS]
    builtin = [f for f in files if not any((d["apiVersion"], d["kind"]) in CRD_KINDS
                                           for d in yaml.safe_load_all(f.read_text()) if d)]
    for kube in (None, MIN_KUBE):
        proc = _kubernetes_validate(builtin, kube)
        assert proc.returncode == 0, output(proc)
        assert "passed" in proc.stdout and "Couldn't find schema" not in proc.stdout + proc.stderr
    if crds:
        # Reported, not silently passed: the only objects without a schema are the CRD kinds.
        crd_files = [f for f in files if f not in builtin]
        proc = _kubernetes_validate(crd_files)
        warned = proc.stdout + proc.stderr
        assert all(f"kind {kind}" in warned for _, kind in CRD_KINDS if any(
            o["kind"] == kind for o in crds))
        print(f"kubernetes-validate has no schema for {sorted({o['kind'] for o in crds})} "
              "(custom resources): checked structurally by test_service_monitor_*")


def test_kubernetes_validate_fails_on_broken_manifest(tmp_path):
    files = _render(tmp_path)
    sts = next(f for f in files if f.name == "engine-statefulset.yaml")
    text = sts.read_text()
    sts.write_text(text.replace("  serviceName:", "  servicName:", 1))  # unknown field (strict)
    proc = _kubernetes_validate([sts])
    assert proc.returncode != 0, output(proc)
    assert "servicName" in proc.stdout + proc.stderr, output(proc)
    sts.write_text(text.replace("podManagementPolicy: Parallel", "podManagementPolicy: [1]", 1))
    proc = _kubernetes_validate([sts])
    assert proc.returncode != 0 and "podManagementPolicy" in proc.stdout + proc.stderr, output(proc)


def _by_kind(objects, kind, suffix=""):
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, (kind, suffix, [o["metadata"]["name"] for o in found])
    return found[0]


# Flags the scheduler pushes to its workers when it connects (a worker started with another
# block size, or with smaller limits, refuses it).
ENGINE_LIMITS = ("PAGEDSERVE_BLOCK_SIZE", "PAGEDSERVE_MAX_NUM_SEQS",
                 "PAGEDSERVE_MAX_NUM_BATCHED_TOKENS")


def _env(container) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_cuda_tp4_three_replicas(tmp_path):
    objects = _objects(_render(tmp_path, CI_VALUES, _values_file(tmp_path, ALL_ON)))
    sts = _by_kind(objects, "StatefulSet", "-engine")
    pod = sts["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"scheduler", "worker"}
    assert "replicas" not in sts["spec"]  # the HPA owns it when autoscaling is on
    worker, scheduler = containers["worker"], containers["scheduler"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert _env(worker)["PAGEDSERVE_TENSOR_PARALLEL_SIZE"] == "4"
    assert _env(worker)["PAGEDSERVE_DEVICE"] == "cuda"
    assert _env(scheduler)["PAGEDSERVE_WORKERS"] == ",".join(
        f"127.0.0.1:{50053 + r}" for r in range(4))
    for limit in ENGINE_LIMITS:  # the scheduler pushes them; the worker must be started alike
        assert _env(worker)[limit] == _env(scheduler)[limit], limit
    assert [p["containerPort"] for p in worker["ports"] if p["name"].startswith("grpc-rank")] == [
        50053, 50054, 50055, 50056]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    assert vols["models"]["persistentVolumeClaim"]["claimName"] == "llm-models"
    assert pod["nodeSelector"] and pod["tolerations"] and pod["affinity"]
    for c in (scheduler, worker):
        port = int(_env(c)["PAGEDSERVE_PORT"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port, (c["name"], probe)
        # readiness: the ability to serve (""); liveness: the process (grpc_utils.LIVENESS)
        assert "service" not in c["readinessProbe"]["grpc"], c["name"]
        assert c["livenessProbe"]["grpc"]["service"] == LIVENESS, c["name"]
    # the scheduler must not be restarted while it waits for its workers
    assert scheduler["startupProbe"]["grpc"]["service"] == LIVENESS
    hpa = _by_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == sts["metadata"]["name"]
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "pagedserve_num_requests_waiting"
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "PodDisruptionBudget"} == {
        "ps-pagedserve-router", "ps-pagedserve-engine"}
    # Without autoscaling the StatefulSet has the 3 replicas of the values file.
    objects = _objects(_render(tmp_path / "noscale", CI_VALUES))
    assert _by_kind(objects, "StatefulSet")["spec"]["replicas"] == 3


def test_the_engine_pod_is_guaranteed_qos_with_whole_cpus(tmp_path):
    """requests == limits, whole CPUs, in every container of the engine pod: Kubernetes' static
    CPU manager then gives the worker cores of its own, and its CPU limit (the cgroup's quota)
    sizes its OpenMP threads (services/worker/cpu_threads.py)."""
    sts = _by_kind(_objects(_render(tmp_path)), "StatefulSet", "-engine")
    for c in sts["spec"]["template"]["spec"]["containers"]:
        res = c["resources"]
        assert res["requests"] == res["limits"], c["name"]
        assert float(res["limits"]["cpu"]).is_integer(), c["name"]
    worker = next(c for c in sts["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "worker")
    assert worker["resources"]["limits"]["cpu"] == "2"


def test_router_finds_engines_through_the_headless_service(tmp_path):
    objects = _objects(_render(tmp_path))
    headless = _by_kind(objects, "Service", "-engine")
    assert headless["spec"]["clusterIP"] == "None"
    sts = _by_kind(objects, "StatefulSet", "-engine")
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    router = _by_kind(objects, "Deployment", "-router")
    rc = router["spec"]["template"]["spec"]["containers"][0]
    grpc_port = next(p["port"] for p in headless["spec"]["ports"] if p["name"] == "grpc")
    assert _env(rc)["PAGEDSERVE_SCHEDULERS"] == (
        f"dns:///{headless['metadata']['name']}.llm.svc.cluster.local:{grpc_port}")
    assert rc["readinessProbe"]["grpc"]["port"] == int(_env(rc)["PAGEDSERVE_PORT"])
    assert "service" not in rc["readinessProbe"]["grpc"]  # "": SERVING while engines can serve
    for probe in ("startupProbe", "livenessProbe"):  # never restarted for waiting on engines
        assert rc[probe]["grpc"] == {"port": int(_env(rc)["PAGEDSERVE_PORT"]),
                                     "service": LIVENESS}, probe
    svc = _by_kind(objects, "Service", "-router")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
        "grpc": 50051, "http": 8000, "metrics": 9091}
    assert _env(rc)["PAGEDSERVE_HTTP_PORT"] == "8000"
    assert _env(rc)["PAGEDSERVE_METRICS_PORT"] == "9091"


def test_every_variable_is_a_flag_and_every_pod_runs_as_non_root(tmp_path):
    objects = _objects(_render(tmp_path, CI_VALUES))
    for o in objects:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = o["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["command"][0] == "pagedserve"
            service = c["command"][1]
            assert not unknown_env(service, _env(c)), (service, unknown_env(service, _env(c)))
            assert _env(c)["PAGEDSERVE_HOST"] == "0.0.0.0"  # probes and peers reach the pod IP


def test_service_monitor_selects_the_metrics_ports(tmp_path):
    """ServiceMonitor (a custom resource kubernetes-validate has no schema for): its selector
    matches the router and engine Services and its endpoints name their metrics ports."""
    objects = _objects(_render(tmp_path, _values_file(tmp_path, ALL_ON)))
    sm = _by_kind(objects, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    selector = sm["spec"]["selector"]["matchLabels"]
    services = [o for o in objects if o["kind"] == "Service"
                and selector.items() <= o["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in services} == {"ps-pagedserve-router",
                                                         "ps-pagedserve-engine"}
    port_names = {p["name"] for s in services for p in s["spec"]["ports"]}
    for endpoint in sm["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert set(endpoint) <= {"port", "path", "interval"}
    assert set(sm["spec"]) == {"selector", "namespaceSelector", "endpoints"}


def test_readme_documents_every_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    assert "helm install pagedserve helm/pagedserve" in readme
    leaf_dicts = {"podSecurityContext", "containerSecurityContext", "router.resources",
                  "engine.scheduler.resources", "engine.worker.resources"}

    def leaves(d, prefix=""):
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v and key not in leaf_dicts:
                yield from leaves(v, key + ".")
            else:
                yield key
    missing = [k for k in leaves(values) if f"| `{k}` |" not in readme]
    assert not missing, f"values missing from helm/pagedserve/README.md's table: {missing}"
    for name in ("values.schema.json", "templates/NOTES.txt", "ci/values-cuda-tp4.yaml",
                 "ci/values-lws-pp2.yaml", "ci/values-keda-scale-to-zero.yaml"):
        assert (CHART / name).is_file()


def test_every_service_drains_within_its_pods_grace_period(tmp_path):
    """PAGEDSERVE_SHUTDOWN_TIMEOUT reaches every container, each pod's grace period is longer,
    and a grace period that would SIGKILL a draining pod is refused at render time."""
    objects = _objects(_render(tmp_path, _values_file(tmp_path, {"shutdownTimeout": 40})))
    pods = [o["spec"]["template"]["spec"] for o in objects
            if o["kind"] in ("Deployment", "StatefulSet")]
    assert len(pods) == 2
    for spec in pods:
        assert spec["terminationGracePeriodSeconds"] > 40
        for c in spec["containers"]:
            assert _env(c)["PAGEDSERVE_SHUTDOWN_TIMEOUT"] == "40"
    short = _values_file(tmp_path, {"router": {"terminationGracePeriodSeconds": 20}})
    proc = run([*HELM, "template", "ps", str(CHART), "-f", str(short)])
    assert proc.returncode != 0, output(proc)
    assert "router.terminationGracePeriodSeconds (20) must be larger than shutdownTimeout" \
        in proc.stderr, output(proc)
