"""One Generate call, from validated request to streamed responses, without gRPC.

``prepare`` validates and tokenizes; ``stream_responses`` submits one engine request per choice
(n of them; vLLM V1's fan-out in the frontend) and merges their RequestOutputs into one stream of
GenerateResponses: incremental detokenization and stop-string matching per choice (a hit aborts
that choice's engine request), and a final message per choice with finish_reason and usage. If
the caller stops listening (client cancelled) or a choice fails, every running choice is aborted
so the engine frees its blocks. A beam search (``use_beam_search``) is one engine request whose
final output holds all n choices (``services.router.beam_search_choices``); it is aborted the
same way.

Structured outputs: a request with ``structured_outputs`` first waits for its grammar
(``services.router.structured_output_grammar``: cached, else compiled on a worker thread while
the loop serves others; vLLM's WAITING_FOR_GRAMMAR, here before submission), then every choice is
submitted with it in ``EngineSamplingParams.structured_output``. An invalid grammar ends the
call before anything is submitted, so it never holds KV blocks.

Backpressure: the outputs of one call wait in a bounded ``OutputQueue`` between the engine
stream (which never waits for a client: it carries every request of this router) and the
caller. A caller that reads too slowly (gRPC flow control suspends its ``yield`` while the
client does not read) lets the queue fill; past ``max_pending`` messages the call is failed
with RESOURCE_EXHAUSTED, its engine requests are aborted at once (their KV blocks freed), and the
buffered outputs are dropped, so one slow client costs bounded memory and never slows the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from services.common.logs import log_access
from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.beam_search_choices import BeamSearch
from services.router.callers import Caller, caller_var
from services.router.choices import Choice, child_params, child_request_id
from services.router.quotas import charge_tokens, clamp_priority
from services.router.replicas import ReplicaSet
from services.router.structured_output_grammar import compile_structured_outputs
from services.router.tokenizer import encode_chat, encode_prompt
from services.router.tracing import traced_prepare
from services.router.validation import (
    MAX_LOGPROBS,
    RequestError,
    TextOptions,
    invalid,
    validate_n,
    validate_priority,
    validate_prompt_ids,
    validate_request_id,
    validate_sampling,
)

log = logging.getLogger(__name__)
# Requests larger than this (serialized bytes; an HTTP body's length) are validated and
# tokenized on a thread (``asyncio.to_thread(prepare, ...)``), not on the event loop.
INLINE_PREPARE_BYTES = 16 * 1024


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request ready for the engine.

    Attributes:
        request_id: the client's id (or a generated one), echoed in every response.
        prompt_token_ids: the tokenized prompt, shared by all choices.
        params: the engine sampling parameters (of choice 0; see ``child_params``).
        text: stop strings and text options, applied per choice.
        n: number of choices, in [1, 64].
        priority: scheduling priority (lower runs sooner); 0 unless the engine's policy is
            "priority".
        structured_outputs: the requested constraint (compiled by ``stream_responses``), or
            None; ``params.structured_output`` is still "" here.
        lora: the LoRA adapter every choice runs with (the request's ``model``), or None.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: EngineSamplingParams
    text: TextOptions
    n: int = 1
    priority: int = 0
    structured_outputs: api_pb2.StructuredOutputs | None = None
    lora: LoRARequest | None = None


@traced_prepare
def prepare(request: api_pb2.GenerateRequest, tokenizer,
            info: engine_pb2.GetEngineInfoResponse, *,
            max_logprobs: int = MAX_LOGPROBS, lora: LoRARequest | None = None
            ) -> PreparedRequest:
    """Validate and tokenize a GenerateRequest.

    Args:
        max_logprobs: the router's --max-logprobs (the most ``logprobs`` /
            ``prompt_logprobs``; -1: the vocabulary size).
        lora: the adapter the request's ``model`` named (``ServedModel.resolve``, by the
            caller: the one place a model name is checked), or None.

    Raises:
        RequestError: INVALID_ARGUMENT naming the field and its limit, or that the server
            runs the pooling runner (embeddings only: nothing can be generated).

    Traced (``router.tracing.traced_prepare``): the span ``router.validate_and_tokenize``.
    """
    if info.runner == "pooling":
        raise invalid("The model does not support Completions API or Chat Completions API: "
                      "the server runs --runner pooling (an embedding model); use the Embed "
                      "RPC (gRPC) or POST /v1/embeddings (HTTP)", None)
    request_id = validate_request_id(request.request_id) or uuid.uuid4().hex
    params, text = validate_sampling(request.sampling_params, vocab_size=info.vocab_size,
                                     max_logprobs=max_logprobs)
    n = validate_n(request.sampling_params)
    priority = validate_priority(request.priority, scheduling_policy=info.scheduling_policy)
    priority = clamp_priority(priority, info.scheduling_policy)  # the key's max_priority
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:
            raise invalid("prompt is empty", "prompt")
        ids = encode_prompt(tokenizer, request.prompt)
    elif kind == "chat":
        if not request.chat.messages:
            raise invalid("chat.messages is empty", "messages")
        ids = encode_chat(tokenizer, request.chat.messages, tools=request.chat.tools,
                          chat_template_kwargs=request.chat.chat_template_kwargs)
    elif kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
    else:
        raise invalid("prompt is empty: set one of prompt, chat or prompt_token_ids", "prompt")
    validate_prompt_ids(ids, max_model_len=info.max_model_len, vocab_size=info.vocab_size)
    sp = request.sampling_params
    eos = frozenset() if params.ignore_eos else frozenset(info.eos_token_ids)
    text = replace(text, stop_token_ids=frozenset(params.stop_token_ids) - eos)
    return PreparedRequest(request_id, ids, params, text, n=n, priority=priority,
                           structured_outputs=(sp.structured_outputs
                                               if sp.HasField("structured_outputs") else None),
                           lora=lora)


@dataclass(slots=True)
class RequestLog:
    """The access log entry of one public request (gRPC Generate / Chat, OpenAI HTTP), filled
    in while the request runs and written once when it ends (``done``, see
    ``services.common.logs.log_access``).

    Attributes:
        route: the HTTP path or the gRPC method.
        request_id: the request's id, once known.
        prompt_tokens: the tokenized prompt's length (0 until ``accepted``).
        error: gRPC code name of an error that ended a stream after its status was sent.
        started: ``time.monotonic()`` at arrival.
        finish_reasons: choice index -> its finish reason (api.proto's ``FinishReason``).
        lora: the LoRA adapter's name, "" for none (once ``accepted``).
        started_at: ``time.time()`` at arrival (the usage row's ``started``).
        usage: the router's ``usage.recorder.UsageRecorder`` (None: no usage accounting).
        caller: the request's ``callers.Caller`` when it was accepted (None: read at ``done``).
    """

    route: str
    request_id: str | None = None
    prompt_tokens: int = 0
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    finish_reasons: dict[int, int] = field(default_factory=dict)
    _tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens so far
    lora: str = ""
    started_at: float = field(default_factory=time.time)
    usage: Any = None
    caller: Caller | None = None
    _cached: dict[int, int] = field(default_factory=dict)  # choice index -> cached tokens
    _n: int = 1  # choices per prompt (a completion batch's choice i of prompt p: p * n + i)

    def accepted(self, req: PreparedRequest) -> None:
        """The request passed validation: record its id and prompt length, log it (sizes
        only, never text)."""
        self.request_id, self.prompt_tokens = req.request_id, len(req.prompt_token_ids)
        charge_tokens(len(req.prompt_token_ids))  # (the key's tokens_per_minute)
        self.lora, self._n = (req.lora.name if req.lora else ""), req.n
        self.caller = caller_var.get()  # (inside the handler: the key the edge checked)
        log.info("request accepted: %d prompt tokens, n=%d, max_tokens=%s",
                 self.prompt_tokens, req.n,
                 "auto" if req.params.max_tokens is None else req.params.max_tokens,
                 extra={"request_id": req.request_id})

    def observe(self, response: api_pb2.GenerateResponse) -> None:
        """Count a response's tokens (a choice's final message carries its usage), and charge
        the new ones to the key's tokens_per_minute."""
        before = self._tokens.get(response.index, 0)
        if response.finish_reason:
            self._cached[response.index] = response.usage.num_cached_tokens
            self._tokens[response.index] = response.usage.completion_tokens
            self.finish_reasons[response.index] = response.finish_reason
        else:
            self._tokens[response.index] = (self._tokens.get(response.index, 0)
                                            + len(response.token_ids))
        charge_tokens(self._tokens[response.index] - before)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far, all choices together."""
        return sum(self._tokens.values())

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, as the response's usage counts them:
        those of each prompt's first choice (the others share its blocks)."""
        return sum(c for i, c in self._cached.items() if i % self._n == 0)

    def done(self, status: int | str) -> None:
        """Write the access log line with the request's final ``status`` (HTTP status, or
        gRPC code name), and hand the request to ``usage``."""
        if self.usage is not None:
            self.usage.finished(self, status, time.time())
        log_access(self.route, status, request_id=self.request_id,
                   prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                   duration_s=time.monotonic() - self.started, error=self.error)


class EngineError(Exception):
    """The engine ended the request with an error (a gRPC status code and message).

    Attributes:
        param: the request field at fault, named as ``RequestError.param``, or None.
    """

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def engine_refusal(req: PreparedRequest, code_value: int, message: str) -> EngineError:
    """The error of an engine output that ended a choice of ``req`` (``RequestOutput.error_code``
    and ``error_message``).

    ``param``: the router checks every field before submitting except what only the engine
    knows: a beam search's ``beam_width`` against the scheduler's max_num_seqs and KV cache
    size (``services/scheduler/beam_search_groups.py``), and a LoRA adapter (the ``model``)
    against the workers (none served, or the adapter failed to load). So the engine's
    INVALID_ARGUMENT names ``beam_width`` for a beam search, ``model`` for a request with an
    adapter, no field for one that is both (either may be at fault) nor for any other error.

    NOTE: the engine's RequestOutput carries no field name, so this is inferred from the
    request, not read from the error.
    """
    code = status_of(code_value)
    param = None
    if code == grpc.StatusCode.INVALID_ARGUMENT and (req.params.beam_width > 0) != (
            req.lora is not None):
        param = "beam_width" if req.params.beam_width > 0 else "model"
    return EngineError(code, message, param)


# Default of the router's --max-stream-buffer: outputs (engine steps) buffered per call.
DEFAULT_MAX_STREAM_BUFFER = 4096


class OutputQueue(asyncio.Queue):
    """The RequestOutputs of one call's engine requests, at most ``max_pending`` waiting.

    ``put_nowait`` never blocks (the engine stream's reader calls it for every request of this
    router). An output that would exceed the bound is not queued: the queue drops what it holds,
    keeps only a final ``overflow`` marker, and calls ``on_overflow()`` once. A request's final
    output (finish_reason or error set) is always accepted, so a queue at its bound still ends.

    Args:
        max_pending: most outputs waiting (>= 1).
        on_overflow: called (synchronously, from the putter) the first time the bound is hit.
    """

    OVERFLOW = object()  # the marker the reader gets after an overflow

    def __init__(self, max_pending: int, on_overflow=None):
        super().__init__()
        self.max_pending = max_pending
        self.on_overflow = on_overflow
        self.overflowed = False

    def put_nowait(self, item) -> None:
        if self.overflowed:
            return
        final = item is not self.OVERFLOW and (item.finish_reason or item.error_code)
        if final or self.qsize() < self.max_pending:
            super().put_nowait(item)
            return
        self.overflowed = True
        while not self.empty():  # free the buffered outputs now, not when the client reads
            self.get_nowait()
        super().put_nowait(self.OVERFLOW)
        if self.on_overflow is not None:
            self.on_overflow()


def slow_client_error(max_pending: int) -> EngineError:
    """The RESOURCE_EXHAUSTED a call ends with when its client reads too slowly."""
    return EngineError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"client reads too slowly: {max_pending} responses were waiting to be "
                       "sent (router --max-stream-buffer); the request was aborted")


def status_of(code_value: int) -> grpc.StatusCode:
    """The gRPC status whose numeric value is ``code_value`` (UNKNOWN for another number)."""
    return next((c for c in grpc.StatusCode if c.value[0] == code_value), grpc.StatusCode.UNKNOWN)


async def stream_responses(engine: ReplicaSet, tokenizer, req: PreparedRequest, *,
                           max_pending: int = DEFAULT_MAX_STREAM_BUFFER, on_overflow=None):
    """Async generator of the GenerateResponses of one prepared request, all its choices merged.

    Waits for the request's grammar, if any (see the module's note), then submits ``req.n``
    engine requests (one per choice, ``services.router.choices``; a beam search one, id
    ``req.request_id``, ``services.router.beam_search_choices``) and yields each choice's
    messages as its tokens arrive, tagged with ``index``; each choice ends with a message
    carrying its finish_reason and usage. If a choice fails in the engine, or the caller stops
    listening (client cancelled), every choice still running is aborted in the engine.

    Args:
        max_pending: most engine outputs buffered while the caller does not read
            (``OutputQueue``); past it every choice is aborted in the engine at once.
        on_overflow: called with that ``EngineError`` (RESOURCE_EXHAUSTED), from the engine
            stream's reader, so a caller suspended in a write to its slow client can end the
            call; the generator itself raises it at its next read.

    Raises:
        EngineError: the engine rejected or failed a choice (e.g. RESOURCE_EXHAUSTED when its
            queue is full, UNAVAILABLE when unreachable); the caller read too slowly
            (RESOURCE_EXHAUSTED); before anything is submitted, INVALID_ARGUMENT when an engine
            request id is still running (a reused request_id) or the grammar is invalid
            (``structured_outputs.<kind>: ...``).
    """
    params = await _with_grammar(req)
    choices = _choices(req, tokenizer)

    def overflowed() -> None:  # called by the engine stream's reader: stop every choice now
        _abort_running(engine, choices)
        if on_overflow is not None:
            on_overflow(slow_client_error(max_pending))

    queue = OutputQueue(max_pending, overflowed)  # every choice's outputs, in arrival order
    _submit(engine, req, params, choices, queue)
    num_running = len(choices)
    try:
        while num_running:
            out = await queue.get()
            if out is OutputQueue.OVERFLOW:
                raise slow_client_error(max_pending)
            choice = choices.get(out.request_id)
            if choice is None or choice.finished:  # e.g. the ABORT after a stop-string hit
                continue
            if out.error_code:
                choice.finished = True  # the engine has already ended it
                raise engine_refusal(req, out.error_code, out.error_message)
            responses, stop_string_hit = choice.on_output(out)
            if stop_string_hit:
                engine.abort(out.request_id)
                engine.release(out.request_id)
            if choice.finished:
                num_running -= 1
            for response in responses:
                yield response
    finally:
        _abort_running(engine, choices)  # cancelled, or a choice failed: free their blocks


async def _with_grammar(req: PreparedRequest) -> EngineSamplingParams:
    """``req.params`` with the compiled grammar of ``req.structured_outputs``, if any.

    Raises:
        EngineError: INVALID_ARGUMENT ``structured_outputs.<kind>: ...``, the grammar invalid.
    """
    if req.structured_outputs is None:
        return req.params
    try:
        grammar = await compile_structured_outputs(req.structured_outputs)
    except RequestError as e:
        raise EngineError(e.code, e.message, e.param) from None
    return replace(req.params, structured_output=grammar)


def _choices(req: PreparedRequest, tokenizer) -> dict[str, Choice | BeamSearch]:
    """The choices of ``req`` by engine request id: one per choice, or one beam search for all."""
    if req.params.beam_width:
        return {req.request_id: BeamSearch(req.request_id, req.n, req.prompt_token_ids,
                                           req.text, tokenizer)}
    rids = (child_request_id(req.request_id, i, req.n) for i in range(req.n))
    return {rid: Choice(i, rid, req.request_id, req.prompt_token_ids, req.text, tokenizer)
            for i, rid in enumerate(rids)}


def _submit(engine: ReplicaSet, req: PreparedRequest, params: EngineSamplingParams,
            choices: dict[str, Choice | BeamSearch], queue: OutputQueue) -> None:
    """Submit every choice's engine request, its outputs to ``queue``.

    Raises:
        EngineError: INVALID_ARGUMENT, nothing submitted: an engine request id is running.
    """
    # NOTE: checked before anything is submitted, so that the clean-up never aborts another
    # caller's request that happens to have one of these ids.
    taken = next((rid for rid in choices if engine.is_running(rid)), None)
    if taken is not None:
        raise EngineError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request_id {req.request_id!r} is already running" +
                          (f" (engine request {taken!r})" if taken != req.request_id else ""))
    for i, rid in enumerate(choices):
        if queue.overflowed:  # cannot happen with a real engine before anything was read
            break
        engine.submit(rid, req.prompt_token_ids, child_params(params, i),
                      priority=req.priority, queue=queue,
                      parent_request_id=req.request_id if len(choices) > 1 else "",
                      lora=req.lora)


def _abort_running(engine: ReplicaSet, choices: dict[str, Choice | BeamSearch]) -> None:
    """Abort the choices still running in the engine (freeing their KV blocks); each is then
    finished."""
    for choice in choices.values():
        if not choice.finished:
            choice.finished = True
            engine.abort(choice.engine_request_id)
            engine.release(choice.engine_request_id)
