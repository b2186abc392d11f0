"""Why a request ended: the one finish-reason enum, api.proto's ``FinishReason``.

engine.proto's ``RequestOutput.finish_reason`` is that same proto enum, so a reason goes from
the scheduler to the client unchanged. ``FinishReason`` is it as a Python enum: its values are
the proto's numbers (a member goes into a message as it is, and a message's value converts back
with ``FinishReason(value)``), and ``str()`` is OpenAI's / vLLM's ``finish_reason`` string.
"""

from __future__ import annotations

import enum
from typing import cast

from services.common.pb.pagedserve.v1 import api_pb2


class FinishReason(enum.IntEnum):
    """Why a request ended (0, FINISH_REASON_UNSPECIFIED, is "not yet" and has no member)."""

    STOP = api_pb2.FINISH_REASON_STOP  # EOS, a stop token id or a stop string
    LENGTH = api_pb2.FINISH_REASON_LENGTH  # max_tokens or max_model_len reached
    ABORT = api_pb2.FINISH_REASON_ABORT  # aborted: by the client, a stop string, or a fault

    def __str__(self) -> str:
        """``"stop"``, ``"length"`` or ``"abort"``."""
        return self.name.lower()

    @property
    def pb(self) -> api_pb2.FinishReason:
        """This reason for a message field: itself (the same number), typed as the generated
        stubs type the field."""
        return cast(api_pb2.FinishReason, self)
