"""The CPU KV cache's allocation on transparent huge pages (services/worker/huge_pages.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from services.worker.huge_pages import HUGE_PAGE, zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_cache_tensor_is_zeros_on_a_2mb_boundary(dtype):
    shape = (1000, 16, 3, 64 + (dtype == torch.int8))  # > 2 MB at every dtype
    t = zeros_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % HUGE_PAGE == 0
    t[-1, -1, -1, -1] = 1  # the whole tensor is writable, its buffer kept alive by the view
    assert t.sum().item() == 1


def test_a_small_tensor_is_an_ordinary_zero_tensor():
    t = zeros_on_huge_pages((4, 16, 2, 64), torch.float32)
    assert t.shape == (4, 16, 2, 64) and not t.any() and t.is_contiguous()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(),
                    reason="no transparent huge pages on this kernel")
def test_the_kernel_is_asked_for_huge_pages():
    """The range holding the tensor carries MADV_HUGEPAGE (VmFlags ``hg``), from its first huge
    page to its last; whether the kernel then finds free 2 MB pages is up to it.

    NOTE: only what ``zeros_on_huge_pages`` controls is checked: whether memory it did not
    advise lacks the flag depends on what else this process advised and freed before."""
    t = zeros_on_huge_pages((4 * HUGE_PAGE // 4,), torch.float32)
    first, last = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size() - 1
    assert "hg" in _vm_flags(first)
    assert "hg" in _vm_flags(last)
