"""The native row argmax (``kernels.cpu_argmax``) is ``torch.argmax(x, dim=-1)`` bitwise, on
every instruction-set path this CPU runs: ties (the first), NaN (the first NaN), infinities,
all -inf rows, odd widths, strided rows; and the sampler takes it for CPU float32 logits."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_build
from kernels.cpu_argmax import row_argmax


@pytest.fixture(autouse=True)
def _native():
    cpu_build.load()


@pytest.mark.parametrize("width", [1, 7, 64, 65, 1000, 49152])
def test_row_argmax_is_torch_argmax(isa, width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(37, width, generator=gen)
    if width > 3:
        x[1, width // 2] = x[1].max()  # a tie: the first wins
        x[2, -1] = float("inf")
        x[3, 1] = float("nan")
        x[3, width - 2] = float("nan")  # two NaNs: the first
        x[4] = float("-inf")
        x[5, 0] = float("-inf")
        x[6] = 0.0  # all equal
        x[7, 2] = float("inf")
        x[7, 3] = float("-inf")
        x[8, :] = torch.arange(width, dtype=torch.float32).flip(0)  # max at 0
    assert torch.ops.pagedserve.argmax(x).dtype == torch.int64
    assert torch.equal(torch.ops.pagedserve.argmax(x), x.argmax(dim=-1))
    wide = torch.randn(37, width + 5, generator=gen)
    assert torch.equal(row_argmax(wide[:, :width]), wide[:, :width].argmax(dim=-1))  # strided
    assert row_argmax(x[:0]).shape == (0,)


def test_other_inputs_take_torch_and_bad_ones_are_refused():
    x = torch.randn(4, 10, dtype=torch.float64)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))  # not float32: torch's
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        torch.ops.pagedserve.argmax(x)
    with pytest.raises(ValueError, match="N > 0"):
        torch.ops.pagedserve.argmax(torch.zeros(3, 0))


def test_the_sampler_takes_it_for_greedy_rows(monkeypatch):
    from kernels import cpu_argmax
    from services.worker.sample import sampler

    calls = []
    real = cpu_argmax.row_argmax
    monkeypatch.setattr(sampler, "row_argmax", lambda x: calls.append(x.shape) or real(x))
    logits = torch.randn(3, 50)
    params = sampler.SamplingTensors.build([0.0] * 3, [1.0] * 3, [0] * 3, {}, 50,
                                           torch.device("cpu"))
    assert torch.equal(sampler.Sampler()(logits, params), logits.argmax(dim=-1))
    assert calls == [(3, 50)]
