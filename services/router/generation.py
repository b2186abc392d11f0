"""One Generate call, from validated request to streamed responses, without gRPC.

``prepare`` validates and tokenizes; ``stream_responses`` submits to the engine and turns
RequestOutputs into GenerateResponses: incremental detokenization, stop-string matching (which
aborts the engine request on a hit), and the final message with finish_reason and usage. If the
caller stops listening (client cancelled), the engine request is aborted so its blocks are freed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import grpc

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.router.detokenizer import IncrementalDetokenizer
from services.router.engine_client import EngineClient
from services.router.stop_strings import StopStringMatcher
from services.router.tokenizer import encode_chat, encode_prompt
from services.router.validation import (RequestError, TextOptions, validate_prompt_ids,
                                        validate_request_id, validate_sampling)

_FINISH = {engine_pb2.ENGINE_FINISH_REASON_STOP: api_pb2.FINISH_REASON_STOP,
           engine_pb2.ENGINE_FINISH_REASON_LENGTH: api_pb2.FINISH_REASON_LENGTH,
           engine_pb2.ENGINE_FINISH_REASON_ABORT: api_pb2.FINISH_REASON_ABORT}


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request ready for the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: engine_pb2.EngineSamplingParams
    text: TextOptions


def prepare(request: api_pb2.GenerateRequest, tokenizer,
            info: engine_pb2.GetEngineInfoResponse) -> PreparedRequest:
    """Validate and tokenize a GenerateRequest.

    Raises:
        RequestError: INVALID_ARGUMENT naming the field and its limit.
    """
    request_id = validate_request_id(request.request_id) or uuid.uuid4().hex
    params, text = validate_sampling(request.sampling_params, vocab_size=info.vocab_size)
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        ids = encode_prompt(tokenizer, request.prompt)
    elif kind == "chat":
        if not request.chat.messages:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "chat.messages is empty")
        ids = encode_chat(tokenizer, [{"role": m.role, "content": m.content}
                                      for m in request.chat.messages])
    elif kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
    else:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           "prompt is empty: set one of prompt, chat or prompt_token_ids")
    validate_prompt_ids(ids, max_model_len=info.max_model_len, vocab_size=info.vocab_size)
    return PreparedRequest(request_id, ids, params, text)


class EngineError(Exception):
    """The engine ended the request with an error (a gRPC status code and message)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _status(code_value: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == code_value), grpc.StatusCode.UNKNOWN)


async def stream_responses(engine: EngineClient, tokenizer, req: PreparedRequest):
    """Async generator of GenerateResponses for one prepared request.

    Raises:
        EngineError: the engine rejected or failed the request.
    """
    queue = engine.submit(req.request_id, req.prompt_token_ids, req.params)
    detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids,
                                   skip_special_tokens=req.text.skip_special_tokens)
    stops = StopStringMatcher(req.text.stop, req.text.include_stop_str_in_output)
    num_output = 0
    finished = False
    try:
        while True:
            out = await queue.get()
            if out.error_code:
                finished = True
                raise EngineError(_status(out.error_code), out.error_message)
            ids = list(out.new_token_ids)
            num_output += len(ids)
            match = stops.feed(detok.step(ids)) if ids else None
            text = match.text_to_emit if match else ""
            if match is not None and match.stopped:
                finished = True
                engine.abort(req.request_id)
                engine.release(req.request_id)
                yield _final(req, ids, text, api_pb2.FINISH_REASON_STOP, num_output,
                             match.stop_str)
                return
            if out.finish_reason:
                finished = True
                # release what the detokenizer and the stop matcher still hold back
                tail = stops.feed(detok.flush())
                text += tail.text_to_emit
                if tail.stopped:
                    yield _final(req, ids, text, api_pb2.FINISH_REASON_STOP, num_output,
                                 tail.stop_str)
                else:
                    yield _final(req, ids, text + stops.flush(), _FINISH[out.finish_reason],
                                 num_output)
                return
            if ids or text:
                yield api_pb2.GenerateResponse(request_id=req.request_id, token_ids=ids, text=text)
    finally:
        if not finished:  # the caller went away mid-stream: free the engine's blocks
            engine.abort(req.request_id)
            engine.release(req.request_id)


def _final(req: PreparedRequest, ids: list[int], text: str, reason: int, num_output: int,
           stop_str: str | None = None) -> api_pb2.GenerateResponse:
    return api_pb2.GenerateResponse(
        request_id=req.request_id, token_ids=ids, text=text, finish_reason=reason,
        usage=api_pb2.Usage(prompt_tokens=len(req.prompt_token_ids),
                            completion_tokens=num_output),
        stop_reason=stop_str or "")
