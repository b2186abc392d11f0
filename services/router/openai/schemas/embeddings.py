"""POST /v1/embeddings (``openai.embeddings``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.router.openai.schemas.common import Answer, Int, Request


class EmbeddingRequest(Request):
    """POST /v1/embeddings."""

    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]] = Field(
        description="a non-empty string, a list of strings, a list of token ids, or a list "
                    "of token-id lists")
    encoding_format: Literal["float", "base64"] | None = Field(None, description="default float")
    dimensions: Int | None = None
    truncate_prompt_tokens: Int | None = None
    user: str | None = None


class Embedding(Answer):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian "
                                         "float32 (encoding_format base64)")


class EmbeddingUsage(Answer):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Answer):
    """POST /v1/embeddings' answer."""

    id: str
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
