"""An Anthropic message built from the router's ``GenerateResponse`` stream (one choice), as
stream events and as the whole answer: a whole answer is the same machine with its events
dropped, so streamed and whole answers agree however the text was split.

Content blocks, in the order the text produced them: ``thinking`` (what the router's
``--reasoning-parser`` splitter took out of the text: ``openai.reasoning``), ``text``, and
``tool_use`` (``id`` ``toolu_...``, ``name``, ``input``) for each tool call the chat tool-call
parser (``openai.tool_calls``: hermes for ``auto``, the grammar's JSON for ``any`` / ``tool``)
read out of the content.

Stream events: ``message_start`` (the message, no content, ``usage.input_tokens``), ``ping``;
per block ``content_block_start``, its ``content_block_delta``\\ s (``text_delta``,
``thinking_delta``, or ``input_json_delta``: the tool input's JSON text in pieces),
``content_block_stop``; last ``message_delta`` (``stop_reason``, ``stop_sequence``,
``usage.output_tokens``) and ``message_stop``.

``stop_reason``: ``max_tokens`` when the choice ended by length; else ``tool_use`` when it
made a call; else ``stop_sequence`` (with the string) when a stop string ended it; else
``end_turn`` (EOS, a stop token, or an abort). ``usage.input_tokens`` is the whole prompt
(cached tokens included, as vLLM's).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from services.common.finish_reason import FinishReason
from services.common.pb.pagedserve.v1 import api_pb2
from services.router.anthropic import models as m
from services.router.anthropic.errors import AnthropicError
from services.router.openai.responses_api import ReasoningSplit


def new_message_id() -> str:
    """A new message id, ``msg_`` and 32 hex digits."""
    return f"msg_{uuid.uuid4().hex}"


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex}"


def _dump(event: BaseModel) -> dict:
    return event.model_dump(mode="json")


class MessageEvents:
    """The stream events and the final message of one request.

    Args:
        model: the served model's name.
        input_tokens: the rendered prompt's tokens.
        tool_calls: factory of the chat tool-call parser (``ParsedRequest.tool_calls``), or
            None when the text is the content.
        message_id: the message's id (default: a new ``msg_...``).
        split: factory of the reasoning splitter (``openai.responses_api.ReasoningSplit``),
            or None: all text is content.
    """

    def __init__(self, model: str, input_tokens: int,
                 tool_calls: Callable[[], Any] | None = None, message_id: str | None = None,
                 split: Callable[[], ReasoningSplit] | None = None):
        self.id = message_id or new_message_id()
        self.model, self.input_tokens = model, input_tokens
        self._tools = tool_calls() if tool_calls is not None else None
        self._split = split() if split is not None else None
        # {"type": "text", "text"}, {"type": "thinking", "thinking"}, or a tool_use's
        # {"type", "id", "name", "json"} (its input as JSON text)
        self.blocks: list[dict] = []
        self._open = False  # the last block is still being written
        self.stop_reason: m.StopReason | None = None
        self.stop_sequence: str | None = None
        self.output_tokens = 0

    # ---- whole message ------------------------------------------------------------------
    def message(self) -> dict:
        """The Message: its content so far; after the final message, its stop reason and
        usage."""
        return _dump(self._message(self.blocks))

    def _message(self, blocks: list[dict]) -> m.Message:
        return m.Message(id=self.id, model=self.model, content=[_block(b) for b in blocks],
                         stop_reason=self.stop_reason, stop_sequence=self.stop_sequence,
                         usage=m.Usage(input_tokens=self.input_tokens,
                                       output_tokens=self.output_tokens))

    # ---- events -------------------------------------------------------------------------
    def start(self) -> list[dict]:
        """``message_start`` (no content yet) and ``ping``."""
        return [_dump(m.MessageStart(message=self._message([]))), _dump(m.Ping())]

    def feed(self, r: api_pb2.GenerateResponse) -> list[dict]:
        """The events of one message of the choice; the final one (``finish_reason`` set)
        also closes the open block and ends with ``message_delta`` and ``message_stop``."""
        events: list[dict] = []
        reasoning, content = (self._split.feed(r.text, len(r.token_ids)) if self._split
                              else ("", r.text))
        if r.finish_reason and self._split is not None:
            rest = self._split.flush()
            reasoning, content = reasoning + rest[0], content + rest[1]
        events += self._text(reasoning, "thinking")
        if self._tools is None:
            events += self._text(content)
        else:
            delta = self._tools.feed(content)
            if r.finish_reason:
                end = self._tools.finish()
                delta = {"content": delta.get("content", "") + end.get("content", ""),
                         "tool_calls": delta.get("tool_calls", []) + end.get("tool_calls", [])}
            events += self._text(delta.get("content", ""))
            for call in delta.get("tool_calls", ()):
                events += self._call(call)
        if r.finish_reason:
            events += self._close()
            self._finish(r)
            events.append(_dump(m.MessageDelta(
                delta=m.MessageDeltaBody(stop_reason=self.stop_reason,
                                         stop_sequence=self.stop_sequence),
                usage=m.DeltaUsage(output_tokens=self.output_tokens))))
            events.append(_dump(m.MessageStop()))
        return events

    @staticmethod
    def error(e: AnthropicError) -> dict:
        """The ``error`` event of an error after the stream started."""
        return e.body()

    def _finish(self, r: api_pb2.GenerateResponse) -> None:
        self.output_tokens = r.usage.completion_tokens
        if FinishReason(r.finish_reason) == FinishReason.LENGTH:
            self.stop_reason = "max_tokens"
        elif any(b["type"] == "tool_use" for b in self.blocks):
            self.stop_reason = "tool_use"
        elif r.stop_reason:
            self.stop_reason, self.stop_sequence = "stop_sequence", r.stop_reason
        else:
            self.stop_reason = "end_turn"

    # ---- blocks -------------------------------------------------------------------------
    def _text(self, text: str, kind: str = "text") -> list[dict]:
        """More of a ``kind`` ("text" or "thinking") block: the open one, or a new one."""
        if not text:
            return []
        events = []
        if not (self._open and self.blocks[-1]["type"] == kind):
            events += self._close()
            events += self._add({"type": kind, kind: ""})
        self.blocks[-1][kind] += text
        delta = m.TextDelta(text=text) if kind == "text" else m.ThinkingDelta(thinking=text)
        events.append(_dump(m.ContentBlockDelta(index=len(self.blocks) - 1, delta=delta)))
        return events

    def _call(self, call: dict) -> list[dict]:
        """A chat tool-call delta: a new call (it has an ``id``) or more of the open call's
        arguments."""
        events = []
        arguments = call["function"].get("arguments", "")
        if "id" in call:
            events += self._close()
            events += self._add({"type": "tool_use", "id": _tool_id(),
                                 "name": call["function"]["name"], "json": ""})
        self.blocks[-1]["json"] += arguments
        if arguments:
            events.append(_dump(m.ContentBlockDelta(
                index=len(self.blocks) - 1, delta=m.InputJsonDelta(partial_json=arguments))))
        return events

    def _add(self, block: dict) -> list[dict]:
        shown = _block(block) if block["type"] != "tool_use" else m.ToolUseBlock(
            id=block["id"], name=block["name"], input={})
        self.blocks.append(block)
        self._open = True
        return [_dump(m.ContentBlockStart(index=len(self.blocks) - 1, content_block=shown))]

    def _close(self) -> list[dict]:
        if not self._open:
            return []
        self._open = False
        return [_dump(m.ContentBlockStop(index=len(self.blocks) - 1))]


def _block(block: dict) -> m.TextBlock | m.ThinkingBlock | m.ToolUseBlock:
    """A block as the answer shows it: a tool_use's input parsed (``{}`` when its JSON is not
    an object: cut short by max_tokens)."""
    if block["type"] == "text":
        return m.TextBlock(text=block["text"])
    if block["type"] == "thinking":
        return m.ThinkingBlock(thinking=block["thinking"])
    try:
        value = json.loads(block["json"]) if block["json"] else {}
    except (ValueError, RecursionError):
        value = None
    return m.ToolUseBlock(id=block["id"], name=block["name"],
                          input=value if isinstance(value, dict) else {})
