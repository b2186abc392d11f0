"""A CPU worker sharing its machine, on the real OS: a worker started in a cgroup with a quota
of 1 CPU uses 1 thread, ``--cpu-bind`` pins its OpenMP thread and moves the others off that
core, and the governor drops threads while busy processes take the cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs in the affinity mask")


def _start_worker(model: Path, tmp_path: Path, *flags: str, prefix: str = ""):
    """``pagedserve worker`` on any free ports (``prefix``: shell run first, in the same
    process); returns (process, log path) once it serves, and its metrics URL."""
    log = tmp_path / f"worker-{uuid.uuid4().hex[:6]}.log"
    cmd = (f"{prefix}exec {sys.executable} -m services.cli worker --model {model} "
           f"--port 0 --metrics-port 0 --dtype float32 --kv-cache-memory 16MiB "
           f"--enforce-eager --log-format text {' '.join(flags)}")
    with open(log, "w") as err:  # (the child keeps its own copy of the descriptor)
        proc = subprocess.Popen(["sh", "-c", cmd], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err)
    deadline = time.monotonic() + 240
    while "worker serving on" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the worker did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    url = re.search(r"metrics on (http://\S+/metrics)", log.read_text()).group(1)
    return proc, log, url


def _threads_metric(url: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return float(re.search(r'^pagedserve:worker_cpu_threads\{rank="0"\} (\S+)$', text,
                           re.M).group(1))


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _cgroup_with_one_cpu() -> Path:
    """A new cgroup (v2, else v1's cpu hierarchy) with a quota of 1 CPU that a process can
    join; skips with the reason where this process cannot make one."""
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    cg = _make_cgroup()
    joined = subprocess.run(["sh", "-c", f"echo $$ > {cg}/cgroup.procs"], capture_output=True,
                            text=True)
    if joined.returncode != 0:
        cg.rmdir()
        pytest.skip(f"a process cannot join a new cgroup here: {joined.stderr.strip()}")
    return cg


def _make_cgroup() -> Path:
    name = f"pagedserve-test-{uuid.uuid4().hex[:8]}"
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v2 / "cgroup.controllers").exists():
            if "cpu" not in (v2 / "cgroup.subtree_control").read_text().split():
                (v2 / "cgroup.subtree_control").write_text("+cpu")
            cg = v2 / name
            cg.mkdir()
            (cg / "cpu.max").write_text("100000 100000")
            return cg
        for hier in ("cpu", "cpu,cpuacct"):
            if (v2 / hier / "cpu.cfs_quota_us").exists():
                cg = v2 / hier / name
                cg.mkdir()
                (cg / "cpu.cfs_period_us").write_text("100000")
                (cg / "cpu.cfs_quota_us").write_text("100000")
                return cg
    except OSError as e:
        pytest.skip(f"cannot make a cgroup with a CPU quota here: {e}")
    pytest.skip("no cgroup cpu controller mounted at /sys/fs/cgroup")


@needs_two
def test_a_worker_in_a_cgroup_with_one_cpu_uses_one_thread(tiny_llama, tmp_path):
    cg = _cgroup_with_one_cpu()
    try:
        proc, log, url = _start_worker(tiny_llama, tmp_path,
                                       prefix=f"echo $$ > {cg}/cgroup.procs && ")
        try:
            assert _threads_metric(url) == 1
            assert "OpenMP threads: 1 (the cgroup's CPU quota is 1 CPUs" in log.read_text()
        finally:
            _stop(proc)
    finally:
        cg.rmdir()


def _affinity(pid: int, tid: int) -> str | None:
    """The thread's CPU list; None: it ended since the task folder was listed."""
    try:
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M).group(1)


@needs_two
def test_cpu_bind_pins_the_forward_thread_and_moves_the_others(tiny_llama, tmp_path):
    core = CPUS[-1]
    proc, log, url = _start_worker(tiny_llama, tmp_path, "--cpu-bind", str(core))
    try:
        assert _threads_metric(url) == 1
        pid = proc.pid  # (the shell exec'd the worker: same process)
        # (a short-lived helper thread may end between the listing and its read: left out)
        masks = {int(t): m for t in os.listdir(f"/proc/{pid}/task")
                 if (m := _affinity(pid, int(t))) is not None}
        pinned = [t for t, m in masks.items() if m == str(core)]
        assert len(pinned) == 1, masks  # the forward thread (its team of one)
        assert masks[pid] != str(core) and str(core) not in masks[pid].split(","), masks
        assert f"bound one per core to CPUs {core} (--cpu-bind {core})" in log.read_text()
    finally:
        _stop(proc)


@needs_two
def test_the_governor_drops_threads_while_busy_processes_take_the_cores():
    """This process's own OpenMP team under the real readers: parallel work (many regions a
    step, as a forward has) beside one busy process per CPU."""
    import torch

    from services.worker.cpu_governor import ThreadGovernor
    from services.worker.cpu_threads import omp_thread_ids

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    gov = ThreadGovernor(2, omp_thread_ids(2), set(CPUS), torch.set_num_threads)
    a, b = torch.randn(64, 256), torch.randn(256, 256)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in CPUS]
    try:
        deadline = time.monotonic() + 60
        while gov.threads == 2 and time.monotonic() < deadline:
            gov.before_step()
            for _ in range(50):
                torch.mm(a, b)
            gov.after_step()
        assert gov.threads == 1
        assert torch.get_num_threads() == 1
    finally:
        for p in busy:
            p.kill()
            p.wait()
        torch.set_num_threads(threads)
