"""Beam rows and copy-on-write in the ModelRunner (issue 20), at float32.

- A beam row (``beam_width > 0``) returns its top-C raw logprobs, C past the router's 20,
  equal to transformers' log_softmax for the same context; its own sample is not appended
  (a plain row's is); the token the scheduler sends in the next step's new_token_ids is the one
  computed next.
- Copy-on-write: a fork sharing a partial last block gets a copy of it (``blocks_to_copy``)
  put into its table (``first_new_block``); both beams go on with different tokens and get
  the logprobs of two requests that never shared a block. Without the copy, or without the
  table replacement, they do not (the test sees both).
- TP=2 (slow): the peer rank keeps beam rows un-appended too and copies its own KV heads.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from tests.worker.beam_driver import run_fork, run_unshared, token_lists

PROMPT = torch.randint(0, 512, (21,), generator=torch.Generator().manual_seed(3)).tolist()
A_TOKENS, B_TOKENS = [7, 300], [11, 42]  # each beam's next tokens, as the scheduler picks them


def make_runner(model, backend: str = "torch") -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(model), dtype="float32", device="cpu",
                                    kv_cache_memory=1 << 20, attention_backend=backend,
                                    enforce_eager=True))


@pytest.fixture(scope="module")
def hf(tiny_llama) -> HFLlamaForCausalLM:
    return HFLlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_logprobs(model: HFLlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """log_softmax ``[V]`` of transformers' float32 logits after ``token_ids``."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0, -1].float(), -1)


def top(out, request_id: str) -> tuple[list[int], list[float]]:
    """The top token ids and logprobs ``out`` returned for ``request_id``."""
    lp, offset = out.logprobs, 0
    for rid, k in zip(out.request_ids, lp.num_top_logprobs, strict=True):
        if rid == request_id:
            return lp.top_token_ids[offset:offset + k], lp.top_logprobs[offset:offset + k]
        offset += max(k, 0)
    raise KeyError(request_id)


def assert_candidates(out, request_id: str, expected: torch.Tensor, c: int) -> list[int]:
    """``request_id``'s top-``c`` candidates equal the top ``c`` of ``expected [V]``; returns
    their ids."""
    ids, lps = top(out, request_id)
    values, indices = expected.topk(c)
    assert ids == indices.tolist()
    torch.testing.assert_close(torch.tensor(lps), values, atol=1e-5, rtol=0)
    return ids


def test_a_beam_returns_its_candidates_and_computes_the_token_it_is_sent(tiny_llama, hf):
    runner = make_runner(tiny_llama)
    c, n = 40, len(PROMPT)
    beam = EngineSamplingParams(temperature=0.0, beam_width=4, logprobs=c)
    plain = EngineSamplingParams(temperature=0.0)
    out = runner.execute_step(StepInput(1, [NewRequest("beam", PROMPT, beam, [3, 8], 0, n),
                                            NewRequest("plain", PROMPT, plain, [4, 9], 0, n)],
                                        [], []))
    ids = assert_candidates(out, "beam", hf_logprobs(hf, PROMPT), c)
    assert out.sampled_token_ids == [ids[0], ids[0]]  # (temperature 0: the argmax)
    assert token_lists(runner, ["beam", "plain"]) == {"beam": PROMPT, "plain": PROMPT + ids[:1]}
    chosen = ids[2]  # the scheduler picks a candidate that is not the sample
    out = runner.execute_step(StepInput(2, [], [
        CachedRequest("beam", [chosen], [], False, n, 1),
        CachedRequest("plain", [], [], False, n, 1)], []))
    assert_candidates(out, "beam", hf_logprobs(hf, [*PROMPT, chosen]), c)
    assert token_lists(runner, ["beam"]) == {"beam": [*PROMPT, chosen]}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_fork_with_a_copied_last_block_equals_two_unshared_requests(tiny_llama, backend):
    runner = make_runner(tiny_llama, backend)
    fork, tokens = run_fork(runner, PROMPT, A_TOKENS, B_TOKENS, blocks=[30, 31, 32])
    assert tokens == {"a": PROMPT + A_TOKENS, "b": PROMPT + B_TOKENS}
    unshared = run_unshared(runner, PROMPT, A_TOKENS, B_TOKENS, blocks=[40, 41, 42, 43],
                            step_id=10)
    for got, want in zip(fork, unshared, strict=True):
        assert got.keys() == want.keys() == {"a", "b"}
        assert not torch.isnan(got["a"]).any()  # (every token a candidate)
        for rid in "ab":
            torch.testing.assert_close(got[rid], want[rid], atol=1e-5, rtol=0)
    assert (fork[0]["a"] - fork[0]["b"]).abs().max() > 1e-2  # they did go different ways

    def worst(steps) -> float:
        return max((s[rid] - w[rid]).abs().max().item()
                   for s, w in zip(steps, unshared, strict=True) for rid in "ab")
    no_copy, _ = run_fork(runner, PROMPT, A_TOKENS, B_TOKENS, blocks=[50, 51, 52], step_id=20,
                          copy=False)
    no_replace, _ = run_fork(runner, PROMPT, A_TOKENS, B_TOKENS, blocks=[60, 61, 62],
                             step_id=30, replace=False)
    assert worst(no_copy) > 1e-3 and worst(no_replace) > 1e-3


def test_a_step_with_copies_and_nothing_scheduled_still_copies(tiny_llama):
    """The copy runs first, even when the step computes nothing on this rank."""
    runner = make_runner(tiny_llama)
    k, v = runner.kv_caches[0]
    k[5].normal_()
    v[5].normal_()
    out = runner.execute_step(StepInput(1, [], [], [], [(5, 6)]))
    assert out.request_ids == []
    for kv in runner.kv_caches:
        for t in kv:
            assert torch.equal(t[6], t[5])


def test_first_new_block_past_the_table_is_refused(tiny_llama):
    runner = make_runner(tiny_llama)
    greedy = EngineSamplingParams(temperature=0.0)
    runner.execute_step(StepInput(1, [NewRequest("r", [1, 2, 3], greedy, [4], 0, 3)], [], []))
    with pytest.raises(ValueError, match="past the end of its block table"):
        runner.execute_step(StepInput(2, [], [CachedRequest("r", [], [7], False, 3, 1,
                                                            first_new_block=2)], []))


@pytest.mark.slow  # two rank processes (spawned: torch imported twice), ~15 s
def test_tp2_peer_keeps_beams_unappended_and_copies_its_heads(tiny_llama, tmp_path):
    import multiprocessing as mp

    from services.common.ports import free_port_range
    from tests.worker.beam_driver import tp_rank

    blocks = [30, 31, 32]
    expected, _ = run_fork(make_runner(tiny_llama), PROMPT, A_TOKENS, B_TOKENS, blocks)
    ctx = mp.get_context("spawn")
    port = free_port_range(1)
    paths = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=tp_rank, args=(r, port, str(tiny_llama), PROMPT, A_TOKENS,
                                               B_TOKENS, blocks, str(paths[r])))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:  # no rank outlives the test, even a hung one
            if p.is_alive():
                p.kill()
            p.join(10)
    driver, peer = (json.loads(p.read_text()) for p in paths)
    for rank in (driver, peer):
        assert rank["tokens"] == {"a": PROMPT + A_TOKENS, "b": PROMPT + B_TOKENS}
        assert rank["copied"]
    assert peer["logprobs"] == [{}, {}]
    for got, want in zip(driver["logprobs"], expected, strict=True):
        for rid in "ab":
            torch.testing.assert_close(torch.tensor(got[rid]), want[rid], atol=1e-5, rtol=0)
