"""POST /v1/completions beyond one prompt and one pass: a batch of prompts, ``best_of``,
``echo`` (OpenAI's legacy completions, as vLLM serves them).

- Batch: each prompt of ``ParsedCompletion.requests`` is its own prepared request (engine
  request ids ``f"{request_id}-{p}"`` for prompt p, vLLM's form), all validated before any is
  submitted. Their streams run side by side and merge into one; choice ``i`` of prompt ``p``
  has OpenAI's ``index = p * n + i``. Usage is summed over the prompts (prompt tokens and
  cached tokens per prompt, completion tokens per choice). If one prompt fails, the others are
  aborted (their generators are closed, which aborts their engine requests).
- best_of > n (not streamed): ``best_of`` candidates per prompt run in the engine (as n
  choices would, seeds ``seed + i``); the n with the highest cumulative logprob of their
  tokens (raw logprobs, of every token counted in the candidate's completion_tokens, also
  the one that completed a stop string) are returned, best first; ties keep candidate order.
  ``usage.completion_tokens`` counts every candidate (OpenAI bills them).
- echo: see ``openai.responses.Echo``. With ``max_tokens: 0`` (``score_only``) the engine
  still generates one token (it always generates at least one); its text, logprobs and count
  are dropped and the choice ends with finish_reason "length".

A ``CompletionCall`` offers ``ResponseBuilder``'s interface (``add``, ``response``,
``role_chunks``, ``chunk``, ``usage_chunk``), so ``openai.http`` drives both the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.router.generation import PreparedRequest, prepare, stream_responses
from services.router.openai.requests import ParsedCompletion
from services.router.openai.responses import Echo, ResponseBuilder
from services.router.replicas import ReplicaSet
from services.router.validation import MAX_LOGPROBS, RequestError


@dataclass(slots=True)
class _Prompt:
    """One prompt of the call: its prepared request and its shaping."""

    prepared: PreparedRequest
    builder: ResponseBuilder


class CompletionCall:
    """One /v1/completions request: its prompts prepared, run in the engine, and shaped.

    Build it with ``prepare`` (validates and tokenizes every prompt, submits nothing).

    Attributes:
        parsed: the parsed body.
    """

    def __init__(self, parsed: ParsedCompletion, prompts: list[_Prompt]):
        self.parsed = parsed
        self._prompts = prompts
        for p in prompts:  # one response: one creation time (and one id, below)
            p.builder.created = prompts[0].builder.created
        self.id = prompts[0].builder.id
        # candidate (global index) -> cumulative logprob of its tokens (best_of's ranking)
        self._scores: dict[int, float] = {}

    @classmethod
    def prepare(cls, parsed: ParsedCompletion, request_id: str, tokenizer,
                info: engine_pb2.GetEngineInfoResponse,
                max_logprobs: int = MAX_LOGPROBS, lora: LoRARequest | None = None
                ) -> CompletionCall:
        """Validate and tokenize every prompt (``generation.prepare``); nothing is submitted.

        Args:
            request_id: the call's id; prompt p of a batch runs as ``f"{request_id}-{p}"``.
            max_logprobs: the router's --max-logprobs.
            lora: the LoRA adapter the request's model named, or None.

        Raises:
            RequestError: INVALID_ARGUMENT from validation; an error about the prompt itself
                of a batch is prefixed with ``prompt[p]: ``.
        """
        batch = len(parsed.requests) > 1
        prompts = []
        for p, request in enumerate(parsed.requests):
            request.request_id = request_id
            try:
                prepared = prepare(request, tokenizer, info, max_logprobs=max_logprobs,
                                   lora=lora)
            except RequestError as e:
                if batch and e.param == "prompt":
                    raise RequestError(e.code, f"prompt[{p}]: {e.message}", e.param) from None
                raise
            if batch:
                prepared.request_id = f"{request_id}-{p}"
            prepared.n = parsed.best_of
            echo = None
            if parsed.echo:
                ids = prepared.prompt_token_ids
                text = (request.prompt if request.WhichOneof("input") == "prompt"
                        else tokenizer.decode(ids))
                echo = Echo(text, ids[0], parsed.logprobs)
            builder = ResponseBuilder(False, info.model, parsed.best_of, tokenizer, echo,
                                      options=parsed.options,
                                      prompt_tokens=len(prepared.prompt_token_ids))
            prompts.append(_Prompt(prepared, builder))
        return cls(parsed, prompts)

    @property
    def id(self) -> str:
        """The response's id (``cmpl-...``), the same in every prompt's choices and chunks."""
        return self._prompts[0].builder.id

    @id.setter
    def id(self, value: str) -> None:
        for p in self._prompts:
            p.builder.id = value

    @property
    def prepared(self) -> list[PreparedRequest]:
        """The prompts' prepared requests, in order."""
        return [p.prepared for p in self._prompts]

    # ---- running ------------------------------------------------------------------------
    async def responses(self, engine: ReplicaSet, tokenizer, *, max_pending: int
                        ) -> AsyncGenerator[api_pb2.GenerateResponse, None]:
        """Async generator of every prompt's GenerateResponses, merged in arrival order, each
        with ``index`` = the candidate's global index ``p * best_of + i``.

        Closing it (or an error of one prompt) closes every prompt's ``stream_responses``
        generator, which aborts their engine requests.

        Raises:
            EngineError: as ``generation.stream_responses``, from the first prompt that fails.
        """
        gens = [stream_responses(engine, tokenizer, p.prepared, max_pending=max_pending)
                for p in self._prompts]
        if len(gens) == 1:
            async with contextlib.aclosing(gens[0]) as responses:
                async for r in responses:
                    yield self._engine_message(0, r)
            return
        # NOTE: maxsize 1: a prompt's pump waits while the client does not read, so its
        # stream_responses keeps its own bound (--max-stream-buffer) on what is buffered.
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)

        async def pump(p: int, gen) -> None:
            try:
                async with contextlib.aclosing(gen):
                    async for r in gen:
                        await queue.put((p, r))
            except Exception as e:  # noqa: BLE001 - re-raised by the reader: the call fails
                await queue.put((p, e))
            else:
                await queue.put((p, None))

        tasks = [asyncio.create_task(pump(p, g)) for p, g in enumerate(gens)]
        try:
            running = len(tasks)
            while running:
                p, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield self._engine_message(p, item)
        finally:
            for t in tasks:
                t.cancel()  # a pump cancelled in its stream_responses aborts that prompt
            await asyncio.gather(*tasks, return_exceptions=True)

    def _engine_message(self, p: int, r: api_pb2.GenerateResponse) -> api_pb2.GenerateResponse:
        """``r`` of prompt ``p`` with its global candidate index (and, ``score_only``, without
        the generated token)."""
        r.index += p * self.parsed.best_of
        if self.parsed.score_only:
            del r.token_ids[:], r.logprobs[:]
            r.text = ""
            if r.finish_reason:
                r.finish_reason, r.stop_reason = api_pb2.FINISH_REASON_LENGTH, ""
                r.ClearField("stop_token_id")
                r.usage.completion_tokens = 0
        return r

    def _local(self, r: api_pb2.GenerateResponse) -> tuple[int, api_pb2.GenerateResponse]:
        """(prompt, a copy of ``r`` with its index within its prompt)."""
        p, i = divmod(r.index, self.parsed.best_of)
        local = api_pb2.GenerateResponse()
        local.CopyFrom(r)
        local.index = i
        return p, local

    # ---- whole response -----------------------------------------------------------------
    def add(self, r: api_pb2.GenerateResponse) -> None:
        """Record one message of ``responses`` (non-streaming mode)."""
        self._scores[r.index] = self._scores.get(r.index, 0.0) + sum(
            t.logprob for t in r.logprobs)
        p, local = self._local(r)
        self._prompts[p].builder.add(local)

    def response(self) -> dict:
        """The whole ``text_completion`` object: n choices per prompt (the best of best_of),
        index ``p * n + rank``; the usage of every candidate."""
        n, best_of = self.parsed.n, self.parsed.best_of
        body = None
        choices = []
        for p, prompt in enumerate(self._prompts):
            body = prompt.builder.response()
            order = list(range(n))
            if best_of > n:
                order = sorted(range(best_of),
                               key=lambda i: -self._scores.get(p * best_of + i, 0.0))[:n]
            for rank, i in enumerate(order):
                choice = body["choices"][i]
                choice["index"] = p * n + rank
                choices.append(choice)
        assert body is not None  # at least one prompt
        body["choices"], body["usage"] = choices, self.usage()
        return body

    def usage(self) -> dict:
        """OpenAI's usage, summed over the prompts (see ``ResponseBuilder.usage``)."""
        usages = [p.builder.usage() for p in self._prompts]
        prompt = sum(u["prompt_tokens"] for u in usages)
        completion = sum(u["completion_tokens"] for u in usages)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "prompt_tokens_details": {
                    "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                         for u in usages)}}

    # ---- stream chunks (best_of == n) ---------------------------------------------------
    def role_chunks(self, include_usage: bool) -> list[dict]:
        """None: completions have no role chunks (``ResponseBuilder``'s interface)."""
        return []

    def chunk(self, r: api_pb2.GenerateResponse, include_usage: bool) -> dict | None:
        """The stream chunk of one message of ``responses`` (index ``p * n + i``), or None
        when it shows nothing."""
        p, local = self._local(r)
        body = self._prompts[p].builder.chunk(local, include_usage)
        if body is not None:
            body["choices"][0]["index"] = r.index  # best_of == n when streaming
        return body

    def usage_chunk(self) -> dict:
        """The last chunk of ``stream_options.include_usage``: the summed usage."""
        body = self._prompts[0].builder.usage_chunk()
        body["usage"] = self.usage()
        return body

