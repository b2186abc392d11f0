"""The protocols pass ``buf lint`` (rules in buf.yaml: STANDARD and COMMENTS; the two internal
streams' message names are the only exception). buf is the npm package @bufbuild/buf pinned in
package.json, installed into node_modules/ by ``make install``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUF = REPO / "node_modules/.bin/buf"


def _buf(*args: str) -> subprocess.CompletedProcess:
    assert BUF.exists(), f"{BUF} missing: run `make install` (npm ci installs buf)"
    return subprocess.run([str(BUF), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_buf_lint_passes():
    proc = _buf("lint")
    assert proc.returncode == 0, (f"buf lint failed (exit {proc.returncode}):\n"
                                  f"{proc.stdout}{proc.stderr}")


def test_public_api_passes_every_rule_without_exceptions():
    """api.proto alone, with buf.yaml's rule sets but none of its ignores."""
    config = ('{"version":"v2","modules":[{"path":"protos"}],'
              '"lint":{"use":["STANDARD","COMMENTS"]}}')
    proc = _buf("lint", "--config", config, "--path", "protos/pagedserve/v1/api.proto")
    assert proc.returncode == 0, f"buf lint api.proto failed:\n{proc.stdout}{proc.stderr}"


def test_the_exceptions_are_needed():
    """The internal protocols without buf.yaml's ignores fail only the two naming rules (drop
    the ignores from buf.yaml once the streams' messages are renamed)."""
    config = ('{"version":"v2","modules":[{"path":"protos"}],'
              '"lint":{"use":["STANDARD","COMMENTS"]}}')
    proc = _buf("lint", "--config", config, "--error-format", "json")
    rules = {json.loads(line)["type"] for line in proc.stdout.splitlines() if line.strip()}
    assert rules == {"RPC_REQUEST_STANDARD_NAME", "RPC_RESPONSE_STANDARD_NAME"}, proc.stdout
