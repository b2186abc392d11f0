"""The worker service: WorkerService servicer (thin) and its start-up.

Each StepRequest is decoded into a ``StepInput`` (``services/common/step.py``), run by the
``ModelRunner`` on one dedicated thread (so the event loop keeps answering health checks during
a forward pass; the same thread loaded the model, see ``forward_thread``), and the sampled
tokens go back as a StepResult.

Parallel workers (``--tensor-parallel-size N --pipeline-parallel-size M``): ``serve`` serves one
rank, ``--rank``, joining the group at ``--dist-init-addr`` (or ``MASTER_ADDR:MASTER_PORT``;
services/worker/parallel/rendezvous.py); the process layer starts and supervises all N*M, or one
host's
share of them (``pagedserve worker`` without ``--rank``: services/cli/ranks.py), rank r serving
on ``--port + r``. A rank whose step fails (e.g. a peer died during a collective) stops serving
and exits with code 1: its process group is unusable, so the group restarts. After loading,
each rank reports its memory (services/worker/memory_report.py) in its log and metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.config import PORT, add_flag, field_default, float_in, int_in, parse_bytes
from services.common.grpc_utils import new_server, set_serving, stop_event_on_signals
from services.common.logs import add_log_flags
from services.common.metrics import WORKER_PORT, add_metrics_flags, start_metrics_server
from services.common.pb.pagedserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.progress import startup_step
from services.common.shutdown import InFlight, add_shutdown_flags, drain
from services.common.spec_decode_config import SpeculativeConfig
from services.common.step import StepInput
from services.common.step_wire import step_from_pb, step_output_to_pb
from services.common.tls import add_tls_flags, tls_from_args
from services.common.tracing import add_tracing_flags
from services.worker.config import WorkerConfig
from services.worker.cpu_governor import ThreadGovernor, governor_for
from services.worker.cpu_threads import cpu_bind_flag, pin_threads, plan_from_args, set_threads
from services.worker.lora import LoRAConfig
from services.worker.metrics import WorkerMetrics
from services.worker.pooler_config import RUNNERS, PoolerConfig
from services.worker.step_checks import check_block_copies, check_sampling
from services.worker.tracing import record_step

log = logging.getLogger(__name__)
SERVICE = "pagedserve.v1.WorkerService"


def step_input_from_pb(msg: worker_pb2.StepRequest, vocab_size: int,
                       num_kv_blocks: int | None = None, max_loras: int = 0) -> StepInput:
    """Decode a StepRequest (``step_wire.step_from_pb``) and check what the runner will use.

    ``num_kv_blocks`` (the rank's; the servicer passes it) range-checks the block copies;
    None leaves that to the caller (in-process benchmarks, whose scheduler sized the cache).
    ``max_loras`` (the rank's ``GetWorkerInfoResponse.max_loras``): 0 refuses a new request
    with a LoRA adapter, which this rank cannot run (never silently the base model).

    Raises:
        ValueError: a malformed message: columns that disagree, a new request's sampling
            parameters the sampler cannot use (``check_sampling``; ``vocab_size``: the
            model's), block copies that cannot run as asked (``check_block_copies``), or a
            LoRA adapter on a rank without LoRA support.
    """
    step = step_from_pb(msg)
    for r in step.new_requests:
        try:
            check_sampling(r.sampling_params, vocab_size)
        except ValueError as e:
            raise ValueError(f"new request {r.request_id!r}: {e}") from None
        if r.lora is not None and not max_loras:
            raise ValueError(f"new request {r.request_id!r} names LoRA adapter "
                             f"{r.lora.name!r} but this worker runs no LoRA adapters "
                             "(max_loras 0); the scheduler never sends one to it")
    if num_kv_blocks is not None:
        check_block_copies(step.blocks_to_copy, num_kv_blocks)
    return step


def limits_refused(limits: worker_pb2.GetWorkerInfoRequest,
                   info: worker_pb2.GetWorkerInfoResponse,
                   speculative_config: str = "") -> str | None:
    """Why this rank (``info``; ``speculative_config``: its ``--speculative-config``,
    ``SpeculativeConfig.to_json()`` or "" for none) cannot serve a scheduler with ``limits``,
    naming the flag and both values; None when it can. A limit left 0 is not checked.
    ``block_size`` must be equal, and so must the speculative config (checked with a
    block_size: a real scheduler; the rank proposes the drafts, a draft model writes into the
    scheduler's lookahead slots); ``max_model_len``, ``max_num_seqs`` and
    ``max_num_batched_tokens`` at most the rank's (it sized its input batch, and on CUDA the
    profiling step that sized its KV cache, for those; a scheduler asking less is fine)."""
    if limits.block_size and limits.block_size != info.block_size:
        return (f"the scheduler has --block-size {limits.block_size} but this worker was started "
                f"with --block-size {info.block_size}; start both with the same value")
    if limits.block_size and limits.speculative_config != speculative_config:
        return (f"the scheduler has --speculative-config {limits.speculative_config or '(none)'}"
                f" but this worker was started with --speculative-config "
                f"{speculative_config or '(none)'}; start both with the same value")
    if limits.max_model_len > info.max_model_len:
        return (f"the scheduler has --max-model-len {limits.max_model_len} but this worker's "
                f"max_model_len is {info.max_model_len} (its --max-model-len, or the model's "
                "context length); lower the scheduler's")
    for flag, theirs, ours in (
            ("--max-num-seqs", limits.max_num_seqs, info.max_num_seqs),
            ("--max-num-batched-tokens", limits.max_num_batched_tokens,
             info.max_num_batched_tokens)):
        if theirs > ours:
            return (f"the scheduler has {flag} {theirs} but this worker was started with {flag} "
                    f"{ours} (its input batch and CUDA memory profile are sized for that); start "
                    "the worker with at least the scheduler's value")
    return None


def forward_thread() -> ThreadPoolExecutor:
    """The one thread that does a worker's torch work: loading, warm-up and every step.

    NOTE: one thread for all of it, not one for loading and another for steps: each thread
    that starts an OpenMP parallel region gets its own libgomp thread pool, and once a process
    has more OpenMP threads than CPUs, libgomp throttles its spin-wait (GOMP_SPINCOUNT's
    "throttled" count), so every worker thread sleeps on a futex at the end of every parallel
    region and is woken for the next one. Measured (benchmarks/forward_thread.py, 16
    requests): ~150,000 voluntary context switches in a run with a second pool, ~300 without.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Decode protobuf → ModelRunner.execute_step → encode protobuf; nothing else."""

    def __init__(self, runner, info: worker_pb2.GetWorkerInfoResponse,
                 fatal: asyncio.Event | None = None, metrics: WorkerMetrics | None = None,
                 executor: ThreadPoolExecutor | None = None,
                 governor: ThreadGovernor | None = None):
        self.runner = runner
        self._governor = governor  # (the thread-count governor, around each step)
        self.info = info
        speculative = getattr(runner, "speculative", None)  # (SpeculativeConfig | None)
        self.speculative_config = speculative.to_json() if speculative is not None else ""
        self.metrics = metrics
        self.fatal = fatal  # set when a failed step leaves this rank unusable (parallel ranks)
        self.streams = InFlight()  # open step streams: shutdown waits until none is
        # One thread: steps must run in order, and torch uses its own intra-op threads. Pass
        # the thread that built the runner (see forward_thread()).
        self._executor = executor or forward_thread()

    def _run_step(self, step: StepInput):
        """One step on the forward thread, with the governor around it when there is one."""
        if self._governor is None:
            return self.runner.execute_step(step)
        return self._governor.run(self.runner.execute_step, step)

    async def GetWorkerInfo(self, request, context):
        refused = limits_refused(request, self.info, self.speculative_config)
        if refused is not None:
            log.error("refusing the scheduler: %s", refused)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused)
        return self.info

    async def Execute(self, request_iterator, context):
        with self.streams.track():
            async with contextlib.aclosing(self._execute(request_iterator, context)) as steps:
                async for result in steps:
                    yield result

    async def _execute(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        async for msg in request_iterator:
            try:
                step = step_input_from_pb(msg, self.info.vocab_size, self.info.num_kv_blocks,
                                          self.info.max_loras)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {msg.step_id}: {e}")
            if step.new_requests and log.isEnabledFor(logging.DEBUG):
                for r in step.new_requests:
                    log.debug("step %d: new request, %d tokens, %d blocks", msg.step_id,
                              len(r.prompt_token_ids), len(r.block_ids),
                              extra={"request_id": r.request_id})
            t0, start_ns = time.perf_counter(), time.time_ns() if step.traceparents else 0
            try:
                out = await loop.run_in_executor(self._executor, self._run_step, step)
            except Exception as e:  # a bug or OOM in the forward: fail the stream loudly
                log.exception("step %d failed", msg.step_id)
                if self.fatal is not None:
                    self.fatal.set()
                await context.abort(grpc.StatusCode.INTERNAL, f"step {msg.step_id} failed: {e}")
            seconds = time.perf_counter() - t0
            if step.traceparents:
                record_step(step, start_ns, start_ns + int(seconds * 1e9), self.info.rank)
            if self.metrics is not None:
                self.metrics.observe_step(seconds, step.total_num_scheduled_tokens,
                                          len(step.new_requests) + len(step.cached_requests))
            yield step_output_to_pb(out)


def _default(name: str):
    """``WorkerConfig``'s default of field ``name``: its flag's."""
    return field_default(WorkerConfig, name)


def add_args(p: argparse.ArgumentParser) -> None:
    """The worker's flags (also accepted by ``pagedserve serve``)."""
    add_flag(p, "--host", default="127.0.0.1", help="address to bind")
    add_flag(p, "--port", type=PORT, default=50053, help="WorkerService port")
    add_flag(p, "--model", default=_default("model"),
             help="transformers folder or .gguf file (default: packaged SmolLM2-135M-Instruct)")
    add_flag(p, "--dtype", default=_default("dtype"),
             choices=["auto", "float32", "bfloat16", "float16"],
             help="compute dtype; auto = bfloat16 on a CPU/GPU with native bf16, else float32")
    add_flag(p, "--device", default=_default("device"), help="cpu, cuda or auto")
    add_flag(p, "--block-size", type=int_in(1, 1024), default=_default("block_size"),
             help="tokens per KV block (worker and scheduler must agree)")
    add_flag(p, "--kv-cache-memory", type=parse_bytes,
             default=_default("kv_cache_memory"),
             help="KV cache size on CPU, e.g. 4GiB")
    add_flag(p, "--kv-cache-dtype", default=_default("kv_cache_dtype"),
             choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],
             help="how the KV cache stores K/V: auto = the model dtype; int8 = per token and "
                  "head with a one-byte scale; fp8 (= fp8_e4m3) / fp8_e5m2 = float8 with scale "
                  "1.0. Half the bytes of bfloat16 (about twice the tokens in --kv-cache-memory, "
                  "half the bytes read per decoded token); every attention backend")
    add_flag(p, "--gpu-memory-utilization", type=float_in(0, 1, lo_open=True),
             default=_default("gpu_memory_utilization"),
             help="fraction of GPU memory for weights, activations and KV cache")
    add_flag(p, "--max-num-seqs", type=int_in(1), default=_default("max_num_seqs"),
             help="most requests in one step (the scheduler's may not be larger; the worker's "
                  "input batch and, on CUDA, the profiling forward pass are sized for it)")
    add_flag(p, "--max-num-batched-tokens", type=int_in(1),
             default=_default("max_num_batched_tokens"),
             help="most tokens computed in one step (the chunked-prefill budget; the "
                  "scheduler's may not be larger; on CUDA also the size of the profiling "
                  "forward pass)")
    add_flag(p, "--max-model-len", type=int_in(1), default=_default("max_model_len"),
             help="longest prompt+output in tokens (default: the model's context length; the "
                  "scheduler's may not be larger)")
    add_flag(p, "--attention-backend", default=_default("attention_backend"),
             choices=["auto", "torch", "triton", "cpu"],
             help="auto = triton on CUDA, torch on CPU; cpu = the native C++ CPU kernels")
    add_flag(p, "--enforce-eager", action="store_true", default=_default("enforce_eager"),
             help="run the model eagerly: never torch.compile the forward (by default a "
                  "single-rank CPU worker compiles it at start, cached on disk)")
    add_flag(p, "--batch-invariant", action="store_true",
             default=_default("batch_invariant"),
             help="every request's output bitwise the same whatever else is in the batch, "
                  "at any dtype (vLLM's VLLM_BATCH_INVARIANT). A 16-bit model on the CPU "
                  "already is (its linear layers run on the native row-invariant kernels); "
                  "this puts a float32 model's there too. CPU with the native kernels only "
                  "(docs/architecture.md#numerics)")
    add_flag(p, "--quantization", default=_default("quantization"),
             choices=["gguf", "none", "awq", "gptq", "int8", "w8a8"],
             help="how the weights are stored. gguf (the default for a .gguf model on a CPU "
                  "worker without tensor parallelism): the file's quantized tensors as stored "
                  "(Q4_0/Q4_1/Q4_K as 4-bit codes, Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 as int8 codes, "
                  "with their scales per group), the embedding and LM head included, "
                  "dequantized inside the native GEMM; activations in --dtype. none: a GGUF "
                  "dequantized at load to --dtype. int8 / w8a8: the decoder's linear layers "
                  "quantized at load per output channel (symmetric; embedding and LM head in "
                  "--dtype); int8 is weight-only, w8a8 quantizes activations per token too "
                  "(the native W8A8 kernel: int32 sums, vpdpbusd on VNNI). awq / gptq: a "
                  "4-bit AWQ (GEMM) or GPTQ checkpoint's layers as stored (detected from "
                  "config.json's quantization_config without the flag). Unset: gguf for a "
                  ".gguf, the "
                  "checkpoint's own for AWQ / GPTQ, else --dtype. CPU only")
    add_flag(p, "--runner", default=_default("runner"), choices=list(RUNNERS),
             help="what the server runs (vLLM's flag): generate = sample tokens; pooling = "
                  "embeddings (/v1/embeddings: one forward per prompt, no LM head, no KV kept); "
                  "auto = pooling for an embedding checkpoint (a sentence-transformers "
                  "modules.json or 1_Pooling/config.json, or config.json architectures naming "
                  "only ...Model), else generate")
    add_flag(p, "--pooler-config", type=pooler_config_flag,
             default=_default("pooler_config"),
             help='the pooling runner\'s pooling as JSON, vLLM\'s fields: {"pooling_type": '
                  '"LAST" | "MEAN" | "CLS", "normalize": true | false}; fields left out: what '
                  "the checkpoint's sentence-transformers config says, else LAST, normalized")
    add_flag(p, "--enable-lora", action="store_true",
             help="serve LoRA adapters (vLLM's flag): each request may name a PEFT adapter, "
                  "loaded from its folder at first use; rows of different adapters run in "
                  "one step (services/worker/lora/)")
    add_flag(p, "--max-loras", type=int_in(1), default=field_default(LoRAConfig, "max_loras"),
             help="LoRA adapters resident at once, so the most distinct adapters in one step "
                  "(vLLM's flag; the scheduler's may not be larger)")
    add_flag(p, "--max-lora-rank", type=int_in(1),
             default=field_default(LoRAConfig, "max_lora_rank"),
             help="the largest LoRA rank served (vLLM's flag); each resident slot is this "
                  "wide, and an adapter of a higher rank is refused")
    add_flag(p, "--max-cpu-loras", type=int_in(1),
             default=field_default(LoRAConfig, "max_cpu_loras"),
             help="LoRA adapters kept loaded in CPU memory, least recently used evicted "
                  "(vLLM's flag; default and minimum: --max-loras)")
    add_flag(p, "--tensor-parallel-size", type=int_in(1),
             default=_default("tensor_parallel_size"),
             help="ranks each layer is split across (all-reduce over gloo/NCCL)")
    add_flag(p, "--pipeline-parallel-size", type=int_in(1),
             default=_default("pipeline_parallel_size"),
             help="pipeline stages the layers are split into (one rank group per stage)")
    add_flag(p, "--rank", type=int_in(0), default=None,
             help="serve only this rank (rendezvous at --dist-init-addr, or MASTER_ADDR:"
                  "MASTER_PORT); unset with more than one rank: start all ranks here (or this "
                  "host's share, --nnodes), rank r on --port + r")
    add_flag(p, "--world-size", type=int_in(1), default=_default("world_size"),
             help="number of ranks; must equal tensor x pipeline parallel size (a check)")
    add_flag(p, "--distributed-timeout", type=float_in(0, lo_open=True), default=60.0,
             help="seconds a rank waits on a peer (a collective, a missed heartbeat) before "
                  "failing; the rendezvous at start waits up to 5 minutes, or this if longer")
    add_flag(p, "--pipeline-layer-partition", type=partition_flag,
             default=os.environ.get("VLLM_PP_LAYER_PARTITION",
                                    _default("pipeline_layer_partition")),
             help="layers per pipeline stage, e.g. 10,20 (must sum to the model's layer count; "
                  "unset: an even split). Also read from vLLM's VLLM_PP_LAYER_PARTITION")
    add_flag(p, "--dist-init-addr", default=None,
             help="HOST:PORT of the torch.distributed rendezvous (rank 0's host; its store "
                  "listens on PORT): needed when the ranks span hosts; unset: MASTER_ADDR / "
                  "MASTER_PORT, or a fresh local port when all ranks start here")
    add_flag(p, "--nnodes", type=int_in(1), default=1,
             help="hosts the ranks span (without --rank: this host starts its world size / "
                  "nnodes ranks, ranks node_rank x that .. on --port + local index)")
    add_flag(p, "--node-rank", type=int_in(0), default=0,
             help="this host's index among --nnodes (0: the host of rank 0 and the rendezvous)")
    add_flag(p, "--advertise-host", default=None,
             help="the host name or address the scheduler reaches this host's ranks on "
                  "(logged and reported to rank 0; default --host, or this host's name when "
                  "--host is a wildcard)")
    add_flag(p, "--speculative-config", type=speculative_flag, default=None,
             help='speculative decoding as JSON, vLLM\'s fields, e.g. {"method": "ngram", '
                  '"num_speculative_tokens": 4} or {"model": DRAFT, "num_speculative_tokens": '
                  '4}; the scheduler must have the same (services/common/spec_decode_config.py)')
    add_flag(p, "--cpu-threads", type=int_in(1), default=None,
             help="OpenMP threads of a CPU worker (default: the CPUs its affinity mask and "
                  "cgroup CPU quota allow, shared between this host's ranks; "
                  "services/worker/cpu_threads.py)")
    add_flag(p, "--cpu-bind", type=cpu_bind_flag,
             default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
             help="pin the OpenMP threads one per core: auto (the CPUs this rank may use), a "
                  "list such as 0-3 (split between this host's ranks) or 0-1|2-3 (one per "
                  "rank), or none; the worker's other threads move to the cores left. vLLM's "
                  "VLLM_CPU_OMP_THREADS_BIND is read too")
    add_flag(p, "--cpu-adaptive-threads", action=argparse.BooleanOptionalAction, default=True,
             help="use fewer OpenMP threads while other processes take the worker's cores, "
                  "all again once they leave (services/worker/cpu_governor.py; off with "
                  "--batch-invariant)")
    add_flag(p, "--kv-offload-dir", metavar="PATH", default=_default("kv_offload_dir"),
             help="a KV tier on disk: KV blocks the scheduler picks are written to and read "
                  "back from files under PATH/<namespace>/tp<rank>of<size> (the scheduler "
                  "needs prefix caching; not with --pipeline-parallel-size > 1 or --runner "
                  "pooling; services/worker/kv_tier.py)")
    add_tls_flags(p)
    add_shutdown_flags(p)
    add_log_flags(p)
    add_tracing_flags(p)
    add_metrics_flags(p, WORKER_PORT)


def speculative_flag(text: str) -> str:
    """``--speculative-config``'s argparse type: the text, once ``SpeculativeConfig.parse``
    accepts it (parsed again by ``WorkerConfig.from_args``; kept a string so it forwards as
    given).

    Raises:
        argparse.ArgumentTypeError: parse's message.
    """
    try:
        SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def partition_flag(text: str) -> str:
    """``--pipeline-layer-partition``'s argparse type: the text, once ``parse_partition``
    accepts it (the sum is checked against the model at load).

    Raises:
        argparse.ArgumentTypeError: parse_partition's message.
    """
    from services.worker.parallel.layer_partition import parse_partition
    try:
        parse_partition(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def pooler_config_flag(text: str) -> str:
    """``--pooler-config``'s argparse type: the text, once ``PoolerConfig.parse`` accepts it.

    Raises:
        argparse.ArgumentTypeError: parse's message (naming the field).
    """
    try:
        PoolerConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def world_size(args) -> int:
    """Ranks the flags ask for (``WorkerConfig.num_ranks``).

    Raises:
        ValueError: the flags disagree (``WorkerConfig``'s checks: --world-size,
            --pipeline-layer-partition or --speculative-config against the parallel sizes).
    """
    return WorkerConfig.from_args(args).num_ranks


def advertised_host(args) -> str:
    """Where the scheduler reaches this host's ranks: ``--advertise-host``, else ``--host``
    unless that is a wildcard (0.0.0.0, ::), else this host's name."""
    import socket
    if args.advertise_host:
        return args.advertise_host
    return args.host if args.host not in ("", "0.0.0.0", "::", "[::]") else socket.getfqdn()


def build_runner(args):
    """Join the rank group (if any), load this rank's part of the model and allocate the KV
    cache (slow: seconds to minutes).

    Raises:
        ValueError: flags that disagree (``WorkerConfig.from_args``), before joining.
    """
    from services.worker.device import resolve_device
    from services.worker.model_runner import ModelRunner
    from services.worker.parallel.distributed import ParallelConfig, init_distributed
    config = WorkerConfig.from_args(args)
    pc = ParallelConfig(config.tensor_parallel_size, config.pipeline_parallel_size,
                        args.rank or 0, config.layer_partition)
    parallel = None
    if pc.world_size > 1:
        resolved = resolve_device(config.device)
        if resolved.type == "cuda" and config.device in ("auto", "cuda"):
            import torch  # NOTE: one GPU per rank: LOCAL_RANK (torchrun) or the rank
            local_rank = int(os.environ.get("LOCAL_RANK", pc.rank))
            resolved = torch.device("cuda", local_rank % torch.cuda.device_count())
        config = dataclasses.replace(config, device=str(resolved))
        parallel = init_distributed(pc, resolved, args.distributed_timeout, args.dist_init_addr,
                                    f"{advertised_host(args)}:{args.port}")
    return ModelRunner(config, parallel)


def lora_config(args) -> LoRAConfig | None:
    """The LoRA limits of ``--enable-lora`` and its flags, or None without it
    (``WorkerConfig.lora``). Raises ValueError (naming the flags) when --max-cpu-loras is
    below --max-loras."""
    return WorkerConfig.from_args(args).lora


def worker_info(runner) -> worker_pb2.GetWorkerInfoResponse:
    """What this rank tells the scheduler at start-up (the KV cache groups: the whole model's,
    the same on every rank)."""
    ps = getattr(runner, "parallel", None)
    tp, pp, rank = ((ps.config.tensor_parallel_size, ps.config.pipeline_parallel_size,
                     ps.config.rank) if ps else (1, 1, 0))
    return worker_pb2.GetWorkerInfoResponse(
        model=runner.model_name, dtype=runner.dtype_name, num_kv_blocks=runner.num_kv_blocks,
        block_size=runner.block_size, max_model_len=runner.max_model_len,
        vocab_size=runner.vocab_size, eos_token_ids=runner.eos_token_ids, rank=rank,
        world_size=tp * pp, device=str(runner.device),
        attention_backend=runner.attention_backend_name, tensor_parallel_size=tp,
        pipeline_parallel_size=pp, group_id=ps.group_id if ps else "",
        max_num_seqs=runner.max_num_seqs, max_num_batched_tokens=runner.max_num_batched_tokens,
        kv_cache_dtype=runner.kv_cache_dtype_name, quantization=runner.weights_quantization,
        **_pooling_info(runner), **_lora_info(runner), **_kv_tier_info(runner),
        kv_cache_groups=[worker_pb2.KVCacheGroup(sliding_window=g.sliding_window,
                                                 layer_ids=g.layer_ids)
                         for g in runner.kv_cache_groups])


def _lora_info(runner) -> dict:
    """The runner's GetWorkerInfoResponse fields about LoRA (none when it is off)."""
    manager = getattr(runner, "lora", None)
    if manager is None:
        return {}
    cfg = manager.config
    return {"max_loras": cfg.max_loras, "max_lora_rank": cfg.max_lora_rank,
            "max_cpu_loras": cfg.cpu_capacity}


def _kv_tier_info(runner) -> dict:
    """The runner's GetWorkerInfoResponse fields about the KV tier (none without it)."""
    tier = getattr(runner, "kv_tier", None)
    if tier is None:
        return {}
    return {"kv_offload_path": tier.rank_dir, "kv_offload_block_bytes": tier.block_bytes}


def _pooling_info(runner) -> dict:
    """The runner's GetWorkerInfoResponse fields about pooling (none for a generate runner)."""
    info = getattr(runner, "info", None)
    if info is None or info.runner != "pooling":
        return {"runner": "generate"}
    return {"runner": "pooling", "embedding_size": runner.model.config.hidden_size,
            "matryoshka_dimensions": list(info.matryoshka_dimensions),
            "is_matryoshka": info.is_matryoshka}


def _report_kernel_builds() -> None:
    """A first start builds the CPU kernels: a start-up step, which says so while it lasts."""
    from kernels import cpu_build
    cpu_build.progress = functools.partial(startup_step, detail="once for this source")


async def serve(args, runner=None, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None):
    """Load the model (unless ``runner`` is given) and serve until stopped.

    A parallel rank whose step failed exits the process with code 1 (see the module note).

    Raises:
        ValueError: more than one rank and no ``--rank`` (``pagedserve worker`` starts them
            all), or a ``--world-size`` that disagrees.
    """
    if runner is None and world_size(args) > 1 and args.rank is None:
        raise ValueError(f"{world_size(args)} ranks and no --rank: give the rank this process "
                         "serves, or start them all with `pagedserve worker`")
    forward = forward_thread()
    report = governor = None
    if runner is None:
        _report_kernel_builds()
        loop = asyncio.get_running_loop()
        plan = plan_from_args(args)  # (a ValueError names the flag)
        await loop.run_in_executor(forward, set_threads, plan)
        runner = await loop.run_in_executor(forward, build_runner, args)
        from services.worker.memory_report import measure
        report = await loop.run_in_executor(forward, measure, runner)
        if plan.bind is not None:  # (after warm-up: compile workers would inherit one core)
            await loop.run_in_executor(forward, pin_threads, plan)
        governor = await loop.run_in_executor(forward, governor_for, plan, runner,
                                              args.cpu_adaptive_threads)
    server, port, health = await new_server(args.host, args.port, tls=tls_from_args(args))
    args.port = port
    fatal = asyncio.Event() if getattr(runner, "parallel", None) else None
    info = worker_info(runner)
    metrics = WorkerMetrics(rank=info.rank)
    if report is not None:
        metrics.set_memory(report)
        metrics.set_cpu_threads(plan.threads)
    if governor is not None:
        governor.on_change = metrics.set_cpu_threads
    tier = getattr(runner, "kv_tier", None)
    if tier is not None:
        tier.metrics = metrics.kv_tier
        metrics.kv_tier.set_writes_enabled(tier.writes_enabled)
    servicer = WorkerServicer(runner, info, fatal, metrics, forward, governor)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    await server.start()
    metrics_server = start_metrics_server(metrics.registry, args.metrics_host or args.host,
                                          args.metrics_port)
    args.metrics_port = metrics_server.port if metrics_server else args.metrics_port
    try:
        await set_serving(health, True, [SERVICE])
        log.info("worker serving on %s:%d: %s %s, %d KV blocks", args.host, port,
                 runner.model_name, runner.dtype_name, runner.num_kv_blocks)
        if ready:
            ready.set()
        stop = stop or stop_event_on_signals()
        waits = [asyncio.ensure_future(e.wait()) for e in (stop, fatal) if e is not None]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if fatal is not None and not fatal.is_set():  # stopping on purpose, as its peers are
            from services.worker.parallel.distributed import stop_heartbeat
            stop_heartbeat()
        if fatal is None or not fatal.is_set():  # keep stepping until the scheduler drained
            await drain("worker", health, [SERVICE], args.shutdown_timeout,
                        servicer.streams.begin_drain, servicer.streams.wait_idle)
    finally:
        await set_serving(health, False, [SERVICE])
        await server.stop(grace=1.0)
        if metrics_server is not None:
            metrics_server.close()
        if tier is not None:  # (after the last step: the queued writes finish first)
            tier.close()
    if fatal is not None:  # a rank of a group: exit now, whether stopped or failed
        if fatal.is_set():
            log.error("rank %d: a step failed; exiting so the rank group can restart",
                      runner.parallel.config.rank)
        logging.shutdown()
        # NOTE: not SystemExit: the forward thread may still be blocked in a collective on a
        # dead peer, and interpreter shutdown would wait for it.
        os._exit(1 if fatal.is_set() else 0)

