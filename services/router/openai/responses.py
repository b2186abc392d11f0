"""OpenAI response bodies built from the router's ``GenerateResponse`` stream.

The shapes follow OpenAI's API (as vLLM serves it): ``text_completion`` /
``chat.completion`` objects, ``chat.completion.chunk`` / ``text_completion`` stream chunks
(a completion with ``echo`` has the prompt before each choice's output),
``usage`` with ``prompt_tokens_details.cached_tokens``. Each choice also carries vLLM's extra
``stop_reason`` (the stop string that matched, or the stop_token_ids entry that ended the
choice as an integer, else null). ``logprobs`` is null unless the
request asked for them (see ``openai.logprobs``); a stream chunk then carries the logprobs of
the tokens of its message (a chunk is sent for tokens whose text is still held back, too).

Usage of an n > 1 request: ``prompt_tokens`` counted once, ``completion_tokens`` summed over
the choices, ``cached_tokens`` as reported for choice 0 (the other choices share its prompt
blocks, so theirs would count the sharing, not the client's cache hit).

vLLM's extras (``OutputOptions``): ``prompt_logprobs`` (a list per completion choice, one for
the whole chat response; not streamed), ``return_tokens_as_token_ids`` (logprob tokens spelled
``token_id:<id>``), ``stream_options.continuous_usage_stats`` (every chunk carries the usage so
far: the prompt, and the tokens of the chunk's choice, as vLLM counts them).

Chat with tools: each choice's text goes through its tool-call parser (``openai.tool_calls``),
streamed or whole alike: ``message`` / ``delta`` then carry ``tool_calls`` (content null when
only whitespace is left), and a choice that made calls ends with ``finish_reason:
"tool_calls"`` instead of "stop".

Chat with ``--reasoning-parser``: each choice's text is first split by its
``openai.reasoning.ReasoningSplitter``; the span goes to ``reasoning_content`` and
``reasoning`` (vLLM's old and new names, the same text; null when the output began outside
the span; both left out with ``include_reasoning: false``), the rest is the content, the only
part the tool-call parser reads; ``content`` is null when nothing follows the span.
``usage.completion_tokens_details.reasoning_tokens`` is the splitter's count
(``ReasoningSplitter.reasoning_tokens``, the Responses API's too): the tokens of every message
that arrived while the span was open, the one closing it included (one token per message while
streaming; a message holding several, e.g. a beam search's one message, counts whole).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from services.common.finish_reason import FinishReason
from services.common.pb.pagedserve.v1 import api_pb2
from services.router.openai.logprobs import LogprobsFormatter, merge
from services.router.openai.logprobs import prompt_logprobs as vllm_prompt_logprobs
from services.router.openai.reasoning import ReasoningOptions
from services.router.openai.tool_calls import join as join_deltas
from services.router.openai.tool_calls import merge as merge_deltas


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """What a request asked its response to carry besides the text.

    Attributes:
        logprobs: the top logprobs of each generated token (``logprobs`` objects; else null).
        prompt_logprobs: vLLM's ``prompt_logprobs`` with this many top tokens, or None.
        token_ids_as_tokens: vLLM's ``return_tokens_as_token_ids``.
        continuous_usage: (streaming) ``stream_options.continuous_usage_stats`` with
            ``include_usage``: every chunk carries the usage so far.
    """

    logprobs: bool = False
    prompt_logprobs: int | None = None
    token_ids_as_tokens: bool = False
    continuous_usage: bool = False


@dataclass(frozen=True, slots=True)
class Echo:
    """(completions) What ``echo`` puts before each choice's output.

    Attributes:
        text: the prompt's text (the client's string, or its token ids decoded).
        first_token_id: the prompt's first token, the one without a prompt logprob.
        top: top logprobs per prompt token (the request's ``logprobs``; the engine may have
            been asked for more, for ``prompt_logprobs``).
    """

    text: str
    first_token_id: int
    top: int | None = None


class ResponseBuilder:
    """Turns one request's GenerateResponses into OpenAI bodies, whole or as stream chunks.

    Args:
        chat: chat completion (True) or text completion (False).
        model: the served model's name, echoed in every body.
        n: number of choices.
        tokenizer: the model's tokenizer, to spell tokens in logprobs.
        echo: (completions) prepend the prompt to each choice: its text to the text of the
            choice's first message (whole or chunk), and with logprobs the prompt's logprobs
            (from that message's ``prompt_logprobs``) to its logprobs.
        tool_calls: (chat) makes one choice's tool-call parser (``openai.tool_calls``), or
            None: the text is content.
        reasoning: (chat with ``--reasoning-parser``) how to split the reasoning span out,
            or None: no reasoning fields.
        options: the logprobs and usage the request asked for.
        prompt_tokens: the prompt's length (for ``options.continuous_usage``).
    """

    def __init__(self, chat: bool, model: str, n: int, tokenizer=None,
                 echo: Echo | None = None, tool_calls=None,
                 reasoning: ReasoningOptions | None = None,
                 options: OutputOptions = OutputOptions(), prompt_tokens: int = 0):
        self.chat, self.model, self.n = chat, model, n
        self._echo = echo
        self._echo_pending = set(range(n)) if echo is not None else set()
        self._tokenizer, self._options, self._prompt_tokens = tokenizer, options, prompt_tokens
        self._num_tokens = [0] * n  # tokens so far per choice (continuous usage)
        self._prompt_logprobs: dict[int, list] = {}  # choice -> vLLM's prompt_logprobs
        # one tool-call parser per choice (openai.tool_calls), or None: the text is content
        self._tools = [tool_calls() for _ in range(n)] if tool_calls is not None else None
        self._reasoning = reasoning
        self._splitters = ([reasoning.splitter() for _ in range(n)]
                           if reasoning is not None else None)
        self._reasoning_texts: list[list[str]] = [[] for _ in range(n)]
        self._logprobs = ([LogprobsFormatter(tokenizer, chat, options.token_ids_as_tokens)
                           for _ in range(n)] if options.logprobs else None)
        self._logprob_parts: list[list[dict]] = [[] for _ in range(n)]
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())  # seconds since the epoch, as OpenAI
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._finals: dict[int, api_pb2.GenerateResponse] = {}

    # ---- whole response -----------------------------------------------------------------
    def add(self, r: api_pb2.GenerateResponse) -> None:
        """Record one streamed message (non-streaming mode)."""
        k = self._options.prompt_logprobs
        if k is not None and r.index not in self._prompt_logprobs:  # the choice's first message
            self._prompt_logprobs[r.index] = vllm_prompt_logprobs(self._tokenizer,
                                                                  r.prompt_logprobs, k)
        prefix, prompt_logprobs = self._echoed(r)
        reasoning, text = self._split(r)
        self._reasoning_texts[r.index].append(reasoning)
        self._texts[r.index].append(prefix + text)
        if prompt_logprobs is not None:
            self._logprob_parts[r.index].append(prompt_logprobs)
        if self._logprobs is not None:
            self._logprob_parts[r.index].append(self._logprobs[r.index].format(r.logprobs))
        if r.finish_reason:
            self._finals[r.index] = r

    def response(self) -> dict:
        """The whole ``chat.completion`` / ``text_completion`` object, after every message was
        ``add``ed."""
        choices = []
        for i in range(self.n):
            final = self._finals.get(i)
            text = "".join(self._texts[i])
            choice: dict[str, Any] = {"index": i}
            if self.chat:
                choice["message"] = self._message(i, (
                    {"role": "assistant", "content": text} if self._tools is None
                    else merge_deltas([self._tools[i].feed(text), self._tools[i].finish()])))
            else:
                choice["text"] = text
            choice |= self._ending(final, i)
            choice["logprobs"] = (merge(self._logprob_parts[i], self.chat)
                                  if self._logprobs is not None else None)
            if self._options.prompt_logprobs is not None and not self.chat:
                choice["prompt_logprobs"] = self._prompt_logprobs.get(i)
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": choices,
            "usage": self.usage()}
        if self._options.prompt_logprobs is not None and self.chat:  # one prompt: top level
            body["prompt_logprobs"] = self._prompt_logprobs.get(0)
        return body

    def usage(self) -> dict:
        """OpenAI's usage object over the choices that have finished."""
        finals = self._finals
        prompt = next((f.usage.prompt_tokens for f in finals.values()), 0)
        completion = sum(f.usage.completion_tokens for f in finals.values())
        cached = finals[0].usage.num_cached_tokens if 0 in finals else 0
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion,
                                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self._reasoning is not None:
            assert self._splitters is not None
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(self._splitters[i].reasoning_tokens for i in finals)}
        return usage

    def _split(self, r: api_pb2.GenerateResponse) -> tuple[str, str]:
        """``(reasoning, content)`` of message ``r``'s text (its choice's held-back rest too
        on its last message); counts its tokens as reasoning while the span is open.
        ``("", text)`` without a reasoning parser."""
        if self._splitters is None:
            return "", r.text
        splitter = self._splitters[r.index]
        reasoning, content = splitter.feed(r.text, len(r.token_ids))
        if r.finish_reason:
            rest_reasoning, rest_content = splitter.flush()
            reasoning, content = reasoning + rest_reasoning, content + rest_content
        return reasoning, content

    def _message(self, index: int, message: dict) -> dict:
        """(chat) A choice's whole message with its reasoning fields (see the module's
        docstring)."""
        if self._reasoning is None or self._splitters is None:
            return message
        if self._splitters[index].thinking and message["content"] == "":
            message["content"] = None
        if self._reasoning.include:
            text = ("".join(self._reasoning_texts[index]) or None
                    if self._splitters[index].thinking else None)
            message |= {"reasoning_content": text, "reasoning": text}
        return message

    # ---- stream chunks ------------------------------------------------------------------
    def role_chunks(self, include_usage: bool) -> list[dict]:
        """(chat only) The first chunk of each choice: ``delta: {role: assistant, content:
        ""}``, as OpenAI sends it."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}, include_usage, i)
                for i in range(self.n)]

    def chunk(self, r: api_pb2.GenerateResponse, include_usage: bool) -> dict | None:
        """The stream chunk for one message, or None when it shows nothing (no text, not
        final). A final message is also recorded for ``usage``."""
        prefix, prompt_logprobs = self._echoed(r)
        reasoning, content = self._split(r)  # (counts the tokens of a message without text)
        self._num_tokens[r.index] = (r.usage.completion_tokens if r.finish_reason
                                     else self._num_tokens[r.index] + len(r.token_ids))
        if r.finish_reason:
            self._finals[r.index] = r
        elif not (prefix or r.text or prompt_logprobs
                  or (self._logprobs is not None and r.logprobs)):
            return None
        choice: dict[str, Any] = {"index": r.index}
        if self.chat:
            if self._tools is not None:
                parser = self._tools[r.index]
                delta = parser.feed(content)
                delta = join_deltas(delta, parser.finish()) if r.finish_reason else delta
            else:
                delta = {"content": content} if content else {}
            if reasoning and self._reasoning is not None and self._reasoning.include:
                delta = {"reasoning_content": reasoning, "reasoning": reasoning, **delta}
            choice["delta"] = delta
            if not (delta or r.finish_reason or self._logprobs is not None):
                return None  # all held back (a possible tag or tool call)
        else:
            choice["text"] = prefix + r.text
        choice["logprobs"] = (self._logprobs[r.index].format(r.logprobs)
                              if self._logprobs is not None and r.logprobs else None)
        if prompt_logprobs is not None:  # the prompt's tokens first
            choice["logprobs"] = merge([prompt_logprobs] + ([choice["logprobs"]]
                                                            if choice["logprobs"] else []), False)
        choice |= self._ending(r if r.finish_reason else None, r.index)
        return self._chunk(choice, include_usage, r.index)

    def _echoed(self, r: api_pb2.GenerateResponse) -> tuple[str, dict | None]:
        """(echo) The prompt's text and logprobs object (None without logprobs) to put
        before ``r``, the first message of its choice; ``("", None)`` for any other."""
        if self._echo is None or r.index not in self._echo_pending:
            return "", None
        self._echo_pending.discard(r.index)
        logprobs = (self._logprobs[r.index].format_prompt(self._echo.first_token_id,
                                                          r.prompt_logprobs, self._echo.top)
                    if self._logprobs is not None else None)
        return self._echo.text, logprobs

    def usage_chunk(self) -> dict:
        """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
        body = self._chunk(None, False)
        body["choices"] = []
        body["usage"] = self.usage()
        return body

    def _chunk(self, choice: dict | None, include_usage: bool, index: int = 0) -> dict:
        body: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.model,
            "choices": [choice] if choice is not None else []}
        if include_usage and choice is not None and self._options.continuous_usage:
            # vLLM's continuous usage: the prompt and the tokens of this chunk's choice so far
            done = self._num_tokens[index]
            body["usage"] = {"prompt_tokens": self._prompt_tokens, "completion_tokens": done,
                             "total_tokens": self._prompt_tokens + done}
        elif include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def _ending(self, final: api_pb2.GenerateResponse | None, index: int) -> dict:
        if final is None:
            return {"finish_reason": None, "stop_reason": None}
        reason = str(FinishReason(final.finish_reason))
        if reason == "stop" and self._tools is not None and self._tools[index].called:
            reason = "tool_calls"  # the choice ended after making tool calls
        stop_reason: str | int | None = final.stop_reason or None
        if final.HasField("stop_token_id"):
            stop_reason = final.stop_token_id
        return {"finish_reason": reason, "stop_reason": stop_reason}
