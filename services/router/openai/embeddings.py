"""POST /v1/embeddings: OpenAI's embeddings API on a pooling server (worker ``--runner pooling``).

``EmbeddingCall.parse`` validates the JSON body once (input shapes, lengths, token ids,
``encoding_format``, ``dimensions``, ``truncate_prompt_tokens``) and tokenizes the strings;
``EmbeddingCall.run`` submits one engine request per input (the scheduler batches them, each
its prompt's one forward) and gathers their pooled vectors (``RequestOutput.embedding``);
``EmbeddingCall.response`` shapes OpenAI's answer. Limits and wording follow vLLM's
``vllm/entrypoints/openai`` embedding server where OpenAI's API says nothing.
"""

from __future__ import annotations

import asyncio
import base64
import math
from dataclasses import dataclass, field

import grpc
import numpy as np

from services.common.pb.pagedserve.v1 import engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.generation import EngineError
from services.router.generation import _status as status_of
from services.router.openai.errors import bad_request, utf8
from services.router.replicas import ReplicaSet
from services.router.tokenizer import encode_prompt

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit for an embeddings request's array)
ENCODING_FORMATS = ("float", "base64")
_SHAPES = ("input must be a non-empty string, a list of strings, a list of token ids, or a "
           "list of token-id lists")
# nothing is sampled on a pooling server; the engine still takes (and checks) parameters
_POOLING_PARAMS = EngineSamplingParams(max_tokens=1)


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _inputs(value) -> tuple[list[str] | None, list[list[int]] | None]:
    """``input`` as strings or as token-id lists (one set, the other None).

    Raises:
        OpenAIError: 400 for any other shape, an empty input, or too many inputs.
    """
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(_SHAPES, "input")
    if all(_is_id(x) for x in value):
        value = [value]
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input has {len(value)} items, at most {MAX_INPUTS} are allowed",
                          "input")
    if all(isinstance(x, str) for x in value):
        for i, text in enumerate(value):
            if not text:
                raise bad_request(f"input[{i}] is an empty string", "input")
            utf8(text, f"input[{i}]", "input")
        return value, None
    if all(isinstance(x, list) and x and all(_is_id(t) for t in x) for x in value):
        return None, value
    raise bad_request(_SHAPES, "input")


@dataclass(slots=True)
class EmbeddingCall:
    """One validated embeddings request.

    Attributes:
        request_id: the response's id, and the prefix of its engine requests' ids.
        prompts: the token ids of each input, in order.
        encoding_format: "float" (lists of numbers) or "base64" (little-endian float32).
        dimensions: the length to shorten each embedding to (then L2-normalized), or None.
        vectors: the pooled vectors once ``run`` has them, in input order.
    """

    request_id: str
    prompts: list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    vectors: list[list[float]] = field(default_factory=list)

    @classmethod
    def parse(cls, body: dict, request_id: str, tokenizer,
              info: engine_pb2.GetEngineInfoResponse) -> EmbeddingCall:
        """Validate ``body`` (OpenAI's embeddings request) against the engine ``info`` and
        tokenize its strings (with the tokenizer's special tokens, as vLLM does).

        Raises:
            OpenAIError: 400 naming the field and the limit: the server does not pool, a bad
                ``input`` shape, an empty or over-long input (``max_model_len``), a token id
                outside the vocabulary, an unknown ``encoding_format``, ``dimensions`` the
                model does not support, a bad ``truncate_prompt_tokens``.
        """
        if info.runner != "pooling":
            raise bad_request("The model does not support Embeddings API (the server runs "
                              f"--runner {info.runner or 'generate'}; start it with --runner "
                              "pooling)", "model")
        texts, prompts = _inputs(body.get("input"))
        fmt = body.get("encoding_format") or "float"
        if fmt not in ENCODING_FORMATS:
            raise bad_request(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, "
                              f"got {fmt!r}", "encoding_format")
        dims = _dimensions(body.get("dimensions"), info)
        truncate = body.get("truncate_prompt_tokens")
        if truncate is not None and not (_is_id(truncate) and (truncate >= 1 or truncate == -1)):
            raise bad_request("truncate_prompt_tokens must be an integer >= 1, or -1 "
                              f"(max_model_len), got {truncate!r}", "truncate_prompt_tokens")
        if truncate == -1:
            truncate = info.max_model_len
        if prompts is None:
            assert texts is not None
            prompts = [encode_prompt(tokenizer, t) for t in texts]
        for i, ids in enumerate(prompts):
            if truncate is not None:
                ids = prompts[i] = ids[-truncate:]  # (the last ones, as vLLM keeps)
            if not ids:
                raise bad_request(f"input[{i}] has no tokens", "input")
            if len(ids) > info.max_model_len:
                raise bad_request(
                    f"input[{i}] has {len(ids)} tokens, more than the model's max_model_len "
                    f"{info.max_model_len}; shorten it or set truncate_prompt_tokens", "input")
            bad = next((j for j, t in enumerate(ids) if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                raise bad_request(f"input[{i}][{bad}] = {ids[bad]} is not a token id: ids must "
                                  f"be in [0, {info.vocab_size})", "input")
        return cls(request_id, prompts, fmt, dims)

    async def run(self, engine: ReplicaSet) -> None:
        """Submit every input as an engine request and wait for all their vectors
        (``vectors``). However it ends (an engine error, the client gone), the requests still
        running are aborted so none keeps KV blocks.

        Raises:
            EngineError: the engine refused or failed one of them (e.g. RESOURCE_EXHAUSTED
                when its queue is full), or an id of this call is still running.
        """
        ids = [f"{self.request_id}-{i}" for i in range(len(self.prompts))]
        taken = next((rid for rid in ids if engine.is_running(rid)), None)
        if taken is not None:
            raise EngineError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"request_id {self.request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        pending = dict(zip(ids, range(len(ids)), strict=True))
        vectors: list[list[float]] = [[] for _ in ids]
        try:
            for rid, prompt in zip(ids, self.prompts, strict=True):
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
                vectors[i] = list(out.embedding)
        finally:
            for rid in pending:  # failed, or cancelled: free the engine's blocks
                engine.abort(rid)
                engine.release(rid)
        self.vectors = vectors

    def response(self, model: str) -> dict:
        """OpenAI's embeddings response: ``{"id", "object": "list", "data": [{"object":
        "embedding", "index", "embedding"}], "model", "usage"}``."""
        data = []
        for i, vector in enumerate(self.vectors):
            if self.dimensions is not None:  # Matryoshka: the first d, normalized again
                vector = vector[:self.dimensions]
                norm = math.sqrt(sum(x * x for x in vector)) or 1.0
                vector = [x / norm for x in vector]
            data.append({"object": "embedding", "index": i,
                         "embedding": vector if self.encoding_format == "float" else
                         base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()})
        tokens = sum(map(len, self.prompts))
        return {"id": self.request_id, "object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _dimensions(value, info: engine_pb2.GetEngineInfoResponse) -> int | None:
    """``dimensions`` checked against what the model supports (vLLM's rules): a Matryoshka
    model only, one of its ``matryoshka_dimensions`` when it lists them, at most the
    embedding size.

    Raises:
        OpenAIError: 400 naming the field and what is allowed.
    """
    if value is None:
        return None
    if not _is_id(value) or value < 1:
        raise bad_request(f"dimensions must be a positive integer, got {value!r}", "dimensions")
    if not info.is_matryoshka:
        raise bad_request(f"Model \"{info.model}\" does not support matryoshka representation, "
                          "changing output dimensions will lead to poor results (dimensions)",
                          "dimensions")
    allowed = list(info.matryoshka_dimensions)
    if allowed and value not in allowed:
        raise bad_request(f"Model \"{info.model}\" only supports {allowed} matryoshka "
                          f"dimensions, using other output dimensions will lead to poor "
                          f"results (dimensions {value})", "dimensions")
    if value > info.embedding_size:
        raise bad_request(f"dimensions {value} is more than the model's embedding size "
                          f"{info.embedding_size}", "dimensions")
    return value
