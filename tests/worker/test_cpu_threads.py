"""The worker's OpenMP thread plan (services/worker/cpu_threads.py): CPU lists, cgroup quotas
(v1 and v2, read from fake trees), ``--cpu-threads`` / ``--cpu-bind`` and the split between
a host's ranks."""

from __future__ import annotations

import argparse

import pytest

from services.worker.cpu_threads import (
    cgroup_cpu_limit,
    cpu_bind_flag,
    local_rank_of,
    parse_cpu_list,
    plan_cpu_threads,
)

EIGHT = list(range(8))


def test_cpu_lists_parse_as_taskset_reads_them():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list(" 5 ") == [5]
    for bad in ("", "a", "3-1", "-1", "0,0", "1-2,2"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    assert cpu_bind_flag("AUTO") == "auto"
    assert cpu_bind_flag("nobind") == "nobind"
    assert cpu_bind_flag("0-1|2-3") == "0-1|2-3"
    with pytest.raises(argparse.ArgumentTypeError, match="'x'"):
        cpu_bind_flag("0-1|x")


def _v2(tmp_path, path: str, quotas: dict[str, str]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup").write_text(f"0::{path}\n")
    for folder, text in quotas.items():
        d = tmp_path / "fs" / folder.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(text + "\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "fs")


def test_cgroup_v2_quota_is_the_lowest_on_the_path(tmp_path):
    proc, root = _v2(tmp_path, "/kubepods/pod1/c1", {
        "/": "max 100000", "kubepods": "max 100000", "kubepods/pod1": "150000 100000",
        "kubepods/pod1/c1": "max 100000"})
    cpus, where = cgroup_cpu_limit(proc, root)
    assert cpus == 1.5 and where.endswith("kubepods/pod1/cpu.max")
    proc, root = _v2(tmp_path / "b", "/", {"/": "max 100000"})
    assert cgroup_cpu_limit(proc, root) is None
    proc, root = _v2(tmp_path / "c", "/", {"/": "50000 100000"})  # a container's namespace
    assert cgroup_cpu_limit(proc, root)[0] == 0.5


def test_cgroup_v1_quota_and_no_limit(tmp_path):
    (tmp_path / "cgroup").write_text("5:memory:/x\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    d = tmp_path / "fs" / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("200000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(tmp_path / "cgroup"), str(tmp_path / "fs"))[0] == 2.0
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(str(tmp_path / "cgroup"), str(tmp_path / "fs")) is None
    assert cgroup_cpu_limit(str(tmp_path / "missing"), str(tmp_path / "fs")) is None


def test_default_threads_come_from_affinity_quota_and_ranks():
    plan = plan_cpu_threads(cpus=EIGHT, limit=None)
    assert (plan.threads, plan.bind, plan.reason) == (8, None, "8 CPUs in the affinity mask")
    plan = plan_cpu_threads(cpus=EIGHT, limit=(1.5, "/sys/fs/cgroup/cpu.max"))
    assert plan.threads == 1 and "quota is 1.5 CPUs (/sys/fs/cgroup/cpu.max)" in plan.reason
    assert plan_cpu_threads(cpus=EIGHT, limit=(0.2, "f")).threads == 1  # never 0
    assert plan_cpu_threads(cpus=EIGHT, limit=(16.0, "f")).threads == 8  # the mask is lower
    assert plan_cpu_threads(cpus=EIGHT, limit=None, local_rank=1, local_ranks=2).threads == 4
    assert plan_cpu_threads(cpus=[0], limit=None, local_rank=1, local_ranks=2).threads == 1
    assert plan_cpu_threads(3, cpus=EIGHT, limit=None).threads == 3  # --cpu-threads wins


def test_bind_pins_this_ranks_share_and_moves_the_rest():
    plan = plan_cpu_threads(cpu_bind="auto", cpus=EIGHT, limit=None, local_rank=1,
                            local_ranks=2)
    assert plan.bind == (4, 5, 6, 7) and plan.others == (0, 1, 2, 3) and plan.threads == 4
    plan = plan_cpu_threads(cpu_bind="auto", cpus=EIGHT, limit=(2.0, "f"))
    assert plan.bind == (0, 1) and plan.others == (2, 3, 4, 5, 6, 7)
    plan = plan_cpu_threads(cpu_bind="0-1|6-7", cpus=EIGHT, limit=None, local_rank=1,
                            local_ranks=2)
    assert plan.bind == (6, 7)
    plan = plan_cpu_threads(cpu_bind="0-7", cpus=EIGHT, limit=None)
    assert plan.bind == tuple(EIGHT) and plan.others is None  # nothing left for the others
    plan = plan_cpu_threads(2, "2-5", cpus=EIGHT, limit=None)
    assert plan.bind == (2, 3) and plan.threads == 2
    assert plan_cpu_threads(cpu_bind="none", cpus=EIGHT, limit=None).bind is None


@pytest.mark.parametrize("kwargs, message", [
    ({"cpu_bind": "6-9"}, "CPUs 8-9 are not in this process's affinity mask"),
    ({"cpu_bind": "0|1|2", "local_ranks": 2}, "3 lists"),
    ({"cpu_bind": "0", "local_ranks": 2}, "1 cores to 2 worker ranks"),
    ({"cpu_threads": 3, "cpu_bind": "0-1"}, "--cpu-threads 3 is more than the 2 cores"),
])
def test_impossible_binds_are_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_cpu_threads(cpus=EIGHT, limit=None, **kwargs)


def test_a_hosts_ranks_are_counted_from_the_flags():
    ns = argparse.Namespace(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
                            rank=3)
    assert local_rank_of(ns) == (1, 2)
    ns.rank, ns.nnodes = None, 1
    assert local_rank_of(ns) == (0, 4)
