"""Tool calls read out of a chat choice's generated text, incrementally (OpenAI's shapes).

One parser per choice turns the text, as it streams, into OpenAI chat deltas: ``{"content":
str}`` and/or ``{"tool_calls": [{"index", "id", "type": "function", "function": {"name",
"arguments"}}, ...]}``. A whole (non-streamed) response feeds its text through the same parser
and ``merge``s the deltas, so streaming and non-streaming give the same final message however
the text is split.

- ``HermesParser`` (``tool_choice: "auto"`` with ``--tool-call-parser hermes``): the model
  writes each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes /
  Qwen2.5 format; whitespace around the JSON allowed). Text outside the calls is content,
  streamed until a ``<tool_call>`` may be starting (a possible prefix of it is held back); a
  call is sent as one delta once it closes (or at the end, if it is still open then). A block
  whose body is not such a JSON object stays content, as written.
- ``NamedParser`` (a named ``tool_choice``): the whole text is the arguments of one call of that
  function (the grammar made it the function's parameters object); streamed as fragments.
- ``RequiredParser`` (``tool_choice: "required"``): the text is a JSON array of ``{"name",
  "parameters"}`` objects (vLLM's form, enforced by the grammar); each call is sent once its
  object is complete. Text that does not parse so (e.g. cut by max_tokens) is content.

Content is null when only whitespace surrounds the calls: whitespace is held back until other
content arrives, and dropped at the end if calls were made. ``called`` tells the response to
report ``finish_reason: "tool_calls"`` (auto and required; a named call keeps "stop", as OpenAI).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

START, END = "<tool_call>", "</tool_call>"


def call_id() -> str:
    """A fresh tool-call id, ``chatcmpl-tool-<32 hex digits>`` (vLLM's form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class _Parser:
    """The shared part: numbering the calls, holding whitespace-only content back."""

    def __init__(self):
        self.called = False  # any tool call was sent
        self._num_calls = 0
        self._content_started = False  # non-whitespace content was sent
        self._held_space = ""

    def feed(self, text: str) -> dict:
        """The delta for the next piece of text (``{}`` when nothing can be shown yet)."""
        raise NotImplementedError

    def finish(self) -> dict:
        """The delta that flushes what is held back, at the choice's end."""
        raise NotImplementedError

    def _call(self, name: str, arguments: str) -> dict:
        self.called = True
        self._num_calls += 1
        return {"index": self._num_calls - 1, "id": call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def _content(self, text: str) -> str:
        """``text`` as content to send now: whitespace waits until other content comes."""
        if self._content_started:
            return text
        self._held_space += text
        if self._held_space.isspace() or not self._held_space:
            return ""
        self._content_started = True
        text, self._held_space = self._held_space, ""
        return text

    def _flush_content(self) -> str:
        """At the end: held whitespace is content only if no call was made."""
        text, self._held_space = self._held_space, ""
        return "" if self.called else text


def _delta(content: str = "", calls: list[dict] | None = None) -> dict:
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta


def join(a: dict, b: dict) -> dict:
    """Two consecutive deltas as one."""
    return _delta(a.get("content", "") + b.get("content", ""),
                  a.get("tool_calls", []) + b.get("tool_calls", []))


def merge(deltas: list[dict]) -> dict:
    """The whole assistant message of a choice's deltas: ``{"role": "assistant", "content":
    str | None, "tool_calls"?: [...]}``; a call's argument fragments are concatenated; content
    is null when calls were made and there is no other text."""
    content = ""
    calls: dict[int, dict] = {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", ()):
            if call["index"] in calls:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            else:
                calls[call["index"]] = {"id": call["id"], "type": "function",
                                        "function": dict(call["function"])}
    message: dict[str, Any] = {"role": "assistant", "content": content or
                               (None if calls else "")}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def _hermes_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments as JSON text)`` of a ``<tool_call>`` body, or None when it is not
    ``{"name": str, "arguments": object}``."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
            and isinstance(call.get("arguments"), dict)):
        return None
    return call["name"], json.dumps(call["arguments"], ensure_ascii=False)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesParser(_Parser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in free text.

    Args:
        one: keep only the first call (``parallel_tool_calls: false``, as vLLM): later valid
            call blocks are dropped, neither calls nor content.
    """

    def __init__(self, one: bool = False):
        super().__init__()
        self._one = one
        self._buf = ""  # text not yet sent: a possible START prefix, or an open call's body
        self._in_call = False

    def feed(self, text: str) -> dict:
        self._buf += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buf.find(END)
                if end < 0:
                    break
                body, self._buf = self._buf[:end], self._buf[end + len(END):]
                self._in_call = False
                call = _hermes_call(body)
                if call is None:
                    content += self._content(START + body + END)
                elif not (self._one and self.called):
                    calls.append(self._call(*call))
                continue
            start = self._buf.find(START)
            if start < 0:
                keep = _held_prefix(self._buf, START)
                cut = len(self._buf) - keep
                content += self._content(self._buf[:cut])
                self._buf = self._buf[cut:]
                break
            content += self._content(self._buf[:start])
            self._buf = self._buf[start + len(START):]
            self._in_call = True
        return _delta(content, calls)

    def finish(self) -> dict:
        rest, self._buf = self._buf, ""
        if self._in_call:  # a call the model did not close (e.g. it ended with EOS)
            self._in_call = False
            call = _hermes_call(rest)
            if call is not None:
                calls = [] if self._one and self.called else [self._call(*call)]
                return _delta(self._flush_content(), calls)
            rest = START + rest
        content = self._content(rest)
        return _delta(content + self._flush_content())


class NamedParser(_Parser):
    """The whole text is the arguments of one call of ``name``."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self._started = False

    def feed(self, text: str) -> dict:
        # NOTE: not self._call: ``called`` stays False, as OpenAI ends a forced function
        # call with "stop"
        if not self._started:
            self._started = True
            return _delta(calls=[{"index": 0, "id": call_id(), "type": "function",
                                  "function": {"name": self.name, "arguments": text}}])
        return _delta(calls=[{"index": 0, "function": {"arguments": text}}]) if text else {}

    def finish(self) -> dict:
        return {} if self._started else self.feed("")


class RequiredParser(_Parser):
    """A JSON array of ``{"name": str, "parameters": object}``, one call each."""

    def __init__(self):
        super().__init__()
        self._buf = ""
        self._pos = 0  # where the next unparsed element starts in _buf
        self._state = "open"  # open -> item -> sep -> (item | done); bad: the rest is text
        self._raw_from = 0  # a failure sends _buf[_raw_from:] as content

    def feed(self, text: str) -> dict:
        self._buf += text
        if self._state == "bad":
            return _delta(self._content(text))
        calls = []
        while self._state != "bad":
            pos = len(self._buf) - len(self._buf[self._pos:].lstrip())
            if pos == len(self._buf):
                break
            char = self._buf[pos]
            if self._state == "open" and char == "[":
                self._state, self._pos = "item", pos + 1
            elif self._state == "item" and char == "{":
                if "}" not in text:  # an object ends with "}": it cannot be complete yet
                    break
                try:
                    value, end = json.JSONDecoder().raw_decode(self._buf, pos)
                except (ValueError, RecursionError):
                    break  # not complete yet (a real error shows at the end)
                if not (isinstance(value, dict) and isinstance(value.get("name"), str)
                        and isinstance(value.get("parameters"), dict)):
                    self._state = "bad"
                    break
                calls.append(self._call(value["name"], json.dumps(value["parameters"],
                                                                  ensure_ascii=False)))
                self._state, self._pos, self._raw_from = "sep", end, end
            elif self._state == "sep" and char in ",]":
                self._state = "item" if char == "," else "done"
                self._pos = self._raw_from = pos + 1
            else:
                self._state = "bad"
        if self._state == "bad":
            return _delta(self._content(self._buf[self._raw_from:]), calls)
        return _delta(calls=calls)

    def finish(self) -> dict:
        content = ""
        if self._state not in ("bad", "done"):  # unfinished: cut short, or not an array
            self._state = "bad"
            content = self._content(self._buf[self._raw_from:])
        return _delta(content + self._flush_content())
