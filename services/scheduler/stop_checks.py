"""When a request's new tokens finish it: the scheduler's stop rule (EOS, ``stop_token_ids``,
``max_tokens``, ``max_model_len``), applied token by token. Stop strings are the router's
(they need text)."""

from __future__ import annotations

from collections.abc import Collection

from services.scheduler.request import FinishReason, Request


def check_stop(request: Request, token_id: int, eos_token_ids: Collection[int],
               max_model_len: int) -> FinishReason | None:
    """The finish reason ``token_id``, just appended to ``request``'s output, gives it, or
    None.

    NOTE: STOP wins over LENGTH when both hold (the model did end the text, OpenAI's "stop");
    vLLM V1 checks length first. The eos/stop token stays in output_token_ids. min_tokens: a
    stop token at output index < min_tokens (the worker masks them; this is defence in depth)
    does not finish: num_output_tokens counts it, hence ``>``.
    """
    params = request.sampling_params
    if ((not params.ignore_eos and token_id in eos_token_ids)
            or token_id in params.stop_token_ids) and (
            request.num_output_tokens > params.min_tokens):
        return FinishReason.STOP
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    if request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def append_run(request: Request, token_ids: list[int], eos_token_ids: Collection[int],
               max_model_len: int) -> tuple[list[int], FinishReason | None]:
    """Append ``token_ids`` to ``request``'s output one by one, checking for a stop after each
    (``check_stop``); returns the ones appended (up to and with the one that finished the
    request) and the finish reason (None: it goes on)."""
    for n, token_id in enumerate(token_ids, 1):
        request.output_token_ids.append(token_id)
        reason = check_stop(request, token_id, eos_token_ids, max_model_len)
        if reason is not None:
            return token_ids[:n], reason
    return token_ids, None
