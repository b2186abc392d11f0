"""Speculative decoding in the ModelRunner (issue 21), on a tiny random-weight Llama at float32.

- Greedy tokens with drafts (right, wrong, partly right, random, none; mixed in one batch)
  equal the tokens without drafts, exactly; a rejected draft is never part of the token list.
- min_tokens counts one more output per position, logit_bias applies at every position, a
  seeded row draws in position order (the first output of a spec step is the plain step's),
  logprobs come one per output token and equal the plain run's.
- The driver proposes (prompt lookup) for eligible rows only; TP peers append what the driver
  kept from its padded broadcast.
- Losslessness at temperature 1 (chi-square): the first output token of a spec step is
  distributed as the target, and so is the token after an accepted draft.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from services.common.sampling_params import EngineSamplingParams
from services.common.spec_decode_config import SpeculativeConfig
from services.common.step import CachedRequest, NewRequest, StepInput, StepOutput
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from services.worker.spec_decode.ngram_proposer import NgramProposer

GREEDY = EngineSamplingParams(temperature=0.0)
K = 4  # drafts per step at most
NEW_TOKENS = 12


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny forwards: one thread (two threads on a loaded machine are far slower)."""


@pytest.fixture(scope="module")
def runner(tiny_llama) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                    kv_cache_memory=4 << 20, attention_backend="torch",
                                    max_num_seqs=64))


def prompts(n: int, length: int = 9, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(length + i)] for i in range(n)]


def split(out: StepOutput) -> dict[str, list[int]]:
    """Each request's new tokens of a step."""
    counts = out.num_sampled_token_ids or [1] * len(out.request_ids)
    tokens, got, at = out.sampled_token_ids, {}, 0
    for rid, n in zip(out.request_ids, counts, strict=True):
        got[rid], at = tokens[at:at + n], at + n
    return got


class Driver:
    """Plays the scheduler for requests that decode with the drafts a function gives.

    ``drafts(i, outputs)`` -> the drafts request i verifies next (its outputs so far). Every
    request gets all its blocks up front and is scheduled until it has ``new_tokens``
    outputs; after every step the worker's token list of each request must be its prompt and
    outputs exactly (no draft left counted). ``counts[i]``: request i's new tokens per step.
    """

    def __init__(self, runner: ModelRunner, step_id: int = 0) -> None:
        self.runner, self.step_id = runner, step_id
        self.steps: list[StepOutput] = []
        self.counts: list[list[int]] = []

    def step(self, step: StepInput) -> StepOutput:
        out = self.runner.execute_step(step)
        self.step_id += 1
        self.steps.append(out)
        return out

    def run(self, token_lists: list[list[int]], sampling: list[EngineSamplingParams],
            drafts, new_tokens: int = NEW_TOKENS, k: int = 0) -> list[list[int]]:
        runner, bs = self.runner, self.runner.block_size
        ids = [f"spec-{self.step_id}-{i}" for i in range(len(token_lists))]
        per = -(-(max(map(len, token_lists)) + new_tokens + K + 1) // bs)
        new = [NewRequest(rid, list(t), s, list(range(i * per, (i + 1) * per)), 0, len(t))
               for i, (rid, t, s) in enumerate(zip(ids, token_lists, sampling, strict=True))]
        outputs: list[list[int]] = [[] for _ in ids]
        self.counts = [[] for _ in ids]
        got = split(self.step(StepInput(self.step_id, new, [], [], num_speculative_tokens=k)))
        for i, rid in enumerate(ids):
            outputs[i] += got[rid]
        while min(map(len, outputs)) < new_tokens:
            cached, active = [], [i for i in range(len(ids)) if len(outputs[i]) < new_tokens]
            for i in active:
                d = list(drafts(i, outputs[i]))[:K]
                n = len(token_lists[i]) + len(outputs[i])
                cached.append(CachedRequest(ids[i], [], [], False, n - 1, 1 + len(d),
                                            spec_token_ids=d))
            got = split(self.step(StepInput(self.step_id, [], cached, [],
                                            num_speculative_tokens=k)))
            for i in active:
                rid = ids[i]
                outputs[i] += got[rid]
                self.counts[i].append(len(got[rid]))
                state = runner.input_batch.requests[rid]
                n = len(token_lists[i]) + len(outputs[i])
                assert runner.input_batch.num_tokens[state.row] == n
                assert runner.input_batch.token_ids[state.row, :n].tolist() == (
                    token_lists[i] + outputs[i])
        self.step(StepInput(self.step_id, [], [], ids))
        return [o[:new_tokens] for o in outputs]


def no_drafts(i: int, outputs: list[int]) -> list[int]:
    return []


def reference(runner: ModelRunner, token_lists, sampling, new_tokens: int = NEW_TOKENS + K + 1):
    return Driver(runner, 1000).run(token_lists, sampling, no_drafts, new_tokens)


def right(ref: list[int], outputs: list[int], n: int = K) -> list[int]:
    return ref[len(outputs):len(outputs) + n]


def wrong(ref: list[int], outputs: list[int], n: int = K) -> list[int]:
    return [(t + 1) % 512 for t in right(ref, outputs, n)]


def test_greedy_tokens_with_drafts_equal_the_tokens_without(runner):
    """Right, wrong, partly right, random and no drafts, all in the same steps."""
    ps = prompts(3)
    refs = reference(runner, ps, [GREEDY] * 3)
    rng = random.Random(1)
    strategies = [
        lambda ref, o: right(ref, o),
        lambda ref, o: wrong(ref, o),
        lambda ref, o: right(ref, o, 2) + wrong(ref, o)[2:],  # the first two right
        lambda ref, o: (right(ref, o) if rng.random() < 0.5 else wrong(ref, o))[
            :rng.randrange(K + 1)],
        lambda ref, o: [],
    ]
    cases = [(p, refs[i], s) for i, p in enumerate(ps) for s in strategies]
    driver = Driver(runner)
    outputs = driver.run([c[0] for c in cases], [GREEDY] * len(cases),
                         lambda i, o: cases[i][2](cases[i][1], o))
    assert outputs == [c[1][:NEW_TOKENS] for c in cases]
    for i in range(0, len(cases), len(strategies)):
        c = driver.counts[i:i + len(strategies)]
        assert c[0][:2] == [K + 1] * 2  # all right: K accepted + the token after them
        assert set(c[1]) == {1}  # all wrong: only the target's token
        assert c[2][:2] == [3, 3]  # two right: two accepted + the correction
        assert set(c[4]) == {1}  # no drafts


def test_min_tokens_counts_one_more_output_at_each_draft_position(runner):
    """A stop id masked for the first 5 outputs: a draft of it inside them is rejected (the
    target resamples without it), and right drafts of the masked run are accepted."""
    p = prompts(1, seed=2)[0]
    free = reference(runner, [p], [GREEDY])[0]
    stop = free[2]  # what greedy picks at output 2 unmasked
    masked = EngineSamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=(stop,))
    ref = reference(runner, [p], [masked])[0]
    assert ref[2] != stop and ref[:2] == free[:2]
    outputs = Driver(runner).run([p, p], [masked, masked],
                                 lambda i, o: right(free if i == 0 else ref, o))
    assert outputs == [ref[:NEW_TOKENS]] * 2


def test_logit_bias_applies_at_every_draft_position(runner):
    p = prompts(1, seed=3)[0]
    free = reference(runner, [p], [GREEDY])[0]
    biased = EngineSamplingParams(temperature=0.0, logit_bias=((free[1], -100.0),
                                                               ((free[0] + 5) % 512, 3.0)))
    ref = reference(runner, [p], [biased])[0]
    assert ref != free
    outputs = Driver(runner).run([p, p], [biased, biased],
                                 lambda i, o: right(free if i == 0 else ref, o))
    assert outputs == [ref[:NEW_TOKENS]] * 2


def test_seeded_rows_draw_in_position_order_and_are_reproducible(runner):
    """At temperature 1 with a seed, a spec step's first output is the token a plain step
    would have drawn (position 0 draws first from the generator); the same drafts give the
    same tokens again."""
    p = prompts(1, seed=4)[0]
    seeded = EngineSamplingParams(temperature=1.0, seed=1234)
    plain = Driver(runner).run([p], [seeded], no_drafts, new_tokens=2)[0]
    driver = Driver(runner)
    spec = driver.run([p], [seeded], lambda i, o: [7, 8, 9], new_tokens=2)[0]
    assert spec[:2] == plain[:2]
    again = Driver(runner).run([p], [seeded], lambda i, o: [7, 8, 9], new_tokens=2)[0]
    assert again == spec
    # drafts the seeded sample accepts: the plain run's own tokens
    longer = Driver(runner).run([p], [seeded], no_drafts, new_tokens=6)[0]
    accepted = Driver(runner)
    got = accepted.run([p], [seeded], lambda i, o: right(longer, o, 3), new_tokens=5)[0]
    assert got == longer[:5]  # the seeded run's own tokens, 4 of them in one step
    assert accepted.steps[1].num_sampled_token_ids == [4]  # 3 drafts accepted + 1


def test_logprobs_come_one_per_output_token_and_equal_the_plain_run(runner):
    p = prompts(1, seed=5)[0]
    with_lp = EngineSamplingParams(temperature=0.0, logprobs=3)
    plain, spec = Driver(runner), Driver(runner)
    ref = plain.run([p, p], [with_lp, GREEDY], no_drafts, new_tokens=6)[0]
    spec.run([p, p], [with_lp, GREEDY], lambda i, o: right(ref, o, 3) if i == 0 else [],
             new_tokens=6)
    lp = spec.steps[1].logprobs
    assert spec.steps[1].num_sampled_token_ids == [4, 1]
    assert lp is not None and lp.num_top_logprobs == [3, 3, 3, 3, -1]
    expected = [s.logprobs for s in plain.steps[1:5]]  # outputs 1..4, one per step
    assert lp.sampled_logprobs == pytest.approx(
        [e.sampled_logprobs[0] for e in expected], abs=1e-4)
    assert lp.top_token_ids == [t for e in expected for t in e.top_token_ids[:3]]
    assert lp.top_logprobs == pytest.approx(
        [v for e in expected for v in e.top_logprobs[:3]], abs=1e-4)


def test_drafts_a_request_cannot_verify_or_scheduled_wrong_are_refused(runner):
    p = prompts(1, seed=6)[0]
    penalised = EngineSamplingParams(temperature=0.0, repetition_penalty=1.2)
    d = Driver(runner)
    with pytest.raises(ValueError, match="cannot verify them"):
        d.run([p], [penalised], lambda i, o: [1, 2])
    d.step(StepInput(d.step_id, [], [], list(runner.input_batch.requests)))
    d.step(StepInput(d.step_id, [NewRequest("x", p, GREEDY, [0, 1], 0, len(p))], [], []))
    n = len(p) + 1
    with pytest.raises(ValueError, match="drafts need its last token"):
        d.step(StepInput(d.step_id, [], [CachedRequest("x", [], [], False, n - 2, 4,
                                                       spec_token_ids=[1, 2])], []))
    d.step(StepInput(d.step_id, [], [], ["x"]))


def test_the_driver_proposes_for_eligible_rows_after_appending(tiny_llama):
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                   '"prompt_lookup_min": 1, "prompt_lookup_max": 3}')
    r = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                 kv_cache_memory=4 << 20, attention_backend="torch",
                                 speculative=spec))
    assert r.ngram is not None and r.draft is None
    loop = list(range(512))  # whatever token is sampled, it occurred earlier: lookup finds it
    samplings = [GREEDY, EngineSamplingParams(temperature=0.0, repetition_penalty=1.3),
                 EngineSamplingParams(temperature=0.0, beam_width=2), GREEDY]
    new = [NewRequest(f"q{i}", loop, s, list(range(40 * i, 40 * i + 33)), 0, len(loop))
           for i, s in enumerate(samplings)]
    out = r.execute_step(StepInput(0, new, [], [], num_speculative_tokens=3))
    ib = r.input_batch
    lookup = NgramProposer(1, 3)
    assert out.draft_token_ids is not None
    for i in (0, 3):  # from the token lists with this step's token appended
        row = ib.requests[f"q{i}"].row
        assert out.draft_token_ids[i] == lookup.propose(ib.token_ids[row, :ib.num_tokens[row]],
                                                        3)
    assert out.draft_token_ids[1] == out.draft_token_ids[2] == []  # penalised, beam
    assert all(len(out.draft_token_ids[i]) > 0 for i in (0, 3))
    # next step verifies them; no proposals when the step asks for none
    cached = [CachedRequest("q0", [], [], False, len(loop), 1 + len(out.draft_token_ids[0]),
                            spec_token_ids=out.draft_token_ids[0])]
    nxt = r.execute_step(StepInput(1, [], cached, []))
    assert nxt.draft_token_ids is None and nxt.request_ids == ["q0"]


class _FakeTP:
    """A stand-in for a TP pair's ParallelState without processes: the driver's broadcast is
    recorded, the peer's receives it (tensor_parallel_size 1, so logits stay local)."""

    def __init__(self, driver: bool, wire: list[torch.Tensor]) -> None:
        self.config = SimpleNamespace(is_first_stage=True, is_last_stage=True, is_driver=driver,
                                      tensor_parallel_size=1, pipeline_parallel_size=1)
        self.device, self.wire = torch.device("cpu"), wire

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.is_driver:
            self.wire.append(x.clone())
        else:
            x.copy_(self.wire.pop(0))
        return x


def test_a_tp_peer_appends_what_the_driver_kept(tiny_llama, runner):
    peer = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                    kv_cache_memory=4 << 20, attention_backend="torch",
                                    max_num_seqs=64))
    wire: list[torch.Tensor] = []
    runner.parallel, peer.parallel = _FakeTP(True, wire), _FakeTP(False, wire)
    try:
        ps = prompts(3, seed=7)
        refs = reference(runner, ps, [GREEDY] * 3)
        wire.clear()
        rng = random.Random(0)

        def drafts(i, o):
            return (right(refs[i], o, 2) + wrong(refs[i], o))[:rng.randrange(K + 1)]

        driver = Driver(runner)
        # (the peer runs the same steps after the driver, reading the recorded broadcasts)
        original = driver.step

        def both(step: StepInput) -> StepOutput:
            out = original(step)
            assert peer.execute_step(step).request_ids == []
            for rid, state in runner.input_batch.requests.items():
                other = peer.input_batch.requests[rid]
                n = runner.input_batch.num_tokens[state.row]
                assert peer.input_batch.num_tokens[other.row] == n
                assert (peer.input_batch.token_ids[other.row, :n]
                        == runner.input_batch.token_ids[state.row, :n]).all()
            return out

        driver.step = both  # type: ignore[method-assign]
        assert driver.run(ps, [GREEDY] * 3, drafts) == [r[:NEW_TOKENS] for r in refs]
        assert not wire
    finally:
        runner.parallel = peer.parallel = None


def test_the_runner_refuses_speculation_with_pipeline_parallelism():
    from services.worker.parallel.distributed import ParallelConfig, ParallelState

    spec = SpeculativeConfig.parse('{"num_speculative_tokens": 2}')
    parallel = ParallelState(ParallelConfig(1, 2, 1), None, "g", torch.device("cpu"))
    with pytest.raises(ValueError, match="--speculative-config does not work with "
                                         "--pipeline-parallel-size 2"):
        ModelRunner(WorkerConfig(model="unused", device="cpu", speculative=spec), parallel)


def test_temperature_one_is_lossless_with_a_fixed_draft(runner):
    """N rows of one spec step share a context and the drafts (d0, d1): their first output
    token is distributed as the target's p(. | context) and, given d0 was accepted, the next
    as p(. | context, d0) (chi-square, p > 0.01), with d0 accepted p(d0) of the time. A
    logit_bias on d0 (part of the target distribution) makes it likely, so that about half the
    rows test the position after it. The rows share their KV blocks: every row writes the same
    K/V into them."""
    torch.manual_seed(0)  # (the unseeded rows' shared generator: a fixed draw, whatever ran before)
    n, p = 20000, prompts(1, length=5, seed=8)[0]
    ib = runner.input_batch
    d = Driver(runner, 5000)
    d.step(StepInput(d.step_id, [NewRequest("base", p, GREEDY, [0], 0, len(p))], [], []))
    last = ib.token_ids[ib.requests["base"].row, len(p)]  # the context's last token
    context = [*p, int(last)]
    ids = [f"row{i}" for i in range(n)]
    d.step(StepInput(d.step_id, [NewRequest(rid, p, GREEDY, [0], len(p) - 1, 1)
                                 for rid in ids], [], ["base"]))
    for rid in ids:  # every row's context: p + last (overwriting what the row sampled)
        ib.token_ids[ib.requests[rid].row, len(p)] = last
    raw0 = _target_logprobs(runner, context)
    d0 = int(raw0.argmax())
    bias = np.zeros(runner.vocab_size)
    bias[d0] = 4.0
    t1 = EngineSamplingParams(temperature=1.0, logit_bias=((d0, 4.0),))
    for rid in ids:  # (the rows' sampling parameters, as a NewRequest with the bias gives)
        state = ib.requests[rid]
        state.sampling, state.logit_bias = t1, (np.array([d0]), np.array([4.0], np.float32))
        ib.sampling_rows.write(state.row, state)
    target0 = _softmax(raw0 + bias)
    target1 = _softmax(_target_logprobs(runner, [*context, d0]) + bias)
    d1 = (int(target1.argmax()) + 1) % 512
    out = d.step(StepInput(d.step_id, [], [
        CachedRequest(rid, [], [], False, len(context) - 1, 3, spec_token_ids=[d0, d1])
        for rid in ids], []))
    d.step(StepInput(d.step_id, [], [], ids))
    got = split(out)
    first = np.array([got[rid][0] for rid in ids])
    second = np.array([got[rid][1] for rid in ids if got[rid][0] == d0])
    assert _chi_square_p(first, target0) > 0.01
    assert _chi_square_p(second, target1) > 0.01
    accept = target0[d0]  # P(accept d0) = p(d0): within 4 binomial sigmas
    assert 0.3 < accept < 0.8
    assert abs(len(second) - n * accept) < 4 * np.sqrt(n * accept * (1 - accept))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _target_logprobs(runner: ModelRunner, context: list[int]) -> np.ndarray:
    """The target's raw next-token logprobs ``[V]`` after ``context`` (float64), from a plain
    greedy prefill with logprobs of the whole vocabulary."""
    d = Driver(runner, 9000)
    lp = EngineSamplingParams(temperature=0.0, logprobs=runner.vocab_size)
    out = d.step(StepInput(d.step_id, [NewRequest("probe", context, lp, [300, 301], 0,
                                                  len(context))], [], []))
    d.step(StepInput(d.step_id, [], [], ["probe"]))
    assert out.logprobs is not None
    logprobs = np.zeros(runner.vocab_size)
    logprobs[out.logprobs.top_token_ids] = out.logprobs.top_logprobs
    return logprobs


def _chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of ``samples`` against ``probs``, tokens expected fewer
    than 5 times pooled into one bin."""
    expected = probs * len(samples)
    observed = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # (the pooled bin too small: fold it into the largest)
        obs, exp = obs[:-1], exp[:-1]
        obs[exp.argmax()] += observed[~big].sum()
        exp[exp.argmax()] += expected[~big].sum()
    statistic = float(((obs - exp) ** 2 / exp).sum())
    # the chi-square survival function with len - 1 degrees of freedom (no scipy here)
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_spec_steps_reuse_the_compiled_forward_of_the_warm_up(tiny_llama):
    """The compiled CPU forward (one dynamic graph, services/worker/compiled.py) runs steps
    of 1 + d query tokens per request without compiling again: a spec step after the warm-up
    takes milliseconds, not the seconds of a compile, and gives the plain run's tokens."""
    import time

    from services.worker.compiled import CompiledForward

    r = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                 kv_cache_memory=4 << 20, attention_backend="cpu"))
    if not isinstance(r.forward, CompiledForward):
        pytest.skip(f"the forward runs eagerly here: {r.eager_reason}")
    ps = prompts(2, seed=9)
    refs = reference(r, ps, [GREEDY] * 2)
    driver = Driver(r)
    original, seconds = driver.step, []

    def timed(step: StepInput) -> StepOutput:
        t0 = time.perf_counter()
        out = original(step)
        seconds.append(time.perf_counter() - t0)
        return out

    driver.step = timed  # type: ignore[method-assign]
    outputs = driver.run(ps, [GREEDY] * 2, lambda i, o: (right if i else wrong)(refs[i], o))
    assert outputs == [ref[:NEW_TOKENS] for ref in refs]
    assert max(seconds) < 1.0, seconds
