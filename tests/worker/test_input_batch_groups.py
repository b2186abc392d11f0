"""InputBatch with several KV cache groups: the wire's block ids (group by group, -1 = no
block) cut into one block table per group, one attention metadata per group (its own slot
mapping and block tables; sequence lengths and query offsets shared), the errors, parking, and
random steps against a plain-Python reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.common.pb.pagedserve.v1 import worker_pb2
from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput
from services.worker.input_batch import InputBatch
from services.worker.server import step_input_from_pb

BS, V = 4, 50
GREEDY = EngineSamplingParams(temperature=0.0)


def make_batch(groups: int, max_num_seqs=4, max_model_len=32, max_num_batched_tokens=16,
               num_kv_blocks=64) -> InputBatch:
    return InputBatch(torch.device("cpu"), BS, num_kv_blocks, V, (2,), max_num_seqs=max_num_seqs,
                      max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                      num_kv_cache_groups=groups)


def step(batch: InputBatch, step_id: int, new=(), cached=(), finished=()):
    scheduled = batch.update(StepInput(step_id, list(new), list(cached), list(finished)))
    return batch.prepare(scheduled) if scheduled else None


def tables(prepared) -> list[list[list[int]]]:
    return [m.block_tables.tolist() for m in prepared.attn_metadata]


def slots(prepared) -> list[list[int]]:
    return [m.slot_mapping.tolist() for m in prepared.attn_metadata]


def check_shared(prepared) -> None:
    """The groups' metadata differ only in slot mapping and block tables."""
    first, *rest = prepared.attn_metadata
    for m in rest:
        assert m is not first
        assert m.seq_lens is first.seq_lens and m.query_start_loc is first.query_start_loc
        assert (m.max_query_len, m.max_seq_len) == (first.max_query_len, first.max_seq_len)


def test_wire_block_ids_are_cut_group_by_group():
    """A StepRequest's flat block ids, through the servicer's decoding: a prefill of 6 tokens in
    2 groups of 2 blocks, then a decode that appends one block per group."""
    batch = make_batch(groups=2)
    msg = worker_pb2.StepRequest(step_id=0, new_requests=[worker_pb2.NewRequest(
        request_id="a", prompt_token_ids=[11, 12, 13, 14, 15, 16], block_ids=[1, 2, 5, 6],
        num_scheduled_tokens=6, sampling_params=GREEDY.to_pb())])
    out = batch.prepare(batch.update(step_input_from_pb(msg, V)))
    assert len(out.attn_metadata) == 2
    check_shared(out)
    assert tables(out) == [[[1, 2]], [[5, 6]]]
    assert slots(out) == [[4, 5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25]]
    assert out.attn_metadata[0].seq_lens.tolist() == [6]
    assert batch.block_table[:, batch.requests["a"].row, :3].tolist() == [[1, 2, 0], [5, 6, 0]]
    batch.append_sampled(out.sampled_rows, [17])
    out = step(batch, 1, cached=[CachedRequest("a", [], [], False, 6, 1)])
    assert slots(out) == [[10], [26]]
    batch.append_sampled(out.sampled_rows, [18])
    cached = worker_pb2.CachedRequests(
        request_ids=["a"], new_block_ids=[3, 7], num_new_block_ids=[2],
        resumed_from_preemption=[False], num_computed_tokens=[7], num_scheduled_tokens=[1])
    msg = worker_pb2.StepRequest(step_id=2, cached_requests=cached)
    out = batch.prepare(batch.update(step_input_from_pb(msg, V)))
    assert tables(out) == [[[1, 2, 3]], [[5, 6, 7]]] and slots(out) == [[11], [27]]
    assert out.input_ids.tolist() == [18]


def test_minus_one_is_stored_as_zero_and_never_shifts_the_other_groups():
    """-1 (a sliding group's block before its window): a prefix hit whose sliding group lacks
    the first blocks, a request resumed with its window's blocks only, and appends."""
    batch = make_batch(groups=3)
    # 10 tokens, 8 of them cached: group 1 (sliding) holds only block 1 of the hit
    out = step(batch, 0, new=[NewRequest("hit", list(range(10, 20)), GREEDY,
                                         [1, 2, 3, -1, 4, 5, 6, 7, 8], 8, 2)])
    check_shared(out)
    assert tables(out) == [[[1, 2, 3]], [[0, 4, 5]], [[6, 7, 8]]]
    assert slots(out) == [[12, 13], [20, 21], [32, 33]]
    out = step(batch, 1, new=[NewRequest("r", [1, 2, 3, 4, 5], GREEDY, [9, 10, 11, 12, 13, 14],
                                         0, 5)],
               cached=[CachedRequest("hit", [], [-1, 15, 16], False, 10, 0)])  # (an append)
    assert tables(out) == [[[9, 10]], [[11, 12]], [[13, 14]]]
    row = batch.requests["hit"].row
    assert batch.block_table[:, row, :5].tolist() == [[1, 2, 3, 0, 0], [0, 4, 5, 15, 0],
                                                      [6, 7, 8, 16, 0]]
    # resumed: its whole tables, the sliding group's first two blocks gone
    out = step(batch, 2, cached=[CachedRequest("r", [1, 2, 3, 4, 5, 6], [20, 21, -1, 24, 22, 23],
                                               True, 4, 2)])
    assert tables(out) == [[[20, 21]], [[0, 24]], [[22, 23]]]
    assert slots(out) == [[84, 85], [96, 97], [92, 93]]


def test_a_block_count_the_groups_do_not_divide_or_a_bad_id_is_refused():
    batch = make_batch(groups=2, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"'a': 3 block ids for 2 KV cache groups"):
        step(batch, 0, new=[NewRequest("a", [1, 2], GREEDY, [1, 2, 3], 0, 2)])
    for blocks, shown in (([-1, 16], r"\[-1, 16\]"), ([5, -2], r"\[-2, 5\]")):
        with pytest.raises(ValueError, match=r"block ids must be in \[0, 16\) or -1 \(no "
                                             rf"block\), got {shown}"):
            step(batch, 1, new=[NewRequest("b", [1, 2], GREEDY, blocks, 0, 2)])
    step(batch, 2, new=[NewRequest("c", [1, 2, 3, 4, 5], GREEDY, [1, 2, 3, 4], 0, 5)])
    with pytest.raises(ValueError, match=r"'c': 1 block ids for 2 KV cache groups"):
        step(batch, 3, cached=[CachedRequest("c", [], [7], False, 5, 0)])
    with pytest.raises(ValueError, match="max_model_len=32"):  # 8 blocks per group + 1
        step(batch, 4, cached=[CachedRequest("c", [], list(range(7)) * 2, False, 5, 0)])


def test_first_new_block_replaces_every_groups_tables_from_there():
    """Copy-on-write: a cached request's new block ids are written from ``first_new_block`` in
    each group (its last block replaced by the copy), and the tables end after them; past the
    tables' end is refused."""
    batch = make_batch(groups=2)
    step(batch, 0, new=[NewRequest("a", list(range(10, 20)), GREEDY, [1, 2, 3, 5, 6, 7], 0, 10)])
    row = batch.requests["a"].row
    out = step(batch, 1, cached=[CachedRequest("a", [20], [8, 9], False, 10, 1,
                                               first_new_block=2)])
    assert tables(out) == [[[1, 2, 8]], [[5, 6, 9]]] and slots(out) == [[34], [38]]
    batch.update(StepInput(2, [], [CachedRequest("a", [], [12, 13], False, 11, 0,
                                                 first_new_block=1)], []))
    assert batch.num_blocks[row] == 2
    assert batch.block_table[:, row, :4].tolist() == [[1, 12, 0, 0], [5, 13, 0, 0]]
    with pytest.raises(ValueError, match="from table index 3, past the end of its block table"):
        batch.update(StepInput(3, [], [CachedRequest("a", [], [14, 15], False, 11, 0,
                                                     first_new_block=3)], []))


def test_a_parked_request_gets_every_group_table_back():
    batch = make_batch(groups=2, max_num_seqs=1)
    step(batch, 0, new=[NewRequest("a", [1, 2, 3, 4, 5], GREEDY, [1, 2, 3, 4], 0, 5)])
    step(batch, 1, new=[NewRequest("b", [6, 7], GREEDY, [8, 9], 0, 2)])  # "a" gives its row
    assert batch.requests["a"].parked[1].tolist() == [[1, 2], [3, 4]]
    out = step(batch, 2, cached=[CachedRequest("a", [], [5, 6], False, 5, 0)])  # "b" parked
    assert out is None  # (nothing scheduled)
    out = step(batch, 3, cached=[CachedRequest("a", [], [], False, 4, 1)])
    assert tables(out) == [[[1, 2, 5]], [[3, 4, 6]]] and slots(out) == [[8], [16]]
    assert batch.requests["b"].parked[1].tolist() == [[8], [9]]


# ---- random steps -----------------------------------------------------------------------------

@dataclass
class Held:
    """The reference's view of a request: its token list and one block table per group."""

    tokens: list[int]
    tables: list[list[int]]


def split(block_ids: list[int], groups: int) -> list[list[int]]:
    n = len(block_ids) // groups
    return [list(block_ids[g * n:(g + 1) * n]) for g in range(groups)]


def reference(held: dict[str, Held], order: list[tuple[str, int, int]], groups: int) -> dict:
    """Per group, token by token: ``slot = table[p // BS] * BS + p % BS`` with -1 read as 0."""
    out: dict = {"slots": [[] for _ in range(groups)], "tables": [], "seq_lens": []}
    for rid, c, n in order:
        for g in range(groups):
            table = [max(b, 0) for b in held[rid].tables[g]]
            out["slots"][g] += [table[p // BS] * BS + p % BS for p in range(c, c + n)]
        out["seq_lens"].append(c + n)
    width = max(len(held[rid].tables[0]) for rid, _, _ in order)
    out["tables"] = [[[max(b, 0) for b in held[rid].tables[g]]
                      + [0] * (width - len(held[rid].tables[g])) for rid, _, _ in order]
                     for g in range(groups)]
    return out


@dataclass
class SimRequest:
    request_id: str
    tokens: list[int]
    tables: list[list[int]] = field(default_factory=list)
    computed: int = 0
    sent: bool = False
    resumed: bool = False


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), groups=st.integers(2, 4), max_num_seqs=st.integers(1, 3),
       budget=st.integers(1, 10))
def test_random_steps_equal_reference(data, groups, max_num_seqs, budget):
    """Arrivals, chunked prefills, decodes, preemptions and aborts; every group's blocks drawn
    on their own, and blocks wholly before the scheduled tokens turned to -1 at random (a
    sliding group freeing what fell out of its window)."""
    max_model_len, num_kv_blocks = 20, 40
    batch = make_batch(groups, max_num_seqs, max_model_len, budget, num_kv_blocks)
    held: dict[str, Held] = {}
    sims: list[SimRequest] = []
    finished: list[str] = []
    block = st.integers(0, num_kv_blocks - 1)
    for step_id in range(data.draw(st.integers(1, 10), "steps")):
        if data.draw(st.booleans(), "arrive"):
            prompt = data.draw(st.lists(st.integers(3, V - 1), min_size=1, max_size=12))
            r = SimRequest(f"r{step_id}", prompt, [[] for _ in range(groups)])
            r.computed = BS * data.draw(st.integers(0, (len(prompt) - 1) // BS), "prefix hit")
            sims.append(r)
        for r in [r for r in sims if r.sent and data.draw(st.integers(0, 5)) == 0]:
            r.tables, r.computed, r.resumed = [[] for _ in range(groups)], 0, True
        for r in [r for r in sims if r.sent and data.draw(st.integers(0, 9)) == 0]:
            sims.remove(r)
            finished.append(r.request_id)
        new, cached, left = [], [], budget
        for r in data.draw(st.permutations(sims))[:max_num_seqs]:
            n = min(data.draw(st.integers(1, 6), "chunk"), len(r.tokens) - r.computed, left)
            if n < 1:
                continue
            left -= n
            num_blocks = -(-(r.computed + n) // BS)
            old = len(r.tables[0])
            added = [[data.draw(block) for _ in range(num_blocks - old)] for _ in range(groups)]
            for g in range(groups):
                r.tables[g] += added[g]
                for j in range(r.computed // BS):  # wholly before this chunk: may be freed
                    if data.draw(st.integers(0, 3)) == 0:
                        r.tables[g][j] = -1
                        event("-1")
            flat = [b for t in r.tables for b in t]
            if not r.sent:
                new.append(NewRequest(r.request_id, list(r.tokens), GREEDY, flat, r.computed, n))
            else:
                # (a freed entry of an already sent block stays as sent: the worker never reads
                # it, and only the scheduler's own table must say -1)
                diff = flat if r.resumed else [b for a in added for b in a]
                cached.append(CachedRequest(r.request_id, list(r.tokens) if r.resumed else [],
                                            diff, r.resumed, r.computed, n))
            r.sent, r.resumed, r.computed = True, False, r.computed + n
        s = StepInput(step_id, new, cached, finished)
        finished = []
        order = []
        for rid in s.finished_request_ids:
            held.pop(rid, None)
        for nr in s.new_requests:
            held[nr.request_id] = Held(list(nr.prompt_token_ids), split(nr.block_ids, groups))
            order.append((nr.request_id, nr.num_computed_tokens, nr.num_scheduled_tokens))
        for cr in s.cached_requests:
            h = held[cr.request_id]
            parts = split(cr.new_block_ids, groups)
            if cr.resumed_from_preemption:
                h.tokens, h.tables = list(cr.new_token_ids), parts
            else:
                h.tables = [t + p for t, p in zip(h.tables, parts, strict=True)]
            order.append((cr.request_id, cr.num_computed_tokens, cr.num_scheduled_tokens))
        scheduled = batch.update(s)
        if order:
            prepared = batch.prepare(scheduled)
            ref = reference(held, order, groups)
            assert len(prepared.attn_metadata) == groups
            check_shared(prepared)
            assert slots(prepared) == ref["slots"]
            assert tables(prepared) == ref["tables"]
            assert prepared.attn_metadata[0].seq_lens.tolist() == ref["seq_lens"]
            for rid, c, n in order:  # the sampled ones: the scheduler's tokens grow
                r = next(r for r in sims if r.request_id == rid)
                if c + n == len(r.tokens):
                    tok = data.draw(st.integers(3, V - 1), "sampled")
                    r.tokens.append(tok)
                    held[rid].tokens.append(tok)
            batch.append_sampled(prepared.sampled_rows,
                                 [held[rid].tokens[-1] for rid in prepared.sampled_request_ids])
        for r in [r for r in sims if len(r.tokens) >= max_model_len]:
            sims.remove(r)
            finished.append(r.request_id)
        assert not batch.block_table[:, batch.free_rows].any()
