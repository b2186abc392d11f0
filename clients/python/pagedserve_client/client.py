"""gRPC clients for pagedserve's public GenerationService: ``Client`` (blocking) and
``AsyncClient`` (asyncio).

Sampling keyword arguments are vLLM's names: temperature, top_p, top_k, seed, max_tokens, stop,
stop_token_ids, ignore_eos, include_stop_str_in_output, skip_special_tokens, n, min_p,
repetition_penalty, presence_penalty, frequency_penalty, min_tokens, logprobs,
prompt_logprobs, and:

- ``structured_outputs``: constrain the output, as vLLM's ``StructuredOutputsParams`` with
  exactly one of ``{"json": schema}`` (a dict or its JSON text), ``{"regex": ...}``,
  ``{"choice": [...]}``, ``{"grammar": ...}`` (Lark or GBNF), ``{"json_object": True}``; or an
  ``api_pb2.StructuredOutputs`` (see ``pagedserve_client.sampling``).
- ``logit_bias``: ``{token_id: bias}``, bias in [-100, 100], added to the raw logits.
- ``use_beam_search=True`` (vLLM's): beam search instead of sampling, with ``beam_width``
  (beams searched, default ``n``, in [n, 64]), ``length_penalty`` (default 1.0) and
  ``early_stopping`` (True, False (default) or "never", transformers' rule); the ``n`` best
  hypotheses come back as n choices, each whole in one delta at the end of the search, with
  ``beam_score``. The server refuses sampling options with it (temperature > 0, top_p, top_k,
  min_p, penalties, logit_bias, min_tokens, logprobs, prompt_logprobs, structured_outputs,
  stop strings) with INVALID_ARGUMENT naming the field.

``n`` (1..64, default 1) asks for n completions (choices) of the same prompt, as in vLLM and
OpenAI: streamed deltas carry ``index`` (0 .. n-1) and interleave; ``generate`` returns them all
in ``GenerationResult.choices``. With a ``seed``, choice i samples with seed + i, so a repeated
request reproduces every choice.

``priority`` (an int32, default 0; lower runs sooner, as in vLLM) is accepted only when the
server's scheduler runs ``--scheduling-policy priority``; otherwise a non-zero priority is
INVALID_ARGUMENT.

``model`` (default "": the base model) names the model to run, as OpenAI's clients do: a name
of the base model or a LoRA adapter the server serves (``list_models``); another name is
NOT_FOUND.

Besides ``generate`` / ``stream``: ``chat`` / ``chat_stream`` (the Chat RPC: messages in, chat
template applied), ``tokenize`` (text or messages → ``TokenizeResult``), ``detokenize`` (ids →
text) and ``list_models`` (→ ``[ModelInfo]``); their result types are in ``text_types``.

Errors are ``grpc.RpcError`` (``.code()`` INVALID_ARGUMENT etc. with a message naming the field;
RESOURCE_EXHAUSTED when the server sheds load, UNAVAILABLE when it has no engine).

Security: ``root_certificates`` / ``private_key`` / ``certificate_chain`` (PEM bytes) or
``credentials`` (a ``grpc.ChannelCredentials``) make the channel TLS (mTLS with a client
certificate); ``api_key`` is sent as ``authorization: Bearer <key>`` metadata on every call
(UNAUTHENTICATED when the router refuses it).

Deadlines, retries, cancellation:
- ``timeout`` (seconds) on the client is every call's default deadline; each method also takes
  ``timeout=`` for that call. The deadline covers the whole call, retries included; past it
  the call fails with DEADLINE_EXCEEDED.
- A call that fails with UNAVAILABLE before its first streamed message (the router restarting,
  no engine yet) is retried up to ``max_retries`` times with exponential backoff
  (``retry_backoff`` seconds, doubling, at most 2 s). Once a message has arrived the call is
  never retried: the tokens already delivered would be generated again.
- Leaving a stream early (``break``, closing the iterator, cancelling the asyncio task)
  cancels the RPC, and the server aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from pagedserve_client.embeddings import EmbeddingResult, embed_request, embedding_result
from pagedserve_client.pb.pagedserve.v1 import api_pb2, api_pb2_grpc
from pagedserve_client.sampling import early_stopping_str, set_logit_bias, structured_outputs_pb
from pagedserve_client.text_types import (
    ModelInfo,
    TokenizeResult,
    chat_request,
    detokenize_request,
    models_from_pb,
    tokenize_request,
    tokenize_result,
)
from pagedserve_client.types import GenerationResult, StreamDelta, delta_from_pb, join

_SAMPLING_FIELDS = {f.name for f in api_pb2.SamplingParams.DESCRIPTOR.fields}
_DEFAULT = object()  # "use the client's timeout"
MAX_BACKOFF = 2.0  # seconds between retries at most


class _Retry:
    """Deadline and retry bookkeeping of one call (see the module docstring)."""

    def __init__(self, timeout: float | None, max_retries: int, backoff: float):
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.max_retries, self.backoff, self.attempt = max_retries, backoff, 0

    def remaining(self) -> float | None:
        """Seconds left for the next attempt (None = no deadline)."""
        if self.deadline is None:
            return None
        return max(0.001, self.deadline - time.monotonic())

    def next_delay(self, error: grpc.RpcError, started: bool) -> float | None:
        """Seconds to wait before retrying after ``error``, or None to give up (re-raise)."""
        if started or error.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        if self.attempt >= self.max_retries:
            return None
        delay = min(MAX_BACKOFF, self.backoff * 2 ** self.attempt)
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            return None
        self.attempt += 1
        return delay
_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024)]


def build_request(prompt: str | None = None, messages: list[dict] | None = None,
                  prompt_token_ids: list[int] | None = None, request_id: str = "",
                  priority: int = 0, chat_template_kwargs: dict | None = None,
                  model: str = "", **sampling) -> api_pb2.GenerateRequest:
    """Build a GenerateRequest from exactly one of prompt / messages / prompt_token_ids.

    Args:
        request_id: echoed in every response; the server makes one when empty.
        priority: scheduling priority, an int32 (lower runs sooner).
        chat_template_kwargs: (``messages`` only) extra variables for the chat template, e.g.
            ``{"enable_thinking": False}`` (vLLM's ``chat_template_kwargs``; every method
            that takes ``**sampling`` passes it here).
        model: the base model's name or a LoRA adapter's; "" runs the base model.
        **sampling: SamplingParams fields by name (vLLM's names, including ``n`` and the beam
            search ones; ``structured_outputs``, ``logit_bias`` and ``early_stopping`` as in
            ``pagedserve_client.sampling``).

    Raises:
        ValueError: not exactly one prompt form, an unknown sampling parameter, a value out
            of its wire type's range (e.g. a priority outside int32), or
            ``chat_template_kwargs`` without ``messages`` or not JSON-serializable.
        TypeError: a sampling parameter or priority of the wrong type.
    """
    if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
        raise ValueError("pass exactly one of prompt=, messages= or prompt_token_ids=")
    if chat_template_kwargs is not None and messages is None:
        raise ValueError("chat_template_kwargs= needs messages= (it is for the chat template)")
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {sorted(unknown)}; "
                         f"known: {sorted(_SAMPLING_FIELDS)}")
    if isinstance(sampling.get("stop"), str):  # vLLM and OpenAI accept one string
        sampling["stop"] = [sampling["stop"]]
    params = api_pb2.SamplingParams()
    structured, bias = sampling.pop("structured_outputs", None), sampling.pop("logit_bias", None)
    if structured is not None:
        params.structured_outputs.CopyFrom(structured_outputs_pb(structured))
    if bias is not None:
        set_logit_bias(params, bias)
    if sampling.get("early_stopping") is not None:
        sampling["early_stopping"] = early_stopping_str(sampling["early_stopping"])
    for name, value in sampling.items():
        if value is None:
            continue
        try:
            if isinstance(value, (list, tuple)):
                getattr(params, name).extend(value)
            else:
                setattr(params, name, value)
        except (ValueError, TypeError) as e:  # protobuf's range/type checks
            raise type(e)(f"{name}={value!r}: {e}") from None
    req = api_pb2.GenerateRequest(sampling_params=params, request_id=request_id, model=model)
    try:
        req.priority = priority
    except (ValueError, TypeError) as e:
        raise type(e)(f"priority={priority!r}: {e}") from None
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
            req.chat.messages.append(api_pb2.ChatMessage(role=m["role"], content=m["content"]))
        if chat_template_kwargs is not None:
            try:
                req.chat.chat_template_kwargs = json.dumps(chat_template_kwargs)
            except TypeError as e:
                raise ValueError(f"chat_template_kwargs: {e}") from None
    else:
        try:
            req.prompt_token_ids.ids.extend(prompt_token_ids)
        except (ValueError, TypeError) as e:
            raise type(e)(f"prompt_token_ids: {e}") from None
    return req


def channel_credentials(root_certificates: bytes | None = None,
                        private_key: bytes | None = None,
                        certificate_chain: bytes | None = None,
                        credentials: grpc.ChannelCredentials | None = None
                        ) -> grpc.ChannelCredentials | None:
    """The TLS credentials of a client, or None for a plaintext channel.

    Args:
        root_certificates: PEM CA bundle that verifies the router (None: the system's roots).
        private_key / certificate_chain: PEM client key and certificate, for a router that
            requires client certificates (mTLS); give both or neither.
        credentials: ready-made ``grpc.ChannelCredentials`` (then the PEM arguments must be
            None).

    Raises:
        ValueError: both ``credentials`` and PEM arguments, or only one of private_key /
            certificate_chain.
    """
    pem = (root_certificates, private_key, certificate_chain)
    if credentials is not None:
        if any(x is not None for x in pem):
            raise ValueError("pass either credentials= or the PEM arguments, not both")
        return credentials
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("private_key and certificate_chain must be given together")
    if all(x is None for x in pem):
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates,
                                        private_key=private_key,
                                        certificate_chain=certificate_chain)


class _ClientBase:
    """Channel, stub, default deadline, retry settings and call metadata shared by both
    clients."""

    _insecure_channel: Callable
    _secure_channel: Callable

    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None,
                 max_retries: int = 2, retry_backoff: float = 0.2, *,
                 root_certificates: bytes | None = None, private_key: bytes | None = None,
                 certificate_chain: bytes | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 api_key: str | None = None):
        creds = channel_credentials(root_certificates, private_key, certificate_chain,
                                    credentials)
        if creds is None:
            self._channel = self._insecure_channel(address, options=_OPTIONS)
        else:
            self._channel = self._secure_channel(address, creds, options=_OPTIONS)
        # NOTE: plain metadata, not grpc call credentials: those are refused on a plaintext
        # channel, and a router may check keys behind a TLS-terminating proxy.
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._stub = api_pb2_grpc.GenerationServiceStub(self._channel)
        self.timeout = timeout  # seconds per call; None = no deadline
        self.max_retries, self.retry_backoff = max_retries, retry_backoff

    def _retry(self, timeout) -> _Retry:
        return _Retry(self.timeout if timeout is _DEFAULT else timeout, self.max_retries,
                      self.retry_backoff)


class Client(_ClientBase):
    """Blocking client. Use as a context manager or call ``close()``.

    Args:
        address: the router's ``host:port`` (default port 50051).
        timeout: default deadline of every call in seconds (None = none); ``timeout=`` on a
            method overrides it for that call.
        max_retries: retries of a call that fails with UNAVAILABLE before any message arrived.
        retry_backoff: seconds before the first retry; doubles each time, at most 2 s.
        root_certificates: PEM CA bundle that verifies a router serving TLS (None with no
            other TLS argument: plaintext; None with a client certificate: system roots).
        private_key / certificate_chain: PEM client key and certificate for a router that
            requires client certificates (mTLS).
        credentials: a ready ``grpc.ChannelCredentials`` instead of the three PEM arguments.
        api_key: sent as ``authorization: Bearer <api_key>`` metadata on every call, for a
            router started with ``--api-key`` (a wrong or missing key: UNAUTHENTICATED).

    Raises:
        ValueError: inconsistent TLS arguments (see ``channel_credentials``).
    """

    _insecure_channel = staticmethod(grpc.insecure_channel)
    _secure_channel = staticmethod(grpc.secure_channel)

    def _streaming(self, method: Callable, req, timeout, convert: Callable) -> Iterator:
        retry = self._retry(timeout)
        while True:
            call = method(req, timeout=retry.remaining(), metadata=self._metadata)
            started = False
            try:
                for msg in call:
                    started = True
                    yield convert(msg)
                return
            except grpc.RpcError as e:
                delay = retry.next_delay(e, started)
                if delay is None:
                    raise
            finally:
                call.cancel()
            time.sleep(delay)

    def _unary(self, method: Callable, req, timeout):
        retry = self._retry(timeout)
        while True:
            try:
                return method(req, timeout=retry.remaining(), metadata=self._metadata)
            except grpc.RpcError as e:
                delay = retry.next_delay(e, started=False)
                if delay is None:
                    raise
            time.sleep(delay)

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               prompt_token_ids: list[int] | None = None, priority: int = 0,
               timeout=_DEFAULT, **sampling) -> Iterator[StreamDelta]:
        """Yield the deltas of a request as they are generated; the last delta of each choice
        has finish_reason and usage. With ``n > 1`` the choices' deltas interleave (tell them
        apart by ``delta.index``). Breaking out of the loop cancels the request (every choice).

        Raises:
            grpc.RpcError: the server refused or failed the request.
        """
        req = build_request(prompt, messages, prompt_token_ids, priority=priority, **sampling)
        yield from self._streaming(self._stub.Generate, req, timeout, delta_from_pb)

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 prompt_token_ids: list[int] | None = None, priority: int = 0,
                 timeout=_DEFAULT, **sampling) -> GenerationResult:
        """Run a request to the end and return it whole: every choice in ``result.choices``
        (ordered by index), choice 0 also as ``result.text``, ``.token_ids``, ``.usage``...

        Raises:
            grpc.RpcError: the server refused or failed the request.
        """
        return join(list(self.stream(prompt, messages=messages, prompt_token_ids=prompt_token_ids,
                                     priority=priority, timeout=timeout, **sampling)))

    def chat_stream(self, messages: list[dict], *, priority: int = 0, timeout=_DEFAULT,
                    **sampling) -> Iterator[StreamDelta]:
        """Stream the assistant's answer to ``messages`` through the Chat RPC (the model's chat
        template plus the assistant prefix); the same deltas as ``stream(messages=...)``.
        Breaking out of the loop cancels the request.

        Raises:
            ValueError, TypeError: as ``build_request``.
            grpc.RpcError: the server refused or failed the request.
        """
        req = chat_request(build_request(messages=messages, priority=priority, **sampling))
        yield from self._streaming(self._stub.Chat, req, timeout,
                                   lambda msg: delta_from_pb(msg.delta))

    def chat(self, messages: list[dict], *, priority: int = 0, timeout=_DEFAULT,
             **sampling) -> GenerationResult:
        """The assistant's whole answer to ``messages`` (every choice, as ``generate``).

        Raises:
            ValueError, TypeError: as ``build_request``.
            grpc.RpcError: the server refused or failed the request.
        """
        return join(list(self.chat_stream(messages, priority=priority, timeout=timeout,
                                          **sampling)))

    def tokenize(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 add_special_tokens: bool | None = None,
                 add_generation_prompt: bool | None = None,
                 continue_final_message: bool | None = None,
                 chat_template_kwargs: dict | None = None,
                 timeout=_DEFAULT) -> TokenizeResult:
        """Token ids of a text or a conversation, exactly as ``generate`` would send them.

        Args:
            add_special_tokens: let the tokenizer add its special tokens (e.g. a BOS). None: the
                server's default, True for a prompt, False for messages (the chat template
                writes them).
            add_generation_prompt: messages only; None (default) or True appends the assistant
                prefix, as ``generate`` does.
            continue_final_message: messages only; True leaves the last message open (no
                end-of-turn token), with ``add_generation_prompt=False`` (vLLM's option).
            chat_template_kwargs: messages only; extra variables for the chat template, as
                ``chat`` takes them (e.g. ``{"enable_thinking": False}``).

        Raises:
            ValueError: not exactly one of prompt / messages; ``chat_template_kwargs``
                without messages or not JSON-serializable.
            grpc.RpcError: INVALID_ARGUMENT (empty input, template rejected the messages).
        """
        req = tokenize_request(prompt, messages, add_special_tokens, add_generation_prompt,
                               continue_final_message, chat_template_kwargs)
        return tokenize_result(self._unary(self._stub.Tokenize, req, timeout))

    def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool | None = None,
                   timeout=_DEFAULT) -> str:
        """The text of ``token_ids`` (special tokens left out unless skip_special_tokens=False).

        Raises:
            ValueError, TypeError: an id that is not an int32.
            grpc.RpcError: INVALID_ARGUMENT when an id is outside [0, vocab_size).
        """
        req = detokenize_request(token_ids, skip_special_tokens)
        return self._unary(self._stub.Detokenize, req, timeout).text

    def embed(self, input: str | list[str] | list[int] | list[list[int]], *,
              dimensions: int | None = None, truncate_prompt_tokens: int | None = None,
              request_id: str = "", timeout=_DEFAULT) -> EmbeddingResult:
        """Embeddings of ``input`` (a string, strings, a token-id list, or token-id lists)
        from a pooling server (``--runner pooling``): one vector per input, in order.

        Args:
            dimensions: shorten each vector to this length, then L2-normalize it (Matryoshka
                models only).
            truncate_prompt_tokens: keep each input's last k tokens (-1: max_model_len).

        Raises:
            TypeError: another input shape.
            grpc.RpcError: INVALID_ARGUMENT naming the field (the server does not pool, an
                empty or too-long input, dimensions the model does not support, ...),
                RESOURCE_EXHAUSTED, UNAVAILABLE.
        """
        req = embed_request(input, dimensions, truncate_prompt_tokens, request_id)
        return embedding_result(self._unary(self._stub.Embed, req, timeout))

    def list_models(self, timeout=_DEFAULT) -> list[ModelInfo]:
        """The served model(s) (pagedserve serves one).

        Raises:
            grpc.RpcError: UNAVAILABLE while the server has no engine yet.
        """
        return models_from_pb(self._unary(self._stub.ListModels, api_pb2.ListModelsRequest(),
                                          timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """asyncio client; same methods and arguments as ``Client`` but ``async``. Cancelling the
    task that iterates a stream cancels the RPC."""

    _insecure_channel = staticmethod(grpc.aio.insecure_channel)
    _secure_channel = staticmethod(grpc.aio.secure_channel)

    async def _streaming(self, method: Callable, req, timeout,
                         convert: Callable) -> AsyncIterator:
        retry = self._retry(timeout)
        while True:
            call = method(req, timeout=retry.remaining(), metadata=self._metadata)
            started = False
            try:
                async for msg in call:
                    started = True
                    yield convert(msg)
                return
            except grpc.RpcError as e:
                delay = retry.next_delay(e, started)
                if delay is None:
                    raise
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def _unary(self, method: Callable, req, timeout):
        retry = self._retry(timeout)
        while True:
            try:
                return await method(req, timeout=retry.remaining(), metadata=self._metadata)
            except grpc.RpcError as e:
                delay = retry.next_delay(e, started=False)
                if delay is None:
                    raise
            await asyncio.sleep(delay)

    async def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                     prompt_token_ids: list[int] | None = None, priority: int = 0,
                     timeout=_DEFAULT, **sampling) -> AsyncIterator[StreamDelta]:
        """Async-iterate the deltas of a request (see ``Client.stream``); leaving the loop
        cancels the request.

        Raises:
            grpc.aio.AioRpcError: the server refused or failed the request.
        """
        req = build_request(prompt, messages, prompt_token_ids, priority=priority, **sampling)
        async for delta in self._streaming(self._stub.Generate, req, timeout, delta_from_pb):
            yield delta

    async def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       prompt_token_ids: list[int] | None = None, priority: int = 0,
                       timeout=_DEFAULT, **sampling) -> GenerationResult:
        """Run a request to the end and return it whole (see ``Client.generate``).

        Raises:
            grpc.aio.AioRpcError: the server refused or failed the request.
        """
        return join([d async for d in self.stream(
            prompt, messages=messages, prompt_token_ids=prompt_token_ids, priority=priority,
            timeout=timeout, **sampling)])

    async def chat_stream(self, messages: list[dict], *, priority: int = 0, timeout=_DEFAULT,
                          **sampling) -> AsyncIterator[StreamDelta]:
        """Async-iterate the answer to ``messages`` (see ``Client.chat_stream``).

        Raises:
            grpc.aio.AioRpcError: the server refused or failed the request.
        """
        req = chat_request(build_request(messages=messages, priority=priority, **sampling))
        async for delta in self._streaming(self._stub.Chat, req, timeout,
                                           lambda msg: delta_from_pb(msg.delta)):
            yield delta

    async def chat(self, messages: list[dict], *, priority: int = 0, timeout=_DEFAULT,
                   **sampling) -> GenerationResult:
        """The whole answer to ``messages`` (see ``Client.chat``).

        Raises:
            grpc.aio.AioRpcError: the server refused or failed the request.
        """
        return join([d async for d in self.chat_stream(messages, priority=priority,
                                                       timeout=timeout, **sampling)])

    async def tokenize(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       add_special_tokens: bool | None = None,
                       add_generation_prompt: bool | None = None,
                       continue_final_message: bool | None = None,
                       chat_template_kwargs: dict | None = None,
                       timeout=_DEFAULT) -> TokenizeResult:
        """Token ids of a text or a conversation (see ``Client.tokenize``).

        Raises:
            ValueError: not exactly one of prompt / messages.
            grpc.aio.AioRpcError: INVALID_ARGUMENT (empty input, template rejected it).
        """
        req = tokenize_request(prompt, messages, add_special_tokens, add_generation_prompt,
                               continue_final_message, chat_template_kwargs)
        return tokenize_result(await self._unary(self._stub.Tokenize, req, timeout))

    async def detokenize(self, token_ids: list[int], *,
                         skip_special_tokens: bool | None = None, timeout=_DEFAULT) -> str:
        """The text of ``token_ids`` (see ``Client.detokenize``).

        Raises:
            grpc.aio.AioRpcError: INVALID_ARGUMENT when an id is outside [0, vocab_size).
        """
        req = detokenize_request(token_ids, skip_special_tokens)
        return (await self._unary(self._stub.Detokenize, req, timeout)).text

    async def embed(self, input: str | list[str] | list[int] | list[list[int]], *,
                    dimensions: int | None = None, truncate_prompt_tokens: int | None = None,
                    request_id: str = "", timeout=_DEFAULT) -> EmbeddingResult:
        """Embeddings of ``input`` from a pooling server (see ``Client.embed``).

        Raises:
            TypeError: another input shape.
            grpc.aio.AioRpcError: INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED,
                UNAVAILABLE.
        """
        req = embed_request(input, dimensions, truncate_prompt_tokens, request_id)
        return embedding_result(await self._unary(self._stub.Embed, req, timeout))

    async def list_models(self, timeout=_DEFAULT) -> list[ModelInfo]:
        """The served model(s) (see ``Client.list_models``).

        Raises:
            grpc.aio.AioRpcError: UNAVAILABLE while the server has no engine yet.
        """
        return models_from_pb(await self._unary(self._stub.ListModels,
                                                api_pb2.ListModelsRequest(), timeout))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
