"""The public RPCs around Generate, without gRPC: Chat (mapped onto a Generate request),
Tokenize, Detokenize and ListModels.

Each function takes the request message (plus the router's tokenizer and the engine's
``GetEngineInfoResponse``) and returns the response message; a bad request raises
``RequestError`` (INVALID_ARGUMENT naming the field), which the servicer turns into a status.
Tokenize uses the very helpers Generate uses (``encode_prompt``, ``encode_chat``), so its ids are
the prompt Generate would send to the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.router.tokenizer import encode_chat, encode_prompt
from services.router.validation import invalid, validate_token_ids


def _messages(messages, field: str):
    """``messages`` (ChatMessage protos), checked to be non-empty.

    Raises:
        RequestError(INVALID_ARGUMENT): no messages (``field is empty``).
    """
    if not messages:
        raise invalid(f"{field} is empty", "messages")
    return messages


def chat_to_generate(request: api_pb2.ChatRequest) -> api_pb2.GenerateRequest:
    """The GenerateRequest that a ChatRequest stands for (its messages as the ``chat`` input;
    sampling_params, request_id, priority and model copied), so Chat streams exactly what Generate
    would.

    Raises:
        RequestError(INVALID_ARGUMENT): ``messages is empty``. Every other check is Generate's
            (``generation.prepare``).
    """
    _messages(request.messages, "messages")
    return api_pb2.GenerateRequest(
        chat=api_pb2.ChatMessages(messages=request.messages, tools=request.tools,
                                  chat_template_kwargs=request.chat_template_kwargs),
        sampling_params=request.sampling_params, request_id=request.request_id,
        priority=request.priority, model=request.model)


def tokenize(request: api_pb2.TokenizeRequest, tokenizer,
             info: engine_pb2.GetEngineInfoResponse) -> api_pb2.TokenizeResponse:
    """Token ids of a text or a conversation, as Generate would tokenize it.

    ``add_special_tokens`` unset means what Generate does: True for a prompt (the tokenizer's
    post-processor adds its BOS, if it has one), False for a chat (the template writes them).
    No length limit is applied: ``count`` may reach or exceed ``max_model_len`` (returned too).

    Raises:
        RequestError(INVALID_ARGUMENT): no input, an empty prompt or chat.messages, a
            conversation the chat template rejects, a bad ``chat.chat_template_kwargs``, or
            ``continue_final_message`` with ``add_generation_prompt``.
    """
    kind = request.WhichOneof("input")
    add_special = (request.add_special_tokens if request.HasField("add_special_tokens")
                   else None)
    if kind == "prompt" and request.prompt:
        ids = encode_prompt(tokenizer, request.prompt,
                            add_special_tokens=True if add_special is None else add_special)
    elif kind == "chat":
        messages = _messages(request.chat.messages, "chat.messages")
        generation_prompt = (request.add_generation_prompt
                             if request.HasField("add_generation_prompt") else True)
        ids = encode_chat(tokenizer, messages, tools=request.chat.tools,
                          chat_template_kwargs=request.chat.chat_template_kwargs,
                          add_generation_prompt=generation_prompt,
                          continue_final_message=request.continue_final_message,
                          add_special_tokens=bool(add_special))
    else:
        raise invalid("prompt is empty: set one of prompt or chat", "prompt")
    return api_pb2.TokenizeResponse(token_ids=ids, count=len(ids),
                                    max_model_len=info.max_model_len)


def detokenize(request: api_pb2.DetokenizeRequest, tokenizer,
               info: engine_pb2.GetEngineInfoResponse, *,
               field: str = "token_ids") -> api_pb2.DetokenizeResponse:
    """The text of token ids, decoded in one piece (``skip_special_tokens`` default True, as
    SamplingParams). Ids the tokenizer lacks but the model has (``vocab_size`` is often padded
    beyond the tokenizer) decode to nothing.

    Args:
        field: the name of the ids in error messages (the OpenAI API's is ``tokens``).

    Raises:
        RequestError(INVALID_ARGUMENT): an id outside [0, vocab_size), e.g.
            ``token_ids[2] must be in [0, 49152), got -1``.
    """
    ids = list(request.token_ids)
    validate_token_ids(field, ids, vocab_size=info.vocab_size)
    skip = (request.skip_special_tokens if request.HasField("skip_special_tokens") else True)
    return api_pb2.DetokenizeResponse(text=tokenizer.decode(ids, skip_special_tokens=skip))


def list_models(info: engine_pb2.GetEngineInfoResponse,
                adapters: Sequence[tuple[str, str]] = ()) -> api_pb2.ListModelsResponse:
    """The served model as the engine describes it, then its LoRA ``adapters`` ((name,
    parent) pairs, in load order), each like the base but with its name and parent."""
    base = api_pb2.ModelInfo(
        id=info.model, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        dtype=info.dtype, eos_token_ids=info.eos_token_ids)
    models = [base]
    for name, parent in adapters:
        models.append(api_pb2.ModelInfo())
        models[-1].CopyFrom(base)
        models[-1].id, models[-1].parent = name, parent
    return api_pb2.ListModelsResponse(models=models)
