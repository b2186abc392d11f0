"""logit_bias: added to the raw logits after the penalties, before min_tokens and the grammar
mask; rows without a bias untouched."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import EngineSamplingParams
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from services.worker.sample.penalties import PenaltyTensors, TokenCounts
from services.worker.sample.sampler import Sampler, SamplingTensors
from services.worker.step_checks import check_sampling
from tests.worker.grammar_driver import generate

V = 64
CPU = torch.device("cpu")


def seeded(n: int, seed: int = 0) -> dict[int, torch.Generator]:
    return {i: torch.Generator().manual_seed(seed + i) for i in range(n)}


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                    kv_cache_memory=4 << 20, attention_backend="torch"))


def test_bias_steers_greedy_and_leaves_other_requests_alone(runner):
    prompt = list(range(3, 20))
    greedy = EngineSamplingParams(temperature=0.0, max_tokens=4)
    free = generate(runner, [prompt], [greedy])[0]
    target = (free[0] + 7) % runner.vocab_size
    pushed = EngineSamplingParams(temperature=0.0, max_tokens=4, logit_bias=((target, 100.0),))
    banned = EngineSamplingParams(temperature=0.0, max_tokens=4,
                                  logit_bias=((free[0], -100.0),))
    outputs = generate(runner, [prompt] * 3, [pushed, banned, greedy])
    assert outputs[0] == [target] * 4  # +100 wins every step
    assert outputs[1][0] != free[0]
    assert outputs[2] == free  # the unbiased request of the same steps


def test_rows_without_a_bias_sample_exactly_as_without_any():
    """Seeded rows at temperature 1: the unbiased rows' tokens are the same whether or not
    other rows of the step carry a bias (their logits are untouched, bit for bit)."""
    n = 16
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(0))
    plain = SamplingTensors.build([1.0] * n, [1.0] * n, [0] * n, seeded(n), V, CPU)
    biased = SamplingTensors.build([1.0] * n, [1.0] * n, [0] * n, seeded(n), V, CPU,
                                   logit_bias={3: [(5, 100.0)], 9: [(1, -100.0), (2, 50.0)]})
    before = logits.clone()
    a, b = Sampler()(logits, plain), Sampler()(logits, biased)
    assert torch.equal(logits, before)  # the sampler never writes its input (raw logprobs)
    unbiased = [i for i in range(n) if i not in (3, 9)]
    assert torch.equal(a[unbiased], b[unbiased])
    assert b[3] == 5 and b[9] == 2


def test_bias_comes_after_the_penalties_and_before_min_tokens():
    """Against a hand-computed reference: repetition, frequency and presence penalties, then
    the bias, then min_tokens' -inf; sampled (seeded) from the reference logits with no
    processor the tokens must be the same."""
    n = 6
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(1)) * 3
    prompt, outputs = [1, 2, 3], [4, 4, 5]
    counts = [TokenCounts.create(prompt, V, CPU) for _ in range(n)]
    for c in counts:
        c.update(prompt + outputs)
    rep, pres, freq = 1.5, 0.5, 0.25
    penalties = PenaltyTensors.build(list(range(n)), counts, [rep] * n, [pres] * n, [freq] * n,
                                     CPU)
    bias = {i: [(t, 2.0 + i) for t in (1, 4, 7, 0)] for i in range(n)}
    min_tokens = ([0, 1], [0, 0])  # rows 0 and 1: token 0 (a stop id) masked
    processed = SamplingTensors.build([1.0] * n, [1.0] * n, [0] * n, seeded(n), V, CPU,
                                      penalties=penalties, logit_bias=bias,
                                      min_tokens_mask=min_tokens)
    ref = logits.clone()
    for i in range(n):
        for t in (1, 2, 3, 4, 5):  # seen: in the prompt or the output
            ref[i, t] = ref[i, t] / rep if ref[i, t] > 0 else ref[i, t] * rep
        ref[i, 4] -= 2 * freq + pres
        ref[i, 5] -= freq + pres
        for t, b in bias[i]:
            ref[i, t] += b
    ref[[0, 1], 0] = float("-inf")
    plain = SamplingTensors.build([1.0] * n, [1.0] * n, [0] * n, seeded(n), V, CPU)
    assert torch.equal(Sampler()(logits, processed), Sampler()(ref, plain))
    greedy = SamplingTensors.build([0.0] * n, [1.0] * n, [0] * n, {}, V, CPU,
                                   penalties=penalties, logit_bias=bias,
                                   min_tokens_mask=min_tokens)
    assert torch.equal(Sampler()(logits, greedy), ref.argmax(-1))
    # the order matters here: bias before the repetition penalty would give (l + b) / rep
    assert not torch.equal(ref.argmax(-1), _bias_then_penalty(logits, bias, rep, pres, freq))


def _bias_then_penalty(logits, bias, rep, pres, freq) -> torch.Tensor:
    out = logits.clone()
    for i, pairs in bias.items():
        for t, b in pairs:
            out[i, t] += b
        for t in (1, 2, 3, 4, 5):
            out[i, t] = out[i, t] / rep if out[i, t] > 0 else out[i, t] * rep
        out[i, 4] -= 2 * freq + pres
        out[i, 5] -= freq + pres
    out[[0, 1], 0] = float("-inf")
    return out.argmax(-1)


def test_check_sampling_refuses_bias_the_sampler_cannot_use():
    check_sampling(EngineSamplingParams(logit_bias=((0, -100.0), (99, 100.0))), 100)
    for bad in (((100, 1.0),), ((-1, 1.0),), ((3, float("nan")),), ((3, 1.0), (3, 2.0))):
        with pytest.raises(ValueError, match="logit_bias the sampler cannot use"):
            check_sampling(EngineSamplingParams(logit_bias=bad), 100)
