"""Fixtures of the native CPU kernel tests."""

from __future__ import annotations

import pytest

from kernels.cpu_attention import ISA_ENV, cpu_isa
from tests.kernels.cpu_isas import RUNNABLE_ISAS


@pytest.fixture(params=RUNNABLE_ISAS)
def isa(request, monkeypatch) -> str:
    """Every instruction-set path this CPU can run, forced by ``PAGEDSERVE_CPU_ISA``."""
    monkeypatch.setenv(ISA_ENV, request.param)
    assert cpu_isa() == request.param
    return request.param
