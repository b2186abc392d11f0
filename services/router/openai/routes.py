"""The ``openapi.Route`` of every route ``openai.http`` and ``openai.lora_routes`` serve: the
models (``openai.schemas``) its handler validates the request with and writes its answers
through (``openai.schema_check``), so ``GET /openapi.json`` describes what the code does.
"""

from __future__ import annotations

from services.router.openai.schemas.common import ENGINE_ERRORS, ErrorResponse
from services.router.openai.schemas.completions import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamEvent,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamEvent,
)
from services.router.openai.schemas.embeddings import EmbeddingRequest, EmbeddingResponse
from services.router.openai.schemas.misc import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRARequest,
    ModelList,
    OpenAPIDocument,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRARequest,
    Version,
)
from services.router.openai.schemas.responses import (
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from services.router.openapi import Route

# Every error answer but the ones of a bad body (a route without a body, or an open one).
AUTH = {401: "missing or invalid API key (router --api-key)"}
_BODY = {**ENGINE_ERRORS, **AUTH}
_READ = {**AUTH, 500: "internal error"}

COMPLETIONS = Route("POST", "/v1/completions", "Text completion (one prompt or a batch)",
                    CompletionRequest, CompletionResponse, CompletionStreamEvent, _BODY,
                    ErrorResponse, tags=("openai",))
CHAT = Route("POST", "/v1/chat/completions", "Chat completion", ChatCompletionRequest,
             ChatCompletionResponse, ChatStreamEvent, _BODY, ErrorResponse, tags=("openai",))
RESPONSES = Route("POST", "/v1/responses", "Responses API", ResponsesRequest, ResponseObject,
                  ResponseStreamEvent, _BODY, ErrorResponse, tags=("openai",))
STORED_RESPONSE = Route("GET", "/v1/responses/{response_id}", "A stored Response", None,
                        ResponseObject, None, {**_READ, 404: "not stored"}, ErrorResponse,
                        tags=("openai",))
EMBEDDINGS = Route("POST", "/v1/embeddings", "Embeddings (a pooling model's server)",
                   EmbeddingRequest, EmbeddingResponse, None, _BODY, ErrorResponse,
                   tags=("openai",))
MODELS = Route("GET", "/v1/models", "The served model and its LoRA adapters", None, ModelList,
               None, {**_READ, 503: "no scheduler replica can serve"}, ErrorResponse,
               tags=("openai",))
TOKENIZE = Route("POST", "/tokenize", "vLLM's: the token ids of a prompt or a chat",
                 TokenizeRequest, TokenizeResponse, None, _BODY, ErrorResponse, tags=("vllm",))
DETOKENIZE = Route("POST", "/detokenize", "vLLM's: the text of token ids", DetokenizeRequest,
                   DetokenizeResponse, None, _BODY, ErrorResponse, tags=("vllm",))
VERSION = Route("GET", "/version", "pagedserve's version", None, Version, None, _READ,
                ErrorResponse, tags=("vllm",))
HEALTH = Route("GET", "/health", "Readiness: 200 while a scheduler replica can serve", None,
               None, None, {503: "no scheduler replica can serve (or draining); no body"},
               open=True, tags=("probes",))
METRICS = Route("GET", "/metrics", "Prometheus metrics (text exposition format)", None, None,
                None, {500: "internal error"}, ErrorResponse, open=True, tags=("probes",),
                text="text/plain")
OPENAPI = Route("GET", "/openapi.json", "This document", None, OpenAPIDocument, None,
                {500: "internal error"}, ErrorResponse, open=True, tags=("probes",))
LOAD_LORA = Route("POST", "/v1/load_lora_adapter", "vLLM's: serve a LoRA adapter (router "
                  "--allow-runtime-lora-updating)", LoadLoRARequest, None, None,
                  {**AUTH, 400: "a bad adapter or name", 413: "request body too large",
                   500: "internal error"}, ErrorResponse, tags=("lora",), text="text/plain")
UNLOAD_LORA = Route("POST", "/v1/unload_lora_adapter", "vLLM's: stop serving a LoRA adapter",
                    UnloadLoRARequest, None, None,
                    {**AUTH, 400: "a bad body", 404: "no such adapter",
                     413: "request body too large", 500: "internal error"}, ErrorResponse,
                    tags=("lora",), text="text/plain")
