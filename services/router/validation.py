"""Request validation: public SamplingParams -> engine params + router-side text options.

This is where a request's parameters are checked, once: the ``EngineSamplingParams`` it makes
(``services/common/sampling_params.py``) has every default filled in, and the scheduler and the
workers take it as it is. Every rule raises ``RequestError`` (gRPC INVALID_ARGUMENT) with a
message that names the field, the allowed range and the value received, in vLLM's wording,
e.g. ``temperature must be >= 0, got -1.0`` or ``top_p must be in (0, 1], got 1.5``.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.pb.pagedserve.v1 import api_pb2
from services.common.sampling_params import TOP_K_OFF, EngineSamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_REQUEST_ID_CHARS = 128
MAX_N = 64  # most choices (parallel samples) per request
MAX_BEAM_WIDTH = 64  # most beams of one beam search
EARLY_STOPPING = ("true", "false", "never")  # transformers' early_stopping values, as strings
MAX_LOGPROBS = 20  # default router --max-logprobs: most top logprobs per token (vLLM's)
MAX_LOGIT_BIAS = 1024  # most logit_bias entries per request
LOGIT_BIAS_RANGE = 100.0  # a bias is in [-100, 100] (OpenAI's range)
PRIORITY_POLICY = "priority"  # the scheduling policy under which priority != 0 is allowed
# Chat roles a message may have: OpenAI's (``function`` is its deprecated tool role). vLLM
# passes any role to the chat template; we refuse unknown ones, as OpenAI does, so a typo is
# not silently rendered into the prompt.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class RequestError(Exception):
    """A request the router refuses; the gRPC servicer turns it into a status (``code`` and
    ``message``), the HTTP layer into OpenAI's error body (``param`` its field,
    ``openai.requests.from_error``).

    Attributes:
        code: the gRPC status code (INVALID_ARGUMENT for every rule here).
        message: what is wrong, naming the field and its allowed range.
        param: the request field at fault as api.proto's GenerateRequest / SamplingParams
            name it at the top level (``"temperature"``, ``"stop"`` for ``stop[2]``,
            ``"messages"`` for ``chat.messages[1].role``, ``"prompt"`` for the prompt or its
            token ids), or None when no one field is.
    """

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def invalid(message: str, param: str | None) -> RequestError:
    """A RequestError with INVALID_ARGUMENT (every validation rule's code) about ``param``."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, param)


@dataclass(frozen=True, slots=True)
class TextOptions:
    """The options the router applies to the output text (the engine never sees them).

    Attributes:
        stop: stop strings, matched on the detokenized text.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        skip_special_tokens: leave special tokens out of the text.
        stop_token_ids: the stop token ids a finish reports (``GenerateResponse.stop_token_id``):
            the request's, less the model's EOS ids unless ignore_eos (vLLM checks EOS
            first). Set by ``generation.prepare``, which knows the EOS ids.
    """

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: frozenset[int] = frozenset()


def _fmt(x: float) -> str:
    """A float32 proto value as the client most likely wrote it (0.1, not 0.10000000149)."""
    return repr(float(f"{x:.7g}"))


def _finite(name: str, x: float, param: str | None = None) -> float:
    """``x``, the field ``name`` (its ``param``; None: ``name``), checked to be finite."""
    if not math.isfinite(x):
        raise invalid(f"{name} must be a finite number, got {_fmt(x)}", param or name)
    return x


def validate_sampling(sp: api_pb2.SamplingParams, *, vocab_size: int,
                      max_logprobs: int = MAX_LOGPROBS
                      ) -> tuple[EngineSamplingParams, TextOptions]:
    """Check ``sp`` and split them into what the engine samples with and what the router
    applies to the text. Unset fields take the defaults documented in api.proto.

    top_k 0, -1 and values >= vocab_size all mean "off" and become -1 (``TOP_K_OFF``).
    With ``use_beam_search`` the engine parameters are a beam search's (``_beam_search``);
    without it, ``beam_width``, ``length_penalty`` and ``early_stopping`` must be unset (or at
    their defaults).

    Raises:
        RequestError(INVALID_ARGUMENT): a field is out of range (the message names it), or a
            field beam search refuses is set with it (see ``_beam_search``).
    """
    temperature = _finite("temperature", sp.temperature) if sp.HasField(
        "temperature") else 1.0
    if temperature < 0:
        raise invalid(f"temperature must be >= 0, got {_fmt(temperature)}", "temperature")
    top_p = _finite("top_p", sp.top_p) if sp.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {_fmt(top_p)}", "top_p")
    top_k = sp.top_k if sp.HasField("top_k") else TOP_K_OFF
    if top_k < -1:
        raise invalid(f"top_k must be -1 (off) or >= 0, got {top_k}", "top_k")
    if top_k == 0 or top_k >= vocab_size:
        top_k = TOP_K_OFF
    if sp.HasField("max_tokens") and sp.max_tokens < 1:
        raise invalid(f"max_tokens must be >= 1, got {sp.max_tokens}", "max_tokens")
    stop = tuple(sp.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    for i, s in enumerate(stop):
        if not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
            raise invalid(f"stop[{i}] must have 1 to {MAX_STOP_STRING_CHARS} characters, "
                               f"got {len(s)}", "stop")
    _check_ids("stop_token_ids", sp.stop_token_ids, vocab_size, "stop_token_ids")
    engine = EngineSamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k,
        seed=sp.seed if sp.HasField("seed") else None,
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else None,
        stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        logprobs=_logprobs(sp, "logprobs", max_logprobs, vocab_size),
        prompt_logprobs=_logprobs(sp, "prompt_logprobs", max_logprobs, vocab_size),
        logit_bias=_logit_bias(sp, vocab_size), **_penalties(sp))
    text = TextOptions(
        stop=stop, include_stop_str_in_output=sp.include_stop_str_in_output,
        skip_special_tokens=(sp.skip_special_tokens
                             if sp.HasField("skip_special_tokens") else True))
    if sp.use_beam_search:
        return _beam_search(sp, engine), text
    for name in ("beam_width", "length_penalty", "early_stopping"):
        if sp.HasField(name) and getattr(sp, name) != _BEAM_DEFAULTS.get(name):
            raise invalid(f"{name} requires use_beam_search to be true", name)
    return engine, text


# The beam search fields' defaults: set to them without use_beam_search, they are accepted.
_BEAM_DEFAULTS = {"length_penalty": 1.0, "early_stopping": "false"}
# The sampling options beam search does not use, each with the one value it accepts ("off").
_BEAM_OFF = (("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
             ("presence_penalty", 0.0), ("frequency_penalty", 0.0))


def _beam_search(sp: api_pb2.SamplingParams, engine: EngineSamplingParams
                 ) -> EngineSamplingParams:
    """The engine parameters of a beam search (``use_beam_search``): ``engine`` (``sp``
    already checked as for sampling) reduced to what beam search uses (max_tokens,
    stop_token_ids, ignore_eos) plus beam_width (default n), length_penalty (default 1.0) and
    early_stopping (default "false"), at temperature 0 (unset means 0 here); the seed is
    ignored.

    Raises:
        RequestError(INVALID_ARGUMENT): a sampling option beam search does not use is on
            (``top_p must be 1 with use_beam_search, got 0.9``), logprobs, prompt_logprobs,
            structured_outputs or stop strings are set, ``beam_width`` is outside [n, 64],
            ``length_penalty`` is not finite, or ``early_stopping`` is none of "true",
            "false", "never".
    """
    given = {"temperature": sp.temperature if sp.HasField("temperature") else 0.0}
    for name, off in _BEAM_OFF:
        value = given.get(name, getattr(engine, name))
        if value != off:
            raise invalid(f"{name} must be {off:g} with use_beam_search, got {_fmt(value)}", name)
    if engine.top_k != TOP_K_OFF:
        raise invalid(f"top_k must be off (0 or -1) with use_beam_search, got {engine.top_k}",
                      "top_k")
    if engine.min_tokens:
        raise invalid(f"min_tokens must be 0 with use_beam_search, got {engine.min_tokens}",
                      "min_tokens")
    if engine.logit_bias:
        raise invalid("logit_bias must be empty with use_beam_search", "logit_bias")
    for name in ("logprobs", "prompt_logprobs", "structured_outputs"):
        if sp.HasField(name):
            raise invalid(f"{name} is not supported with use_beam_search", name)
    if sp.stop:
        raise invalid("stop (stop strings) is not supported with use_beam_search: beams are "
                      "ranked on tokens, not text; use stop_token_ids", "stop")
    n = validate_n(sp)
    width = sp.beam_width if sp.HasField("beam_width") else n
    if not n <= width <= MAX_BEAM_WIDTH:
        raise invalid(f"beam_width must be in [n, {MAX_BEAM_WIDTH}] (n is {n}), got {width}",
                      "beam_width")
    length_penalty = (_finite("length_penalty", sp.length_penalty)
                      if sp.HasField("length_penalty") else 1.0)
    early_stopping = sp.early_stopping if sp.HasField("early_stopping") else "false"
    if early_stopping not in EARLY_STOPPING:
        raise invalid('early_stopping must be one of "true", "false", "never", got '
                      f"{early_stopping!r}", "early_stopping")
    return EngineSamplingParams(
        temperature=0.0, max_tokens=engine.max_tokens, stop_token_ids=engine.stop_token_ids,
        ignore_eos=engine.ignore_eos, beam_width=width, length_penalty=length_penalty,
        early_stopping=early_stopping)


def _logprobs(sp: api_pb2.SamplingParams, name: str, limit: int, vocab_size: int
              ) -> int | None:
    """``sp.<name>`` (logprobs or prompt_logprobs) in [0, limit] (the router's
    --max-logprobs; -1: ``vocab_size``), or None (unset).

    Raises:
        RequestError(INVALID_ARGUMENT): out of range, e.g. ``logprobs must be in [0, 20]
            (the router's --max-logprobs), got 21``.
    """
    if not sp.HasField(name):
        return None
    value = getattr(sp, name)
    limit = vocab_size if limit < 0 else limit
    if not 0 <= value <= limit:
        raise invalid(f"{name} must be in [0, {limit}] (the router's --max-logprobs), "
                      f"got {value}", name)
    return value


def _logit_bias(sp: api_pb2.SamplingParams, vocab_size: int
                ) -> tuple[tuple[int, float], ...]:
    """``sp.logit_bias`` as (token id, bias) pairs sorted by id: at most
    ``MAX_LOGIT_BIAS`` entries, ids in [0, vocab_size), biases finite and in [-100, 100].

    Raises:
        RequestError(INVALID_ARGUMENT): e.g. ``logit_bias token id 60000 must be in
            [0, 49152)`` or ``logit_bias[5] must be in [-100, 100], got 150.0``.
    """
    if len(sp.logit_bias) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, "
                      f"got {len(sp.logit_bias)}", "logit_bias")
    pairs = tuple(sorted(sp.logit_bias.items()))
    for token_id, bias in pairs:
        if not 0 <= token_id < vocab_size:
            raise invalid(f"logit_bias token id {token_id} must be in [0, {vocab_size})",
                          "logit_bias")
        _finite(f"logit_bias[{token_id}]", bias, "logit_bias")
        if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
            raise invalid(f"logit_bias[{token_id}] must be in [-100, 100], got {_fmt(bias)}",
                          "logit_bias")
    return pairs


def _penalties(sp: api_pb2.SamplingParams) -> dict[str, Any]:
    """min_p, the three penalties and min_tokens, checked (vLLM's ranges), with defaults.

    Raises:
        RequestError(INVALID_ARGUMENT): e.g. ``min_p must be in [0, 1], got 1.5``.
    """
    def get(name: str, default: float) -> float:
        return _finite(name, getattr(sp, name)) if sp.HasField(name) else default

    min_p = get("min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise invalid(f"min_p must be in [0, 1], got {_fmt(min_p)}", "min_p")
    repetition_penalty = get("repetition_penalty", 1.0)
    if repetition_penalty <= 0:
        raise invalid(f"repetition_penalty must be > 0, got {_fmt(repetition_penalty)}",
                      "repetition_penalty")
    out: dict[str, float | int] = {"min_p": min_p, "repetition_penalty": repetition_penalty}
    for name in ("presence_penalty", "frequency_penalty"):
        out[name] = get(name, 0.0)
        if not -2 <= out[name] <= 2:
            raise invalid(f"{name} must be in [-2, 2], got {_fmt(out[name])}", name)
    min_tokens = sp.min_tokens if sp.HasField("min_tokens") else 0
    if min_tokens < 0:
        raise invalid(f"min_tokens must be >= 0, got {min_tokens}", "min_tokens")
    if sp.HasField("max_tokens") and min_tokens > sp.max_tokens:
        raise invalid(f"min_tokens must be <= max_tokens ({sp.max_tokens}), "
                      f"got {min_tokens}", "min_tokens")
    out["min_tokens"] = min_tokens
    return out


def validate_n(sp: api_pb2.SamplingParams) -> int:
    """The number of choices to generate: ``sp.n``, default 1.

    Raises:
        RequestError(INVALID_ARGUMENT): n outside [1, 64], e.g. ``n must be in [1, 64], got 0``.
    """
    n = sp.n if sp.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be in [1, {MAX_N}], got {n}", "n")
    return n


def validate_priority(priority: int, *, scheduling_policy: str) -> int:
    """Check a request's scheduling priority (lower runs sooner, as in vLLM) against the
    engine's policy: any int32 under "priority"; only 0 under "fcfs" (or an engine that does not
    report a policy, which is fcfs).

    Raises:
        RequestError(INVALID_ARGUMENT): priority != 0 while the policy is not "priority".
    """
    if priority != 0 and scheduling_policy != PRIORITY_POLICY:
        raise invalid("priority must be 0 unless the scheduler runs --scheduling-policy "
                      f"priority (it runs {scheduling_policy or 'fcfs'}), got {priority}",
                      "priority")
    return priority


def validate_prompt_ids(ids: Sequence[int], *, max_model_len: int, vocab_size: int) -> None:
    """Check a tokenized prompt: non-empty, shorter than ``max_model_len`` (so at least one
    token can be generated), every id in [0, vocab_size).

    Raises:
        RequestError(INVALID_ARGUMENT): naming the lengths or the first bad id and its index.
    """
    if len(ids) == 0:
        raise invalid("prompt is empty", "prompt")
    if len(ids) >= max_model_len:
        raise invalid(f"prompt has {len(ids)} tokens but max_model_len is {max_model_len}: "
                           "the prompt must be shorter than max_model_len", "prompt")
    _check_ids("prompt_token_ids", ids, vocab_size, "prompt")


def validate_messages(messages: Sequence) -> list[dict]:
    """Check a conversation and return it as the dicts the chat template takes (OpenAI's
    message shape, as transformers' ``apply_chat_template`` expects it). ``messages``:
    ChatMessage protos or dicts with the same fields (a dict's tool calls are
    ``{"id", "name", "arguments"}`` dicts too). The same rules for Generate's ``chat``, the Chat
    RPC and OpenAI's /v1/chat/completions (the index is the message's).

    Rules: a string role among ``CHAT_ROLES`` and string content; ``tool_calls`` only on an
    ``assistant`` message, each with an id, a function name and arguments that are a JSON object
    as text; ``tool_call_id`` only on a ``tool`` message, and there required, naming the id of a
    tool call of an earlier assistant message.

    Returns:
        ``[{"role", "content"}]``, plus ``"name"`` when set, ``"tool_calls": [{"id", "type":
        "function", "function": {"name", "arguments": dict}}]`` (arguments parsed from JSON,
        as vLLM hands them to templates) and a tool message's ``"tool_call_id"``.

    Raises:
        RequestError(INVALID_ARGUMENT): naming the message and field, e.g. ``messages[1].role
            must be one of system, developer, user, assistant, tool, function, got 'wizard'``
            or ``messages[3].tool_call_id 'x' answers no earlier tool call``.
    """
    if not messages:
        raise invalid("messages is empty", "messages")
    out = []
    call_ids: set[str] = set()  # ids of the tool calls made so far
    for i, m in enumerate(messages):
        role, content = _get(m, "role", None), _get(m, "content", None)
        if not isinstance(role, str) or not isinstance(content, str):
            raise invalid(f"messages[{i}] needs a string role and content", "messages")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                          f"got {role!r}", "messages")
        message: dict[str, Any] = {"role": role, "content": content}
        if _get(m, "name", ""):
            message["name"] = _get(m, "name", "")
        calls = _get(m, "tool_calls", ())
        if calls:
            if role != "assistant":
                raise invalid(f"messages[{i}].tool_calls: only an assistant message makes "
                              f"tool calls, this one is {role!r}", "messages")
            message["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]", "messages")
                                     for j, c in enumerate(calls)]
        call_id = _get(m, "tool_call_id", "")
        if role == "tool":
            if not call_id:
                raise invalid(f"messages[{i}].tool_call_id is required on a tool message",
                              "messages")
            if call_id not in call_ids:
                raise invalid(f"messages[{i}].tool_call_id {call_id!r} answers no tool call "
                              "of an earlier assistant message", "messages")
            message["tool_call_id"] = call_id
        elif call_id:
            raise invalid(f"messages[{i}].tool_call_id: only a tool message answers a tool "
                          f"call, this one is {role!r}", "messages")
        call_ids.update(c["id"] for c in message.get("tool_calls", ()))
        out.append(message)
    return out


def validate_tools(tools: Sequence[api_pb2.Tool]) -> list[dict]:
    """Check the functions offered to the model and return them as the chat template takes
    them: ``[{"type": "function", "function": {"name", "description"?, "parameters"?}}]``
    (OpenAI's shape, transformers' ``apply_chat_template(tools=...)``; the parameters parsed
    from JSON; an empty description or parameters_json is left out).

    Raises:
        RequestError(INVALID_ARGUMENT): a tool without a name, two tools of one name, or
            parameters_json that is not a JSON object, e.g. ``tools[1].name 'f' is taken by
            tools[0]``.
    """
    out: list[dict] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if not tool.name:
            raise invalid(f"tools[{i}].name is empty", "tools")
        if tool.name in seen:
            raise invalid(f"tools[{i}].name {tool.name!r} is taken by tools[{seen[tool.name]}]",
                          "tools")
        seen[tool.name] = i
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters_json:
            function["parameters"] = _json_object(f"tools[{i}].parameters_json",
                                                  tool.parameters_json, "tools")
        out.append({"type": "function", "function": function})
    return out


def _get(message, name: str, default):
    """A ChatMessage's (or ToolCall's) field, or the dict's key (``default`` when absent)."""
    return message.get(name, default) if isinstance(message, dict) else getattr(message, name)


def _tool_call(call, name: str, param: str) -> dict:
    """One ToolCall (proto or dict), the field ``name`` of the request field ``param``, as the
    template takes it, checked."""
    call_id, function = _get(call, "id", ""), _get(call, "name", "")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{name}.id must be a non-empty string", param)
    if not isinstance(function, str) or not function:
        raise invalid(f"{name}.name must be a non-empty string", param)
    arguments = _get(call, "arguments", "")
    if not isinstance(arguments, str):
        raise invalid(f"{name}.arguments must be a JSON object as text", param)
    return {"id": call_id, "type": "function",
            "function": {"name": function, "arguments": _json_object(
                f"{name}.arguments", arguments, param)}}


def _json_object(name: str, text: str, param: str) -> dict:
    """``text`` (the field ``name`` of the request field ``param``) parsed as a JSON object.

    Raises:
        RequestError(INVALID_ARGUMENT): not JSON, or not an object (naming ``name``).
    """
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise invalid(f"{name} must be a JSON object as text: {e}", param) from None
    if not isinstance(value, dict):
        raise invalid(f"{name} must be a JSON object as text, got a {type(value).__name__}", param)
    return value


def validate_chat_template_kwargs(text: str, reserved: Collection[str] = ()) -> dict:
    """A chat's ``chat_template_kwargs`` (the text of a JSON object; empty: none) as the dict
    of extra template variables.

    Args:
        reserved: names the template call takes as its own arguments (``messages``, ``tools``,
            ``tokenize``, ...), which a client may not set.

    Raises:
        RequestError(INVALID_ARGUMENT): not a JSON object, NaN or an infinite number in it,
            or a reserved key, e.g. ``chat.chat_template_kwargs may not set 'tokenize' (an
            argument of the template call, not a template variable)``.
    """
    if not text:
        return {}
    value = _json_object("chat.chat_template_kwargs", text, "chat_template_kwargs")
    try:  # Python's json reads NaN, Infinity and 1e400 (as inf): none of them is JSON
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise invalid("chat.chat_template_kwargs must hold JSON values only: NaN and infinite "
                      "numbers (e.g. 1e400) are not JSON", "chat_template_kwargs") from None
    for key in value:
        if key in reserved:
            raise invalid(f"chat.chat_template_kwargs may not set {key!r} (an argument of the "
                          "template call, not a template variable)", "chat_template_kwargs")
    return value


def validate_request_id(request_id: str) -> str:
    """Return the client's request id, or a fresh one (32 hex digits) when it is empty.

    Raises:
        RequestError(INVALID_ARGUMENT): longer than 128 characters.
    """
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id must have at most {MAX_REQUEST_ID_CHARS} characters, "
                           f"got {len(request_id)}", "request_id")
    return request_id or uuid.uuid4().hex


def _check_ids(name: str, ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Raise naming the first id of ``ids`` (the field ``name`` of the request field
    ``param``) outside [0, vocab_size); O(n) in C for the common case."""
    if len(ids) and (min(ids) < 0 or max(ids) >= vocab_size):
        i, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise invalid(f"{name}[{i}] must be in [0, {vocab_size}), got {bad}", param)


def validate_token_ids(name: str, ids: Sequence[int], *, vocab_size: int) -> None:
    """Check that every id of ``ids`` (the request field ``name``) is in [0, vocab_size); an
    empty list passes.

    Raises:
        RequestError(INVALID_ARGUMENT): naming the first bad id and its index, e.g.
            ``token_ids[3] must be in [0, 49152), got 60000``.
    """
    _check_ids(name, ids, vocab_size, name)
