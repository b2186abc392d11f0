"""The SDK's Embed call: its request builder and result type (no protobuf in user code)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve_client.pb.pagedserve.v1 import api_pb2


@dataclass(slots=True)
class EmbeddingResult:
    """The embeddings of an ``embed`` call.

    Attributes:
        embeddings: one vector (float32 values) per input, in input order.
        prompt_tokens: each input's length in tokens (after truncation).
        model: the served model's name.
    """

    embeddings: list[list[float]]
    prompt_tokens: list[int]
    model: str


def embed_request(input: str | list[str] | list[int] | list[list[int]],
                  dimensions: int | None, truncate_prompt_tokens: int | None,
                  request_id: str) -> api_pb2.EmbedRequest:
    """An EmbedRequest: ``input`` as OpenAI's (a string, strings, one token-id list, or
    token-id lists); None options left unset.

    Raises:
        TypeError: another input shape (an empty list included).
        ValueError: a token id outside int32 (the server checks the vocabulary).
    """
    items: list = [input] if isinstance(input, str) else input
    if items and all(isinstance(x, int) for x in items):
        items = [items]  # one token-id list
    req = api_pb2.EmbedRequest(request_id=request_id)
    if not isinstance(items, list) or not items:
        raise TypeError("input must be a string, a list of strings, a list of token ids, or a "
                        "list of token-id lists")
    for x in items:
        if isinstance(x, str):
            req.input.append(api_pb2.EmbedInput(text=x))
        elif isinstance(x, list) and all(isinstance(t, int) for t in x):
            req.input.append(api_pb2.EmbedInput(token_ids=api_pb2.TokenIds(ids=x)))
        else:
            raise TypeError(f"input item {x!r} is neither a string nor a list of token ids")
    if dimensions is not None:
        req.dimensions = dimensions
    if truncate_prompt_tokens is not None:
        req.truncate_prompt_tokens = truncate_prompt_tokens
    return req


def embedding_result(msg: api_pb2.EmbedResponse) -> EmbeddingResult:
    """Convert an EmbedResponse."""
    return EmbeddingResult([list(e.values) for e in msg.embeddings],
                           [e.prompt_tokens for e in msg.embeddings], msg.model)
