"""InputBatch's persistent rows: reuse, preemption, limits, and the prepared step tensors against
a plain-Python reference built from the step's dataclasses (random steps with hypothesis)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput
from services.worker.input_batch import InputBatch

BS, V = 4, 50
GREEDY = EngineSamplingParams(temperature=0.0)


def make_batch(max_num_seqs=4, max_model_len=32, max_num_batched_tokens=16,
               num_kv_blocks=64) -> InputBatch:
    return InputBatch(torch.device("cpu"), BS, num_kv_blocks, V, (2,),
                      max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      max_num_batched_tokens=max_num_batched_tokens)


def step(batch: InputBatch, step_id: int, new=(), cached=(), finished=()):
    """Update and prepare; None when nothing is scheduled."""
    scheduled = batch.update(StepInput(step_id, list(new), list(cached), list(finished)))
    return batch.prepare(scheduled) if scheduled else None


# ---- an independent reference: the step's tensors from plain lists --------------------------

@dataclass
class Held:
    """What the reference knows of a request: its whole token list and block table."""

    tokens: list[int]
    blocks: list[int]
    num_prompt_tokens: int
    sampling: EngineSamplingParams


def apply_step(held: dict[str, Held], s: StepInput) -> list[tuple[str, int, int]]:
    """The reference's own bookkeeping of ``s``; returns (id, computed, scheduled) in order."""
    for rid in s.finished_request_ids:
        held.pop(rid, None)
    order = []
    for r in s.new_requests:
        held[r.request_id] = Held(list(r.prompt_token_ids), list(r.block_ids),
                                  len(r.prompt_token_ids), r.sampling_params)
        order.append((r.request_id, r.num_computed_tokens, r.num_scheduled_tokens))
    for r in s.cached_requests:
        h = held[r.request_id]
        h.tokens = list(r.new_token_ids) if r.resumed_from_preemption else h.tokens + list(
            r.new_token_ids)
        h.blocks = list(r.new_block_ids) if r.resumed_from_preemption else h.blocks + list(
            r.new_block_ids)
        order.append((r.request_id, r.num_computed_tokens, r.num_scheduled_tokens))
    return [o for o in order if o[2] > 0]


def reference(held: dict[str, Held], order: list[tuple[str, int, int]]) -> dict:
    """Token by token, request by request, as docs/architecture.md ("KV cache layout") states
    the slot."""
    out = {k: [] for k in ("input_ids", "positions", "slot_mapping", "seq_lens",
                           "logits_indices", "sampled", "chunks")}
    qsl = [0]
    for rid, c, n in order:
        h = held[rid]
        for p in range(c, c + n):
            out["input_ids"].append(h.tokens[p])
            out["positions"].append(p)
            out["slot_mapping"].append(h.blocks[p // BS] * BS + p % BS)
        k, end = h.sampling.prompt_logprobs, min(c + n, h.num_prompt_tokens - 1)
        if k is not None and end > c:  # position p scores prompt token p + 1
            out["chunks"].append((rid, k, qsl[-1], c + 1, h.tokens[c + 1:end + 1]))
        qsl.append(qsl[-1] + n)
        out["seq_lens"].append(c + n)
        if c + n == len(h.tokens):
            out["logits_indices"].append(qsl[-1] - 1)
            out["sampled"].append(rid)
    width = max(len(held[rid].blocks) for rid, _, _ in order)
    out["block_tables"] = [held[rid].blocks + [0] * (width - len(held[rid].blocks))
                           for rid, _, _ in order]
    out["query_start_loc"] = qsl
    return out


def check_prepared(prepared, held: dict[str, Held], order) -> None:
    ref = reference(held, order)
    (meta,) = prepared.attn_metadata  # one KV cache group
    got = {"input_ids": prepared.input_ids, "positions": prepared.positions,
           "slot_mapping": meta.slot_mapping, "seq_lens": meta.seq_lens,
           "query_start_loc": meta.query_start_loc, "logits_indices": prepared.logits_indices,
           "block_tables": meta.block_tables}
    dtypes = {"seq_lens": torch.int32, "query_start_loc": torch.int32,
              "block_tables": torch.int32}
    for name, tensor in got.items():
        assert tensor.dtype == dtypes.get(name, torch.int64), name
        assert tensor.tolist() == ref[name], name
    assert meta.max_query_len == max(n for _, _, n in order)
    assert meta.max_seq_len == max(ref["seq_lens"])
    assert prepared.sampled_request_ids == ref["sampled"]
    assert [(c.request_id, c.k, c.hidden_start, c.first_position, c.target_token_ids)
            for c in prepared.prompt_chunks] == ref["chunks"]
    options = [held[rid].sampling for rid in ref["sampled"]]
    sampling = prepared.sampling_tensors
    assert sampling.temperature.tolist() == pytest.approx([o.temperature for o in options])
    assert sampling.top_k.tolist() == [o.top_k if 0 < o.top_k < V else V for o in options]
    assert sorted(sampling.generators) == [i for i, o in enumerate(options) if o.seed is not None]
    assert prepared.num_logprobs == [o.logprobs for o in options]


def check_rows(batch: InputBatch) -> None:
    """Free rows are clean; every block table is zero past its end; no row is shared."""
    assert not batch.block_table[:, batch.free_rows].any()
    assert not batch.num_tokens[batch.free_rows].any()
    rows = [s.row for s in batch.requests.values() if s.row >= 0]
    assert len(rows) == len(set(rows)) and not set(rows) & set(batch.free_rows)
    assert len(rows) + len(batch.free_rows) == batch.max_num_seqs
    for r in rows:
        assert not batch.block_table[:, r, batch.num_blocks[r]:].any()


# ---- examples ---------------------------------------------------------------------------------

def test_mixed_step_equals_reference():
    """New + cached in one step: a prefix hit (computed 8 > 0), a chunked prefill's second
    chunk, decodes, and a prompt_logprobs request; then decodes that cross a block boundary."""
    batch, held = make_batch(max_num_seqs=5, max_num_batched_tokens=24), {}
    scored = EngineSamplingParams(temperature=0.5, top_k=3, seed=1, prompt_logprobs=2,
                                  logprobs=1)
    first = StepInput(0, [NewRequest("long", list(range(10, 20)), scored, [7, 3], 0, 6),
                          NewRequest("d1", [1, 2, 3], GREEDY, [9], 0, 3),
                          NewRequest("d2", [4, 5, 6, 7], GREEDY, [11], 0, 4)], [], [])
    second = StepInput(1, [NewRequest("hit", list(range(30, 41)), GREEDY, [20, 21, 22], 8, 3)],
                       [CachedRequest("long", [], [5], False, 6, 4),  # the rest of its prompt
                        CachedRequest("d1", [44], [], False, 3, 1),
                        CachedRequest("d2", [45], [12], False, 4, 1)], [])
    third = StepInput(2, [], [CachedRequest(r, [t], b, False, c, 1) for r, t, b, c in
                              (("long", 46, [], 10), ("d1", 47, [13], 4), ("d2", 48, [], 5),
                               ("hit", 49, [23], 11))], [])
    for s in (first, second, third):
        order = apply_step(held, s)
        check_prepared(batch.prepare(batch.update(s)), held, order)
        check_rows(batch)


def test_rows_are_reused_after_finish():
    batch = make_batch(max_num_seqs=3, max_num_batched_tokens=32)
    step(batch, 0, new=[NewRequest(r, [1] * 9, GREEDY, [1, 2, 3], 0, 9) for r in "abc"])
    assert [batch.requests[r].row for r in "abc"] == [0, 1, 2] and not batch.free_rows
    out = step(batch, 1, new=[NewRequest("d", [7, 8], GREEDY, [6], 0, 2)], finished=["b"])
    assert batch.requests["d"].row == 1 and "b" not in batch.requests
    assert batch.block_table[0, 1].tolist()[:4] == [6, 0, 0, 0]  # b's longer table is gone
    assert out.input_ids.tolist() == [7, 8]
    assert out.attn_metadata[0].slot_mapping.tolist() == [24, 25]
    step(batch, 2, finished=["a", "c", "d"])
    assert not batch.requests and sorted(batch.free_rows) == [0, 1, 2]
    check_rows(batch)


def test_resumed_request_replaces_its_block_table_row():
    batch = make_batch()
    step(batch, 0, new=[NewRequest("a", list(range(1, 11)), GREEDY, [1, 2, 3], 0, 10)])
    row = batch.requests["a"].row
    # Preempted (the worker is not told), then resumed with a new, shorter table and its whole
    # token list (here: the prompt and token 99).
    out = step(batch, 1, cached=[CachedRequest("a", [*range(1, 11), 99], [8, 9], True, 0, 8)])
    assert batch.block_table[0, row, :4].tolist() == [8, 9, 0, 0]
    assert out.attn_metadata[0].block_tables.tolist() == [[8, 9]]
    assert out.attn_metadata[0].slot_mapping.tolist() == [32, 33, 34, 35, 36, 37, 38, 39]
    assert out.sampled_request_ids == []  # 8 of 11 tokens: not the end of the chunk
    out = step(batch, 2, cached=[CachedRequest("a", [], [4], False, 8, 3)])
    assert out.input_ids.tolist() == [9, 10, 99] and out.sampled_request_ids == ["a"]
    assert out.attn_metadata[0].slot_mapping.tolist() == [16, 17, 18]
    check_rows(batch)


def test_requests_beyond_the_rows_are_parked_and_restored():
    """The worker holds more requests than rows (preempted ones wait): a held request outside
    the step gives its row up and gets its tokens and table back when it is scheduled again."""
    batch, held = make_batch(max_num_seqs=2), {}
    steps = [StepInput(0, [NewRequest("a", [1, 2, 3], GREEDY, [5], 0, 3),
                           NewRequest("b", [4, 5], GREEDY, [6], 0, 2)], [], []),
             StepInput(1, [NewRequest("c", [7, 8, 9, 10, 11], GREEDY, [7, 8], 0, 5)],
                       [CachedRequest("b", [12], [], False, 2, 1)], []),  # "a" is parked
             StepInput(2, [], [CachedRequest("a", [13], [9], False, 3, 1),
                               CachedRequest("c", [14], [], False, 5, 1)], [])]  # "b" parked
    for s in steps:
        order = apply_step(held, s)
        check_prepared(batch.prepare(batch.update(s)), held, order)
        check_rows(batch)
    assert batch.requests["b"].row == -1 and batch.requests["b"].parked[0].tolist() == [4, 5, 12]
    step(batch, 3, finished=["b"])
    assert len(batch.free_rows) == 0 and "b" not in batch.requests


def test_a_step_larger_than_the_buffers_grows_them_keeping_every_row():
    """The worker's --max-num-seqs / --max-num-batched-tokens need not match the scheduler's:
    a larger step grows the rows and step buffers once, and held rows keep their data."""
    batch, held = make_batch(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=8), {}
    steps = [StepInput(0, [NewRequest("a", [1, 2, 3], GREEDY, [5], 0, 3)], [], []),
             StepInput(1, [NewRequest(r, list(range(10, 19)), GREEDY,
                                      [3 * i, 3 * i + 1, 3 * i + 2], 0, 9)
                           for i, r in enumerate("bcd")],  # 3 rows, 27 tokens
                       [CachedRequest("a", [4], [], False, 3, 1)], [])]
    for s in steps:
        order = apply_step(held, s)
        check_prepared(batch.prepare(batch.update(s)), held, order)
        check_rows(batch)
    assert batch.max_num_seqs == 4 and batch.max_num_batched_tokens == 28
    assert batch.token_ids[batch.requests["a"].row, :4].tolist() == [1, 2, 3, 4]


def test_limits_raise_naming_them():
    batch = make_batch(max_num_seqs=2, max_model_len=12, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_model_len=12"):
        step(batch, 2, new=[NewRequest("b", [1] * 13, GREEDY, [0, 1, 2, 3], 0, 1)])
    with pytest.raises(ValueError, match="max_model_len=12"):  # 4 blocks of 4 > 12 tokens
        step(batch, 3, new=[NewRequest("b", [1] * 3, GREEDY, [0, 1, 2, 3], 0, 1)])
    batch = make_batch(max_num_seqs=2, max_model_len=12, max_num_batched_tokens=8)
    step(batch, 0, new=[NewRequest("a", [1] * 11, GREEDY, [0, 1, 2], 4, 7)])
    step(batch, 1, cached=[CachedRequest("a", [5], [], False, 11, 1)])  # 12 tokens: the limit
    with pytest.raises(ValueError, match="max_model_len=12"):
        step(batch, 2, cached=[CachedRequest("a", [6], [], False, 12, 1)])
    with pytest.raises(ValueError, match="max_model_len=12"):
        step(batch, 3, cached=[CachedRequest("a", [], [3], False, 12, 0)])


# ---- random steps -----------------------------------------------------------------------------

@dataclass
class SimRequest:
    """The test scheduler's view of one request."""

    request_id: str
    tokens: list[int]
    sampling: EngineSamplingParams
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent: int = 0  # tokens the worker holds; 0 = never sent
    resumed: bool = False


OPTIONS = st.sampled_from([
    GREEDY, EngineSamplingParams(temperature=0.7, top_p=0.9),
    EngineSamplingParams(top_k=5, seed=3), EngineSamplingParams(temperature=0.0, logprobs=2),
    EngineSamplingParams(prompt_logprobs=1),
    EngineSamplingParams(top_k=V + 5, min_p=0.1, logprobs=0, prompt_logprobs=0)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), max_num_seqs=st.integers(1, 4), budget=st.integers(1, 12),
       owns_tokens=st.booleans())
def test_random_steps_equal_reference(data, max_num_seqs, budget, owns_tokens):
    """Arrivals (some with a prefix hit), chunked prefills, decodes, preemptions (resumed with a
    new table and the whole token list), aborts and requests left out of a step; more requests
    than rows. ``owns_tokens``: the batch appends each step's samples itself (the sampling
    stage), else they come as the next step's new_token_ids (an earlier pipeline stage)."""
    max_model_len, num_kv_blocks = 20, 48
    batch = make_batch(max_num_seqs, max_model_len, budget, num_kv_blocks)
    held: dict[str, Held] = {}
    sims: list[SimRequest] = []
    finished: list[str] = []
    for step_id in range(data.draw(st.integers(1, 14), "steps")):
        if data.draw(st.booleans(), "arrive"):
            prompt = data.draw(st.lists(st.integers(3, V - 1), min_size=1, max_size=12))
            r = SimRequest(f"r{step_id}", prompt, data.draw(OPTIONS))
            r.computed = BS * data.draw(st.integers(0, (len(prompt) - 1) // BS), "prefix hit")
            sims.append(r)
        for r in [r for r in sims if r.sent and data.draw(st.integers(0, 5)) == 0]:
            r.blocks, r.computed, r.resumed = [], 0, True  # preempted
        for r in [r for r in sims if r.sent and data.draw(st.integers(0, 9)) == 0]:
            sims.remove(r)  # aborted
            finished.append(r.request_id)
        new, cached, left = [], [], budget
        for r in data.draw(st.permutations(sims))[:max_num_seqs]:
            n = min(data.draw(st.integers(1, 6), "chunk"), len(r.tokens) - r.computed, left)
            if n < 1:
                continue
            left -= n
            num_blocks = -(-(r.computed + n) // BS)
            added = [data.draw(st.integers(0, num_kv_blocks - 1), "block")  # (hit blocks too)
                     for _ in range(num_blocks - len(r.blocks))]
            r.blocks += added
            if not r.sent:
                new.append(NewRequest(r.request_id, list(r.tokens), r.sampling, list(r.blocks),
                                      r.computed, n))
            else:
                cached.append(CachedRequest(r.request_id,
                                            list(r.tokens) if r.resumed else r.tokens[r.sent:],
                                            list(r.blocks) if r.resumed else added, r.resumed,
                                            r.computed, n))
            r.sent, r.resumed, r.computed = len(r.tokens), False, r.computed + n
        s = StepInput(step_id, new, cached, finished)
        finished = []
        for name, happened in (("prefix hit", any(r.num_computed_tokens for r in new)),
                               ("resumed", any(r.resumed_from_preemption for r in cached)),
                               ("mixed", bool(new and cached))):
            if happened:
                event(name)
        order = apply_step(held, s)
        scheduled = batch.update(s)
        prepared = batch.prepare(scheduled) if order else None
        if prepared is not None:
            check_prepared(prepared, held, order)
        check_rows(batch)
        assert set(batch.requests) == set(held)
        if any(r.parked is not None for r in batch.requests.values()):
            event("parked")
        samples = {}
        for rid, c, n in order:  # "sample" where a chunk reached the end of the token list
            r = next(r for r in sims if r.request_id == rid)
            if c + n == len(r.tokens):
                samples[rid] = data.draw(st.integers(3, V - 1), "sampled")
                r.tokens.append(samples[rid])
                if owns_tokens:
                    held[rid].tokens.append(samples[rid])
                    r.sent = len(r.tokens)
        if owns_tokens and prepared is not None:
            assert sorted(prepared.sampled_request_ids) == sorted(samples)
            batch.append_sampled(prepared.sampled_rows,
                                 [samples[rid] for rid in prepared.sampled_request_ids])
            check_rows(batch)
            for rid in samples:
                row, n = batch.requests[rid].row, len(held[rid].tokens)
                assert batch.token_ids[row, :batch.num_tokens[row]].tolist() == held[rid].tokens
                assert batch.num_tokens[row] == n
        for rid in samples:
            r = next(r for r in sims if r.request_id == rid)
            if len(r.tokens) == max_model_len:
                sims.remove(r)
                finished.append(rid)
