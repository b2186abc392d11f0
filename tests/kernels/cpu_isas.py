"""The instruction-set ladder of the native CPU kernels (``kernels/csrc/cpu_isa.h``) and what
this CPU can run of it, for the kernel tests that run every path the CPU has."""

from __future__ import annotations

import pytest

from kernels.cpu_attention import ISA_ENV, cpu_isa

ISA_ORDER = ["scalar", "avx2", "avx512", "avx512_bf16", "amx"]


def _best_isa() -> str:
    """The best path this CPU runs: what ``cpu_isa`` reports with no override."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ISA_ENV, raising=False)
        return cpu_isa()


BEST_ISA = _best_isa()
# every step this CPU can run (the fallbacks below its best included); a step it lacks cannot
# execute here, and test_isa_env_var checks that forcing it is refused
RUNNABLE_ISAS = ISA_ORDER[: ISA_ORDER.index(BEST_ISA) + 1]
