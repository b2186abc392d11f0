"""The docker-compose stack, run as local processes: each service's own command and environment
from docker/docker-compose.yml, in its depends_on order, gated on its own healthcheck.

docker-compose itself resolves the file (``config --format json``, with docker/.env.example as
the env file and a few variables set as a user would: a tiny model under MODELS_DIR, float32, a
small KV cache). The translation from containers to processes is small and explicit
(``Translation``):
  - command ``pagedserve ...``      -> this venv's ``pagedserve`` console script;
  - a service name as a host        -> 127.0.0.1, and each service's container port
    (PAGEDSERVE_*PORT of that service) -> a free local port, in "host:port" values and in
    the healthcheck command (which names 127.0.0.1:<its own container port>);
  - PAGEDSERVE_HOST 0.0.0.0         -> 127.0.0.1 (nothing else needs to reach us);
  - a bind mount target (/models)   -> its host source, in environment values.
Then one request goes end to end through the router with the SDK, and its greedy tokens must be
transformers' own on the tiny model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.common.ports import free_port
from tests.deploy.conftest import COMPOSE, DOCKER, REPO, output, run, tool
from tests.helpers import make_servable_tiny_llama

pytestmark = pytest.mark.slow
PORT_VARS = ("PAGEDSERVE_PORT", "PAGEDSERVE_HTTP_PORT", "PAGEDSERVE_METRICS_PORT")
PAGEDSERVE = [str(Path(sys.executable).parent / "pagedserve")]
if not os.path.exists(PAGEDSERVE[0]):  # not installed as a console script: same entry point
    PAGEDSERVE = [sys.executable, "-m", "services.cli"]


class Translation:
    """Container names, ports and mounts of the compose config -> this machine's."""

    def __init__(self, services: dict):
        self.services = services
        # (service, container port) -> local port
        self.ports = {(name, int(env[var])): free_port()
                      for name, s in services.items() for env in [s.get("environment") or {}]
                      for var in PORT_VARS if var in env}
        self.mounts = {v["target"]: v["source"] for s in services.values()
                       for v in s.get("volumes", []) if v["type"] == "bind"}

    def address(self, text: str, own: str) -> str:
        """Rewrite every ``host:port`` (host: a service name, or 127.0.0.1 = ``own``)."""
        def sub(m):
            host, port = m.group(1), int(m.group(2))
            service = own if host in ("127.0.0.1", "localhost") else host
            return f"127.0.0.1:{self.ports[(service, port)]}"
        names = "|".join(map(re.escape, [*self.services, "127.0.0.1", "localhost"]))
        return re.sub(rf"\b({names}):(\d+)\b", sub, text)

    def command(self, argv: list[str], own: str) -> list[str]:
        if argv[0] == "CMD":
            argv = argv[1:]
        assert argv[0] == "pagedserve", argv
        return PAGEDSERVE + [self.address(a, own) for a in argv[1:]]

    def environment(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
        for key, value in (self.services[name].get("environment") or {}).items():
            value = "" if value is None else str(value)
            if key in PORT_VARS:
                value = str(self.ports[(name, int(value))])
            elif key == "PAGEDSERVE_HOST" and value == "0.0.0.0":
                value = "127.0.0.1"
            else:
                value = self.address(value, name)
                for target, source in self.mounts.items():
                    if value == target or value.startswith(target + "/"):
                        value = source + value[len(target):]
            env[key] = value
        return env


def _start_order(services: dict) -> list[str]:
    order: list[str] = []

    def visit(name):
        for dep in services[name].get("depends_on") or {}:
            visit(dep)
        if name not in order:
            order.append(name)
    for name in sorted(services):
        visit(name)
    return order


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> Path:
    models = tmp_path_factory.mktemp("models")
    make_servable_tiny_llama(models / "tiny")
    return models


@pytest.fixture(scope="module")
def stack(tiny_models):
    env = {**os.environ, "MODELS_DIR": str(tiny_models), "MODEL": "/models/tiny",
           "DTYPE": "float32", "KV_CACHE_MEMORY": "64MiB", "MAX_NUM_BATCHED_TOKENS": "256",
           "MAX_NUM_SEQS": "16", "LOG_LEVEL": "WARNING"}
    proc = run([tool("docker-compose"), "-f", str(COMPOSE), "--env-file",
                str(DOCKER / ".env.example"), "config", "--format", "json"], env=env)
    assert proc.returncode == 0, output(proc)
    services = json.loads(proc.stdout)["services"]  # the default profile: no monitoring
    assert set(services) == {"worker", "scheduler", "router"}
    tr = Translation(services)
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in _start_order(services):
            for dep, cond in (services[name].get("depends_on") or {}).items():
                assert cond["condition"] == "service_healthy"
                _wait_healthy(tr, dep, procs)
            procs[name] = subprocess.Popen(tr.command(services[name]["command"], name),
                                           env=tr.environment(name), cwd=REPO,
                                           start_new_session=True)
        _wait_healthy(tr, "router", procs)
        yield tr, services
    finally:
        codes = {}
        for name in reversed(list(procs)):
            p = procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                codes[name] = p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                codes[name] = p.wait()
    assert all(c == 0 for c in codes.values()), f"exit codes after SIGTERM: {codes}"


def _wait_healthy(tr: Translation, name: str, procs, timeout: float = 120) -> None:
    """Run the service's own compose healthcheck until it passes."""
    check = tr.command(tr.services[name]["healthcheck"]["test"], name)
    deadline = time.monotonic() + timeout
    while subprocess.run(check, capture_output=True, cwd=REPO).returncode != 0:
        assert procs[name].poll() is None, f"{name} exited with {procs[name].returncode}"
        assert time.monotonic() < deadline, f"{name} not healthy after {timeout} s"
        time.sleep(0.5)


def test_request_through_the_compose_stack(stack, tiny_models):
    from pagedserve_client import Client
    from tests.stack.conftest import hf_greedy

    tr, services = stack
    router = f"127.0.0.1:{tr.ports[('router', int(services['router']['environment']['PAGEDSERVE_PORT']))]}"
    with Client(router, timeout=60) as c:
        prompt_ids = c.tokenize("The capital of France is").token_ids
        r = c.generate(prompt="The capital of France is", temperature=0, max_tokens=8,
                       ignore_eos=True)
        models = c.list_models()
    assert r.finish_reason == "length" and r.usage.completion_tokens == 8
    assert list(r.token_ids) == hf_greedy(str(tiny_models / "tiny"), [list(prompt_ids)], 8)[0]
    assert models[0].id == "tiny"  # the model under the translated /models mount
    http = tr.ports[("router", int(services["router"]["environment"]["PAGEDSERVE_HTTP_PORT"]))]
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=10) as resp:
        assert resp.status == 200


def test_metrics_ports_serve_the_dashboard_metrics(stack):
    """The ports Prometheus scrapes (PAGEDSERVE_METRICS_PORT of each service) serve the metric
    names the Grafana dashboard uses."""
    tr, services = stack
    dashboard = json.loads((DOCKER / "grafana/dashboards/pagedserve.json").read_text())
    wanted = set(re.findall(r"pagedserve:\w+", " ".join(
        t["expr"] for p in dashboard["panels"] for t in p["targets"])))
    exposed = ""
    for name, s in services.items():
        port = tr.ports[(name, int(s["environment"]["PAGEDSERVE_METRICS_PORT"]))]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            exposed += resp.read().decode()
    names = set(re.findall(r"^(pagedserve:\w+?)(?:_bucket|_count|_sum)?[{ ]", exposed, re.M))
    names |= {n + "_total" for n in names} | {n + "_bucket" for n in names}
    absent = wanted - names
    assert not absent, f"dashboard metrics no service exposes: {sorted(absent)}"
