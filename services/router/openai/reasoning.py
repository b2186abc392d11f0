"""A reasoning model's ``<think>…</think>`` span, split from the rest of its output.

The router's ``--reasoning-parser`` (vLLM's flag and names) says how a model writes its
reasoning; chat responses then carry the span as ``reasoning_content`` / ``reasoning`` and
the rest as ``content`` (``openai.responses``). Public interface, also for other response
shapes (e.g. the Responses API's reasoning items):

- ``split(text, thinking=True) -> (reasoning | None, content)``: a whole output.
- ``ReasoningSplitter(thinking)``: the same split incrementally, ``feed(delta, tokens) ->
  (reasoning_delta, content_delta)`` then ``flush()`` at the end; any chunking of a text gives
  the same two strings as ``split`` (tested), and a tag is never cut: a possible prefix of
  ``<think>`` / ``</think>`` at the end of a delta is held back until the next one. Its
  ``reasoning_tokens`` is the one count both chat's
  ``completion_tokens_details.reasoning_tokens`` and the Responses API's
  ``output_tokens_details.reasoning_tokens`` report: every token of a message that arrives
  while the span is open, the one that closes it included.
- ``starts_in_reasoning(parser, chat_template_kwargs, prompt_ends_reasoning)``: whether the
  output of a request begins inside the span (``thinking``).
- ``constrain_after(options, ids, constrained)``: with structured outputs, the token after
  which the grammar applies, and the split that goes with it.

The rules (vLLM's ``deepseek_r1`` / ``qwen3`` parsers): the output begins inside the span,
whether or not the model writes ``<think>`` itself (a template may have put it in the prompt);
the span ends at the first ``</think>``, which belongs to neither part; ``<think>`` tags before
it are dropped; without a ``</think>`` the whole output is reasoning (e.g. cut by max_tokens).
The output begins outside the span, and is all content, when the prompt already closed it
(its last tag is ``</think>``, e.g. Qwen3's template with ``enable_thinking: false`` writes
``<think>\\n\\n</think>``), and with ``qwen3`` when the request's ``chat_template_kwargs`` has
``enable_thinking: false``.

Structured outputs (a grammar: ``response_format``, ``structured_outputs``, a forced tool
call) apply after the reasoning, as vLLM's: a request that begins inside the span is sent
with ``EngineSamplingParams.reasoning_end_token_id`` = the ``</think>`` id, and the worker
enforces the grammar from the token after it
(``services/worker/sample/structured_output_masks.py``).
When ``</think>`` is not a token of its own (``tag_ids`` None) there is no token to wait for:
the grammar applies from the first token and the output is all content (thinking off for
the split), so a constrained answer is never filed as reasoning.

NOTE: where vLLM differs: its whole-output split drops any text before a ``<think>`` and, for
qwen3 with thinking off, still splits at a ``</think>`` the model writes; here text before a
``<think>`` stays reasoning and thinking-off output is all content, so that a streamed
response always equals the whole one. Qwen3.5's implicit end of reasoning at an XML
``<tool_call><function=…>`` is not implemented (no parser here reads that tool format).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")  # router --reasoning-parser choices


def _held(text: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a tag."""
    for k in range(min(len(text), len(END) - 1), 0, -1):
        tail = text[-k:]
        if END.startswith(tail) or START.startswith(tail):
            return k
    return 0


class ReasoningSplitter:
    """One choice's output, as it streams, split into reasoning and content.

    Args:
        thinking: the output begins inside the reasoning span (see ``starts_in_reasoning``);
            False: everything is content and ``reasoning`` stays None.

    Attributes:
        in_reasoning: the span is still open (no ``</think>`` seen yet).
        reasoning_tokens: the tokens of the messages fed while the span was open, the message
            that closes it included (a message holding several tokens counts whole).
    """

    def __init__(self, thinking: bool = True):
        self.thinking = thinking
        self.in_reasoning = thinking
        self.reasoning_tokens = 0
        self._buf = ""  # held back: a possible prefix of a tag

    def feed(self, text: str, tokens: int = 0) -> tuple[str, str]:
        """``(reasoning, content)`` to send for the next piece of output text; either may be
        empty (e.g. while a possible tag is held back).

        Args:
            text: the message's text.
            tokens: the message's token count, added to ``reasoning_tokens`` when the span is
                open as it arrives.
        """
        if self.in_reasoning:
            self.reasoning_tokens += tokens
        if not self.in_reasoning:
            return "", text
        buf = self._buf + text
        end = buf.find(END)
        if end >= 0:
            self._buf, self.in_reasoning = "", False
            return buf[:end].replace(START, ""), buf[end + len(END):]
        cut = len(buf) - _held(buf)
        self._buf = buf[cut:]
        return buf[:cut].replace(START, ""), ""

    def flush(self) -> tuple[str, str]:
        """``(reasoning, content)`` held back, at the end of the output (a tag's prefix that
        never completed is reasoning text)."""
        held, self._buf = self._buf, ""
        return held, ""


def split(text: str, thinking: bool = True) -> tuple[str | None, str]:
    """A whole output as ``(reasoning, content)``; reasoning is None when ``thinking`` is False
    (the output is all content), else a string, empty when the span was.

    E.g. ``split("<think>a</think>b") == split("a</think>b") == ("a", "b")``,
    ``split("a") == ("a", "")``, ``split("a", thinking=False) == (None, "a")``.
    """
    if not thinking:
        return None, text
    splitter = ReasoningSplitter()
    reasoning, content = splitter.feed(text)
    rest_reasoning, rest_content = splitter.flush()
    return reasoning + rest_reasoning, content + rest_content


def tag_ids(tokenizer) -> tuple[int, int] | None:
    """The token ids of ``<think>`` and ``</think>`` when both are tokens of their own (added
    tokens, as in Qwen3's and DeepSeek-R1's tokenizers), else None."""
    added = tokenizer.get_added_vocab()
    if START in added and END in added:
        return added[START], added[END]
    return None


def prompt_ends_reasoning(prompt_token_ids: Sequence[int], ids: tuple[int, int] | None) -> bool:
    """The prompt's last reasoning tag is ``</think>`` (``ids`` from ``tag_ids``; None: no
    tag tokens, False)."""
    if ids is None:
        return False
    start, end = ids
    for token in reversed(prompt_token_ids):
        if token == end:
            return True
        if token == start:
            return False
    return False


def starts_in_reasoning(parser: str, chat_template_kwargs: Mapping,
                        prompt_ends: bool = False) -> bool:
    """Whether a request's output begins inside the reasoning span.

    Args:
        parser: one of ``PARSERS``.
        chat_template_kwargs: the request's (``enable_thinking: false`` turns qwen3's off).
        prompt_ends: ``prompt_ends_reasoning`` of the prompt.
    """
    if prompt_ends:
        return False
    return not (parser == "qwen3" and chat_template_kwargs.get("enable_thinking") is False)


def constrain_after(options: ReasoningOptions, ids: tuple[int, int] | None,
                    constrained: bool) -> tuple[ReasoningOptions, int | None]:
    """How a request with a grammar (``constrained``) is split and gated.

    Returns:
        ``(options, end)``: ``end`` is the ``</think>`` token id after which the engine
        enforces the grammar (``EngineSamplingParams.reasoning_end_token_id``), or None (no
        grammar, output begins outside the span, or no tag tokens in ``ids``: the grammar
        applies from the first token; in the last case ``options`` turn thinking off, so the
        constrained output is content).
    """
    if not (constrained and options.thinking):
        return options, None
    if ids is None:
        return ReasoningOptions(False, options.include), None
    return options, ids[1]


@dataclass(frozen=True, slots=True)
class ReasoningOptions:
    """How a chat request's choices are split (``openai.responses.ResponseBuilder``).

    Attributes:
        thinking: the output begins inside the span (``starts_in_reasoning``).
        include: return the span (``include_reasoning``); False drops it.
    """

    thinking: bool
    include: bool = True

    def splitter(self) -> ReasoningSplitter:
        """A splitter for one choice."""
        return ReasoningSplitter(self.thinking)
