"""Sampler: greedy, top-k/top-p edge cases, seeded determinism, and the sampled distribution."""

from __future__ import annotations

import pytest
import torch

from services.worker.sampler import Sampler, SamplingTensors, apply_top_k_top_p

V = 64


def params(n: int, temperature=1.0, top_p=1.0, top_k=0, generators=None, vocab_size=V):
    return SamplingTensors.build([temperature] * n, [top_p] * n, [top_k] * n, generators or {},
                                 vocab_size, torch.device("cpu"))


def random_logits(n: int, seed: int = 0, vocab_size: int = V) -> torch.Tensor:
    return torch.randn(n, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(8)
    assert torch.equal(Sampler()(logits, params(8, temperature=0.0)), logits.argmax(-1))


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = random_logits(16)
    for p in (params(16, top_k=1), params(16, top_p=1e-6), params(16, top_k=5, top_p=1e-6)):
        for _ in range(3):
            assert torch.equal(Sampler()(logits, p), logits.argmax(-1))


def test_mixed_greedy_and_random_rows():
    logits = random_logits(4)
    p = SamplingTensors.build([0.0, 1.0, 0.0, 1.0], [1.0] * 4, [0, 1, -1, 0], {}, V,
                              torch.device("cpu"))
    out = Sampler()(logits, p)
    assert out.dtype == torch.int64 and out.shape == (4,)
    assert out[[0, 1, 2]].tolist() == logits.argmax(-1)[[0, 1, 2]].tolist()


def test_top_k_off_values():
    logits = random_logits(3)
    for k in (0, -1, V, V + 10):
        assert params(3, top_k=k).no_top_k
    with pytest.raises(ValueError):
        params(3, top_k=-2)
    with pytest.raises(ValueError):
        params(3, top_p=0.0)
    masked = apply_top_k_top_p(logits, torch.tensor([1, 3, V]), None)
    assert (masked.isfinite().sum(-1)).tolist() == [1, 3, V]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    masked = apply_top_k_top_p(probs.log(), None, torch.tensor([0.75]))
    assert masked.isfinite().tolist() == [[True, True, False, False]]
    masked = apply_top_k_top_p(probs.log(), None, torch.tensor([0.85]))
    assert masked.isfinite().tolist() == [[True, True, True, False]]


def test_seeded_row_independent_of_batch():
    sampler = Sampler()
    logits = random_logits(1, seed=3)

    def run(batch_rows: int, row: int) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        tokens = []
        for step in range(20):
            batch = random_logits(batch_rows, seed=100 + step)
            batch[row] = logits[0]
            p = params(batch_rows, temperature=1.5, top_p=0.95, generators={row: gen})
            tokens.append(sampler(batch, p)[row].item())
        return tokens

    alone = run(1, 0)
    assert run(7, 4) == alone and run(3, 0) == alone
    assert len(set(alone)) > 1  # it really samples


def test_unseeded_rows_differ():
    out = Sampler()(random_logits(1).repeat(200, 1) * 0, params(200))
    assert len(set(out.tolist())) > 20  # uniform over 64 tokens


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0),
                                                     (1.0, 3, 1.0), (1.0, 0, 0.8)])
def test_distribution(temperature, top_k, top_p):
    torch.manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 40_000
    logits = probs.log().repeat(n, 1)
    out = Sampler()(logits, params(n, temperature, top_p, top_k, vocab_size=5))
    freq = torch.bincount(out, minlength=5).float() / n
    expected = probs ** (1 / temperature)
    if top_k:
        expected[top_k:] = 0
    if top_p < 1:  # 0.4 + 0.3 < 0.8 <= 0.4 + 0.3 + 0.15: three tokens
        expected[3:] = 0
    expected /= expected.sum()
    torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)
