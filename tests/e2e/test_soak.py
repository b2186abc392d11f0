"""A short soak (``benchmarks/soak.py``) over the real stack as processes: 300 mixed streaming
requests, 64 in flight, 10% cancelled by the client mid-stream. Every request must get a
terminal response (none lost) and no KV block may stay used after the drain. The RSS bound is
checked only by the full ``make soak`` (2,000 requests): over a run this short the services'
RSS still moves by a few percent either way (allocator warm-up, freed start-up memory)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_loses_no_request_and_leaks_no_block(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--requests", "300",
         "--concurrency", "64", "--cancel-fraction", "0.1", "--max-output-len", "64",
         "--rss-at", "100", "--no-rss-check", "--stall-timeout", "60",
         "--output", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    f = json.loads(out.read_text())
    assert f["lost"] == 0, f["lost_examples"]
    assert f["requests_sent"] == 300 and f["peak_concurrency"] == 64
    assert f["finished"] + f["cancelled"] + sum(f["errors_by_code"].values()) == 300
    assert 15 <= f["cancelled"] <= 45  # ~10%
    assert f["errors_by_code"] == {}  # nothing in this load is refused or fails
    assert f["blocks_free"] == f["blocks_total"] > 0, "KV blocks leaked"
    assert set(f["rss_end_mib"]) == {"worker", "scheduler", "router"}
    assert proc.returncode == 0, f["failures"]
