"""Unit-level fuzzing (no stack) of the router's request checks: any SamplingParams, any JSON body.

``validate_sampling`` / ``validate_n`` either accept or raise ``RequestError`` INVALID_ARGUMENT
naming the field; ``parse_completion`` / ``parse_chat`` either return a request or raise
``OpenAIError`` 400 — never another exception (which would be a 500 / UNKNOWN). The stack-level
fuzzing is ``tests/stack/test_fuzz.py``.
"""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.pb.pagedserve.v1 import api_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.openai.errors import OpenAIError
from services.router.openai.requests import parse_chat, parse_completion
from services.router.validation import RequestError, validate_n, validate_sampling
from services.worker.step_checks import check_sampling
from tests.stack.test_fuzz import JSON_VALUES, OPENAI_KEYS, SAMPLING, TYPED_VALUES, _sampling_pb

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VOCAB = 49152


@FUZZ
@given(fields=SAMPLING)
def test_validate_sampling_accepts_or_names_the_field(fields):
    params = _sampling_pb(fields)
    try:
        engine, _ = validate_sampling(params, vocab_size=VOCAB)
        validate_n(params)
    except RequestError as e:
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT
        assert any(e.message.startswith(name) for name in api_pb2.SamplingParams.DESCRIPTOR
                   .fields_by_name), e.message
        return
    # accepted: every float the engine gets is finite and in range
    assert engine.temperature >= 0 and 0 < engine.top_p <= 1 and 0 <= engine.min_p <= 1
    assert engine.repetition_penalty > 0
    assert -1 <= engine.top_k < VOCAB
    # ... it crosses the wire unchanged, and the worker's guard lets it through
    assert EngineSamplingParams.from_pb(engine.to_pb()) == engine
    check_sampling(engine, VOCAB)


@FUZZ
@given(chat=st.booleans(),
       body=st.one_of(JSON_VALUES,
                      st.fixed_dictionaries({}, optional=TYPED_VALUES),
                      st.dictionaries(st.sampled_from(OPENAI_KEYS), JSON_VALUES, max_size=6)))
def test_openai_parsing_accepts_or_is_a_400(chat, body):
    if not isinstance(body, dict):
        return  # openai.http answers 400 before parsing
    try:
        (parse_chat if chat else parse_completion)(body)
    except OpenAIError as e:
        assert e.status == 400, e.message
        assert e.param is not None, e.message
