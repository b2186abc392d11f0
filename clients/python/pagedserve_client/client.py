"""gRPC clients for pagedserve's public GenerationService: ``Client`` (blocking) and
``AsyncClient`` (asyncio).

Sampling keyword arguments are vLLM's names: temperature, top_p, top_k, seed, max_tokens, stop,
stop_token_ids, ignore_eos, include_stop_str_in_output, skip_special_tokens, n.

``n`` (1..64, default 1) asks for n completions (choices) of the same prompt, as in vLLM and
OpenAI: streamed deltas carry ``index`` (0 .. n-1) and interleave; ``generate`` returns them all
in ``GenerationResult.choices``. With a ``seed``, choice i samples with seed + i, so a repeated
request reproduces every choice.

``priority`` (an int32, default 0; lower runs sooner, as in vLLM) is accepted only when the
server's scheduler runs ``--scheduling-policy priority``; otherwise a non-zero priority is
INVALID_ARGUMENT.

Besides ``generate`` / ``stream``: ``chat`` / ``chat_stream`` (the Chat RPC: messages in, chat
template applied), ``tokenize`` (text or messages → ``TokenizeResult``), ``detokenize`` (ids →
text) and ``list_models`` (→ ``[ModelInfo]``); their result types are in ``text_types``.

Errors are ``grpc.RpcError`` (``.code()`` INVALID_ARGUMENT etc. with a message naming the field;
RESOURCE_EXHAUSTED when the server sheds load, UNAVAILABLE when it has no engine).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import grpc

from pagedserve_client.pb.pagedserve.v1 import api_pb2, api_pb2_grpc
from pagedserve_client.text_types import (ModelInfo, TokenizeResult, chat_request,
                                          detokenize_request, models_from_pb,
                                          tokenize_request, tokenize_result)
from pagedserve_client.types import GenerationResult, StreamDelta, delta_from_pb, join

_SAMPLING_FIELDS = {f.name for f in api_pb2.SamplingParams.DESCRIPTOR.fields}
_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024)]


def build_request(prompt: str | None = None, messages: list[dict] | None = None,
                  prompt_token_ids: list[int] | None = None, request_id: str = "",
                  priority: int = 0, **sampling) -> api_pb2.GenerateRequest:
    """Build a GenerateRequest from exactly one of prompt / messages / prompt_token_ids.

    Args:
        request_id: echoed in every response; the server makes one when empty.
        priority: scheduling priority, an int32 (lower runs sooner).
        **sampling: SamplingParams fields by name (vLLM's names, including ``n``).

    Raises:
        ValueError: not exactly one prompt form, an unknown sampling parameter, or a value out
            of its wire type's range (e.g. a priority outside int32).
        TypeError: a sampling parameter or priority of the wrong type.
    """
    if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
        raise ValueError("pass exactly one of prompt=, messages= or prompt_token_ids=")
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {sorted(unknown)}; "
                         f"known: {sorted(_SAMPLING_FIELDS)}")
    if isinstance(sampling.get("stop"), str):  # vLLM and OpenAI accept one string
        sampling["stop"] = [sampling["stop"]]
    params = api_pb2.SamplingParams()
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
    req = api_pb2.GenerateRequest(sampling_params=params, request_id=request_id)
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
    else:
        try:
            req.prompt_token_ids.ids.extend(prompt_token_ids)
        except (ValueError, TypeError) as e:
            raise type(e)(f"prompt_token_ids: {e}") from None
    return req


class Client:
    """Blocking client. Use as a context manager or call ``close()``.

    Args:
        address: the router's ``host:port`` (default port 50051).
    """

    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None):
        self._channel = grpc.insecure_channel(address, options=_OPTIONS)
        self._stub = api_pb2_grpc.GenerationServiceStub(self._channel)
        self.timeout = timeout  # seconds per request; None = no deadline

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               prompt_token_ids: list[int] | None = None, priority: int = 0,
               **sampling) -> Iterator[StreamDelta]:
        """Yield the deltas of a request as they are generated; the last delta of each choice
        has finish_reason and usage. With ``n > 1`` the choices' deltas interleave (tell them
        apart by ``delta.index``). Breaking out of the loop cancels the request (every choice).

        Raises:
            grpc.RpcError: the server refused or failed the request.
        """
        req = build_request(prompt, messages, prompt_token_ids, priority=priority, **sampling)
        call = self._stub.Generate(req, timeout=self.timeout)
        try:
            for msg in call:
                yield delta_from_pb(msg)
        finally:
            call.cancel()

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 prompt_token_ids: list[int] | None = None, priority: int = 0,
                 **sampling) -> GenerationResult:
        """Run a request to the end and return it whole: every choice in ``result.choices``
        (ordered by index), choice 0 also as ``result.text``, ``.token_ids``, ``.usage``...

        Raises:
            grpc.RpcError: the server refused or failed the request.
        """
        return join(list(self.stream(prompt, messages=messages, prompt_token_ids=prompt_token_ids,
                                     priority=priority, **sampling)))

    def chat_stream(self, messages: list[dict], *, priority: int = 0,
                    **sampling) -> Iterator[StreamDelta]:
        """Stream the assistant's answer to ``messages`` through the Chat RPC (the model's chat
        template plus the assistant prefix); the same deltas as ``stream(messages=...)``.
        Breaking out of the loop cancels the request.

        Raises:
            ValueError, TypeError: as ``build_request``.
            grpc.RpcError: the server refused or failed the request.
        """
        req = chat_request(build_request(messages=messages, priority=priority, **sampling))
        call = self._stub.Chat(req, timeout=self.timeout)
        try:
            for msg in call:
                yield delta_from_pb(msg.delta)
        finally:
            call.cancel()

    def chat(self, messages: list[dict], *, priority: int = 0, **sampling) -> GenerationResult:
        """The assistant's whole answer to ``messages`` (every choice, as ``generate``).

        Raises:
            ValueError, TypeError: as ``build_request``.
            grpc.RpcError: the server refused or failed the request.
        """
        return join(list(self.chat_stream(messages, priority=priority, **sampling)))

    def tokenize(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 add_special_tokens: bool | None = None,
                 add_generation_prompt: bool | None = None) -> TokenizeResult:
        """Token ids of a text or a conversation, exactly as ``generate`` would send them.

        Args:
            add_special_tokens: let the tokenizer add its special tokens (e.g. a BOS). None: the
                server's default, True for a prompt, False for messages (the chat template
                writes them).
            add_generation_prompt: messages only; None (default) or True appends the assistant
                prefix, as ``generate`` does.

        Raises:
            ValueError: not exactly one of prompt / messages.
            grpc.RpcError: INVALID_ARGUMENT (empty input, template rejected the messages).
        """
        req = tokenize_request(prompt, messages, add_special_tokens, add_generation_prompt)
        return tokenize_result(self._stub.Tokenize(req, timeout=self.timeout))

    def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool | None = None
                   ) -> str:
        """The text of ``token_ids`` (special tokens left out unless skip_special_tokens=False).

        Raises:
            ValueError, TypeError: an id that is not an int32.
            grpc.RpcError: INVALID_ARGUMENT when an id is outside [0, vocab_size).
        """
        req = detokenize_request(token_ids, skip_special_tokens)
        return self._stub.Detokenize(req, timeout=self.timeout).text

    def list_models(self) -> list[ModelInfo]:
        """The served model(s) (pagedserve serves one).

        Raises:
            grpc.RpcError: UNAVAILABLE while the server has no engine yet.
        """
        return models_from_pb(self._stub.ListModels(api_pb2.ListModelsRequest(),
                                                    timeout=self.timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client; same methods as ``Client`` but ``async``."""

    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None):
        self._channel = grpc.aio.insecure_channel(address, options=_OPTIONS)
        self._stub = api_pb2_grpc.GenerationServiceStub(self._channel)
        self.timeout = timeout

    async def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                     prompt_token_ids: list[int] | None = None, priority: int = 0,
                     **sampling) -> AsyncIterator[StreamDelta]:
        """Async-iterate the deltas of a request (see ``Client.stream``); leaving the loop
        cancels the request.

        Raises:
            grpc.aio.AioRpcError: the server refused or failed the request.
        """
        req = build_request(prompt, messages, prompt_token_ids, priority=priority, **sampling)
        call = self._stub.Generate(req, timeout=self.timeout)
        try:
            async for msg in call:
                yield delta_from_pb(msg)
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       prompt_token_ids: list[int] | None = None, priority: int = 0,
                       **sampling) -> GenerationResult:
        """Run a request to the end and return it whole (see ``Client.generate``).

        Raises:
            grpc.aio.AioRpcError: the server refused or failed the request.
        """
        return join([d async for d in self.stream(
            prompt, messages=messages, prompt_token_ids=prompt_token_ids, priority=priority,
            **sampling)])

    async def chat_stream(self, messages: list[dict], *, priority: int = 0,
                          **sampling) -> AsyncIterator[StreamDelta]:
        """Async-iterate the answer to ``messages`` (see ``Client.chat_stream``).

        Raises:
            grpc.aio.AioRpcError: the server refused or failed the request.
        """
        req = chat_request(build_request(messages=messages, priority=priority, **sampling))
        call = self._stub.Chat(req, timeout=self.timeout)
        try:
            async for msg in call:
                yield delta_from_pb(msg.delta)
        finally:
            call.cancel()

    async def chat(self, messages: list[dict], *, priority: int = 0,
                   **sampling) -> GenerationResult:
        """The whole answer to ``messages`` (see ``Client.chat``).

        Raises:
            grpc.aio.AioRpcError: the server refused or failed the request.
        """
        return join([d async for d in self.chat_stream(messages, priority=priority,
                                                       **sampling)])

    async def tokenize(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       add_special_tokens: bool | None = None,
                       add_generation_prompt: bool | None = None) -> TokenizeResult:
        """Token ids of a text or a conversation (see ``Client.tokenize``).

        Raises:
            ValueError: not exactly one of prompt / messages.
            grpc.aio.AioRpcError: INVALID_ARGUMENT (empty input, template rejected it).
        """
        req = tokenize_request(prompt, messages, add_special_tokens, add_generation_prompt)
        return tokenize_result(await self._stub.Tokenize(req, timeout=self.timeout))

    async def detokenize(self, token_ids: list[int], *,
                         skip_special_tokens: bool | None = None) -> str:
        """The text of ``token_ids`` (see ``Client.detokenize``).

        Raises:
            grpc.aio.AioRpcError: INVALID_ARGUMENT when an id is outside [0, vocab_size).
        """
        req = detokenize_request(token_ids, skip_special_tokens)
        return (await self._stub.Detokenize(req, timeout=self.timeout)).text

    async def list_models(self) -> list[ModelInfo]:
        """The served model(s) (see ``Client.list_models``).

        Raises:
            grpc.aio.AioRpcError: UNAVAILABLE while the server has no engine yet.
        """
        return models_from_pb(await self._stub.ListModels(api_pb2.ListModelsRequest(),
                                                          timeout=self.timeout))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
