"""The sampling parameters survive router -> scheduler -> worker encoding."""

from __future__ import annotations

from services.common.pb.pagedserve.v1 import engine_pb2
from services.scheduler.engine import params_from_pb
from services.scheduler.request import EngineSamplingParams
from services.scheduler.worker_client import _sampling_pb


def test_defaults_decode_to_off():
    p = params_from_pb(engine_pb2.EngineSamplingParams(temperature=1.0))
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            p.min_tokens) == (0.0, 1.0, 0.0, 0.0, 0)  # repetition_penalty 0 on the wire = off


def test_penalties_and_min_tokens_pass_through():
    wire = engine_pb2.EngineSamplingParams(
        temperature=0.5, top_p=0.9, top_k=7, seed=3, max_tokens=20, stop_token_ids=[4, 5],
        ignore_eos=True, min_p=0.25, repetition_penalty=1.5, presence_penalty=-0.5,
        frequency_penalty=0.75, min_tokens=6)
    p = params_from_pb(wire)
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            p.min_tokens, p.stop_token_ids, p.ignore_eos) == (0.25, 1.5, -0.5, 0.75, 6, [4, 5],
                                                              True)
    w = _sampling_pb(p)
    assert (w.min_p, w.repetition_penalty, w.presence_penalty, w.frequency_penalty,
            w.min_tokens, list(w.stop_token_ids), w.ignore_eos, w.seed) == (
        0.25, 1.5, -0.5, 0.75, 6, [4, 5], True, 3)


def test_stop_ids_go_to_the_worker_only_with_min_tokens():
    w = _sampling_pb(EngineSamplingParams(stop_token_ids=[4], ignore_eos=True))
    assert list(w.stop_token_ids) == [] and not w.ignore_eos and w.min_tokens == 0
