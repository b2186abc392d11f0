"""POST /v1/embeddings: OpenAI's embeddings request mapped onto the gRPC ``EmbedRequest`` (JSON
types and ``encoding_format`` only; everything else is ``services.router.embedding``'s
``prepare_embed``, shared with gRPC ``Embed``), and its answer in OpenAI's shape.
"""

from __future__ import annotations

import base64

import numpy as np

from services.common.pb.pagedserve.v1 import api_pb2
from services.router.embedding import PreparedEmbed
from services.router.openai.errors import OpenAIError, bad_request, utf8
from services.router.validation import RequestError

ENCODING_FORMATS = ("float", "base64")
_SHAPES = ("input must be a non-empty string, a list of strings, a list of token ids, or a "
           "list of token-id lists")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_embedding(body: dict) -> tuple[api_pb2.EmbedRequest, str]:
    """``body`` (OpenAI's embeddings request) as an ``EmbedRequest`` and its
    ``encoding_format``. ``input``: a string, a list of strings, a list of token ids (one
    input) or a list of token-id lists; ``user`` is ignored.

    Raises:
        OpenAIError: 400 naming the field: another ``input`` shape, an unknown
            ``encoding_format``, a ``dimensions`` or ``truncate_prompt_tokens`` that is not an
            integer (their limits are ``prepare_embed``'s).
    """
    value = body.get("input")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(_SHAPES, "input")
    if all(_is_int(x) for x in value):
        value = [value]
    request = api_pb2.EmbedRequest()
    if all(isinstance(x, str) for x in value):
        request.input.extend(api_pb2.EmbedInput(text=utf8(t, f"input[{i}]", "input"))
                             for i, t in enumerate(value))
    elif all(isinstance(x, list) and all(_is_int(t) for t in x) for x in value):
        if any(not -2**31 <= t < 2**31 for x in value for t in x):
            raise bad_request("input: token ids must be 32-bit integers", "input")
        request.input.extend(api_pb2.EmbedInput(token_ids=api_pb2.TokenIds(ids=x))
                             for x in value)
    else:
        raise bad_request(_SHAPES, "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise bad_request(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, got "
                          f"{fmt!r}", "encoding_format")
    for name in ("dimensions", "truncate_prompt_tokens"):
        number = body.get(name)
        if number is None:
            continue
        if not _is_int(number) or not -2**31 <= number < 2**31:
            raise bad_request(f"{name} must be an integer, got {number!r}", name)
        setattr(request, name, number)
    return request, fmt


def is_one_token_list(body: dict) -> bool:
    """Whether ``body``'s ``input`` is one list of token ids (one input, ``[1, 2, 3]``), which
    ``prepare_embed(one_list=True)`` names as the client wrote it."""
    value = body.get("input")
    return isinstance(value, list) and bool(value) and all(_is_int(x) for x in value)


def embedding_error(e: RequestError) -> OpenAIError:
    """The 400 for a ``prepare_embed`` error: its message, ``param`` its field."""
    return bad_request(e.message, e.param)


def embedding_response(req: PreparedEmbed, vectors: list[list[float]], encoding_format: str,
                       model: str) -> dict:
    """OpenAI's answer: ``{"id", "object": "list", "data": [{"object": "embedding", "index",
    "embedding"}], "model", "usage"}``; a base64 embedding is its little-endian float32 bytes."""
    data = [{"object": "embedding", "index": i,
             "embedding": vector if encoding_format == "float" else
             base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()}
            for i, vector in enumerate(vectors)]
    tokens = sum(map(len, req.prompts))
    return {"id": req.request_id, "object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

