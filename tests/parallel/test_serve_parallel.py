"""``pagedserve serve --pipeline-parallel-size 2`` end to end: the launcher starts both ranks on
consecutive worker ports and gives the scheduler both addresses."""

from __future__ import annotations

import signal
import subprocess

import pytest

from pagedserve_client import Client
from services.common.ports import free_ports
from tests.e2e.test_serve import CLI, _wait_healthy
from tests.parallel.conftest import PROMPTS, free_port_range, reference_greedy

pytestmark = pytest.mark.slow


def test_serve_passes_parallel_sizes_through(tiny_model):
    port, sched_port = free_ports(2)
    worker_port = free_port_range(2)
    proc = subprocess.Popen(CLI + [
        "serve", "--model", tiny_model, "--dtype", "float32", "--kv-cache-memory", "16MiB",
        "--pipeline-parallel-size", "2", "--port", str(port), "--scheduler-port",
        str(sched_port), "--worker-port", str(worker_port), "--http-port", "-1",
        "--metrics-port", "0"],
        start_new_session=True)
    try:
        _wait_healthy(f"127.0.0.1:{port}", proc, timeout=120)
        for r in range(2):  # both ranks serve, on consecutive ports
            assert subprocess.run(CLI + ["health", "--address", f"127.0.0.1:{worker_port + r}"],
                                  capture_output=True).returncode == 0
        with Client(f"127.0.0.1:{port}") as c:
            got = c.generate(prompt_token_ids=PROMPTS[1], temperature=0, max_tokens=4,
                             ignore_eos=True).token_ids
        assert got == reference_greedy(tiny_model, [PROMPTS[1]], 4)[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
