"""End to end: ``pagedserve serve`` runs the three services as processes; the CLI talks to it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from services.common.ports import free_ports
from tests.helpers import make_servable_tiny_llama

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "services.cli"]


def _wait_healthy(address: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(CLI + ["health", "--address", address],
                         capture_output=True).returncode != 0:
        assert proc.poll() is None, f"serve exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "stack not healthy in time"
        time.sleep(1)


@pytest.fixture
def serve():
    procs = []

    def start(*flags: str) -> str:
        port, sport, wport = free_ports(3)
        proc = subprocess.Popen(CLI + ["serve", "--port", str(port), "--scheduler-port",
                                       str(sport), "--worker-port", str(wport),
                                       "--http-port", "0", "--metrics-port", "0", *flags],
                                start_new_session=True)
        procs.append((proc, [port, sport, wport]))
        address = f"127.0.0.1:{port}"
        _wait_healthy(address, proc)
        return address

    yield start
    for proc, ports in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, "serve did not exit 0 on SIGTERM"
        for p in ports:  # every child is gone: nothing answers on its port
            assert subprocess.run(CLI + ["health", "--address", f"127.0.0.1:{p}",
                                         "--timeout", "0.5"], capture_output=True).returncode == 1


def test_serve_smollm2_answers_paris(serve):
    address = serve()  # the packaged default model, default dtype
    out = subprocess.run(CLI + ["generate", "--address", address, "--chat",
                                "What is the capital of France?", "--temperature", "0",
                                "--max-tokens", "20"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "finish_reason=" in out.stderr


def test_serve_tiny_model_with_flags(serve, tmp_path):
    model = make_servable_tiny_llama(tmp_path / "tiny")
    address = serve("--model", model, "--dtype", "float32", "--block-size", "32",
                    "--kv-cache-memory", "32MiB", "--max-num-seqs", "8",
                    "--max-num-batched-tokens", "128", "--max-model-len", "512")
    out = subprocess.run(CLI + ["generate", "--address", address, "--prompt", "Hi",
                                "--max-tokens", "5", "--seed", "1", "--stop", "zzzz"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "completion_tokens=" in out.stderr
    bad = subprocess.run(CLI + ["generate", "--address", address, "--prompt", "Hi",
                                "--temperature", "-1"], capture_output=True, text=True)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "temperature" in bad.stderr


def test_serve_refuses_busy_ports():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        sport, wport = free_ports(2)
        out = subprocess.run(CLI + ["serve", "--port", str(port), "--scheduler-port", str(sport),
                                    "--worker-port", str(wport), "--http-port", "-1",
                                    "--metrics-port", "-1"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"port(s) {port}" in out.stderr and "already in use" in out.stderr


def test_services_exit_when_serve_is_killed(tmp_path):
    model = make_servable_tiny_llama(tmp_path / "tiny")
    ports = free_ports(3)
    proc = subprocess.Popen(CLI + ["serve", "--port", str(ports[0]), "--scheduler-port",
                                   str(ports[1]), "--worker-port", str(ports[2]),
                                   "--http-port", "0", "--metrics-port", "0", "--model",
                                   model, "--kv-cache-memory", "16MiB"], start_new_session=True)
    try:
        _wait_healthy(f"127.0.0.1:{ports[0]}", proc)
    finally:
        proc.kill()  # SIGKILL: serve cannot stop its children itself
        proc.wait()
    deadline = time.monotonic() + 15
    for p in ports:
        while subprocess.run(CLI + ["health", "--address", f"127.0.0.1:{p}", "--timeout", "0.5"],
                             capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, f"a service on port {p} outlived serve"
            time.sleep(0.5)


def test_demo_prints_clean_answers_and_logs_to_a_file(tmp_path):
    """``make run``: the answers on a terminal (stdout and stderr together) hold no log
    lines; the services' logs, debug level included, are in the file whose path serve prints."""
    model = make_servable_tiny_llama(tmp_path / "tiny")
    ports = free_ports(3)
    terminal = tmp_path / "terminal"
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache")}
    with open(terminal, "wb") as tty:
        proc = subprocess.Popen(CLI + ["serve", "--demo", "--port", str(ports[0]),
                                       "--scheduler-port", str(ports[1]), "--worker-port",
                                       str(ports[2]), "--http-port", "-1", "--metrics-port", "-1",
                                       "--model", model, "--kv-cache-memory", "32MiB",
                                       "--log-level", "debug"],
                                stdout=tty, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
    try:
        deadline = time.monotonic() + 300
        while "Ctrl-C stops" not in (text := terminal.read_text()):  # after the demo
            assert proc.poll() is None, f"serve exited early: {text[-2000:]}"
            assert time.monotonic() < deadline, "demo did not finish in time"
            time.sleep(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert text.count(">>> 4 prompts sent at once") == 1 and "[3] " in text
    for fragment in ('{"time"', '"level"', '"service"', "DEBUG"):
        assert fragment not in text, f"log output among the demo's answers: {fragment}"
    logs = list((tmp_path / "cache" / "logs").glob("serve-*.log"))
    assert len(logs) == 1 and f"the services' logs go to {logs[0]}" in text
    records = [json.loads(line) for line in logs[0].read_text().splitlines()
               if line.startswith('{"time"')]
    assert {r["service"] for r in records} >= {"worker", "scheduler", "router"}
    assert "DEBUG" in {r["level"] for r in records}
