"""The step types (services/common/step.py) and worker.proto agree field for field, and the one
codec (services/common/step_wire.py) round-trips every step and result."""

from __future__ import annotations

from dataclasses import fields, replace

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import worker_pb2
from services.common.sampling_params import EngineSamplingParams
from services.common.step import (
    CachedRequest,
    KVTransfer,
    Logprobs,
    NewRequest,
    SampledLogprobs,
    StepInput,
    StepOutput,
)
from services.common.step_wire import (
    step_from_pb,
    step_output_from_pb,
    step_output_to_pb,
    step_to_pb,
)


def _proto_fields(message) -> set[str]:
    return set(message.DESCRIPTOR.fields_by_name)


def _names(cls) -> list[str]:
    return [f.name for f in fields(cls)]


def test_new_request_is_the_message_field_for_field():
    assert set(_names(NewRequest)) == _proto_fields(worker_pb2.NewRequest)


def test_a_new_requests_adapter_round_trips_and_none_stays_unset():
    r = NewRequest("a", [1, 2], EngineSamplingParams(), [0], 0, 2, LoRARequest(7, "sql", "/x"))
    msg = step_to_pb(StepInput(1, [r], [], []))
    assert msg.new_requests[0].lora.lora_id == 7
    assert step_from_pb(msg).new_requests[0].lora == LoRARequest(7, "sql", "/x")
    r.lora = None
    msg = step_to_pb(StepInput(1, [r], [], []))
    assert not msg.new_requests[0].HasField("lora")
    assert step_from_pb(msg).new_requests[0].lora is None


def test_cached_request_is_one_row_of_the_columns():
    """Per-request scalars are one column each (the id as ``request_ids``); a list field is its
    flat column plus a ``num_`` count column."""
    columns = set()
    for f in fields(CachedRequest):
        if f.name == "request_id":
            columns.add("request_ids")
        elif str(f.type).startswith("list"):
            columns |= {f.name, f"num_{f.name}"}
        else:
            columns.add(f.name)
    assert columns == _proto_fields(worker_pb2.CachedRequests)


def test_the_step_is_the_step_request_field_for_field():
    names = set(_names(StepInput)) - {"blocks_to_copy", "kv_stores", "kv_loads"} | {
        "copy_src_block_ids", "copy_dst_block_ids", "traced_request_ids"} | {
        f"kv_{kind}_{column}" for kind in ("store", "load")
        for column in ("block_ids", "groups", "keys")}
    assert names == _proto_fields(worker_pb2.StepRequest)


def test_the_output_is_the_step_result_field_for_field():
    """The nested logprobs are the result's columns: SampledLogprobs' by name, and each
    Logprobs field as a ``prompt_`` column (plus the token and top-pair counts)."""
    prompt = {f"prompt_{n}" for n in _names(Logprobs)} - {
        "prompt_request_id", "prompt_start", "prompt_prompt_logprobs"}
    names = (set(_names(StepOutput)) - {"logprobs", "prompt_logprobs", "draft_token_ids"}
             | set(_names(SampledLogprobs))
             | prompt | {"prompt_request_ids", "prompt_first_positions", "prompt_logprobs",
                         "prompt_num_tokens", "prompt_num_top"}
             | {"draft_token_ids", "num_draft_token_ids"})
    assert names == _proto_fields(worker_pb2.StepResult)


ids = st.lists(st.integers(-1, 2**31 - 1), max_size=6)
params = st.builds(EngineSamplingParams, temperature=st.sampled_from([0.0, 0.5]),
                   seed=st.none() | st.integers(0, 2**63), beam_width=st.integers(0, 3),
                   reasoning_end_token_id=st.none() | st.integers(0, 2**31 - 1))
loras = st.none() | st.builds(LoRARequest, st.integers(1, 2**31 - 1), st.text(max_size=4),
                              st.text(max_size=8))
new_requests = st.builds(NewRequest, st.text(max_size=4), ids, params, ids,
                         st.integers(0, 99), st.integers(0, 99), loras)
cached_requests = st.builds(CachedRequest, st.text(max_size=4), ids, ids, st.booleans(),
                            st.integers(0, 99), st.integers(0, 99), st.integers(-1, 9), ids,
                            st.booleans())
transfers = st.builds(KVTransfer, st.integers(0, 2**31 - 1), st.integers(0, 5),
                      st.binary(min_size=16, max_size=16))
steps = st.builds(StepInput, st.integers(0, 2**62), st.lists(new_requests, max_size=3),
                  st.lists(cached_requests, max_size=4),
                  st.lists(st.text(max_size=4), unique=True, max_size=3),
                  st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), max_size=3),
                  st.integers(0, 5), st.lists(transfers, max_size=3),
                  st.lists(transfers, max_size=3),
                  st.dictionaries(st.text(max_size=4), st.text(max_size=55), max_size=2))


@settings(max_examples=200, deadline=None)
@given(steps)
def test_a_step_round_trips_and_a_sampling_rank_gets_only_the_tokens_it_cannot_know(step):
    step.finished_request_ids = sorted(step.finished_request_ids)  # (the wire's order)
    assert step_from_pb(step_to_pb(step)) == step
    assert step.for_rank(samples=False) is step
    assert step.for_rank(samples=True) == replace(step, cached_requests=[
        c if c.resumed_from_preemption or c.beam else replace(c, new_token_ids=[])
        for c in step.cached_requests])


@st.composite
def outputs(draw) -> StepOutput:
    n = draw(st.integers(0, 4))
    counts = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    tokens = draw(st.lists(st.integers(0, 99), min_size=sum(counts), max_size=sum(counts)))
    logprobs = None
    if tokens and draw(st.booleans()):  # (the worker sends none for no token)
        ks = draw(st.lists(st.integers(-1, 3), min_size=len(tokens), max_size=len(tokens)))
        asking = [k for k in ks if k >= 0]
        floats = st.floats(-9, 0, width=32)  # (the wire's float)
        logprobs = SampledLogprobs(
            ks, draw(st.lists(floats, min_size=len(asking), max_size=len(asking))),
            draw(st.lists(st.integers(0, 99), min_size=sum(asking), max_size=sum(asking))),
            draw(st.lists(floats, min_size=sum(asking), max_size=sum(asking))))
    prompt = []
    for i in range(draw(st.integers(0, 2))):
        m, k = draw(st.integers(1, 3)), draw(st.integers(0, 2))
        prompt.append(Logprobs(f"p{i}", draw(st.integers(1, 50)), [-1.0] * m,
                               list(range(m * k)), [-2.0] * (m * k)))
    drafts = draw(st.none() | st.lists(ids.map(lambda t: [abs(x) for x in t]), min_size=n,
                                       max_size=n))
    failed = draw(st.lists(st.text(max_size=4), max_size=2))
    broken = draw(st.lists(st.sampled_from([f"r{i}" for i in range(n)]), max_size=2,
                           unique=True)) if n else []
    return StepOutput(draw(st.integers(0, 99)), [f"r{i}" for i in range(n)], tokens, logprobs,
                      prompt, counts if any(c != 1 for c in counts) else None,
                      drafts if drafts and any(drafts) else None,
                      failed_request_ids=failed,
                      failed_messages=[f"LoRA adapter {rid!r}: gone" for rid in failed],
                      kv_loads_done=draw(ids), kv_loads_failed=draw(ids),
                      broken_request_ids=broken,
                      broken_messages=[f"structured output (regex) cannot be honoured: {rid}"
                                       for rid in broken])


@settings(max_examples=200, deadline=None)
@given(outputs())
def test_an_output_round_trips(out):
    assert step_output_from_pb(step_output_to_pb(out)) == out


def test_a_pooling_result_round_trips_and_is_checked():
    out = StepOutput(7, ["a", "b"], [], embeddings=[[0.5, -1.0, 2.0], [0.25, 0.0, 1.0]])
    assert step_output_from_pb(step_output_to_pb(out)) == out
    bad = step_output_to_pb(out)
    bad.embeddings.append(1.0)  # 7 floats for 2 requests
    with pytest.raises(ValueError, match="embeddings"):
        step_output_from_pb(bad)


def test_failed_requests_round_trip_beside_embeddings_and_are_checked():
    out = StepOutput(3, ["a"], [], embeddings=[[1.0]], failed_request_ids=["b"],
                     failed_messages=["LoRA adapter 'x' (/x): no such adapter folder"])
    assert step_output_from_pb(step_output_to_pb(out)) == out
    bad = step_output_to_pb(out)
    bad.failed_messages.append("an error without its request")
    with pytest.raises(ValueError, match="malformed failed request columns: 1 ids, 2 messages"):
        step_output_from_pb(bad)


def test_broken_request_columns_are_checked():
    out = step_output_to_pb(StepOutput(4, ["a"], [7], broken_request_ids=["a"],
                                       broken_messages=["structured output (json_schema) ..."]))
    out.broken_request_ids.append("b")
    with pytest.raises(ValueError, match="malformed broken request columns: 2 ids, 1 messages"):
        step_output_from_pb(out)


def test_malformed_sampled_and_draft_columns_are_refused():
    for bad in (worker_pb2.StepResult(request_ids=["a"], sampled_token_ids=[1, 2],
                                      num_sampled_token_ids=[1]),
                worker_pb2.StepResult(request_ids=["a"], sampled_token_ids=[1],
                                      num_draft_token_ids=[3], draft_token_ids=[1])):
        with pytest.raises(ValueError, match="malformed"):
            step_output_from_pb(bad)


def test_tracing_columns_of_two_lengths_are_refused():
    step = StepInput(1, [], [], [], traceparents={"a": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    assert step_from_pb(step_to_pb(step)).traceparents == step.traceparents
    bad = step_to_pb(step)
    bad.traceparents.append("x")
    with pytest.raises(ValueError, match="traced_request_ids"):
        step_from_pb(bad)


def test_kv_tier_columns_of_two_lengths_are_refused():
    bad = step_to_pb(StepInput(1, [], [], [], kv_loads=[KVTransfer(3, 0, bytes(16))]))
    bad.kv_load_groups.append(1)
    with pytest.raises(ValueError, match="kv_load"):
        step_from_pb(bad)
