"""``make install``'s long steps say that they still run: the pip installs
(scripts/with_progress.py) and the CPU kernel build (``python -m kernels.cpu_build``)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from kernels import cpu_build

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "with_progress.py"


def test_with_progress_ticks_and_passes_the_exit_code_on():
    out = subprocess.run([sys.executable, str(SCRIPT), "installing things", "--every", "0.2",
                          "--", sys.executable, "-c",
                          "import time, sys; print('pip says', flush=True); time.sleep(0.9); "
                          "sys.exit(3)"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    lines = out.stdout.splitlines()
    assert lines[0] == "installing things ..." and "pip says" in lines
    ticks = [x for x in lines if x.startswith("  still installing things: ")]
    took = re.fullmatch(r"installing things: failed after (\d+\.\d) s", lines[-1])
    assert took, lines
    assert 3 <= len(ticks) <= float(took.group(1)) / 0.2 + 1, lines  # one per 0.2 s


def test_with_progress_needs_a_command():
    out = subprocess.run([sys.executable, str(SCRIPT), "installing things"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "need -- COMMAND" in out.stderr


def test_kernel_build_runs_inside_the_progress_hook(tmp_path, monkeypatch):
    """A compile (not a cached library) is wrapped by ``cpu_build.progress``: the worker's
    start-up step, or ``main``'s printer."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_loaded", None)  # (restored: the real library stays)
    events: list[str] = []

    def fake_compile(name, build_directory, **_kwargs):
        events.append("compile")
        time.sleep(0.05)
        lib = Path(build_directory) / f"{name}.so"
        lib.write_bytes(b"not a library")
        return str(lib)

    @contextmanager
    def hook(what):
        events.append(f"start {what}")
        yield
        events.append("end")

    monkeypatch.setattr(cpp_extension, "load", fake_compile)
    monkeypatch.setattr(cpu_build, "progress", hook)
    path = cpu_build.build()
    assert events == ["start building the CPU kernels", "compile", "end"]
    assert path.read_bytes() == b"not a library"
    events.clear()
    assert cpu_build.build() == path and events == []  # cached: nothing to say


def test_cpu_build_main_prints_progress(capsys):
    with cpu_build._print_progress("building the CPU kernels", every=0.05):
        time.sleep(0.18)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "building the CPU kernels ..."
    assert 2 <= len(lines[1:]) <= 4 and all(x.startswith("  still building: ") for x in lines[1:])
