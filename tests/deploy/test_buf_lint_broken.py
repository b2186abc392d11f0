"""`buf lint` on protos/ passes in tests/test_protos_lint.py (not repeated here); this shows the
same command failing on a deliberately broken copy, as every deployment check does."""

from __future__ import annotations

import shutil

from tests.deploy.conftest import REPO, output, run
from tests.test_protos_lint import BUF


def test_buf_lint_fails_on_broken_copy(tmp_path):
    assert BUF.exists(), f"{BUF} missing: run `make install` (npm ci installs buf)"
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    api = tmp_path / "protos/pagedserve/v1/api.proto"
    text = api.read_text()
    assert "  string request_id = 5;" in text
    api.write_text(text.replace("  string request_id = 5;", "  string requestId = 5;", 1))
    proc = run([str(BUF), "lint"], cwd=tmp_path)
    assert proc.returncode != 0, output(proc)
    assert "requestId" in proc.stdout and "lower_snake_case" in proc.stdout, output(proc)
