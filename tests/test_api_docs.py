"""docs/api.md documents every RPC, message, field and enum value of the public api.proto (a
field added to the proto without a row in its message's table fails here)."""

from __future__ import annotations

import re
from pathlib import Path

from services.common.pb.pagedserve.v1 import api_pb2

DOC = Path(__file__).resolve().parent.parent / "docs/api.md"


def _sections() -> dict[str, str]:
    """``## Title`` → the text under it (a title's first word: "FinishReason (enum)" → key
    "FinishReason")."""
    parts = re.split(r"^## (.+)$", DOC.read_text(), flags=re.M)
    return {title.split()[0]: body for title, body in zip(parts[1::2], parts[2::2])}


def _rows(body: str) -> set[str]:
    """The first cells of a section's table rows (without backticks)."""
    return {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", body, flags=re.M)}


def test_every_rpc_is_documented():
    rpcs = {m.name for m in api_pb2.DESCRIPTOR.services_by_name["GenerationService"].methods}
    assert rpcs - _rows(_sections()["RPCs"]) == set()


def test_every_message_and_field_is_documented():
    sections = _sections()
    missing = []
    for name, message in api_pb2.DESCRIPTOR.message_types_by_name.items():
        if name not in sections:
            missing.append(f"## {name}")
            continue
        missing += [f"{name}.{f.name}" for f in message.fields
                    if f.name not in _rows(sections[name])]
    assert missing == [], f"docs/api.md lacks: {missing}"


def test_every_enum_value_is_documented():
    sections = _sections()
    for name, enum in api_pb2.DESCRIPTOR.enum_types_by_name.items():
        assert {v.name for v in enum.values} - _rows(sections[name]) == set(), name
