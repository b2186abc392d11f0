"""``torch.ops.pagedserve.omp_thread_ids`` (kernels/csrc/cpu_threads.cpp): the OpenMP team's
Linux thread ids, the calling thread first, the same ones for every later team."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kernels import cpu_build


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    cpu_build.load()


def test_the_team_is_this_processs_threads_calling_thread_first():
    n = max(2, torch.get_num_threads())
    ids = torch.ops.pagedserve.omp_thread_ids(n)
    assert len(ids) == n and len(set(ids)) == n
    assert ids[0] == threading.get_native_id()
    tasks = {int(t) for t in os.listdir("/proc/self/task")}
    assert set(ids) <= tasks
    assert torch.ops.pagedserve.omp_thread_ids(n) == ids  # the pool's threads, in order
    assert torch.ops.pagedserve.omp_thread_ids(1) == ids[:1]


def test_a_bad_count_is_refused():
    with pytest.raises(ValueError, match="n must be in"):
        torch.ops.pagedserve.omp_thread_ids(0)
