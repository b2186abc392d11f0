"""Beam search in the scheduler (``services/scheduler/beam_search.py``) against transformers.

The fake worker here plays every rank as a real one must for beams: it keeps each request's
token list and block tables from the ScheduledStep diffs alone (a beam's tokens come in
``new_token_ids``; its own argmax is never appended), applies ``blocks_to_copy`` to its "KV
cache" before the step and ``first_new_block`` to the tables, writes each computed position's
(position, prefix key) into its slot and then reads the whole context back through the block
table. The logits come from transformers' own forward of the context it read, so a wrong fork,
a missed or wrong copy-on-write, or a block freed while a beam still reads it gives other
hypotheses than ``generate(num_beams=k)`` (or fails the read check at once).
"""

from __future__ import annotations

import struct

import pytest
import torch

from services.scheduler.beam_search import BeamGroup, _f32
from services.common.step import SampledLogprobs, StepOutput
from services.scheduler.request import EngineSamplingParams, FinishReason, Request
from tests.helpers import hf_beam_search, make_tiny_llama
from tests.scheduler.factories import make_scheduler, prefix_keys, split_tables

BS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama (vocab 96, EOS 2), run on one thread: its forwards are too small
    to share, and two threads contend with anything else on the machine."""
    from transformers import LlamaForCausalLM
    path = make_tiny_llama(tmp_path_factory.mktemp("beam") / "m", vocab_size=96, eos_token_id=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.set_num_threads(threads)


class BeamWorker:
    """A worker for the scheduler's outputs that computes with ``model`` (see the module
    docstring)."""

    def __init__(self, scheduler, model):
        self.scheduler, self.model = scheduler, model
        self.states: dict[str, tuple[list[int], list[list[int]]]] = {}
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, prefix key)
        self.num_copies = 0

    def execute(self, out):
        sched = self.scheduler
        for rid in out.finished_request_ids:
            del self.states[rid]  # KeyError: told to drop a request it never saw
        dsts = [d for _, d in out.blocks_to_copy]
        assert len(set(dsts)) == len(dsts) and not set(dsts) & {s for s, _ in
                                                                 out.blocks_to_copy}
        for src, dst in out.blocks_to_copy:
            self.num_copies += 1
            for off in range(BS):
                if src * BS + off in self.kv:
                    self.kv[dst * BS + off] = self.kv[src * BS + off]
                else:
                    self.kv.pop(dst * BS + off, None)
        for new in out.new_requests:
            self.states[new.request_id] = (list(new.prompt_token_ids),
                                           split_tables(new.block_ids, 1))
        for c in out.cached_requests:
            tokens, tables = self.states[c.request_id]
            if c.resumed_from_preemption:
                self.states[c.request_id] = (list(c.new_token_ids),
                                             split_tables(c.new_block_ids, 1))
                continue
            if c.beam:
                tokens += c.new_token_ids
            if c.first_new_block >= 0:
                del tables[0][c.first_new_block:]
            tables[0] += c.new_block_ids
        sampled, logprobs, reads = {}, {}, []
        for rid, n in out.num_scheduled_tokens.items():
            tokens, tables = self.states[rid]
            request = sched.get_request(rid)
            assert tokens[:request.num_tokens] == request.all_token_ids, rid
            assert tables == request.block_ids, rid
            start = next(c.num_computed_tokens for c in
                         out.new_requests + out.cached_requests
                         if c.request_id == rid)
            keys = prefix_keys(tokens[:start + n])
            for pos in range(start, start + n):
                self.kv[tables[0][pos // BS] * BS + pos % BS] = (pos, keys[pos])
            reads.append((rid, start + n, keys))
        for rid, end, keys in reads:
            tokens, tables = self.states[rid]
            for pos in range(end):
                assert self.kv.get(tables[0][pos // BS] * BS + pos % BS) == (pos, keys[pos]), (
                    f"{rid} reads wrong K/V at {pos}")
            if end < len(tokens):
                continue
            with torch.no_grad():
                logits = self.model(torch.tensor([tokens])).logits[0, -1].float()
            lps = torch.log_softmax(logits, dim=-1)
            params = sched.get_request(rid).sampling_params
            sampled[rid] = int(lps.argmax())
            if params.beam_width:
                top = lps.topk(params.logprobs)
                logprobs[rid] = (float(top.values[0]), top.indices.tolist(),
                                 top.values.tolist())
            else:
                tokens.append(sampled[rid])
        # the StepResult's columns: k per sampled token (-1: asked for none), then theirs
        columns = SampledLogprobs(
            [len(logprobs[r][1]) if r in logprobs else -1 for r in sampled],
            [logprobs[r][0] for r in sampled if r in logprobs],
            [t for r in sampled if r in logprobs for t in logprobs[r][1]],
            [v for r in sampled if r in logprobs for v in logprobs[r][2]])
        return StepOutput(out.step_id, list(sampled), list(sampled.values()),
                          columns if logprobs else None)

    def run(self, max_steps=5000):
        sched, updates = self.scheduler, []
        for _ in range(max_steps):
            if not sched.has_unfinished_requests():
                self.execute(sched.schedule())  # (the workers drop the finished beams)
                return updates
            out = sched.schedule()
            updates += sched.update_from_output(out, self.execute(out))
            sched.block_manager.check_invariants(sched.requests.values())
        raise AssertionError("beam search did not finish")


def hf_beams(model, prompt, k, n, max_new, length_penalty=1.0, early_stopping=False):
    return hf_beam_search(model, prompt, k, n, max_new, length_penalty, early_stopping)


def beam_request(rid, prompt, k, max_new, length_penalty=1.0, early_stopping="false"):
    return Request(rid, prompt, EngineSamplingParams(
        temperature=0.0, max_tokens=max_new, beam_width=k, length_penalty=length_penalty,
        early_stopping=early_stopping))


def assert_same(updates, rid, expected):
    final = [u for u in updates if u.request_id == rid]
    assert len(final) == 1 and final[0].beams is not None
    got = final[0].beams
    assert [h.token_ids for h in got[:len(expected)]] == [g for g, _ in expected]
    for h, (_, score) in zip(got, expected, strict=True):
        assert abs(h.score - score) < 1e-4
    for h in got:
        eos_end = h.token_ids[-1] == 2
        assert h.finish_reason is (FinishReason.STOP if eos_end else FinishReason.LENGTH)


def prompt_of(i, n=7):
    return [(i * 31 + j * 7) % 90 + 3 for j in range(n)]


@pytest.mark.parametrize(("k", "length_penalty", "early_stopping"), [
    (2, 1.0, "false"), (4, 0.5, "true"), (4, 2.0, "false"), (8, 1.0, "never"),
    (8, 2.0, "true")])
def test_beam_search_equals_transformers(model, k, length_penalty, early_stopping):
    sched = make_scheduler(256, block_size=BS, max_num_seqs=16, eos_token_ids=(2,))
    worker = BeamWorker(sched, model)
    prompt = prompt_of(k, 6)  # (a partial last block: the first fork shares it)
    sched.add_request(beam_request("b", prompt, k, 16, length_penalty, early_stopping))
    updates = worker.run()
    es = {"true": True, "false": False, "never": "never"}[early_stopping]
    assert_same(updates, "b", hf_beams(model, prompt, k, k, 16, length_penalty, es))
    assert worker.num_copies > 0 and worker.num_copies == sched.num_blocks_copied_total
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not worker.states


def test_beams_stop_on_eos(model):
    """An EOS the model likes (its greedy choice a few tokens in): hypotheses finish early,
    and the search stops once they cannot be beaten."""
    prompt = prompt_of(3)
    greedy = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6,
                            pad_token_id=0)[0, len(prompt):].tolist()
    eos = greedy[3]
    model.generation_config.eos_token_id = eos
    try:
        sched = make_scheduler(256, block_size=BS, max_num_seqs=16, eos_token_ids=(eos,))
        sched.add_request(beam_request("b", prompt, 4, 24))
        updates = BeamWorker(sched, model).run()
        expected = hf_beams(model, prompt, 4, 4, 24)
        final = next(u for u in updates if u.request_id == "b")
        assert [h.token_ids for h in final.beams] == [g for g, _ in expected]
        assert any(h.finish_reason is FinishReason.STOP for h in final.beams)
        assert all(abs(h.score - s) < 1e-4 for h, (_, s) in zip(final.beams, expected, strict=True))
    finally:
        model.generation_config.eos_token_id = 2


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_beams_mixed_with_greedy_and_preempted(model, prefix_caching):
    """Two beam groups and greedy requests in one small KV cache: groups are preempted (and
    restart) and the results still equal transformers'; nothing leaks."""
    sched = make_scheduler(26, block_size=BS, max_num_seqs=16, eos_token_ids=(2,),
                           max_model_len=64, enable_prefix_caching=prefix_caching)
    worker = BeamWorker(sched, model)
    for i in range(3):
        sched.add_request(Request(f"g{i}", prompt_of(10 + i, 9),
                                  EngineSamplingParams(temperature=0.0, max_tokens=20)))
    sched.add_request(beam_request("b4", prompt_of(4), 4, 14))
    sched.add_request(beam_request("b2", prompt_of(4), 2, 14, 0.5))  # (same prompt: hits)
    restarted, restart = [], sched.beams.restart
    sched.beams.restart = lambda group: (restarted.append(group.root.request_id),
                                         restart(group))[1]
    updates = worker.run()
    assert restarted, "no beam group was preempted"
    assert_same(updates, "b4", hf_beams(model, prompt_of(4), 4, 4, 14))
    assert_same(updates, "b2", hf_beams(model, prompt_of(4), 2, 2, 14, 0.5))
    for i in range(3):
        p = prompt_of(10 + i, 9)
        want = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=20,
                              pad_token_id=0)[0, len(p):].tolist()
        got = [t for u in updates if u.request_id == f"g{i}" for t in u.new_token_ids]
        if 2 in want:
            want = want[:want.index(2) + 1]
        assert got == want
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_abort_frees_every_beam(model):
    sched = make_scheduler(64, block_size=BS, max_num_seqs=16, eos_token_ids=(2,))
    worker = BeamWorker(sched, model)
    sched.add_request(beam_request("b", prompt_of(1), 4, 30))
    for _ in range(6):
        out = sched.schedule()
        sched.update_from_output(out, worker.execute(out))
    assert len(sched.running) == 4 and sched.block_manager.num_shared_blocks > 0
    update = sched.abort_request("b")
    assert update.finish_reason is FinishReason.ABORT
    assert not sched.has_unfinished_requests() and not sched.running
    sched.block_manager.check_invariants([])
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    out = sched.schedule()  # the workers drop every beam
    assert out.finished_request_ids == {"b", "b#beam1", "b#beam2", "b#beam3"}
    sched.add_request(Request("b#beam1", [5, 6], EngineSamplingParams()))  # (ids free again)


def test_candidates_are_capped_at_the_vocabulary():
    sched = make_scheduler(64, block_size=BS, max_num_seqs=16, vocab_size=20)
    sched.add_request(Request("a", [1, 2], EngineSamplingParams(
        beam_width=8, max_tokens=4, stop_token_ids=(3, 4, 5))))
    assert sched.get_request("a").sampling_params.logprobs == 20  # not 4 x 8


def test_beam_group_refusals():
    sched = make_scheduler(16, block_size=BS, max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add_request(beam_request("a", [1, 2, 3], 5, 4))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(beam_request("a", [1, 2, 3], 4, 40))
    sched.add_request(Request("x#beam1", [1, 2], EngineSamplingParams()))
    with pytest.raises(ValueError, match="in use"):
        sched.add_request(beam_request("x", [1, 2, 3], 2, 4))
    sched.add_request(beam_request("y", [1, 2, 3], 2, 4))
    with pytest.raises(ValueError, match="already running"):
        sched.add_request(Request("y#beam1", [1, 2], EngineSamplingParams()))


def test_selection_rounds_as_float32():
    """Scores add and divide in float32 (as transformers' tensors do)."""
    group = BeamGroup(Request("r", [1], EngineSamplingParams()), 1, 1, frozenset({9}), 2, 1.0)
    group.propose(group.root, [5, 9], [-0.1, -0.2])
    assert group.select() is None
    h = group.finished[0]
    assert h.token_ids == [5] and h.cumulative_logprob == _f32(-0.1)
    assert struct.pack("f", h.score) == struct.pack("f", -0.1)
