"""The scheduler service: EngineService servicer (thin) and its start-up.

Start-up: connect to every worker rank, pushing this scheduler's limits (block_size,
max_model_len, max_num_seqs, max_num_batched_tokens), which a rank started for other ones
refuses, check the ranks agree (model, dtype), take the minimum KV block count, build the core
``Scheduler`` (which refuses to start when one request of max_model_len cannot fit), then serve
routers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from services.common.config import PORT, add_flag, field_default, float_in, int_in, parse_bytes
from services.common.grpc_utils import new_server, set_serving, stop_event_on_signals
from services.common.logs import add_log_flags
from services.common.metrics import (
    METRICS_NAMES,
    SCHEDULER_PORT,
    add_metrics_flags,
    start_metrics_server,
)
from services.common.pb.pagedserve.v1 import engine_pb2, engine_pb2_grpc, worker_pb2
from services.common.progress import waiting_step
from services.common.shutdown import SHUTTING_DOWN, TIMED_OUT, add_shutdown_flags, drain, wait_until
from services.common.spec_decode_config import speculative_config_arg
from services.common.tls import add_tls_flags, client_credentials, tls_from_args
from services.common.tracing import add_tracing_flags
from services.scheduler.config import SCHEDULING_POLICIES, SchedulerConfig
from services.scheduler.engine import Engine
from services.scheduler.kv_events import build_kv_event_log
from services.scheduler.kv_events_config import kv_events_config_arg
from services.scheduler.kv_tier import build_kv_tier
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.metrics_names import exposed_registry
from services.scheduler.scheduler import Scheduler
from services.scheduler.worker_client import WorkerGroup, describe_kv_cache_groups

log = logging.getLogger(__name__)
SERVICE = "pagedserve.v1.EngineService"


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Decode protobuf → call the Engine → encode protobuf; nothing else."""

    def __init__(self):
        # Set once the workers are connected; until then RPCs answer UNAVAILABLE.
        self.engine: Engine | None = None
        self.info: engine_pb2.GetEngineInfoResponse | None = None

    def close_streams(self) -> None:
        """End every router's Connect stream once the batches queued on it are sent."""
        if self.engine is not None:
            self.engine.close_streams()

    async def _require_engine(self, context) -> Engine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is waiting for its workers")
        assert self.engine is not None  # context.abort raises
        return self.engine

    async def Connect(self, request_iterator, context):
        engine = await self._require_engine(context)  # set once, never unset
        if engine.draining:  # a router reconnecting while we shut down: nothing to take
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        # NOTE: its first batch is the handshake: it tells the router the stream is up, and
        # whether the engine can serve (it may be waiting for its workers to come back).
        sink = engine.attach()

        async def read_requests():
            try:
                async for msg in request_iterator:
                    if msg.HasField("submit"):
                        engine.submit(sink, msg.submit)
                    elif msg.HasField("abort"):
                        engine.abort(msg.abort.request_id)
            finally:
                sink.queue.put_nowait(None)  # the router closed its side: end the stream

        reader = asyncio.create_task(read_requests())
        try:
            while (batch := await sink.queue.get()) is not None:
                yield batch
        finally:
            reader.cancel()
            engine.detach(sink)

    async def SubscribeKvEvents(self, request, context):
        engine = await self._require_engine(context)
        bm = engine.scheduler.block_manager
        if bm.events is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV events are off: start "
                                "the scheduler with --kv-events-config "
                                "'{\"enable_kv_cache_events\": true}'")
        events = bm.events
        assert events is not None  # context.abort raises
        start = (request.start_sequence_number if request.HasField("start_sequence_number")
                 else None)
        sub, initial = events.subscribe(start, request.publisher_id, bm.cached_blocks)
        try:
            for first in initial:
                yield first
            while (batch := await sub.queue.get()) is not None:
                yield batch
        finally:
            events.unsubscribe(sub)
        if sub.cut_off:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this KV event subscriber "
                                f"fell {events.max_queue_size} batches behind (--kv-events-"
                                "config max_queue_size); reconnect with start_sequence_number")

    async def GetEngineInfo(self, request, context):
        await self._require_engine(context)
        return self.info

    async def GetEngineStats(self, request, context):
        engine = await self._require_engine(context)
        s = engine.scheduler
        bm = s.block_manager
        return engine_pb2.GetEngineStatsResponse(
            num_total_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
            num_used_blocks=bm.num_used_blocks, num_running=s.num_running,
            num_waiting=s.num_waiting, num_preemptions_total=s.num_preemptions_total,
            num_steps_total=engine.num_steps_total, num_cached_blocks=bm.num_cached_blocks,
            prefix_cache_queries_total=s.prefix_cache_queries_total,
            prefix_cache_hits_total=s.prefix_cache_hits_total,
            num_rejected_total=s.num_rejected_total,
            prefix_cache_tier_hits_total=s.prefix_cache_tier_hits_total,
            kv_offload_blocks=bm.tier.index.num_blocks if bm.tier else 0,
            kv_offload_loads_failed_total=bm.tier.num_load_failures_total if bm.tier else 0)


def _default(name: str):
    """The default of SchedulerConfig's field ``name`` (the flag's)."""
    return field_default(SchedulerConfig, name)


def add_args(p: argparse.ArgumentParser) -> None:
    """The scheduler's flags (also accepted by ``pagedserve serve``)."""
    add_flag(p, "--host", default="127.0.0.1", help="address to bind")
    add_flag(p, "--port", type=PORT, default=50052, help="EngineService port")
    add_flag(p, "--workers", default="127.0.0.1:50053",
             help="comma-separated worker rank addresses, rank 0 first")
    add_flag(p, "--worker-connect-timeout", type=float_in(0, lo_open=True), default=900.0,
             help="seconds to wait for the workers at start-up")
    add_flag(p, "--block-size", type=int_in(1, 1024), default=_default("block_size"),
             help="tokens per KV block (the workers' must be equal)")
    add_flag(p, "--max-num-seqs", type=int_in(1), default=_default("max_num_seqs"),
             help="most requests in one step (at most the workers' --max-num-seqs)")
    add_flag(p, "--max-num-batched-tokens", type=int_in(1),
             default=_default("max_num_batched_tokens"),
             help="most tokens computed in one step (the chunked-prefill budget; at most the "
                  "workers')")
    add_flag(p, "--max-model-len", type=int_in(1), default=None,
             help="longest prompt+output in tokens (default: the workers' max_model_len, the "
                  "model's context length unless capped; at most theirs)")
    add_flag(p, "--enable-prefix-caching", action=argparse.BooleanOptionalAction,
             default=_default("enable_prefix_caching"),
             help="reuse the KV blocks of identical prompt prefixes across requests")
    add_flag(p, "--scheduling-policy", choices=SCHEDULING_POLICIES,
             default=_default("scheduling_policy"),
             help="fcfs: arrival order; priority: by each request's priority (lower = sooner), "
                  "then arrival; also picks the preemption victim")
    add_flag(p, "--long-prefill-token-threshold", type=int_in(0), default=None,
             help="most prompt tokens one request prefills per step, so running decodes keep "
                  "moving while a long prompt is chunked in (default: max-num-batched-tokens / "
                  "4; 0 = no cap)")
    add_flag(p, "--async-scheduling", action=argparse.BooleanOptionalAction,
             default=_default("async_scheduling"),
             help="build step N+1 while step N runs on the workers (one step of look-ahead); "
                  "default: on where it can run, off under pipeline parallelism (which keeps "
                  "one step per stage in flight) and speculative decoding (asking for it there "
                  "is an error)")
    add_flag(p, "--max-num-waiting-requests", type=int_in(0),
             default=_default("max_num_waiting_requests"),
             help="refuse new requests with RESOURCE_EXHAUSTED while this many wait (0 = no "
                  "limit)")
    add_flag(p, "--max-num-waiting-tokens", type=int_in(0),
             default=_default("max_num_waiting_tokens"),
             help="refuse new requests with RESOURCE_EXHAUSTED once the waiting queue would "
                  "hold more prompt tokens than this (0 = no limit)")
    add_flag(p, "--speculative-config", type=speculative_config_arg,
             default=_default("speculative"),
             help="speculative decoding, vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                  "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' or "
                  "'{\"method\": \"draft_model\", \"model\": PATH, "
                  "\"num_speculative_tokens\": 4}' (also disable_by_batch_size, "
                  "prompt_lookup_min); workers and scheduler must agree; not with "
                  "--async-scheduling")
    add_flag(p, "--max-loras", type=int_in(1), default=_default("max_loras"),
             help="most distinct LoRA adapters among the requests of one step (vLLM's flag; "
                  "the workers' active adapter slots: serve passes one value to both); a "
                  "request whose adapter would be one more waits, without being starved")
    add_flag(p, "--kv-offload-size", type=parse_bytes, default=_default("kv_offload_size"),
             help="most bytes the KV tier on disk holds over every worker rank's files, e.g. "
                  "20GiB (when the workers run one: --kv-offload-dir); least recently used "
                  "blocks are evicted beyond it")
    add_flag(p, "--kv-events-config", type=kv_events_config_arg, default=_default("kv_events"),
             help="KV events (vLLM's JSON): the prefix cache's changes per step on a gRPC "
                  "stream (SubscribeKvEvents) and ZMQ, e.g. '{\"enable_kv_cache_events\": "
                  "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                  "\"replay_endpoint\": \"tcp://*:5558\"}' (also buffer_steps, hwm, "
                  "max_queue_size, topic; publisher \"null\": gRPC only); needs prefix caching")
    add_tls_flags(p)
    add_shutdown_flags(p)
    add_log_flags(p)
    add_tracing_flags(p)
    add_metrics_flags(p, SCHEDULER_PORT)
    add_flag(p, "--metrics-names", choices=METRICS_NAMES, default=METRICS_NAMES[0],
             help="names of the /metrics series: pagedserve (pagedserve:NAME), vllm (vLLM's "
                  "vllm:NAME, labels and semantics, for gateways and autoscalers that read "
                  "vLLM's; docs/fleet.md) or both")


def scheduler_config(args, max_model_len: int, pipeline_parallel_size: int = 1
                     ) -> SchedulerConfig:
    """The SchedulerConfig the flags ask for (``--long-prefill-token-threshold`` unset means a
    quarter of ``--max-num-batched-tokens``) for workers of ``pipeline_parallel_size`` stages
    (``SchedulerConfig`` resolves async scheduling and the steps in flight from them).

    Raises:
        ValueError: a flag out of range, or flags that do not go together, naming them.
    """
    threshold = args.long_prefill_token_threshold
    if threshold is None:
        threshold = max(1, args.max_num_batched_tokens // 4)
    try:
        return SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len, block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            scheduling_policy=args.scheduling_policy, long_prefill_token_threshold=threshold,
            max_num_waiting_requests=args.max_num_waiting_requests,
            max_num_waiting_tokens=args.max_num_waiting_tokens,
            pipeline_parallel_size=pipeline_parallel_size,
            async_scheduling=args.async_scheduling, speculative=args.speculative_config,
            max_loras=args.max_loras, kv_offload_size=args.kv_offload_size,
            kv_events=args.kv_events_config)
    except ValueError as e:  # name the flag, not the field
        if str(e).startswith("--"):
            raise
        flag = "--" + str(e).split(" ", 1)[0].replace("_", "-")
        raise ValueError(f"{flag}: {e}") from None


def lora_slots_of(infos: list[worker_pb2.GetWorkerInfoResponse], max_loras: int) -> int:
    """The LoRA adapters every rank can hold active at once (0: the workers run none, so the
    engine refuses requests naming one).

    Raises:
        ValueError: the scheduler's ``--max-loras`` is above the workers' (it would put more
            adapters in one step than they hold), naming both.
    """
    slots = min(i.max_loras for i in infos)
    if 0 < slots < max_loras:
        raise ValueError(f"the scheduler has --max-loras {max_loras} but the workers hold "
                         f"{slots} LoRA adapters at once (their --max-loras); start both with "
                         "the same value")
    return slots


async def build_engine(args) -> tuple[Engine, engine_pb2.GetEngineInfoResponse]:
    """Connect to the workers and build the Engine.

    Raises:
        ValueError: workers disagree, or max_model_len cannot fit.
        WorkerError: workers not reachable within --worker-connect-timeout, one refused this
            scheduler's limits (a flag the worker was started with another value of), or they
            report different KV cache groups.
    """
    limits = worker_pb2.GetWorkerInfoRequest(
        block_size=args.block_size, max_model_len=args.max_model_len or 0,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        speculative_config=args.speculative_config.to_json() if args.speculative_config else "")
    workers = WorkerGroup([a.strip() for a in args.workers.split(",") if a.strip()],
                          credentials=client_credentials(tls_from_args(args)), limits=limits)
    infos = await workers.connect(timeout=args.worker_connect_timeout)
    try:
        return _engine_over(args, workers, infos)
    except BaseException:  # (a refusal: let the workers go now, not at their drain timeout)
        await workers.close()
        raise


def _engine_over(args, workers: WorkerGroup, infos: list[worker_pb2.GetWorkerInfoResponse]
                 ) -> tuple[Engine, engine_pb2.GetEngineInfoResponse]:
    """``build_engine`` once the workers answered: check they agree, build the Engine.

    Raises:
        ValueError: as ``build_engine``.
    """
    first = infos[0]
    for addr, info in zip(workers.addresses, infos, strict=True):
        if (info.model, info.dtype) != (first.model, first.dtype):
            raise ValueError(f"worker {addr} serves {info.model}/{info.dtype} but rank 0 serves "
                             f"{first.model}/{first.dtype}")
        if info.kv_cache_dtype != first.kv_cache_dtype:
            raise ValueError(f"worker {addr} stores its KV cache as --kv-cache-dtype "
                             f"{info.kv_cache_dtype} but rank 0 as {first.kv_cache_dtype}")
        if (info.runner or "generate") != (first.runner or "generate"):
            raise ValueError(f"worker {addr} runs --runner {info.runner or 'generate'} but rank "
                             f"0 runs {first.runner or 'generate'}")
        if info.quantization != first.quantization:
            raise ValueError(f"worker {addr} stores its weights as {info.quantization or 'none'}"
                             f" but rank 0 as {first.quantization or 'none'} (--quantization)")
    num_blocks = min(i.num_kv_blocks for i in infos)
    # (every rank accepted --max-model-len, so it is at most theirs)
    max_model_len = args.max_model_len or min(i.max_model_len for i in infos)
    config = scheduler_config(args, max_model_len, workers.pipeline_parallel_size)
    lora_slots = lora_slots_of(infos, config.max_loras)
    log.info("scheduling: %d steps in flight, async scheduling %s%s", config.max_steps_in_flight,
             "on" if config.async_scheduling else "off",
             f"; speculative decoding {config.speculative.to_json()}"
             if config.speculative else "")
    log.info("KV cache groups: %s", describe_kv_cache_groups(workers.kv_cache_groups))
    scheduler = Scheduler(config, num_kv_blocks=num_blocks, eos_token_ids=list(first.eos_token_ids),
                          sliding_windows=workers.sliding_windows,
                          vocab_size=first.vocab_size or None,
                          pooling=first.runner == "pooling",
                          kv_tier=build_kv_tier(*workers.kv_tier_folders(), config))
    info = engine_pb2.GetEngineInfoResponse(
        model=first.model, max_model_len=max_model_len, block_size=args.block_size,
        num_kv_blocks=num_blocks, vocab_size=first.vocab_size,
        eos_token_ids=first.eos_token_ids, dtype=first.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy, kv_cache_dtype=first.kv_cache_dtype or "auto",
        quantization=first.quantization, runner=first.runner or "generate",
        embedding_size=first.embedding_size,
        matryoshka_dimensions=first.matryoshka_dimensions, is_matryoshka=first.is_matryoshka)
    scheduler.block_manager.events = build_kv_event_log(config.kv_events, args.block_size,
                                                        first.device)
    engine = Engine(scheduler, workers)
    engine.lora_slots = lora_slots
    return engine, info


async def serve(args, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None):
    """Run the scheduler until ``stop`` (or SIGINT/SIGTERM) is set.

    Raises:
        ValueError: a flag out of range (checked before waiting for the workers).
        SystemExit(1): the engine loop ended (it could not recover from an error); health is
            NOT_SERVING by then, so a supervisor restarts the process.
    """
    scheduler_config(args, max_model_len=args.max_model_len or 1)  # fail fast on bad flags
    server, port, health = await new_server(args.host, args.port, tls=tls_from_args(args))
    args.port = port
    servicer = EngineServicer()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
    await server.start()  # health answers NOT_SERVING while we wait for the workers
    engine, loop_task, metrics_server = None, None, None
    try:
        log.info("scheduler waiting for workers %s", args.workers)
        with waiting_step("the workers"):
            engine, info = await build_engine(args)
        engine.on_health = lambda ok: set_serving(health, ok and not engine.draining, [SERVICE])
        engine.metrics = SchedulerMetrics(
            engine.scheduler, model_name=info.model,
            cache_config={"block_size": str(info.block_size),
                          "num_gpu_blocks": str(info.num_kv_blocks),
                          "cache_dtype": info.kv_cache_dtype},
            model_config={"dtype": info.dtype, "quantization": info.quantization or "none"})
        metrics_server = start_metrics_server(exposed_registry(engine.metrics.registry,
                                                               args.metrics_names),
                                              args.metrics_host or args.host, args.metrics_port)
        args.metrics_port = metrics_server.port if metrics_server else args.metrics_port
        servicer.engine, servicer.info = engine, info
        loop_task = asyncio.create_task(engine.run())
        await set_serving(health, True, [SERVICE])
        log.info("scheduler serving on %s:%d: %s, %d KV blocks of %d tokens, max_model_len %d",
                 args.host, port, info.model, info.num_kv_blocks, info.block_size,
                 info.max_model_len)
        if ready:
            ready.set()
        stop = stop or stop_event_on_signals()
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait([waiter, loop_task], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if loop_task.done():  # the engine gave up recovering: exit non-zero, do not linger
            await set_serving(health, False, [SERVICE])
            log.critical("the engine loop ended: %r; exiting", loop_task.exception())
            raise SystemExit(1)
        await drain("scheduler", health, [SERVICE], args.shutdown_timeout, engine.begin_drain,
                    lambda timeout: wait_until(lambda: engine.idle, timeout),
                    on_timeout=lambda: engine.fail_all(grpc.StatusCode.UNAVAILABLE, TIMED_OUT))
        servicer.close_streams()  # the routers get every final output first
    finally:
        await set_serving(health, False, [SERVICE])
        if loop_task:
            loop_task.cancel()
        if engine:
            await engine.workers.close()
        if metrics_server is not None:
            metrics_server.close()
        if engine and engine.scheduler.block_manager.events is not None:
            engine.scheduler.block_manager.events.close()  # (ends the KV event streams)
        await server.stop(grace=1.0)

