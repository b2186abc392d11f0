"""GET /v1/models, POST /tokenize, POST /detokenize, GET /version, the LoRA routes and
GET /openapi.json."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, RootModel

from services.router.openai.schemas.common import Answer, Int, Request
from services.router.openai.schemas.completions import Message, Tool


class ModelCard(Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="the engine's model name, or a LoRA adapter's folder")
    parent: str | None = Field(description="(a LoRA adapter) its base model")
    max_model_len: int


class ModelList(Answer):
    """GET /v1/models' answer: the served model, then its LoRA adapters."""

    object: Literal["list"]
    data: list[ModelCard]


class Version(Answer):
    version: str


class TokenizeRequest(Request):
    """POST /tokenize: exactly one of ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = None


class TokenizeResponse(Answer):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Request):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[Int] = Field(description="a list of token ids (ints)")


class DetokenizeResponse(Answer):
    prompt: str


class LoadLoRARequest(Request):
    """POST /v1/load_lora_adapter."""

    lora_name: str = Field(json_schema_extra={"minLength": 1})
    lora_path: str = Field(json_schema_extra={"minLength": 1},
                           description="a PEFT adapter folder")


class UnloadLoRARequest(Request):
    """POST /v1/unload_lora_adapter."""

    lora_name: str = Field(json_schema_extra={"minLength": 1})


class OpenAPIDocument(RootModel[dict[str, Any]]):
    """An OpenAPI 3.1 document."""
