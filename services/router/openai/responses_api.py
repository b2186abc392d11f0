"""OpenAI Responses API answers (POST /v1/responses) built from one chat choice's messages.

One ``ResponseEvents`` per request turns the router's ``GenerateResponse`` stream into the
Responses stream events, and its final ``Response`` object is the whole (non-streamed) answer:
a whole answer is the same machine with its events dropped, so streamed and whole answers
agree however the text was split.

Output items, in the order the text produced them:

- ``{"type": "reasoning", "id": "rs_...", "summary": [], "content": [{"type":
  "reasoning_text", "text"}], "status"}``: what the reasoning splitter (``split``) took out of
  the text;
- ``{"type": "message", "id": "msg_...", "role": "assistant", "status", "content":
  [{"type": "output_text", "text", "annotations": []}]}``: the content;
- ``{"type": "function_call", "id": "fc_...", "call_id", "name", "arguments", "status"}``: each
  tool call the chat tool-call parser (``openai.tool_calls``) read out of the content.

Every item's ``status`` is ``in_progress`` while it is written, then ``completed``, or
``incomplete`` for the last one of a length finish.

Stream events (``sequence_number`` counts from 0): ``response.created``,
``response.in_progress``; per item ``response.output_item.added``, then its parts
(``response.content_part.added`` / ``.done`` around ``response.output_text.delta`` /
``.done`` or ``response.reasoning_text.delta`` / ``.done``; a call's
``response.function_call_arguments.delta`` / ``.done``), then
``response.output_item.done``; last ``response.completed``, or ``response.incomplete``
(``incomplete_details.reason: "max_output_tokens"``) when the choice ended by length.

Reasoning: ``split`` makes a per-request splitter with ``feed(text) -> (reasoning,
content)`` and ``flush() -> (reasoning, content)`` (the held-back rest): the router's
``--reasoning-parser`` (``openai.reasoning.ReasoningSplitter``); None: all text is content.
``output_tokens_details.reasoning_tokens`` is the splitter's ``reasoning_tokens``, chat's rule
(``openai.reasoning``): every token of a message that arrives while the span is open, the one
that closes it included.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from services.common.finish_reason import FinishReason
from services.common.pb.pagedserve.v1 import api_pb2


class ReasoningSplit(Protocol):
    """Splits one choice's text, as it streams, into reasoning and content."""

    reasoning_tokens: int  # tokens of the messages fed while the span was open

    def feed(self, text: str, tokens: int = 0) -> tuple[str, str]:
        """The (reasoning, content) that ``text`` (``tokens`` tokens) adds (either may be
        held back)."""
        ...

    def flush(self) -> tuple[str, str]:
        """The (reasoning, content) still held back, at the end of the choice."""
        ...


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_response_id() -> str:
    """A new Response id, ``resp_`` and 32 hex digits."""
    return _new_id("resp")


class ResponseEvents:
    """The Responses stream events and final object of one request (one choice).

    Args:
        model: the served model's name.
        echo: the request fields the Response repeats (``ParsedResponses.echo``).
        tool_calls: factory of the tool-call parser (``ParsedRequest.tool_calls``), or None
            when the text is the content.
        split: factory of the reasoning splitter (``ReasoningSplit``), or None.
        response_id: the Response's id (default: a new ``resp_...``).
    """

    def __init__(self, model: str, echo: dict[str, Any],
                 tool_calls: Callable[[], Any] | None = None,
                 split: Callable[[], ReasoningSplit] | None = None,
                 response_id: str | None = None):
        self.id = response_id or new_response_id()
        self.created_at = int(time.time())  # seconds since the epoch
        self.model, self.echo = model, echo
        self._tools = tool_calls() if tool_calls is not None else None
        self._split = split() if split is not None else None
        self._seq = 0
        self.output: list[dict] = []  # items so far, finished or open
        self._open: dict | None = None  # the item being written (always the last of output)
        self._final: api_pb2.GenerateResponse | None = None

    # ---- whole response -----------------------------------------------------------------
    def response(self) -> dict:
        """The Response object: in progress until the final message was fed, then completed
        or incomplete with its usage."""
        final = self._final
        status = "in_progress" if final is None else (
            "incomplete" if self._length() else "completed")
        usage = None
        if final is not None:
            u = final.usage
            usage = {"input_tokens": u.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": u.num_cached_tokens,
                                              "cache_write_tokens": 0},
                     "output_tokens": u.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": (
                         self._split.reasoning_tokens if self._split is not None else 0)},
                     "total_tokens": u.prompt_tokens + u.completion_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": None,
                "incomplete_details": ({"reason": "max_output_tokens"}
                                       if status == "incomplete" else None),
                "model": self.model, "output": [dict(item) for item in self.output],
                "usage": usage, "background": False, "truncation": "disabled",
                "reasoning": None, **self.echo}

    # ---- events -------------------------------------------------------------------------
    def start(self) -> list[dict]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, r: api_pb2.GenerateResponse) -> list[dict]:
        """The events of one message of the choice; the final one (``finish_reason`` set) also
        closes every item and ends with ``response.completed`` / ``response.incomplete``."""
        events: list[dict] = []
        reasoning, content = (self._split.feed(r.text, len(r.token_ids)) if self._split
                              else ("", r.text))
        if r.finish_reason and self._split is not None:
            rest = self._split.flush()
            reasoning, content = reasoning + rest[0], content + rest[1]
        if reasoning:
            events += self._reasoning(reasoning)
        if self._tools is not None:
            delta = self._tools.feed(content)
            if r.finish_reason:
                end = self._tools.finish()
                delta = {"content": delta.get("content", "") + end.get("content", ""),
                         "tool_calls": delta.get("tool_calls", []) + end.get("tool_calls", [])}
            events += self._text(delta.get("content", ""))
            for call in delta.get("tool_calls", ()):
                events += self._call(call)
        else:
            events += self._text(content)
        if r.finish_reason:
            self._final = r
            events += self._close()
            kind = "response.incomplete" if self._length() else "response.completed"
            events.append(self._event(kind, response=self.response()))
        return events

    def error(self, message: str, code: str | None, param: str | None) -> dict:
        """The ``error`` event of an engine error after the stream started."""
        return self._event("error", code=code, message=message, param=param)

    # ---- items --------------------------------------------------------------------------
    def _reasoning(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close()
            events += self._add({"type": "reasoning", "id": _new_id("rs"), "summary": [],
                                 "content": [], "status": "in_progress"},
                                {"type": "reasoning_text", "text": ""})
        item = self._opened()
        item["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", **self._where(),
                                  content_index=0, delta=text))
        return events

    def _text(self, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._close()
            events += self._add({"type": "message", "id": _new_id("msg"), "status": "in_progress",
                                 "role": "assistant", "content": []},
                                {"type": "output_text", "text": "", "annotations": []})
        item = self._opened()
        item["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", **self._where(),
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, call: dict) -> list[dict]:
        """A chat tool-call delta: a new call (it has an ``id``) or more of the open call's
        arguments."""
        events = []
        arguments = call["function"].get("arguments", "")
        if "id" in call:
            events += self._close()
            events += self._add({"type": "function_call", "id": _new_id("fc"),
                                 "call_id": call["id"], "name": call["function"]["name"],
                                 "arguments": "", "status": "in_progress"}, None)
        item = self._opened()
        item["arguments"] += arguments
        if arguments:
            events.append(self._event("response.function_call_arguments.delta",
                                      **self._where(), delta=arguments))
        return events

    def _add(self, item: dict, part: dict | None) -> list[dict]:
        """Open ``item`` (and its one content part)."""
        shown = dict(item)  # as added: no part yet
        self.output.append(item)
        self._open = item
        events = [self._event("response.output_item.added", output_index=len(self.output) - 1,
                              item=shown)]
        if part is not None:
            item["content"] = [part]
            events.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part=dict(part)))
        return events

    def _close(self) -> list[dict]:
        """Finish the open item, if any: its ``.done`` events."""
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        item["status"] = "incomplete" if self._length() else "completed"
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **where,
                                      arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra: dict[str, Any] = {"logprobs": []} if kind == "output_text" else {}
            events.append(self._event(f"response.{kind}.done", **where, content_index=0,
                                      text=part["text"], **extra))
            events.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=dict(part)))
        events.append(self._event("response.output_item.done", **where, item=dict(item)))
        return events

    def _opened(self) -> dict:
        assert self._open is not None
        return self._open

    def _where(self) -> dict:
        return {"item_id": self._opened()["id"], "output_index": len(self.output) - 1}

    def _length(self) -> bool:
        return (self._final is not None
                and FinishReason(self._final.finish_reason) == FinishReason.LENGTH)

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event
