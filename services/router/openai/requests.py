"""OpenAI JSON request bodies -> ``api_pb2.GenerateRequest``, and the OpenAI error for a
validation or engine error (``from_error``; the error itself is ``openai.errors.OpenAIError``).

Only the JSON *types* are checked here (a number where a number belongs, an int32 where the
proto has one); every range rule stays in ``services.router.validation``, which runs afterwards
through ``generation.prepare`` exactly as for a gRPC call. Fields this module does not know are
ignored, as OpenAI clients send extras; fields it knows but does not implement (suffix,
functions, ...) are refused with a 400 naming them. What the response carries besides the
text (logprobs, vLLM's prompt_logprobs, return_tokens_as_token_ids, continuous usage) is the
``OutputOptions`` of ``openai.responses``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from services.common.pb.pagedserve.v1 import api_pb2
from services.router.generation import EngineError
from services.router.openai.errors import OpenAIError, bad_request, utf8
from services.router.openai.messages import parse_messages
from services.router.openai.responses import OutputOptions
from services.router.openai.structured_output_format import error_param, parse_structured_outputs
from services.router.openai.tools import parse_tools
from services.router.validation import MAX_LOGPROBS, MAX_N, RequestError

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
SEED_MODULUS = 2**64  # the proto's seed is a uint64; OpenAI's may be negative

# The gRPC codes of RequestError / EngineError -> (HTTP status, OpenAI error type).
_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
         grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
         grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
         grpc.StatusCode.UNAVAILABLE: (503, "server_error")}
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty")
_INTS = ("top_k", "n", "min_tokens")
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
# The ``RequestError.param`` of a grammar error (services.router.structured_output_grammar).
STRUCTURED = "structured_outputs"
MAX_BEST_OF = MAX_N  # candidates per prompt, as many as choices
MAX_PROMPTS = 1024  # prompts in one /v1/completions batch
_INT_KEY = re.compile(r"-?[0-9]{1,12}")  # a logit_bias key: a token id in decimal


def from_error(error: RequestError | EngineError, prompt_param: str = "prompt",
               structured_param: str = STRUCTURED) -> OpenAIError:
    """The OpenAI error for a validation or engine error, by its gRPC code: INVALID_ARGUMENT
    and OUT_OF_RANGE -> 400, RESOURCE_EXHAUSTED -> 429, UNAVAILABLE -> 503, anything else ->
    500; the message as it is. A 400's ``param`` is the error's ``param``, where the route
    names it differently mapped: the prompt's fields ("prompt", "messages") to
    ``prompt_param``, a grammar's to ``structured_param``, ``request_id`` (the
    X-Request-Id header here, not a field) to none.

    Args:
        prompt_param: the request field holding the prompt ("prompt", "messages" or
            "input").
        structured_param: the request field that set the grammar ("structured_outputs",
            "response_format", ...).
    """
    status, type_ = _HTTP.get(error.code, (500, "server_error"))
    param = None
    if status == 400:
        route = {"prompt": prompt_param, "messages": prompt_param,
                 STRUCTURED: structured_param, "request_id": None}
        param = route.get(error.param, error.param) if error.param is not None else None
    return OpenAIError(status, error.message, type_, param, error.code.name.lower())


@dataclass(slots=True)
class ParsedRequest:
    """An OpenAI request mapped onto the gRPC API.

    Attributes:
        request: the GenerateRequest to ``prepare`` (request_id left empty: one is generated).
        stream: answer as server-sent events.
        include_usage: (streaming) send a last chunk with the whole request's usage.
        prompt_param: "prompt" (completions) or "messages" (chat), for error params.
        tool_calls: (chat with tools) makes the per-choice parser that reads tool calls out
            of the text (``openai.tool_calls``); None: the text is the content.
        structured_param: the field that set ``sampling_params.structured_outputs``, named by
            the 400 of an invalid grammar (see ``from_error``).
        include_reasoning: (chat) return the reasoning span (``--reasoning-parser``); False
            drops it.
        chat_template_kwargs: (chat) the extra template variables (also in ``request``, as
            text), read by the reasoning parser (``enable_thinking``).
        options: what the response carries besides the text.
    """

    request: api_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    prompt_param: str
    tool_calls: Callable[[], Any] | None = None
    structured_param: str = STRUCTURED
    include_reasoning: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)
    options: OutputOptions = field(default_factory=OutputOptions)


@dataclass(slots=True)
class ParsedCompletion:
    """A POST /v1/completions body mapped onto the gRPC API: one GenerateRequest per prompt
    (``services.router.openai.completions`` runs them).

    Attributes:
        requests: one per prompt, in order, all with the same sampling parameters (the engine
            ones: ``logprobs`` / ``prompt_logprobs`` / ``max_tokens`` as the options below
            need them); request_id left empty.
        stream, include_usage: as ``ParsedRequest``.
        n: choices returned per prompt.
        best_of: candidates generated per prompt (>= n); when larger than n, the n with the
            highest cumulative logprob are returned.
        echo: each choice starts with its prompt's text (and, with logprobs, the prompt
            tokens' logprobs).
        score_only: ``echo`` with ``max_tokens: 0``: the engine generates one token (it
            always does), which is not returned nor counted.
        logprobs: the client asked for logprobs (the engine may be asked even when not, for
            best_of's ranking): how many top logprobs, or None.
        options: what the response carries besides the text.
    """

    requests: list[api_pb2.GenerateRequest]
    stream: bool
    include_usage: bool
    n: int
    best_of: int
    echo: bool
    score_only: bool
    logprobs: int | None
    options: OutputOptions = field(default_factory=OutputOptions)


def parse_completion(body: dict) -> ParsedCompletion:
    """Map a POST /v1/completions body. ``prompt`` is a string, a list of token ids, or a
    list of those (a batch of at most ``MAX_PROMPTS`` prompts; a list of ints is one prompt).

    Raises:
        OpenAIError: 400 for a wrong JSON type, an unsupported field, ``best_of`` outside
            [n, 64], ``best_of > n`` with ``stream`` or ``use_beam_search``, or
            ``max_tokens: 0`` with ``min_tokens``.
    """
    _refuse(body, suffix=None)
    template = api_pb2.GenerateRequest()
    sp = template.sampling_params
    logprobs = _int32(body, "logprobs")  # the range is validation's: [0, --max-logprobs]
    echo = _typed(body, "echo", bool) or False
    max_tokens = body.get("max_tokens")
    score_only = echo and _is_int(max_tokens) and max_tokens == 0
    _sampling(body, template, 1 if score_only else max_tokens, "max_tokens")
    if score_only and sp.min_tokens > 0:
        raise bad_request(f"min_tokens must be <= max_tokens (0), got {sp.min_tokens}",
                          "min_tokens")
    n = sp.n if sp.HasField("n") else 1  # its range is validation's
    best_of = _int32(body, "best_of")
    if best_of is not None and not n <= best_of <= MAX_BEST_OF:
        raise bad_request(f"best_of must be in [n, {MAX_BEST_OF}] (n is {n}), got {best_of}",
                          "best_of")
    best_of = max(best_of or n, n)
    if best_of > n and sp.use_beam_search:
        raise bad_request("best_of must be n with use_beam_search: n is the number of "
                          "hypotheses returned, beam_width the number searched", "best_of")
    parsed = _parsed(body, template, "prompt")
    if parsed.stream and best_of > n:
        raise bad_request("best_of > n cannot be streamed: the best candidates are known only "
                          "when all have finished", "best_of")
    if logprobs is not None:
        sp.logprobs = logprobs
        if echo:  # the engine's prompt_logprobs serve both echo and vLLM's prompt_logprobs
            sp.prompt_logprobs = max(logprobs, sp.prompt_logprobs)
    elif best_of > n:
        sp.logprobs = 0  # the ranking needs each sampled token's logprob
    requests = []
    for name, prompt in _prompts(body.get("prompt")):
        req = api_pb2.GenerateRequest()
        req.CopyFrom(template)
        _prompt(req, prompt, name)
        requests.append(req)
    return ParsedCompletion(requests, parsed.stream, parsed.include_usage, n, best_of, echo,
                            score_only, logprobs, _options(parsed, logprobs is not None))


def _prompts(prompt) -> list[tuple[str, object]]:
    """The prompts of a completions body with their names: ``[("prompt", p)]`` for one,
    ``[("prompt[0]", p0), ...]`` for a batch (a list of strings or of lists)."""
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))):
        return [("prompt", prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt must have at most {MAX_PROMPTS} prompts, got {len(prompt)}",
                          "prompt")
    if len(prompt) == 1:
        return [("prompt", prompt[0])]
    return [(f"prompt[{i}]", p) for i, p in enumerate(prompt)]


def _prompt(req: api_pb2.GenerateRequest, prompt, name: str) -> None:
    """Set ``req``'s input to ``prompt``: a string or a list of token ids (``name`` is the
    field, e.g. "prompt[2]", for the error)."""
    if isinstance(prompt, str):
        req.prompt = utf8(prompt, name, "prompt")
    elif isinstance(prompt, list):
        if not all(_is_int(t) and INT32_MIN <= t <= INT32_MAX for t in prompt):
            raise bad_request(f"{name} must be a string or a list of token ids (ints)",
                              "prompt")
        req.prompt_token_ids.ids.extend(prompt)
    elif prompt is None:
        raise bad_request(f"{name} is required", "prompt")
    else:
        raise bad_request(f"{name} must be a string or a list of token ids", "prompt")


def parse_chat(body: dict, tool_parser: str | None = None,
               max_logprobs: int = MAX_LOGPROBS) -> ParsedRequest:
    """Map a POST /v1/chat/completions body: ``messages`` (``openai.messages``), ``tools`` and
    ``tool_choice`` (``openai.tools``); ``max_completion_tokens`` wins over the deprecated
    ``max_tokens``.

    Args:
        tool_parser: the router's ``--tool-call-parser`` if ``--enable-auto-tool-choice`` is
            set, else None (``tool_choice: "auto"`` is then refused).
        max_logprobs: the most ``top_logprobs`` (the router's --max-logprobs, -1 resolved).

    With ``use_beam_search`` the output is plain content (no tool-call parsing), and a
    ``tool_choice`` that forces a call ("required", a named function) is refused: it is a
    structured output, which beam search does not support.

    Raises:
        OpenAIError: 400 for a wrong JSON type, an unsupported field, or a forced tool call
            with beam search.
    """
    _refuse(body, functions=[])
    req = api_pb2.GenerateRequest()
    req.chat.SetInParent()  # an empty list still selects "chat", so validation names it
    req.chat.messages.extend(parse_messages(body.get("messages")))
    tool_calls = parse_tools(body, req, tool_parser)
    enforced = req.sampling_params.HasField("structured_outputs")  # set by tool_choice
    if enforced and _typed(body, "use_beam_search", bool):
        raise bad_request('tool_choice must be "none" or "auto" with use_beam_search: a forced '
                          "tool call is a structured output, which beam search does not "
                          "support", "tool_choice")
    _chat_logprobs(body, req.sampling_params, max_logprobs)
    kwargs = chat_template_kwargs(body, req.chat)
    name, value = (("max_completion_tokens", body["max_completion_tokens"])
                   if body.get("max_completion_tokens") is not None
                   else ("max_tokens", body.get("max_tokens")))
    _sampling(body, req, value, name)
    parsed = _parsed(body, req, "messages")
    parsed.tool_calls = None if req.sampling_params.use_beam_search else tool_calls
    parsed.chat_template_kwargs = kwargs
    include = _typed(body, "include_reasoning", bool)
    parsed.include_reasoning = True if include is None else include
    parsed.options = _options(parsed, req.sampling_params.HasField("logprobs"))
    if enforced:  # a grammar error is about the tools' parameters schemas
        parsed.structured_param = "tools"
    return parsed


def chat_template_kwargs(body: dict, chat: api_pb2.ChatMessages) -> dict:
    """vLLM's ``chat_template_kwargs`` (an object of JSON values, or null) ->
    ``chat.chat_template_kwargs`` as JSON text (the reserved keys are validation's); also
    ``/tokenize``'s.

    Returns:
        the object (empty when absent).

    Raises:
        OpenAIError: 400 (param "chat_template_kwargs") when not an object, or holding a
            string that is not valid Unicode.
    """
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object of template variables, got "
                          f"{kwargs!r}"[:200], "chat_template_kwargs")
    chat.chat_template_kwargs = utf8(json.dumps(kwargs, ensure_ascii=False),
                                     "chat_template_kwargs")
    return kwargs


def _chat_logprobs(body: dict, sp: api_pb2.SamplingParams, limit: int) -> None:
    """Chat's ``logprobs`` (bool) and ``top_logprobs`` (int in [0, limit], only with logprobs)
    -> ``sp.logprobs`` (set only when logprobs is true)."""
    wanted = _typed(body, "logprobs", bool)
    top = _int32(body, "top_logprobs")
    if top is not None and not wanted:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if top is not None and not 0 <= top <= limit:
        raise bad_request(f"top_logprobs must be in [0, {limit}] (the router's "
                          f"--max-logprobs), got {top}", "top_logprobs")
    if wanted:
        sp.logprobs = top or 0


def _parsed(body: dict, req: api_pb2.GenerateRequest, prompt_param: str) -> ParsedRequest:
    stream = _typed(body, "stream", bool) or False
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = (options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad_request("stream_options.include_usage must be a boolean", "stream_options")
    include_usage = bool(include_usage)
    continuous = (options or {}).get("continuous_usage_stats")
    if continuous is not None and not isinstance(continuous, bool):
        raise bad_request("stream_options.continuous_usage_stats must be a boolean",
                          "stream_options")
    prompt_logprobs = _int32(body, "prompt_logprobs")  # the range is validation's
    if prompt_logprobs is not None:
        if stream:
            raise bad_request("prompt_logprobs is not available with stream: true",
                              "prompt_logprobs")
        req.sampling_params.prompt_logprobs = prompt_logprobs
    token_ids = _typed(body, "return_tokens_as_token_ids", bool) or False
    # NOTE: as vLLM, continuous usage needs include_usage too; the options' logprobs flag is
    # set by the caller once it knows whether logprobs were asked for.
    options = OutputOptions(prompt_logprobs=prompt_logprobs, token_ids_as_tokens=token_ids,
                            continuous_usage=include_usage and bool(continuous))
    return ParsedRequest(req, stream, include_usage, prompt_param,
                         structured_param=error_param(body), options=options)


def _options(parsed: ParsedRequest, logprobs: bool) -> OutputOptions:
    """``parsed.options`` with ``logprobs`` set."""
    return replace(parsed.options, logprobs=logprobs)


def _sampling(body: dict, req: api_pb2.GenerateRequest, max_tokens, max_tokens_name: str):
    """Copy the sampling fields into ``req`` (type checks only; ranges are validation's)."""
    sp = req.sampling_params
    for name in _FLOATS:
        value = _typed(body, name, float)
        if value is not None:
            setattr(sp, name, value)
    for name in _INTS:
        value = _int32(body, name)
        if value is not None:
            setattr(sp, name, value)
    for name in _BOOLS:
        value = _typed(body, name, bool)
        if value is not None:
            setattr(sp, name, value)
    if max_tokens is not None:
        limit = _int32({max_tokens_name: max_tokens}, max_tokens_name)
        assert limit is not None  # None only for a null value
        sp.max_tokens = limit
    seed = _typed(body, "seed", int)
    if seed is not None:
        sp.seed = seed % SEED_MODULUS
    stop = body.get("stop")
    if isinstance(stop, str):
        sp.stop.append(utf8(stop, "stop"))
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        sp.stop.extend(utf8(s, f"stop[{i}]", "stop") for i, s in enumerate(stop))
    elif stop is not None:
        raise bad_request("stop must be a string or a list of strings", "stop")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not (isinstance(ids, list)
                and all(_is_int(t) and INT32_MIN <= t <= INT32_MAX for t in ids)):
            raise bad_request("stop_token_ids must be a list of token ids (ints)",
                              "stop_token_ids")
        sp.stop_token_ids.extend(ids)
    priority = _int32(body, "priority")
    if priority is not None:
        req.priority = priority
    _logit_bias(body, sp)
    parse_structured_outputs(body, sp)
    _beam_search(body, sp)


def _beam_search(body: dict, sp: api_pb2.SamplingParams) -> None:
    """vLLM's beam search fields ``use_beam_search`` (a boolean), ``length_penalty`` (a
    number), ``early_stopping`` (true, false or "never") and pagedserve's ``beam_width`` (an
    int) -> ``sp`` (their ranges are validation's, as the rest of beam search's rules).

    Raises:
        OpenAIError: 400 naming the field for a wrong JSON type, or for ``response_format`` /
            ``structured_outputs`` with ``use_beam_search`` (the field the client set).
    """
    use = _typed(body, "use_beam_search", bool)
    if use is not None:
        sp.use_beam_search = use
    width = _int32(body, "beam_width")
    if width is not None:
        sp.beam_width = width
    length_penalty = _typed(body, "length_penalty", float)
    if length_penalty is not None:
        sp.length_penalty = length_penalty
    early = body.get("early_stopping")
    if isinstance(early, bool):
        sp.early_stopping = "true" if early else "false"
    elif early == "never":
        sp.early_stopping = early
    elif early is not None:
        raise bad_request(f'early_stopping must be true, false or "never", got {early!r}',
                          "early_stopping")
    if use and sp.HasField("structured_outputs"):
        param = error_param(body)
        raise bad_request(f"{param} is not supported with use_beam_search", param)


def _logit_bias(body: dict, sp: api_pb2.SamplingParams) -> None:
    """OpenAI's ``logit_bias``: an object of token ids written as decimal strings ("50256")
    to numbers -> ``sp.logit_bias`` (the id and bias ranges are validation's).

    Raises:
        OpenAIError: 400 (param "logit_bias") for a key that is not an int32 or a value that
            is not a number.
    """
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise bad_request("logit_bias must be an object of token ids to biases", "logit_bias")
    for key, value in bias.items():
        if not (_INT_KEY.fullmatch(key) and INT32_MIN <= int(key) <= INT32_MAX):
            raise bad_request(f"logit_bias keys must be token ids (integers), got {key!r}",
                              "logit_bias")
        if not (_is_int(value) or isinstance(value, float)):
            raise bad_request(f"logit_bias[{key}] must be a number, got {value!r}",
                              "logit_bias")
        try:
            sp.logit_bias[int(key)] = float(value)
        except OverflowError:  # an int beyond float range: validation calls inf not finite
            sp.logit_bias[int(key)] = float("inf")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _typed(body: dict, name: str, kind: type):
    """``body[name]`` checked to be a JSON ``kind`` (int also accepted for float), or None
    when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if kind is float and (_is_int(value) or isinstance(value, float)):
        try:
            return float(value)
        except OverflowError:  # an int beyond float range: validation calls inf not finite
            return float("inf")
    if kind is int and (_is_int(value) or (isinstance(value, float) and value.is_integer())):
        return int(value)
    if kind is bool and isinstance(value, bool):
        return value
    what = {float: "a number", int: "an integer", bool: "a boolean"}[kind]
    raise bad_request(f"{name} must be {what}, got {value!r}", name)


def _int32(body: dict, name: str) -> int | None:
    value = _typed(body, name, int)
    if value is not None and not INT32_MIN <= value <= INT32_MAX:
        raise bad_request(f"{name} must be in [{INT32_MIN}, {INT32_MAX}], got {value}", name)
    return value


def _refuse(body: dict, **defaults) -> None:
    """400 for an unimplemented field set to anything but its default (or null)."""
    for name, default in defaults.items():
        value = body.get(name)
        if value is not None and value != default:
            raise bad_request(f"{name} is not supported by this server", name)

