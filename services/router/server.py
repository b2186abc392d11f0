"""The router service: the public GenerationService (thin servicer), health and reflection,
and the OpenAI-compatible HTTP API (``openai.http``) on the same event loop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import grpc
from aiohttp import web
from grpc_reflection.v1alpha import reflection

from services.common.config import PORT, add_flag, float_in, int_in, parse_bytes
from services.common.grpc_utils import new_server, set_serving, stop_event_on_signals
from services.common.logs import add_log_flags, request_id_var
from services.common.metrics import (
    METRICS_NAMES,
    ROUTER_PORT,
    add_metrics_flags,
    start_metrics_server,
)
from services.common.pb.pagedserve.v1 import api_pb2, api_pb2_grpc
from services.common.progress import waiting_step
from services.common.shutdown import SHUTTING_DOWN, TIMED_OUT, InFlight, add_shutdown_flags, drain
from services.common.tls import add_tls_flags, client_credentials, tls_from_args
from services.common.tracing import add_tracing_flags
from services.router import text_api
from services.router.api_keys_file import (
    KeyRing,
    add_api_keys_file_flag,
    key_ring,
    reload_on_sighup,
    stop_reloading,
)
from services.router.auth import ApiKeyInterceptor, add_api_key_flag
from services.router.cache_aware import CacheAwareConfig
from services.router.embedding import embed_response, prepare_embed, run_embed
from services.router.engine_client import EngineClient
from services.router.gateway_metrics import GatewayGauges
from services.router.generation import (
    DEFAULT_MAX_STREAM_BUFFER,
    INLINE_PREPARE_BYTES,
    EngineError,
    RequestLog,
    prepare,
    stream_responses,
)
from services.router.lora_registry import lora_module, registry_from_args
from services.router.metrics import RouterMetrics, code_name
from services.router.openai.errors import OpenAIError
from services.router.openai.http import DEFAULT_MAX_REQUEST_BYTES, DISABLED, OpenAIServer
from services.router.openai.lora_routes import LoRARoutes
from services.router.openai.reasoning import PARSERS as REASONING_PARSERS
from services.router.openai.responses_store import DEFAULT_STORE_SIZE, ResponseStore
from services.router.openai.tools import TOOL_PARSERS
from services.router.quotas import charge_tokens
from services.router.replicas import POLICIES, ReplicaSet, parse_targets
from services.router.served_model import ServedModel
from services.router.tokenizer import load_tokenizer
from services.router.tracing import grpc_ingress
from services.router.usage.recorder import UsageRecorder
from services.router.usage.service import add_usage_flag, usage_from_args
from services.router.validation import MAX_LOGPROBS, RequestError

log = logging.getLogger(__name__)
SERVICE = api_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
# gRPC metadata key a client may set instead of GenerateRequest.request_id (as HTTP X-Request-Id)
REQUEST_ID_METADATA = "x-request-id"


class GenerationServicer(api_pb2_grpc.GenerationServiceServicer):
    """Decode the request → prepare → stream from the engine → encode; nothing else. The logic
    lives in ``generation`` (Generate, Chat), ``embedding`` (Embed) and ``text_api`` (Chat's
    mapping, Tokenize, Detokenize, ListModels)."""

    def __init__(self, engine: ReplicaSet, tokenizer, metrics: RouterMetrics | None = None,
                 max_stream_buffer: int = DEFAULT_MAX_STREAM_BUFFER,
                 served: ServedModel | None = None, max_logprobs: int = MAX_LOGPROBS):
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.served = served or ServedModel()  # --served-model-name: ListModels' id
        self.max_logprobs = max_logprobs  # --max-logprobs
        self.inflight = InFlight()  # Generate/Chat calls running; draining: refuse new ones
        self.max_stream_buffer = max_stream_buffer  # see generation.OutputQueue
        # --usage-db: the usage.recorder.UsageRecorder every call's entry reports to
        self.usage: UsageRecorder | None = None

    async def Generate(self, request, context):
        entry = RequestLog(f"/{SERVICE}/Generate", usage=self.usage)
        with (self._counted("Generate", context, entry), self.inflight.track(),
              grpc_ingress("Generate", context, entry)):
            await self._admit(context)
            async with contextlib.aclosing(self._generate(request, context, entry)) as responses:
                async for response in responses:
                    yield response

    async def Chat(self, request, context):
        entry = RequestLog(f"/{SERVICE}/Chat", usage=self.usage)
        with (self._counted("Chat", context, entry), self.inflight.track(),
              grpc_ingress("Chat", context, entry)):
            await self._admit(context)
            try:
                generate = text_api.chat_to_generate(request)
            except RequestError as e:
                await context.abort(e.code, e.message)
            async with contextlib.aclosing(self._generate(generate, context, entry)) as responses:
                async for response in responses:
                    yield api_pb2.ChatResponse(delta=response)

    async def Tokenize(self, request, context):
        with self._counted("Tokenize", context):
            return await self._call(context, request, text_api.tokenize, request, self.tokenizer)

    async def Detokenize(self, request, context):
        with self._counted("Detokenize", context):
            return await self._call(context, request, text_api.detokenize, request,
                                    self.tokenizer)

    async def Embed(self, request, context):
        entry = RequestLog(f"/{SERVICE}/Embed", usage=self.usage)
        with self._counted("Embed", context, entry), self.inflight.track():
            await self._admit(context)
            if not request.request_id:  # the caller's x-request-id metadata names the request
                request.request_id = dict(context.invocation_metadata() or ()).get(
                    REQUEST_ID_METADATA, "")
            info = await self._info(context)
            prepared = await self._call(context, request, prepare_embed, request,
                                        self.tokenizer)
            entry.request_id, entry.prompt_tokens = (prepared.request_id,
                                                     sum(map(len, prepared.prompts)))
            charge_tokens(entry.prompt_tokens)  # (the key's tokens_per_minute)
            request_id_var.set(prepared.request_id)
            try:
                vectors = await run_embed(self.engine, prepared)
            except EngineError as e:
                await context.abort(e.code, e.message)
            return embed_response(prepared, vectors, info)

    async def ListModels(self, request, context):
        with self._counted("ListModels", context):
            info = await self._info(context)
            return text_api.list_models(info, [(lora.name, parent) for lora, parent
                                               in self.served.adapters(info)])

    @contextlib.contextmanager
    def _counted(self, method: str, context, entry: RequestLog | None = None):
        """Count the call under its final status: the aborted code, CANCELLED when the client
        went away, UNKNOWN on an unexpected error, else OK; with ``entry``, write its access
        log line with that status too."""
        if self.metrics is None and entry is None:
            yield
            return
        code = None
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            # a slow client cut off by the router has its code (RESOURCE_EXHAUSTED) set
            code = context.code() or grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        finally:
            code = code or context.code() or grpc.StatusCode.OK
            if self.metrics is not None:
                self.metrics.request_done(method, code)
            if entry is not None:
                entry.done(code_name(code))

    async def _admit(self, context) -> None:
        """Refuse a new Generate/Chat call with UNAVAILABLE once the router is draining."""
        if self.inflight.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)

    async def _info(self, context):
        info = self.engine.info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "router is connecting to its scheduler")
        assert info is not None  # abort raised
        return self.served.info(info)

    async def _call(self, context, request, fn: Callable[..., Any], *args):
        """``fn(*args, engine_info)``, on a thread for large requests; RequestError → status."""
        info = await self._info(context)
        try:
            if request.ByteSize() > INLINE_PREPARE_BYTES:  # keep the loop free for others
                return await asyncio.to_thread(fn, *args, info)
            return fn(*args, info)
        except RequestError as e:
            await context.abort(e.code, e.message)

    async def _generate(self, request, context, entry: RequestLog):
        if not request.request_id:  # the caller's x-request-id metadata names the request
            request.request_id = dict(context.invocation_metadata() or ()).get(
                REQUEST_ID_METADATA, "")
        entry.request_id = request.request_id or None
        info = await self._info(context)
        try:
            lora = self.served.resolve(request.model, info)
            if request.ByteSize() > INLINE_PREPARE_BYTES:  # keep the loop free for others
                prepared = await asyncio.to_thread(prepare, request, self.tokenizer, info,
                                                   max_logprobs=self.max_logprobs, lora=lora)
            else:
                prepared = prepare(request, self.tokenizer, info, max_logprobs=self.max_logprobs,
                                   lora=lora)
        except RequestError as e:
            await context.abort(e.code, e.message)
        request_id_var.set(prepared.request_id)
        entry.accepted(prepared)
        slow: list[asyncio.Task] = []  # aborts the RPC when the client reads too slowly

        def on_overflow(e: EngineError) -> None:
            # NOTE: from another task: this handler is suspended in a write the client's flow
            # control holds back; the abort sends the status and closes this generator.
            context.set_code(e.code)
            slow.append(asyncio.create_task(_abort_quietly(context, e)))

        try:
            async for response in stream_responses(self.engine, self.tokenizer, prepared,
                                                   max_pending=self.max_stream_buffer,
                                                   on_overflow=on_overflow):
                entry.observe(response)
                yield response
        except EngineError as e:
            if slow:  # already aborted by on_overflow: end with its AbortError, as grpc expects
                error = await slow[0]
                if error is not None:
                    raise error from e
                return
            await context.abort(e.code, e.message)


async def _abort_quietly(context, e: EngineError) -> BaseException | None:
    """``context.abort`` from outside the handler; returns the AbortError it raises."""
    log.warning("request aborted: %s", e.message)
    try:
        await context.abort(e.code, e.message)
    except Exception as abort_error:  # noqa: BLE001 - grpc.aio's AbortError, the normal outcome
        return abort_error
    return None


def _http_gate(inflight: InFlight):
    """aiohttp middleware: count HTTP requests in flight; while draining answer 503 to new
    completions and to /health (so load balancers stop sending)."""
    @web.middleware
    async def gate(request: web.Request, handler):
        if inflight.draining and request.path in _REFUSED_WHILE_DRAINING:
            raise OpenAIError(503, SHUTTING_DOWN, "server_error", code="unavailable")
        with inflight.track():
            return await handler(request)
    return gate


_REFUSED_WHILE_DRAINING = {"/v1/completions", "/v1/chat/completions", "/health"}


async def _end_in_flight(engine: ReplicaSet, inflight: InFlight) -> None:
    """At the shutdown timeout: end every engine request with UNAVAILABLE (``TIMED_OUT``) and
    give the calls a moment (seconds) to send that status to their clients."""
    engine.fail_all(TIMED_OUT)
    await inflight.wait_idle(2.0)


def _targets(value: str) -> str:
    """argparse type of --schedulers: checked by ``parse_targets``, kept as given."""
    try:
        parse_targets(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def replica_set(args, on_serving=None, metrics: RouterMetrics | None = None) -> ReplicaSet:
    """The router's scheduler replicas from its flags: ``--schedulers`` if set, else the one
    ``--scheduler`` (taken as given, any gRPC target: one replica, as before). ``on_serving``:
    async callback(bool), whether at least one replica can serve (see ``ReplicaSet``).

    Raises:
        ValueError: a malformed ``--schedulers`` list.
    """
    if args.schedulers:
        addresses, dns_target = parse_targets(args.schedulers)
    else:
        addresses, dns_target = [args.scheduler], None
    # NOTE: TLS (and the client certificate) on the router→scheduler links, when configured
    factory = functools.partial(EngineClient,
                                credentials=client_credentials(tls_from_args(args)))
    return ReplicaSet(addresses, policy=args.routing_policy, dns_target=dns_target,
                      client_factory=factory,
                      dns_refresh=args.scheduler_dns_refresh,
                      affinity_blocks=args.prefix_affinity_blocks, on_serving=on_serving,
                      metrics=metrics, cache_aware=CacheAwareConfig(
                          args.cache_threshold, args.balance_abs_threshold,
                          args.balance_rel_threshold))


def _request_bytes(value: str) -> int:
    """argparse type of --max-request-bytes: a size (``8MiB``) below 2 GiB (gRPC's int32)."""
    n = parse_bytes(value)
    if n > 2**31 - 1:
        raise argparse.ArgumentTypeError(f"must be at most 2GiB-1 (2147483647), got {value!r}")
    return n


def add_args(p: argparse.ArgumentParser) -> None:
    """The router's flags (also accepted by ``pagedserve serve``)."""
    add_flag(p, "--host", default="127.0.0.1", help="address to bind")
    add_flag(p, "--port", type=PORT, default=50051, help="public gRPC port")
    add_flag(p, "--http-port", type=int_in(-1, 65535), default=8000,
             help="OpenAI-compatible HTTP port (0 = a free port, -1 = no HTTP server)")
    add_flag(p, "--http-host", default=None,
             help="address the HTTP server binds (default: --host)")
    add_flag(p, "--scheduler", default="127.0.0.1:50052",
             help="scheduler address (one replica; --schedulers takes precedence)")
    add_flag(p, "--schedulers", type=_targets, default=None,
             help="scheduler replicas: host:port,host:port,... or one dns:///name:port "
                  "re-resolved every --scheduler-dns-refresh seconds (overrides --scheduler)")
    add_flag(p, "--scheduler-dns-refresh", type=float_in(0, lo_open=True), default=30.0,
             help="seconds between DNS resolutions of a dns:/// --schedulers target")
    add_flag(p, "--routing-policy", default="prefix_affinity", choices=POLICIES,
             help="how a request picks a scheduler replica")
    add_flag(p, "--prefix-affinity-blocks", type=int_in(1, 1024), default=2,
             help="full KV blocks of the prompt that prefix_affinity hashes")
    add_flag(p, "--cache-threshold", type=float_in(0, 1), default=0.5,
             help="cache_aware: least share of the prompt the best replica's cached prefix must "
                  "cover for the cache to pick the replica (else prefix_affinity's choice)")
    add_flag(p, "--balance-abs-threshold", type=int_in(0), default=32,
             help="cache_aware: requests by which the busiest replica must exceed the idlest "
                  "(and --balance-rel-threshold times it) for the least loaded to be picked")
    add_flag(p, "--balance-rel-threshold", type=float_in(1), default=1.5,
             help="cache_aware: how many times the idlest replica's load the busiest one must "
                  "exceed (with --balance-abs-threshold) for the least loaded to be picked")
    add_flag(p, "--model", default=None,
             help="transformers folder or .gguf file whose tokenizer to use "
                  "(default: packaged SmolLM2-135M-Instruct)")
    add_flag(p, "--chat-template", default=None,
             help="Jinja chat template file (or the template text itself) used for chat "
                  "requests instead of the model's own, e.g. for a base model that has none")
    add_flag(p, "--enable-auto-tool-choice", action="store_true", default=False,
             help='allow tool_choice "auto" in chat (the default when tools are sent): the '
                  "model's tool calls are parsed out of its text by --tool-call-parser")
    add_flag(p, "--tool-call-parser", default=None, choices=TOOL_PARSERS,
             help="format of the tool calls a model writes, for --enable-auto-tool-choice "
                  "(hermes: <tool_call>{json}</tool_call>, e.g. with "
                  "examples/tool_chat_template_hermes.jinja)")
    add_flag(p, "--enable-responses-api-store", action="store_true", default=False,
             help="keep the last --responses-api-store-size answers of POST /v1/responses in "
                  "this router's memory, for previous_response_id and GET /v1/responses/{id} "
                  "(store: true, the default, keeps one)")
    add_flag(p, "--responses-api-store-size", type=int_in(1), default=DEFAULT_STORE_SIZE,
             help="answers the responses store keeps (least recently used out first)")
    add_flag(p, "--reasoning-parser", default=None, choices=REASONING_PARSERS,
             help="how the model writes its reasoning: the <think>...</think> span of chat "
                  "answers is returned as reasoning_content / reasoning, not content "
                  "(deepseek_r1: the span may start without <think>, without </think> it is "
                  "all reasoning; qwen3: the same, unless enable_thinking is false)")
    add_flag(p, "--served-model-name", nargs="+", default=None, metavar="NAME",
             help="names the model is served under (default: the engine's, the model folder's "
                  "or GGUF file's name): the first is reported (/v1/models, every response's "
                  "model, ListModels), a request may name any (env: names separated by "
                  "spaces)")
    add_flag(p, "--max-logprobs", type=int_in(-1), default=MAX_LOGPROBS,
             help="most logprobs (top tokens per token) a request may ask for, logprobs, "
                  "top_logprobs and prompt_logprobs alike (vLLM's flag; -1: the vocabulary "
                  "size); above it a request is refused naming the limit")
    add_flag(p, "--max-stream-buffer", type=int_in(1), default=DEFAULT_MAX_STREAM_BUFFER,
             help="responses buffered per streaming call while its client does not read; "
                  "past it the call fails with RESOURCE_EXHAUSTED and its engine requests are "
                  "aborted")
    add_flag(p, "--max-request-bytes", type=_request_bytes, default=DEFAULT_MAX_REQUEST_BYTES,
             help="largest public request accepted (gRPC message, HTTP body; e.g. 8MiB, at "
                  "most 2GiB-1): larger gRPC requests fail with RESOURCE_EXHAUSTED, larger "
                  "HTTP bodies with 413")
    add_flag(p, "--scheduler-connect-timeout", type=float_in(0, lo_open=True), default=900.0,
             help="seconds to wait for the scheduler at start-up")
    add_flag(p, "--enable-lora", action="store_true", default=False,
             help="serve LoRA adapters over the model: a request whose model names one runs "
                  "with it (the workers need --enable-lora too)")
    add_flag(p, "--lora-modules", nargs="+", type=lora_module, default=None,
             metavar="NAME=PATH",
             help="LoRA adapters (PEFT folders) served from the start, each name=path or vLLM's "
                  "JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; each is "
                  "checked against --model at start (env: entries separated by spaces)")
    add_flag(p, "--max-lora-rank", type=int_in(1), default=16,
             help="highest LoRA rank served (vLLM's flag): an adapter of a higher rank is "
                  "refused when it is loaded")
    add_flag(p, "--allow-runtime-lora-updating", action="store_true", default=False,
             help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                  "VLLM_ALLOW_RUNTIME_LORA_UPDATING; behind --api-key)")
    add_flag(p, "--metrics-names", choices=METRICS_NAMES, default=METRICS_NAMES[0],
             help="vllm or both: also export the replicas' queue and KV cache gauges under "
                  "vLLM's names (vllm:num_requests_waiting, ...), summed over the replicas, on "
                  "/metrics of the metrics port and of the HTTP port, for gateways that route "
                  "to this router (docs/fleet.md)")
    add_shutdown_flags(p)
    add_tls_flags(p)
    add_api_key_flag(p)
    add_api_keys_file_flag(p)
    add_usage_flag(p)
    add_log_flags(p)
    add_tracing_flags(p)
    add_metrics_flags(p, ROUTER_PORT)


def _openai_server(args, engine: ReplicaSet, tokenizer, metrics: RouterMetrics,
                   served: ServedModel, inflight: InFlight) -> OpenAIServer | None:
    """The OpenAI-compatible HTTP server the flags ask for (not started), or None with
    ``--http-port -1``; its requests count in ``inflight`` (one drain with gRPC's)."""
    if args.http_port == DISABLED:
        return None
    http = OpenAIServer(engine, tokenizer, metrics, max_body_bytes=args.max_request_bytes,
                        served=served)
    http.max_stream_buffer = args.max_stream_buffer
    http.max_logprobs = args.max_logprobs
    http.tool_parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    if args.enable_responses_api_store:
        http.responses_store = ResponseStore(args.responses_api_store_size)
    http.reasoning_parser = args.reasoning_parser
    if served.loras is not None and args.allow_runtime_lora_updating:
        LoRARoutes(served.loras).add_to(http)
    http.app.middlewares.append(_http_gate(inflight))
    return http


async def _start_http(http: OpenAIServer, args, tls, keys: KeyRing | None) -> None:
    """Start ``http`` on ``--http-host`` (default ``--host``) and ``--http-port`` (HTTPS with
    the router's certificate, behind ``keys`` when set: ``--api-key``, ``--api-keys-file``);
    sets ``args.http_port`` to the port bound."""
    if keys:
        http.require_api_keys(keys)
    ssl_context = tls.http_ssl_context() if tls is not None and tls.certfile is not None else None
    args.http_port = await http.start(args.http_host or args.host, args.http_port, ssl_context)
    log.info("router OpenAI-compatible %s on %s:%d", "HTTPS" if ssl_context else "HTTP",
             args.http_host or args.host, args.http_port)


async def _grpc_server(args, tls, keys: KeyRing | None):
    """The public gRPC server, not started: ``(server, port, health)`` (``new_server``), behind
    ``keys`` when set (``--api-key``, ``--api-keys-file``), refusing requests over
    ``--max-request-bytes``; sets ``args.port`` to the port bound."""
    server, port, health = await new_server(
        args.host, args.port, tls=tls,
        interceptors=[ApiKeyInterceptor(keys)] if keys else [],
        max_receive_bytes=args.max_request_bytes)
    args.port = port
    return server, port, health


async def serve(args, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None):
    """Load the tokenizer, connect to the scheduler, and serve until stopped.

    Raises:
        ValueError: --enable-auto-tool-choice without --tool-call-parser, an empty or
            repeated --served-model-name, LoRA flags without --enable-lora, a bad
            --lora-modules adapter, a bad --api-keys-file (``KeysFileError``).
    """
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser "
                         f"({', '.join(TOOL_PARSERS)})")
    keys = key_ring(args)  # one for gRPC and HTTP: the keys' limits count both
    if keys is not None:
        reload_on_sighup(keys)  # (the main thread's loop only: not in in-process tests)
    tokenizer = await asyncio.to_thread(load_tokenizer, args.model, args.chat_template)
    tls = tls_from_args(args)
    server, port, health = await _grpc_server(args, tls, keys)
    # NOTE: the router is SERVING (readiness: "" and SERVICE; GET /health 200) exactly while at
    # least one scheduler replica can serve: its stream is up, its engine has a complete worker
    # group, and its engine agrees with the others. Liveness (grpc_utils.LIVENESS) stays
    # SERVING throughout, so a router waiting for its engines is not restarted.
    # declared here: the callbacks below refer to them, and they are assigned after them
    engine: ReplicaSet
    inflight: InFlight
    metrics = RouterMetrics(available=lambda: len(engine.available()))
    # NOTE: once draining, a replica that can serve again does not make the router SERVING.
    engine = replica_set(args, on_serving=lambda up: set_serving(
        health, up and not inflight.draining, [SERVICE]), metrics=metrics)
    loras = registry_from_args(args, lambda: (*(args.served_model_name or ()), *(
        (engine.info.model,) if engine.info is not None else ())))
    served = ServedModel(args.served_model_name or (), loras)
    if keys is not None:
        metrics.registry.register(keys.quotas)  # pagedserve:router_quota_rejections_total
    if args.metrics_names != "pagedserve":
        metrics.registry.register(GatewayGauges(
            engine.available, lambda: served.info(engine.info).model if engine.info else ""))
    servicer = GenerationServicer(engine, tokenizer, metrics, args.max_stream_buffer,
                                  served=served, max_logprobs=args.max_logprobs)
    inflight = servicer.inflight  # gRPC calls and HTTP requests: one count, one drain
    usage = usage_from_args(args, lambda: served.info(engine.info).model if engine.info else "",
                            metrics.tokens_done).start(metrics.registry)
    servicer.usage = usage.recorder
    api_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        [SERVICE, "grpc.health.v1.Health", reflection.SERVICE_NAME], server)
    http = _openai_server(args, engine, tokenizer, metrics, served, inflight)
    if http is not None:
        http.usage = usage
    await server.start()
    metrics_server = start_metrics_server(metrics.registry, args.metrics_host or args.host,
                                          args.metrics_port)
    args.metrics_port = metrics_server.port if metrics_server else args.metrics_port
    try:
        if http is not None:  # before the engine is up: /health answers 503 meanwhile
            await _start_http(http, args, tls, keys)
        log.info("router waiting for scheduler %s (routing %s)",
                 args.schedulers or args.scheduler, args.routing_policy)
        with waiting_step("the scheduler"):
            info = await engine.start(timeout=args.scheduler_connect_timeout)
        log.info("router serving on %s:%d (model %s, max_model_len %d)", args.host, port,
                 info.model, info.max_model_len)
        if ready:
            ready.set()
        await (stop or stop_event_on_signals()).wait()
        await drain("router", health, [SERVICE], args.shutdown_timeout, inflight.begin_drain,
                    inflight.wait_idle, on_timeout=lambda: _end_in_flight(engine, inflight))
    finally:
        if keys is not None:
            stop_reloading()
        await set_serving(health, False, [SERVICE])
        if http is not None:
            await http.stop()
        await server.stop(grace=2.0)
        await engine.close()
        await usage.close()  # (after the servers: every request's row is queued)
        if metrics_server is not None:
            metrics_server.close()
