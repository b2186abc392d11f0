"""Speculative decoding in the scheduler: drafts scheduled under the one rule, accepted runs
appended token by token, rejected drafts rolled back, their blocks freed, no leaks.

``SpecWorker`` plays the worker as a real one must: it keeps its own token lists and block
tables from the step diffs alone (drafts written after the tokens, not part of them; a cut
table when the scheduler freed blocks), writes a fake K/V (position, prefix key of the tokens
up to it, drafts included) into every slot a step computes and checks that every slot a step
reads holds the K/V of the request's real tokens, so a rejected draft's K/V that is read, a
wrong rollback of ``num_computed_tokens`` or a freed block still in use fails. The fake model
is ``fake_token`` (the token at a position depends only on the request and the position), so
the outputs with speculation must equal ``expected_output`` exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from services.common.spec_decode_config import SpeculativeConfig
from services.scheduler.outputs import ScheduledStep
from services.scheduler.request import FinishReason
from services.scheduler.scheduler import Scheduler
from services.common.step import StepOutput
from services.scheduler.spec_decode import num_drafts_to_verify
from tests.scheduler.factories import (
    expected_output,
    fake_token,
    make_request,
    make_scheduler,
    prefix_keys,
)

NGRAM = SpeculativeConfig("ngram", 4, 4, 4)
DRAFT = SpeculativeConfig("draft_model", 3, model="draft")


@dataclass
class _State:
    tokens: list[int]
    table: list[int]
    num_computed: int


class SpecWorker:
    """A one-group, one-rank worker that verifies drafts against ``fake_token`` and proposes
    ``propose(request_id, tokens, k)`` after each step that asks for proposals."""

    def __init__(self, scheduler: Scheduler, propose) -> None:
        self.scheduler, self.propose = scheduler, propose
        self.states: dict[str, _State] = {}
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, prefix key)
        self.lookahead_seen = 0  # the most slots past a step's tokens a table covered

    def execute(self, out: ScheduledStep) -> StepOutput:
        bs = self.scheduler.config.block_size
        for rid in out.finished_request_ids:
            self.states.pop(rid)
        for new in out.new_requests:
            assert new.request_id not in self.states
            self.states[new.request_id] = _State(list(new.prompt_token_ids),
                                                 list(new.block_ids), new.num_computed_tokens)
        drafts: dict[str, list[int]] = {}
        for c in out.cached_requests:
            state = self.states[c.request_id]
            if c.resumed_from_preemption:
                state.tokens, state.table = list(c.new_token_ids), list(c.new_block_ids)
                state.num_computed = c.num_computed_tokens
                assert not c.spec_token_ids
                continue
            assert c.num_computed_tokens == state.num_computed, "rollback disagrees"
            if c.first_new_block >= 0:  # (the scheduler freed the blocks of rejected drafts)
                assert c.first_new_block <= len(state.table)
                del state.table[c.first_new_block:]
            state.table += c.new_block_ids
            if c.spec_token_ids:
                drafts[c.request_id] = c.spec_token_ids
        new_tokens: dict[str, list[int]] = {}
        proposals: dict[str, list[int]] = {}
        reads = []
        for rid, n in out.num_scheduled_tokens.items():
            state, request = self.states[rid], self.scheduler.get_request(rid)
            assert state.tokens == request.all_token_ids
            d = drafts.get(rid, [])
            seq = state.tokens + d
            start, end = state.num_computed, state.num_computed + n
            if d:
                assert n == 1 + len(d) and start == len(state.tokens) - 1, "drafts with a prefill"
            assert end <= len(seq) and end <= len(state.table) * bs
            self.lookahead_seen = max(self.lookahead_seen, len(state.table) * bs - end)
            keys = prefix_keys(seq[:end])
            for pos in range(start, end):
                self.kv[state.table[pos // bs] * bs + pos % bs] = (pos, keys[pos])
            reads.append((rid, end, keys))
        for rid, end, keys in reads:
            state = self.states[rid]
            for pos in range(end):
                assert self.kv.get(state.table[pos // bs] * bs + pos % bs) == (pos, keys[pos]), (
                    f"{rid} reads wrong K/V at {pos}")
            d = drafts.get(rid, [])
            if end != len(state.tokens) + len(d):
                state.num_computed = end
                continue  # a prefill chunk short of the end
            num_real = len(state.tokens)
            accepted = []
            for j, draft in enumerate(d):  # greedy verification: accept while it matches
                if fake_token(rid, num_real + j) != draft:
                    break
                accepted.append(draft)
            token = fake_token(rid, num_real + len(accepted))
            state.tokens += [*accepted, token]
            state.num_computed = len(state.tokens) - 1
            new_tokens[rid] = [*accepted, token]
            if out.num_speculative_tokens:
                proposals[rid] = self.propose(rid, state.tokens, out.num_speculative_tokens)
        return StepOutput(out.step_id, list(new_tokens),
                          [t for tokens in new_tokens.values() for t in tokens],
                          num_sampled_token_ids=[len(t) for t in new_tokens.values()],
                          draft_token_ids=([proposals[rid] for rid in new_tokens]
                                           if out.num_speculative_tokens else None))


def run(scheduler: Scheduler, worker: SpecWorker, max_steps: int = 5000):
    """Step to completion (one step in flight, as speculation runs); returns updates by id."""
    updates: dict[str, list] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return updates
        out = scheduler.schedule()
        for u in scheduler.update_from_output(out, worker.execute(out)):
            updates.setdefault(u.request_id, []).append(u)
        scheduler.block_manager.check_invariants(scheduler.requests.values())
    raise AssertionError("unfinished")


def oracle(right: float, seed: int = 0):
    """A proposer whose drafts are the fake model's tokens, each wrong with prob 1 - right."""
    rng = random.Random(seed)

    def propose(rid: str, tokens: list[int], k: int) -> list[int]:
        out = []
        for j in range(rng.randint(0, k)):
            t = fake_token(rid, len(tokens) + j)
            out.append(t if rng.random() < right else t + 1)
        return out
    return propose


def outputs_of(updates: dict[str, list]) -> dict[str, tuple[list[int], FinishReason]]:
    return {rid: ([t for u in us for t in u.new_token_ids], us[-1].finish_reason)
            for rid, us in updates.items()}


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
@pytest.mark.parametrize("right", [1.0, 0.7, 0.0])
def test_outputs_equal_the_model_s_whatever_the_drafts(spec, right):
    sched = make_scheduler(64, block_size=4, max_num_batched_tokens=24, speculative=spec)
    requests = [make_request(i, 3 + 5 * i, max_tokens=9 + 4 * i) for i in range(5)]
    requests.append(make_request(5, 6, max_tokens=30, stop_token_ids=[fake_token("req-5", 17)]))
    requests.append(make_request(6, 5, max_tokens=20, min_tokens=6,
                                 stop_token_ids=[fake_token("req-6", 8)]))
    for r in requests:
        sched.add_request(r)
    worker = SpecWorker(sched, oracle(right))
    got = outputs_of(run(sched, worker))
    for r in requests:
        assert got[r.request_id] == expected_output(r, sched.config.max_model_len), r.request_id
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    stats = sched.spec_stats
    assert stats.num_draft_tokens > 0
    if right == 1.0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if right == 0.0:
        assert stats.num_accepted_tokens == 0
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)


def test_max_tokens_inside_an_accepted_run_ends_there():
    sched = make_scheduler(32, speculative=NGRAM)
    r = make_request(1, 4, max_tokens=6)
    sched.add_request(r)
    worker = SpecWorker(sched, oracle(1.0))
    updates = run(sched, worker)["req-1"]
    assert outputs_of({"req-1": updates})["req-1"] == expected_output(r, 128)
    # the drafts never ask for more than max_tokens: 1 + 4 + 1 at most, the last step short
    assert max(len(u.new_token_ids) for u in updates) <= 5


def test_a_stop_token_inside_an_accepted_run_drops_what_follows():
    stop = fake_token("req-2", 9)  # the 4th output of a 6-token prompt
    sched = make_scheduler(32, speculative=NGRAM)
    r = make_request(2, 6, max_tokens=40, stop_token_ids=[stop])
    sched.add_request(r)
    updates = run(sched, SpecWorker(sched, oracle(1.0)))["req-2"]
    tokens = [t for u in updates for t in u.new_token_ids]
    assert tokens == expected_output(r, 128)[0] and tokens[-1] == stop
    assert updates[-1].finish_reason is FinishReason.STOP
    assert updates[-1].num_output_tokens == len(tokens)


def test_rejected_drafts_roll_back_and_free_their_blocks():
    sched = make_scheduler(32, block_size=2, max_model_len=48, speculative=NGRAM)
    r = make_request(3, 3, max_tokens=20)
    sched.add_request(r)
    wrong = SpecWorker(sched, lambda rid, tokens, k: [fake_token(rid, len(tokens)) + 1] * k)
    out = sched.schedule()  # the prefill: drafts come back with its token
    sched.update_from_output(out, wrong.execute(out))
    assert r.spec_token_ids and len(r.spec_token_ids) == 4
    out = sched.schedule()
    assert out.num_scheduled_tokens["req-3"] == 5 and out.cached_requests[0].spec_token_ids == [
        fake_token("req-3", 4) + 1] * 4
    held = len(r.block_ids[0])
    assert held * 2 >= r.num_computed_tokens == 4 + 4  # slots for the drafts
    sched.update_from_output(out, wrong.execute(out))
    assert r.num_computed_tokens == 4 and r.num_tokens == 5  # every draft rejected
    assert len(r.block_ids[0]) == 2 < held  # ceil(4 / 2): the drafts' blocks are free again
    assert r.trimmed_to == 2
    out = sched.schedule()  # the workers cut their tables too
    cached = out.cached_requests[0]
    assert cached.first_new_block == 2 and r.trimmed_to == -1
    sched.update_from_output(out, wrong.execute(out))
    sched.block_manager.check_invariants(sched.requests.values())


def test_draft_model_gets_lookahead_slots_and_keeps_them():
    sched = make_scheduler(64, block_size=4, speculative=DRAFT)
    for i in range(3):
        sched.add_request(make_request(i, 5 + i, max_tokens=25))
    worker = SpecWorker(sched, oracle(0.5, seed=3))
    for _ in range(6):
        out = sched.schedule()
        sched.update_from_output(out, worker.execute(out))
        for r in sched.running:  # the draft model's own K/V for its next drafts lives there
            assert len(r.block_ids[0]) * 4 >= r.num_computed_tokens + DRAFT.num_speculative_tokens
    assert worker.lookahead_seen >= DRAFT.num_speculative_tokens


def test_large_batches_turn_speculation_off():
    spec = SpeculativeConfig("ngram", 2, 2, 2, disable_by_batch_size=3)
    sched = make_scheduler(64, speculative=spec)
    for i in range(3):
        sched.add_request(make_request(i, 4, max_tokens=8))
    worker = SpecWorker(sched, oracle(1.0))
    out = sched.schedule()
    assert out.num_speculative_tokens == 2  # (admitted this step: 0 running before)
    sched.update_from_output(out, worker.execute(out))
    out = sched.schedule()
    assert out.num_speculative_tokens == 0 and not any(  # 3 running
        c.spec_token_ids for c in out.cached_requests)
    assert all(n == 1 for n in out.num_scheduled_tokens.values())


def test_preemption_drops_drafts_and_recomputes():
    sched = make_scheduler(14, block_size=4, max_num_batched_tokens=32, max_model_len=40,
                           speculative=NGRAM)
    requests = [make_request(i, 6, max_tokens=24) for i in range(3)]
    for r in requests:
        sched.add_request(r)
    got = outputs_of(run(sched, SpecWorker(sched, oracle(0.8, seed=1))))
    assert sched.num_preemptions_total > 0
    for r in requests:
        assert got[r.request_id] == expected_output(r, 40)
    assert sched.block_manager.num_free_blocks == 14


def test_prefix_hits_with_drafts_register_only_real_tokens():
    sched = make_scheduler(64, block_size=4, speculative=NGRAM)
    first = make_request(1, 9, max_tokens=12)
    sched.add_request(first)
    worker = SpecWorker(sched, oracle(0.5, seed=2))
    run(sched, worker)
    again = make_request(1, 9, max_tokens=12)  # the same prompt: a hit on its full blocks
    sched.add_request(again)
    got = outputs_of(run(sched, worker))
    assert again.num_cached_tokens == 8
    assert got["req-1"] == expected_output(again, 128)


def test_num_drafts_to_verify_limits():
    assert num_drafts_to_verify(4, 100, 0, None, 10, 100) == 4
    assert num_drafts_to_verify(4, 3, 0, None, 10, 100) == 2  # the budget, last token first
    assert num_drafts_to_verify(4, 100, 5, 8, 10, 100) == 2  # 5 + 2 + 1 = max_tokens
    assert num_drafts_to_verify(4, 100, 0, None, 98, 100) == 1  # max_model_len
    assert num_drafts_to_verify(4, 1, 0, None, 10, 100) == 0


def test_async_scheduling_and_speculation_are_exclusive():
    with pytest.raises(ValueError, match="--async-scheduling does not work with "
                                         "--speculative-config"):
        make_scheduler(speculative=NGRAM, async_scheduling=True)


def test_step_results_are_cut_per_request():
    from services.common.step import SampledLogprobs
    from services.scheduler.step_results import results_by_request

    plain = results_by_request(StepOutput(0, ["a", "b"], [5, 6]))
    assert {r: (x.token_ids, x.logprobs, x.draft_token_ids) for r, x in plain.items()} == {
        "a": ([5], None, []), "b": ([6], None, [])}
    accepted_only = results_by_request(StepOutput(0, ["a", "b"], [1, 2, 3, 6],
                                                  num_sampled_token_ids=[3, 1]))
    assert accepted_only["a"].token_ids == [1, 2, 3] and accepted_only["b"].token_ids == [6]
    full = results_by_request(StepOutput(
        0, ["a", "b"], [1, 2, 6], SampledLogprobs([1, 1, -1], [-0.5, -0.25], [1, 2],
                                                  [-0.5, -0.25]),
        num_sampled_token_ids=[2, 1], draft_token_ids=[[], [8, 9]]))
    assert full["a"].token_ids == [1, 2] and full["b"].draft_token_ids == [8, 9]
    lp = full["a"].logprobs
    assert (lp.logprobs, lp.top_token_ids, lp.top_logprobs) == ([-0.5, -0.25], [1, 2],
                                                                [-0.5, -0.25])
    assert full["b"].logprobs is None
