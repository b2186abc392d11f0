"""Plain types and request builders of the SDK's non-Generate calls: chat, tokenize,
detokenize and list_models (no protobuf in user code)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedserve_client.pb.pagedserve.v1 import api_pb2


@dataclass(slots=True)
class TokenizeResult:
    """The token ids of a text or conversation, as the server's Generate would tokenize it.

    Attributes:
        token_ids: the ids, each in [0, vocab_size).
        count: ``len(token_ids)`` (the ``prompt_tokens`` Generate would report).
        max_model_len: the model's context length; a prompt must have fewer tokens.
    """

    token_ids: list[int]
    count: int
    max_model_len: int


@dataclass(slots=True)
class ModelInfo:
    """A served model.

    Attributes:
        id: its name as the server reports it (also the OpenAI HTTP API's model id).
        max_model_len: longest prompt + output, in tokens.
        vocab_size: token ids are in [0, vocab_size).
        dtype: the workers' weight and compute dtype, e.g. "float32".
        eos_token_ids: ids that end generation unless ``ignore_eos``.
        parent: for a LoRA adapter, the base model it runs over; "" for the base model.
    """

    id: str
    max_model_len: int
    vocab_size: int
    dtype: str
    eos_token_ids: list[int] = field(default_factory=list)
    parent: str = ""


def chat_request(generate: api_pb2.GenerateRequest) -> api_pb2.ChatRequest:
    """The ChatRequest of a GenerateRequest built with ``messages=`` (see ``build_request``)."""
    return api_pb2.ChatRequest(messages=generate.chat.messages,
                               sampling_params=generate.sampling_params,
                               request_id=generate.request_id, priority=generate.priority,
                               chat_template_kwargs=generate.chat.chat_template_kwargs,
                               model=generate.model)


def tokenize_request(prompt: str | None, messages: list[dict] | None,
                     add_special_tokens: bool | None, add_generation_prompt: bool | None,
                     continue_final_message: bool | None = None,
                     chat_template_kwargs: dict | None = None) -> api_pb2.TokenizeRequest:
    """A TokenizeRequest for exactly one of ``prompt`` / ``messages``; None options are left
    unset (the server's defaults: see ``Client.tokenize``).

    Raises:
        ValueError: not exactly one input, a message without 'role' and 'content',
            ``chat_template_kwargs`` without ``messages`` or not JSON-serializable.
    """
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt= or messages=")
    if chat_template_kwargs is not None and messages is None:
        raise ValueError("chat_template_kwargs= needs messages= (it is for the chat template)")
    req = api_pb2.TokenizeRequest()
    if prompt is not None:
        req.prompt = prompt
    else:
        assert messages is not None  # exactly one of the two, checked above
        req.chat.SetInParent()  # an empty list is still the chat input (the server refuses it)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
            req.chat.messages.append(api_pb2.ChatMessage(role=m["role"], content=m["content"]))
        if chat_template_kwargs is not None:
            try:
                req.chat.chat_template_kwargs = json.dumps(chat_template_kwargs, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"chat_template_kwargs: {e}") from None
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    if add_generation_prompt is not None:
        req.add_generation_prompt = add_generation_prompt
    if continue_final_message is not None:
        req.continue_final_message = continue_final_message
    return req


def detokenize_request(token_ids: list[int], skip_special_tokens: bool | None
                       ) -> api_pb2.DetokenizeRequest:
    """A DetokenizeRequest.

    Raises:
        ValueError: an id outside int32 (the server checks [0, vocab_size)).
        TypeError: an id that is not an int.
    """
    req = api_pb2.DetokenizeRequest()
    try:
        req.token_ids.extend(token_ids)
    except (ValueError, TypeError) as e:
        raise type(e)(f"token_ids: {e}") from None
    if skip_special_tokens is not None:
        req.skip_special_tokens = skip_special_tokens
    return req


def tokenize_result(msg: api_pb2.TokenizeResponse) -> TokenizeResult:
    """Convert a TokenizeResponse."""
    return TokenizeResult(list(msg.token_ids), msg.count, msg.max_model_len)


def models_from_pb(msg: api_pb2.ListModelsResponse) -> list[ModelInfo]:
    """Convert a ListModelsResponse."""
    return [ModelInfo(m.id, m.max_model_len, m.vocab_size, m.dtype, list(m.eos_token_ids),
                      m.parent) for m in msg.models]
