"""CPU KV-cache tensors on transparent huge pages (Linux ``madvise(MADV_HUGEPAGE)``).

Decode attention reads a sequence's K/V block by block through its block table, and the
blocks lie anywhere in a cache of gigabytes: on 4 KB pages nearly every block costs a TLB miss
and a page walk before its lines can stream. On 2 MB pages decode 64 @ 512 over a 3 GB cache
ran 1.08-1.22x faster (docs/benchmarks.md, issue 31, ninth session). Only the caches are asked
for huge pages: torch's own ``THP_MEM_ALLOC_ENABLE=1`` does it for every allocation of 2 MB or
more, and the step's short-lived activations then fault in fresh 2 MB pages every step
(slower overall, the same section of docs/benchmarks.md).

Where the kernel has THP disabled (``never``), on other systems, or if ``madvise`` fails, the
tensor is an ordinary one: the hint changes speed, never results.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes (x86-64 and arm64 with 4 KB base pages)
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux


def _madvise():
    """libc's ``madvise`` through ctypes, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled contiguous CPU tensor of ``shape`` and ``dtype`` whose bytes start on a
    2 MB boundary and were asked for huge pages before they were first written.

    The tensor is a view into a buffer up to 2 MB larger, which it keeps alive. Whether the
    kernel backs it with huge pages depends on its THP setting and free memory; a refused
    hint (or a tensor under 2 MB, or not Linux) leaves an ordinary zero tensor.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise() if nbytes >= HUGE_PAGE else None
    if madvise is None:
        return torch.zeros(shape, dtype=dtype)
    buf = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # not written yet: no pages
    addr = buf.data_ptr()
    start = (addr + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE - addr
    madvise(addr + start, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)  # (a hint: rc unused)
    t = buf[start:start + nbytes].view(dtype).view(shape)
    t.zero_()  # the first touch: the kernel faults the advised range in as huge pages
    return t
