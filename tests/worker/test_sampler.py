"""Sampler: greedy, top-k/top-p edge cases, seeded determinism, the sampled distribution, and
penalties / min_tokens / min-p against transformers' logits processors."""

from __future__ import annotations

import pytest
import torch

from services.worker.sample.penalties import (PenaltyTensors, TokenCounts, apply_min_p,
                                       apply_min_tokens, apply_penalties)
from services.worker.sample.sampler import Sampler, SamplingTensors, apply_top_k_top_p

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
    for k in (0, -1, V, V + 10, -2):  # -1 is the router's; no int indexes outside [1, V]
        assert params(3, top_k=k).no_top_k
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


# --- penalties, min_tokens, min-p: against transformers' logits processors ------------------
# Tolerance: float32, same operations in the same order, so the penalised logits must be equal
# to transformers' bit for bit (rtol=atol=0); the presence/frequency formula to 1e-6 absolute.

def _counts(prompt: list[int], output: list[int], vocab_size: int = V) -> TokenCounts:
    c = TokenCounts.create(prompt, vocab_size, torch.device("cpu"))
    c.update(prompt + output[:2])  # incremental: two folds must equal one
    c.update(prompt + output)
    return c


def _token_rows(n: int, seed: int, vocab_size: int = V) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab_size, (int(torch.randint(1, 12, (1,), generator=g)),),
                           generator=g).tolist(),
             torch.randint(0, vocab_size, (int(torch.randint(0, 20, (1,), generator=g)),),
                           generator=g).tolist()) for _ in range(n)]


def _penalty_tensors(rows, tokens, repetition, presence, frequency):
    return PenaltyTensors.build(rows, [_counts(p, o) for p, o in tokens], repetition, presence,
                                frequency, torch.device("cpu"))


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = random_logits(6, seed=11)
    tokens = _token_rows(6, seed=12)
    ours = logits.clone()
    apply_penalties(ours, _penalty_tensors(list(range(6)), tokens, [penalty] * 6, [0.0] * 6,
                                           [0.0] * 6))
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (prompt, output) in enumerate(tokens):
        expected = hf(torch.tensor([prompt + output]), logits[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], expected, rtol=0, atol=0)


def test_presence_and_frequency_follow_the_openai_formula():
    logits = random_logits(5, seed=21)
    tokens = _token_rows(5, seed=22)
    presence, frequency = [0.0, 1.5, -2.0, 0.5, 2.0], [0.0, 0.0, 1.0, -0.7, 2.0]
    ours = logits.clone()
    apply_penalties(ours, _penalty_tensors(list(range(5)), tokens, [1.0] * 5, presence,
                                           frequency))
    for i, (_, output) in enumerate(tokens):
        count = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=V).float()
        expected = logits[i] - (presence[i] * (count > 0).float() + frequency[i] * count)
        torch.testing.assert_close(ours[i], expected, rtol=0, atol=1e-6)


def test_penalties_touch_only_their_rows():
    logits = random_logits(4, seed=31)
    ours = logits.clone()
    apply_penalties(ours, _penalty_tensors([1, 3], _token_rows(2, seed=32), [1.5, 0.7],
                                           [0.5, 0.0], [0.0, 0.5]))
    assert torch.equal(ours[[0, 2]], logits[[0, 2]]) and not torch.equal(ours[1], logits[1])


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.25, 0.5, 1.0])
def test_min_p_matches_transformers(min_p):
    from transformers import MinPLogitsWarper

    logits = random_logits(8, seed=41)
    ours = apply_min_p(logits, torch.full((8,), min_p))
    expected = MinPLogitsWarper(min_p)(torch.zeros(8, 1, dtype=torch.long), logits.clone())
    assert torch.equal(ours.isfinite(), expected.isfinite())
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize("num_generated", [0, 2, 3, 5])
def test_min_tokens_matches_transformers(num_generated):
    from transformers import MinNewTokensLengthLogitsProcessor

    prompt_len, min_tokens, stop_ids = 4, 3, [2, 9, 17]
    logits = random_logits(1, seed=51)
    hf = MinNewTokensLengthLogitsProcessor(prompt_len, min_tokens, stop_ids)
    expected = hf(torch.zeros(1, prompt_len + num_generated, dtype=torch.long), logits.clone())
    masked = num_generated < min_tokens  # what InputBatch decides for the row
    p = SamplingTensors.build([0.0], [1.0], [0], {}, V, torch.device("cpu"),
                              min_tokens_mask=([0] * 3, stop_ids) if masked else None)
    ours = logits.clone()
    if p.min_tokens_mask is not None:
        apply_min_tokens(ours, *p.min_tokens_mask)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    token = Sampler()(logits, p).item()
    assert token not in stop_ids if masked else token == logits.argmax().item()


def test_greedy_applies_penalties_and_min_tokens():
    logits = random_logits(3, seed=61)
    top = logits.argmax(-1).tolist()
    pen = PenaltyTensors.build([0], [_counts([top[0]], [])], [1e3], [0.0], [0.0],
                               torch.device("cpu"))
    p = SamplingTensors.build([0.0] * 3, [1.0] * 3, [0] * 3, {}, V, torch.device("cpu"),
                              penalties=pen, min_tokens_mask=([1], [top[1]]))
    out = Sampler()(logits, p).tolist()
    assert out[0] != top[0] and out[1] != top[1] and out[2] == top[2]
    assert logits.argmax(-1).tolist() == top  # the caller's logits are untouched


def test_min_p_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 40_000
    p = SamplingTensors.build([1.0] * n, [1.0] * n, [0] * n, {}, 5, torch.device("cpu"),
                              min_p=[0.3] * n)  # keeps p >= 0.12: the first three
    out = Sampler()(probs.log().repeat(n, 1), p)
    freq = torch.bincount(out, minlength=5).float() / n
    expected = torch.tensor([0.4, 0.3, 0.15, 0.0, 0.0]) / 0.85
    torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)


# ---- tiny temperatures, top_k=1, logprobs ---------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-2, 1e-4, 1e-6, 1e-8])
def test_tiny_temperatures_are_greedy_and_finite(temperature):
    """Alone, and in a batch whose odd rows sample at temperature 1 (not all-greedy path)."""
    logits = random_logits(16, seed=5)
    mixed = SamplingTensors.build([temperature, 1.0] * 8, [1.0] * 16, [0] * 16, {}, V,
                                  torch.device("cpu"))
    for _ in range(3):
        alone = Sampler()(logits, params(16, temperature=temperature))
        assert torch.equal(alone, logits.argmax(-1))
        out = Sampler()(logits, mixed)
        assert torch.equal(out[::2], logits.argmax(-1)[::2])
        assert ((out >= 0) & (out < V)).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    logits = random_logits(32, seed=2)
    for _ in range(3):
        assert torch.equal(Sampler()(logits, params(32, temperature=temperature, top_k=1)),
                           logits.argmax(-1))


def test_top_k_1_takes_argmax_on_an_exact_tie():
    """Two tokens tied for the top: top_k=1 keeps both under a threshold mask, so it must be
    argmax (the lower id) outright, as greedy is, in a batch with sampled rows too."""
    logits = torch.zeros(64, V)
    logits[:, 7] = logits[:, 3] = 5.0
    mixed = SamplingTensors.build([1.0] * 64, [1.0] * 64, [1, 0] * 32, {}, V,
                                  torch.device("cpu"))
    for p in (params(64, temperature=1.0, top_k=1), mixed):
        out = Sampler()(logits, p)
        assert (out[::2] == 3).all()
    assert (Sampler()(logits, mixed)[1::2] != 3).any()  # the top_k=0 rows do sample the tie


def test_logprobs_are_raw_log_softmax_with_per_row_top_k():
    from services.worker.sample.compute_logprobs import compute_logprobs
    logits = random_logits(4, seed=7)
    tokens = torch.tensor([3, 10, 0, 63])
    out = compute_logprobs(logits, tokens, [2, None, 0, 5])
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.num_top_logprobs == [2, -1, 0, 5]
    assert out.sampled_logprobs == pytest.approx([ref[0, 3].item(), ref[2, 0].item(),
                                                  ref[3, 63].item()], abs=1e-5)
    assert out.top_token_ids == (ref[0].topk(2).indices.tolist()
                                 + ref[3].topk(5).indices.tolist())
    assert out.top_logprobs == pytest.approx(ref[0].topk(2).values.tolist()
                                             + ref[3].topk(5).values.tolist(), abs=1e-5)
    assert compute_logprobs(logits, tokens, [None] * 4) is None


def test_logprobs_ignore_temperature_and_penalties():
    """Raw logprobs: the sampler never modifies the logits the logprobs are taken from."""
    from services.worker.sample.compute_logprobs import compute_logprobs
    logits = random_logits(2, seed=8)
    before = logits.clone()
    tokens = Sampler()(logits, params(2, temperature=0.3, top_k=3, top_p=0.5))
    out = compute_logprobs(logits, tokens, [1, 1])
    assert torch.equal(logits, before)
    ref = torch.log_softmax(before, dim=-1)
    assert out.sampled_logprobs == pytest.approx(ref.gather(1, tokens[:, None])[:, 0].tolist(),
                                                 abs=1e-6)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [
    (0.7, 0, 0.9), (1.0, 5, 1.0), (1.3, 10, 0.5), (0.5, 3, 0.95), (2.0, 0, 0.3)])
def test_temperature_top_k_top_p_match_transformers_warpers(temperature, top_k, top_p):
    """The filtered logits equal transformers' TemperatureLogitsWarper -> TopKLogitsWarper ->
    TopPLogitsWarper (generate's order), exactly on which tokens survive and within 1e-6 on
    their values, at float32."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = random_logits(16, seed=3)
    ids = torch.zeros(16, 1, dtype=torch.long)
    expected = TemperatureLogitsWarper(temperature)(ids, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(ids, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(ids, expected)
    ours = apply_top_k_top_p(logits / temperature,
                             torch.full((16,), top_k, dtype=torch.long) if top_k else None,
                             torch.full((16,), top_p) if top_p < 1.0 else None)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(ours[finite], expected[finite], atol=1e-6, rtol=1e-6)
