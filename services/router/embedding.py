"""One Embed call (gRPC ``Embed``, OpenAI's ``POST /v1/embeddings``), without gRPC or HTTP.

``prepare_embed`` validates an ``EmbedRequest`` once against the engine (the server must run
the pooling runner; inputs, lengths, token ids, ``dimensions``, ``truncate_prompt_tokens``) and
tokenizes its texts; ``run_embed`` submits one engine request per input (the scheduler batches
them, each its prompt's one forward) and gathers their pooled vectors
(``RequestOutput.embedding``), shortened to ``dimensions`` where asked. Limits and wording
follow vLLM's embedding server where OpenAI's API says nothing.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass

import grpc

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.generation import EngineError, status_of
from services.router.replicas import ReplicaSet
from services.router.tokenizer import encode_prompt
from services.router.validation import invalid, validate_request_id

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit for an embeddings request's array)
# nothing is sampled on a pooling server; the engine still takes (and checks) parameters
_POOLING_PARAMS = EngineSamplingParams(max_tokens=1)




@dataclass(slots=True)
class PreparedEmbed:
    """A validated, tokenized Embed call.

    Attributes:
        request_id: the client's id (or a generated one); engine request i is ``<id>-<i>``.
        prompts: each input's token ids, in order.
        dimensions: the length to shorten each embedding to (then L2-normalized), or None.
    """

    request_id: str
    prompts: list[list[int]]
    dimensions: int | None = None


def prepare_embed(request: api_pb2.EmbedRequest, tokenizer,
                  info: engine_pb2.GetEngineInfoResponse, *, one_list: bool = False
                  ) -> PreparedEmbed:
    """Validate ``request`` against the engine ``info`` and tokenize its texts (with the
    tokenizer's special tokens, as vLLM does).

    Args:
        one_list: the client sent one list of token ids as the whole input (OpenAI's
            ``input: [1, 2, 3]``, the request's one input): an id error names it
            ``input[j]``, as the client wrote it, not ``input[0][j]``.

    Raises:
        RequestError: INVALID_ARGUMENT naming the field (``param``) and the limit: the server
            does not pool, no or too many inputs, an empty or over-long input
            (``max_model_len``), an id outside the vocabulary, ``dimensions`` the model does not
            support, a
            ``truncate_prompt_tokens`` below 1 (but -1) or above ``max_model_len`` (vLLM's
            rule), a bad request_id.
    """
    if info.runner != "pooling":
        raise invalid("The model does not support Embeddings API (the server runs --runner "
                       f"{info.runner or 'generate'}; start it with --runner pooling)", None)
    request_id = validate_request_id(request.request_id or "embd-" + uuid.uuid4().hex)
    n = len(request.input)
    if not 1 <= n <= MAX_INPUTS:
        raise invalid(f"input has {n} items: between 1 and {MAX_INPUTS} are allowed", "input")
    dims = (_dimensions(request.dimensions, info) if request.HasField("dimensions") else None)
    truncate = (request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens")
                else None)
    if truncate is not None and not (truncate >= 1 or truncate == -1):
        raise invalid("truncate_prompt_tokens must be an integer >= 1, or -1 (max_model_len), "
                       f"got {truncate}", "truncate_prompt_tokens")
    if truncate == -1:
        truncate = info.max_model_len
    if truncate is not None and truncate > info.max_model_len:
        raise invalid(f"truncate_prompt_tokens value ({truncate}) is greater than "
                       f"max_model_len ({info.max_model_len}); select a smaller truncation "
                       "size", "truncate_prompt_tokens")
    prompts = []
    for i, item in enumerate(request.input):
        kind = item.WhichOneof("input")
        if kind == "text" and item.text:
            ids = encode_prompt(tokenizer, item.text)
        elif kind == "token_ids" and item.token_ids.ids:
            ids = list(item.token_ids.ids)
        else:
            raise invalid(f"input[{i}] is empty", "input")
        if truncate is not None:
            ids = ids[-truncate:]  # (the last ones, as vLLM keeps)
        if len(ids) > info.max_model_len:
            raise invalid(f"input[{i}] has {len(ids)} tokens, more than the model's "
                           f"max_model_len {info.max_model_len}; shorten it or set "
                           "truncate_prompt_tokens", "input")
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            where = "input" if one_list else f"input[{i}]"
            raise invalid(f"{where}[{bad}] = {ids[bad]} is not a token id: ids must be in "
                           f"[0, {info.vocab_size})", "input")
        prompts.append(ids)
    return PreparedEmbed(request_id, prompts, dims)


def _dimensions(value: int, info: engine_pb2.GetEngineInfoResponse) -> int:
    """``dimensions`` checked against what the model supports (vLLM's rules and wording): a
    Matryoshka model only, one of its ``matryoshka_dimensions`` when it lists them, at most
    the embedding size."""
    if value < 1:
        raise invalid(f"dimensions must be a positive integer, got {value}", "dimensions")
    if not info.is_matryoshka:
        raise invalid(f"dimensions: Model \"{info.model}\" does not support matryoshka "
                       "representation, changing output dimensions will lead to poor results",
                      "dimensions")
    allowed = list(info.matryoshka_dimensions)
    if allowed and value not in allowed:
        raise invalid(f"dimensions {value}: Model \"{info.model}\" only supports {allowed} "
                       "matryoshka dimensions, using other output dimensions will lead to poor "
                       "results", "dimensions")
    if value > info.embedding_size:
        raise invalid(f"dimensions {value} is more than the model's embedding size "
                       f"{info.embedding_size}", "dimensions")
    return value


async def run_embed(engine: ReplicaSet, req: PreparedEmbed) -> list[list[float]]:
    """Submit every input as an engine request and return their vectors, in input order
    (shortened to ``req.dimensions`` and L2-normalized again where asked). However it ends
    (an engine error, the caller cancelled), the requests still running are aborted so none
    keeps KV blocks.

    Raises:
        EngineError: the engine refused or failed one of them (e.g. RESOURCE_EXHAUSTED when
            its queue is full), or INVALID_ARGUMENT when an id of this call is still running.
    """
    ids = [f"{req.request_id}-{i}" for i in range(len(req.prompts))]
    if any(engine.is_running(rid) for rid in ids):
        raise EngineError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request_id {req.request_id!r} is already running")
    queue: asyncio.Queue = asyncio.Queue()
    pending = dict(zip(ids, range(len(ids)), strict=True))
    vectors: list[list[float]] = [[] for _ in ids]
    try:
        for rid, prompt in zip(ids, req.prompts, strict=True):
            engine.submit(rid, prompt, _POOLING_PARAMS, queue=queue)
        while pending:
            out = await queue.get()
            i = pending.pop(out.request_id, None)
            if i is None:
                continue
            if out.error_code:
                raise EngineError(status_of(out.error_code), out.error_message)
            if not out.embedding:
                raise EngineError(grpc.StatusCode.INTERNAL, f"input[{i}] ended without an "
                                  f"embedding (finish_reason {out.finish_reason})")
            vectors[i] = shorten(list(out.embedding), req.dimensions)
    finally:
        for rid in pending:  # failed, or cancelled: free the engine's blocks
            engine.abort(rid)
            engine.release(rid)
    return vectors


def shorten(vector: list[float], dimensions: int | None) -> list[float]:
    """Matryoshka: ``vector``'s first ``dimensions`` entries, L2-normalized (None: as is)."""
    if dimensions is None:
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def embed_response(req: PreparedEmbed, vectors: list[list[float]],
                   info: engine_pb2.GetEngineInfoResponse) -> api_pb2.EmbedResponse:
    """The gRPC answer: the vectors with their inputs' lengths, in order."""
    return api_pb2.EmbedResponse(
        embeddings=[api_pb2.Embedding(values=v, prompt_tokens=len(p))
                    for v, p in zip(vectors, req.prompts, strict=True)],
        model=info.model, prompt_tokens=sum(map(len, req.prompts)))
