"""A worker rank without LoRA support (GetWorkerInfoResponse.max_loras 0) refuses a step whose
new request names an adapter, naming it, rather than running it as the base model."""

from __future__ import annotations

import pytest

from services.common.lora import LoRARequest
from services.common.sampling_params import EngineSamplingParams
from services.common.step import NewRequest, StepInput
from services.common.step_wire import step_to_pb
from services.worker.server import step_input_from_pb


def _step(lora):
    return step_to_pb(StepInput(1, [NewRequest("r1", [1, 2], EngineSamplingParams(), [0], 0, 2,
                                               lora)], [], []))


def test_a_rank_without_lora_refuses_an_adapter_and_takes_base_requests():
    with pytest.raises(ValueError, match="new request 'r1' names LoRA adapter 'sql' but this "
                                         "worker runs no LoRA adapters"):
        step_input_from_pb(_step(LoRARequest(1, "sql", "/a/sql")), vocab_size=10)
    assert step_input_from_pb(_step(None), vocab_size=10).new_requests[0].lora is None


def test_a_rank_with_lora_slots_takes_the_adapter():
    step = step_input_from_pb(_step(LoRARequest(1, "sql", "/a/sql")), vocab_size=10,
                              max_loras=2)
    assert step.new_requests[0].lora == LoRARequest(1, "sql", "/a/sql")
