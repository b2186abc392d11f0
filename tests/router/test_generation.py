"""The router's fan-out of n choices (``stream_responses``) against a scripted fake engine.

The fake records every submit, abort and release and replays a fixed list of RequestOutputs, so
these tests pin the exact protocol: child ids and seeds, a stop string ending one choice only,
usage per choice, and that a failure or a cancel aborts every choice still running.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.choices import child_params, child_request_id
from services.router.generation import EngineError, PreparedRequest, prepare, stream_responses
from services.router.validation import TextOptions
from tests.router import smollm2_tokenizer

RID = "req"
PROMPT = [1, 2, 3, 4, 5]
STOP = api_pb2.FINISH_REASON_STOP
LENGTH = api_pb2.FINISH_REASON_LENGTH
ABORT = api_pb2.FINISH_REASON_ABORT


class FakeEngine:
    """Records the calls ``stream_responses`` makes; replays ``outputs`` on the shared queue."""

    def __init__(self, outputs: list[engine_pb2.RequestOutput], running: tuple[str, ...] = ()):
        self.outputs = outputs
        self.running = set(running)  # ids of other callers' requests
        self.submitted: dict[str, tuple[EngineSamplingParams, int]] = {}
        self.parents: dict[str, str] = {}  # request id -> parent_request_id it was sent with
        self.loras: dict[str, LoRARequest | None] = {}  # request id -> its adapter
        self.aborted: list[str] = []
        self.released: list[str] = []

    def submit(self, request_id, prompt_token_ids, params, *, priority=0, queue=None,
               parent_request_id="", lora=None):
        assert list(prompt_token_ids) == PROMPT and queue is not None
        if not self.submitted:
            for out in self.outputs:
                queue.put_nowait(out)
        self.submitted[request_id] = (params, priority)
        self.parents[request_id] = parent_request_id
        self.loras[request_id] = lora
        return queue

    def is_running(self, request_id):
        return request_id in self.running

    def abort(self, request_id):
        self.aborted.append(request_id)

    def release(self, request_id):
        self.released.append(request_id)


def out(rid, ids=(), finish=0, cached=0, error=0, message=""):
    return engine_pb2.RequestOutput(request_id=rid, new_token_ids=list(ids), finish_reason=finish,
                                    num_cached_tokens=cached, error_code=error,
                                    error_message=message)


def prepared(n=1, seed=None, stop=(), priority=0) -> PreparedRequest:
    params = EngineSamplingParams(temperature=1.0, top_p=1.0, top_k=-1, seed=seed)
    return PreparedRequest(RID, PROMPT, params, TextOptions(stop=tuple(stop)), n=n,
                           priority=priority)


def ids_of(text: str) -> list[int]:
    return smollm2_tokenizer()(text, add_special_tokens=False)["input_ids"]


async def collect(engine, req, stop_after=None) -> list[api_pb2.GenerateResponse]:
    """Run the generator; with ``stop_after`` close it after that many messages (a cancel)."""
    gen = stream_responses(engine, smollm2_tokenizer(), req)
    got = []
    try:
        async for msg in gen:
            got.append(msg)
            if stop_after is not None and len(got) == stop_after:
                break
    finally:
        await gen.aclose()
    return got


def by_index(msgs):
    text, ids, finals = {}, {}, {}
    for m in msgs:
        text[m.index] = text.get(m.index, "") + m.text
        ids.setdefault(m.index, []).extend(m.token_ids)
        if m.finish_reason:
            assert m.index not in finals, "a choice sent two final messages"
            finals[m.index] = m
    return text, ids, finals


def test_child_ids_and_seeds():
    assert child_request_id(RID, 0, 1) == RID
    assert [child_request_id(RID, i, 3) for i in range(3)] == ["0_req", "1_req", "2_req"]
    base = EngineSamplingParams(temperature=0.7, seed=2**64 - 2, max_tokens=9)
    seeds = [child_params(base, i).seed for i in range(4)]
    assert seeds == [2**64 - 2, 2**64 - 1, 0, 1]  # (seed + i) mod 2**64
    assert child_params(base, 3).max_tokens == 9 and base.seed == 2**64 - 2  # a copy
    assert child_params(base, 0) is base
    unseeded = EngineSamplingParams(temperature=0.7)
    assert child_params(unseeded, 2).seed is None


def test_n1_keeps_the_request_id_and_reports_cached_tokens():
    hello = ids_of("Hello world")
    engine = FakeEngine([out(RID, hello[:1], cached=4), out(RID, hello[1:], LENGTH, cached=4)])
    msgs = asyncio.run(collect(engine, prepared(n=1, seed=7, priority=2)))
    assert list(engine.submitted) == [RID] and engine.parents == {RID: ""}
    params, priority = engine.submitted[RID]
    assert params.seed == 7 and priority == 2
    text, ids, finals = by_index(msgs)
    assert text == {0: "Hello world"} and ids == {0: hello}
    usage = finals[0].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.num_cached_tokens) == (
        len(PROMPT), len(hello), 4)
    assert all(m.request_id == RID and m.index == 0 for m in msgs)
    assert engine.aborted == []


def test_every_choice_is_submitted_with_the_requests_adapter():
    lora = LoRARequest(3, "sql", "/adapters/sql")
    a, b = ids_of(" one"), ids_of(" two")
    engine = FakeEngine([out("0_req", a, LENGTH), out("1_req", b, LENGTH)])
    req = prepared(n=2)
    req.lora = lora
    asyncio.run(collect(engine, req))
    assert engine.loras == {"0_req": lora, "1_req": lora}
    engine = FakeEngine([out(RID, a, LENGTH)])
    asyncio.run(collect(engine, prepared()))
    assert engine.loras == {RID: None}


def test_n_choices_are_submitted_with_their_seeds_and_merged():
    a, b, c = ids_of(" one two"), ids_of(" three"), ids_of(" four five six")
    outputs = [out("0_req", a[:1]), out("2_req", c[:1]), out("1_req", b, STOP, cached=16),
               out("0_req", a[1:], LENGTH), out("2_req", c[1:], LENGTH)]
    engine = FakeEngine(outputs)
    msgs = asyncio.run(collect(engine, prepared(n=3, seed=10, priority=-1)))
    assert {rid: (p.seed, prio) for rid, (p, prio) in engine.submitted.items()} == {
        "0_req": (10, -1), "1_req": (11, -1), "2_req": (12, -1)}
    assert engine.parents == {"0_req": RID, "1_req": RID, "2_req": RID}
    text, ids, finals = by_index(msgs)
    assert text == {0: " one two", 1: " three", 2: " four five six"}
    assert ids == {0: a, 1: b, 2: c}
    assert {i: f.usage.completion_tokens for i, f in finals.items()} == {0: len(a), 1: len(b),
                                                                      2: len(c)}
    assert finals[1].usage.num_cached_tokens == 16 and finals[0].usage.num_cached_tokens == 0
    assert msgs[-1].index == 2 and msgs[-1].finish_reason == api_pb2.FINISH_REASON_LENGTH
    assert engine.aborted == []  # every choice finished in the engine


def test_stop_string_ends_one_choice_only():
    a, b = ids_of(" red green blue"), ids_of(" cat STOP dog")
    outputs = [out("0_req", a[:1]), out("1_req", b[:2]), out("1_req", b[2:3]),
               out("0_req", a[1:2]),
               out("1_req", finish=ABORT),  # the engine's answer to the router's abort
               out("0_req", a[2:], LENGTH)]
    engine = FakeEngine(outputs)
    msgs = asyncio.run(collect(engine, prepared(n=2, stop=["STOP"])))
    text, _, finals = by_index(msgs)
    assert text == {0: " red green blue", 1: " cat "}
    assert finals[1].finish_reason == api_pb2.FINISH_REASON_STOP
    assert finals[1].stop_reason == "STOP" and finals[1].usage.completion_tokens == 3
    assert finals[0].finish_reason == api_pb2.FINISH_REASON_LENGTH
    assert engine.aborted == ["1_req"] and engine.released == ["1_req"]


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
def test_an_engine_error_on_one_choice_aborts_the_others(code):
    outputs = [out("0_req", [5]), out("1_req", [6], LENGTH),
               out("2_req", finish=ABORT, error=code.value[0], message="queue is full")]
    engine = FakeEngine(outputs)
    with pytest.raises(EngineError) as err:
        asyncio.run(collect(engine, prepared(n=4)))
    assert err.value.code == code and err.value.message == "queue is full"
    # 1 finished, 2 failed in the engine: only 0 and 3 are still running there
    assert sorted(engine.aborted) == sorted(engine.released) == ["0_req", "3_req"]


def test_cancel_aborts_every_running_choice():
    outputs = [out("0_req", ids_of(" a")), out("1_req", ids_of(" b"), LENGTH),
               out("2_req", ids_of(" c"))]
    engine = FakeEngine(outputs)
    msgs = asyncio.run(collect(engine, prepared(n=3), stop_after=1))
    assert len(msgs) == 1
    assert sorted(engine.aborted) == sorted(engine.released) == ["0_req", "1_req", "2_req"]
    engine = FakeEngine(outputs)
    msgs = asyncio.run(collect(engine, prepared(n=3), stop_after=2))
    assert msgs[1].finish_reason and sorted(engine.aborted) == ["0_req", "2_req"]


def test_a_running_child_id_is_refused_before_anything_is_submitted():
    engine = FakeEngine([], running=("2_req", "3_req"))
    with pytest.raises(EngineError) as err:
        asyncio.run(collect(engine, prepared(n=4)))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == "request_id 'req' is already running (engine request '2_req')"
    # nothing of ours was submitted, and the other caller's requests were left alone
    assert engine.submitted == {} and engine.aborted == [] and engine.released == []


def test_a_slow_caller_is_cut_off_at_the_buffer_bound_and_its_choices_aborted():
    # 2 choices, 9 outputs arrive before the caller reads anything: past 4 buffered outputs
    # the call fails with RESOURCE_EXHAUSTED, both engine requests are aborted at once (not
    # when the caller reads), and the buffered outputs are dropped.
    outputs = [out(f"{i % 2}_req", [7 + i]) for i in range(9)]
    engine = FakeEngine(outputs)
    errors = []

    async def run():
        gen = stream_responses(engine, smollm2_tokenizer(), prepared(n=2), max_pending=4,
                               on_overflow=errors.append)
        try:
            with pytest.raises(EngineError) as err:
                async for _ in gen:
                    pass
        finally:
            await gen.aclose()
        return err.value

    e = asyncio.run(run())
    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "reads too slowly" in e.message
    assert len(errors) == 1 and errors[0].code == e.code
    # overflowed while choice 0's outputs were queued: choice 1 was never submitted (its abort
    # is a no-op for a real engine, which does not know the id)
    assert list(engine.submitted) == ["0_req"]
    assert engine.aborted[0] == engine.released[0] == "0_req"


def test_output_queue_bound_keeps_final_outputs():
    from services.router.generation import OutputQueue

    calls = []
    q = OutputQueue(2, lambda: calls.append(1))
    q.put_nowait(out(RID, [1]))
    q.put_nowait(out(RID, [2]))
    q.put_nowait(out(RID, finish=LENGTH))  # a final output is accepted past the bound
    assert q.qsize() == 3 and not q.overflowed and calls == []
    q2 = OutputQueue(2, lambda: calls.append(1))
    for i in range(5):
        q2.put_nowait(out(RID, [i]))
    assert q2.overflowed and calls == [1]
    assert q2.qsize() == 1 and q2.get_nowait() is OutputQueue.OVERFLOW  # the rest dropped


def test_a_stop_string_inside_several_tokens_at_once_cuts_them_there():
    # speculative decoding: one output carries accepted drafts and the token after them; the
    # token completing the stop string ends the choice as if the tokens had come one by one
    ids = ids_of(" cat STOP dog bird")
    cut = len(ids_of(" cat STOP"))
    one_by_one = [out(RID, [t]) for t in ids[:cut]]
    for outputs in ([out(RID, ids)], one_by_one):
        msgs = asyncio.run(collect(FakeEngine([*outputs, out(RID, finish=ABORT)]),
                                   prepared(stop=["STOP"])))
        text, got, finals = by_index(msgs)
        assert text == {0: " cat "} and got[0] == ids[:cut]
        assert finals[0].stop_reason == "STOP" and finals[0].usage.completion_tokens == cut
    msgs = asyncio.run(collect(FakeEngine([out(RID, ids, LENGTH)]), prepared()))
    assert by_index(msgs)[1][0] == ids  # no stop strings: all of them


def test_a_stop_token_id_finish_names_the_token():
    # the engine stops on a stop_token_ids entry: the final message says which (vLLM's integer
    # stop_reason); an EOS (not in TextOptions.stop_token_ids), a length finish or a stop
    # string leaves it unset
    def final(outputs, stop_ids=(), stop=()):
        req = prepared(stop=stop)
        req.text = TextOptions(stop=tuple(stop), stop_token_ids=frozenset(stop_ids))
        return by_index(asyncio.run(collect(FakeEngine(outputs), req)))[2][0]
    ids = ids_of(" cat dog")
    f = final([out(RID, ids[:1]), out(RID, ids[1:], STOP)], stop_ids={ids[-1], 7})
    assert f.HasField("stop_token_id") and f.stop_token_id == ids[-1] and f.stop_reason == ""
    f = final([out(RID, ids), out(RID, finish=STOP)], stop_ids={ids[-1]})  # (a last empty one)
    assert f.stop_token_id == ids[-1]
    for outputs, stop_ids in (([out(RID, ids, STOP)], {7}), ([out(RID, ids, LENGTH)], {ids[-1]}),
                              ([out(RID, ids, ABORT)], {ids[-1]})):
        assert not final(outputs, stop_ids).HasField("stop_token_id")
    f = final([out(RID, ids_of(" cat STOP dog")), out(RID, finish=ABORT)],
              stop_ids=set(ids_of(" dog")), stop=["STOP"])
    assert f.stop_reason == "STOP" and not f.HasField("stop_token_id")


@pytest.mark.parametrize("ignore_eos, want", [(False, {5}), (True, {5, 2})])
def test_prepare_reports_stop_token_ids_but_the_eos(ignore_eos, want):
    # vLLM checks EOS before stop_token_ids: a stop on EOS has no stop_reason unless ignore_eos
    info = engine_pb2.GetEngineInfoResponse(model="smol", max_model_len=256,
                                            vocab_size=49152, eos_token_ids=[2])
    request = api_pb2.GenerateRequest(prompt_token_ids=api_pb2.TokenIds(ids=PROMPT),
                                      sampling_params=api_pb2.SamplingParams(
                                          stop_token_ids=[5, 2], ignore_eos=ignore_eos))
    assert prepare(request, smollm2_tokenizer(), info).text.stop_token_ids == want
