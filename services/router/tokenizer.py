"""Turn prompts (text or chat) into token ids with the model's tokenizer.

Loading the tokenizer (folder or GGUF, the conversion cache) lives in
``services/common/tokenizer_loading.py``, shared with the worker; its names are re-exported
here for the router's callers.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from transformers import PreTrainedTokenizerFast

from services.common.pb.pagedserve.v1 import api_pb2
from services.common.tokenizer_loading import (  # noqa: F401  (re-exported)
    install_atomically,
    load_tokenizer,
    read_chat_template,
)
from services.router.validation import (
    invalid,
    validate_chat_template_kwargs,
    validate_messages,
    validate_tools,
)

# Names chat_template_kwargs may not use: apply_chat_template's own arguments (tokenize,
# return_dict, ...) and the variables it sets itself (messages, tools, ...).
RESERVED_TEMPLATE_KWARGS = frozenset(
    name for name, p in inspect.signature(PreTrainedTokenizerFast.apply_chat_template)
    .parameters.items() if p.kind is not p.VAR_KEYWORD) | {"messages", "self"}


def encode_prompt(tokenizer: PreTrainedTokenizerFast, text: str, *,
                  add_special_tokens: bool = True) -> list[int]:
    """Token ids of a plain-text prompt, with the special tokens (e.g. BOS) the tokenizer adds
    by default (its post-processor; SmolLM2 adds none), as vLLM's completions API does.

    Args:
        add_special_tokens: False leaves the post-processor's special tokens out (the text's
            own special-token strings, e.g. "<|im_start|>", are still encoded as such).
    """
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def encode_chat(tokenizer: PreTrainedTokenizerFast, messages: Sequence, *,
                tools: Sequence[api_pb2.Tool] = (), chat_template_kwargs: str = "",
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                add_special_tokens: bool = False) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template, followed (by
    default) by the assistant prefix.

    The template writes any BOS itself, so the rendered text is encoded without adding special
    tokens (vLLM's chat default): the ids never start with a doubled BOS.

    Args:
        messages: ChatMessage protos, or ``[{"role": "system" | "user" | "assistant" | ...,
            "content": str}, ...]`` (checked and shaped by ``validate_messages``: an
            assistant's tool calls and a tool message's ``tool_call_id`` reach the template
            in OpenAI's shape, the arguments parsed from JSON).
        tools: the functions offered to the model, passed to the template as ``tools``
            (OpenAI's ``[{"type": "function", "function": {...}}]``, see ``validate_tools``);
            none: the template gets no ``tools``.
        chat_template_kwargs: extra template variables, the text of a JSON object (e.g.
            ``{"enable_thinking": false}``); empty: none.
        add_generation_prompt: append the assistant prefix (what Generate sends); False ends
            with the last message.
        continue_final_message: end with the last message left open (no end-of-turn token),
            so the model continues it (transformers' / vLLM's option; not with
            ``add_generation_prompt``).
        add_special_tokens: also let the tokenizer's post-processor add its special tokens to
            the rendered text (vLLM's tokenize option; off for generation).

    Raises:
        RequestError(INVALID_ARGUMENT): no messages, a message ``validate_messages`` refuses
            (e.g. a role outside ``validation.CHAT_ROLES``, a tool message answering no tool
            call), a tool ``validate_tools`` refuses, ``chat_template_kwargs`` that is not a
            JSON object or sets one of ``RESERVED_TEMPLATE_KWARGS``, no chat template, the
            template rejected the conversation (e.g. role order), or
            ``continue_final_message`` with ``add_generation_prompt``.
    """
    if not messages:
        raise invalid("chat.messages is empty", "messages")
    rendered = validate_messages(messages)
    tool_dicts: list = validate_tools(tools)
    kwargs = validate_chat_template_kwargs(chat_template_kwargs, RESERVED_TEMPLATE_KWARGS)
    if continue_final_message and add_generation_prompt:
        raise invalid("continue_final_message and add_generation_prompt cannot both be true",
                      None)  # (two options at odds: no one field; /tokenize names the chat's)
    if not tokenizer.chat_template:
        raise invalid("this model has no chat template (a base model?): send a plain prompt "
                      "(/v1/completions), or start the router with --chat-template FILE", None)
    try:
        text = tokenizer.apply_chat_template(rendered, tools=tool_dicts or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **kwargs)
    except Exception as e:  # jinja2 TemplateError, or raise_exception() in the template
        raise invalid(f"chat template rejected the messages: {e}", "messages") from e
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
