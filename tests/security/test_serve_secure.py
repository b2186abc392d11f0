"""End to end: ``pagedserve serve`` with mTLS on every link and an API key; the CLI's health
and generate commands talk to it with the same flags (issue 9)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from services.common.ports import free_ports
from tests.helpers import make_servable_tiny_llama

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "services.cli"]
KEY = "sk-e2e-secret"


def _health(address: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + ["health", "--address", address, "--timeout", "2", *flags],
                          capture_output=True, text=True, timeout=30)


def _cmdlines():
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    yield int(entry), f.read()
            except OSError:  # gone meanwhile, or not ours to read
                continue


def test_serve_with_mtls_and_api_key(tmp_path, pki):
    model = make_servable_tiny_llama(tmp_path / "tiny")
    port, sport, wport = free_ports(3)
    tls = pki.service_flags(mtls=True)
    client_tls = ["--ssl-certfile", str(pki.client_cert), "--ssl-keyfile", str(pki.client_key),
                  "--ssl-ca-certs", str(pki.ca)]
    env = {**os.environ, "PAGEDSERVE_API_KEY": KEY}
    proc = subprocess.Popen(CLI + ["serve", "--port", str(port), "--scheduler-port", str(sport),
                                   "--worker-port", str(wport), "--http-port", "-1",
                                   "--metrics-port", "-1", "--model", model, "--dtype",
                                   "float32", "--kv-cache-memory", "32MiB", *tls],
                            env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while _health(address, *client_tls).returncode != 0:
            assert proc.poll() is None, f"serve exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "stack not healthy in time"
            time.sleep(1)
        for p in (port, sport, wport):  # every link serves mTLS only
            assert _health(f"127.0.0.1:{p}").returncode == 1
            assert _health(f"127.0.0.1:{p}", *client_tls).returncode == 0
        gen = CLI + ["generate", "--address", address, "--prompt", "Hi", "--max-tokens", "4",
                     *client_tls]
        out = subprocess.run(gen + ["--api-key", KEY], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert "finish_reason=" in out.stderr
        out = subprocess.run(gen, capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items()
                                  if k != "PAGEDSERVE_API_KEY"})
        assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr
        assert not [pid for pid, cmd in _cmdlines() if KEY.encode() in cmd], \
            "the API key is on a command line (ps shows it)"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert KEY not in stderr  # nor in any service's logs
