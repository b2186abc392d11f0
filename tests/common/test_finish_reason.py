"""FinishReason is api.proto's enum: the same members and numbers, OpenAI's strings."""

from __future__ import annotations

from services.common.finish_reason import FinishReason
from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2


def test_members_are_the_protos_values():
    proto = {name.removeprefix("FINISH_REASON_"): value
             for name, value in api_pb2.FinishReason.items() if value}
    assert {m.name: m.value for m in FinishReason} == proto
    assert [str(m) for m in FinishReason] == ["stop", "length", "abort"]


def test_engine_protocol_carries_the_public_enum():
    field = engine_pb2.RequestOutput.DESCRIPTOR.fields_by_name["finish_reason"]
    assert field.enum_type is api_pb2.FinishReason.DESCRIPTOR
    out = engine_pb2.RequestOutput(finish_reason=FinishReason.LENGTH)
    assert FinishReason(out.finish_reason) is FinishReason.LENGTH
    assert api_pb2.GenerateResponse(finish_reason=out.finish_reason).finish_reason == (
        api_pb2.FINISH_REASON_LENGTH)
