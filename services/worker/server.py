"""The worker service: WorkerService servicer (thin) and its start-up.

Each StepRequest is decoded into a ``StepInput``, run by the ``ModelRunner`` on one dedicated
thread (so the event loop keeps answering health checks during a forward pass), and the sampled
tokens go back as a StepResult.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.config import LOG_LEVELS, PORT, add_flag, float_in, int_in, parse_bytes
from services.common.grpc_utils import new_server, set_serving, stop_event_on_signals
from services.common.pb.pagedserve.v1 import worker_pb2, worker_pb2_grpc
from services.worker.step_input import (CachedRequest, NewRequest, SamplingOptions, StepInput)

log = logging.getLogger(__name__)
SERVICE = "pagedserve.v1.WorkerService"


def step_input_from_pb(msg: worker_pb2.StepRequest) -> StepInput:
    """Decode a StepRequest into the ModelRunner's plain dataclasses."""
    def sampling(p):
        return SamplingOptions(
            temperature=p.temperature, top_p=p.top_p or 1.0, top_k=p.top_k,
            seed=p.seed if p.HasField("seed") else None, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty or 1.0, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, min_tokens=p.min_tokens,
            stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
            logprobs=p.logprobs if p.HasField("logprobs") else None,
            prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None)
    return StepInput(
        step_id=msg.step_id,
        new_requests=[NewRequest(
            request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids),
            sampling=sampling(r.sampling_params), block_ids=list(r.block_ids),
            num_computed_tokens=r.num_computed_tokens, num_scheduled_tokens=r.num_scheduled_tokens)
            for r in msg.new_requests],
        cached_requests=cached_requests_from_pb(msg.cached_requests),
        finished_request_ids=list(msg.finished_request_ids))


def cached_requests_from_pb(c: worker_pb2.CachedRequests) -> list[CachedRequest]:
    """Cut the columnar CachedRequests back into one CachedRequest per request.

    Raises:
        ValueError: the columns disagree in length (a malformed message).
    """
    n = len(c.request_ids)
    columns = (c.num_new_token_ids, c.num_new_block_ids, c.resumed_from_preemption,
               c.num_computed_tokens, c.num_scheduled_tokens)
    if any(len(col) != n for col in columns) or (
            sum(c.num_new_token_ids) != len(c.new_token_ids)
            or sum(c.num_new_block_ids) != len(c.new_block_ids)):
        raise ValueError(f"malformed CachedRequests: {n} request ids but columns of "
                         f"{[len(col) for col in columns]}")
    tokens, blocks = list(c.new_token_ids), list(c.new_block_ids)
    out, t, b = [], 0, 0
    for rid, nt, nb, resumed, computed, scheduled in zip(c.request_ids, *columns):
        out.append(CachedRequest(rid, tokens[t:t + nt], blocks[b:b + nb], resumed, computed,
                                 scheduled))
        t += nt
        b += nb
    return out


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Decode protobuf → ModelRunner.execute_step → encode protobuf; nothing else."""

    def __init__(self, runner, info: worker_pb2.GetWorkerInfoResponse):
        self.runner = runner
        self.info = info
        # One thread: steps must run in order, and torch uses its own intra-op threads.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    async def GetWorkerInfo(self, request, context):
        return self.info

    async def Execute(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        async for msg in request_iterator:
            try:
                step = step_input_from_pb(msg)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {msg.step_id}: {e}")
            t0 = time.perf_counter()
            try:
                out = await loop.run_in_executor(self._executor, self.runner.execute_step, step)
            except Exception as e:  # a bug or OOM in the forward: fail the stream loudly
                log.exception("step %d failed", msg.step_id)
                await context.abort(grpc.StatusCode.INTERNAL, f"step {msg.step_id} failed: {e}")
            result = worker_pb2.StepResult(step_id=out.step_id, request_ids=out.request_ids,
                                           sampled_token_ids=out.sampled_token_ids,
                                           execute_seconds=time.perf_counter() - t0)
            if out.logprobs is not None:
                lp = out.logprobs
                result.num_top_logprobs.extend(lp.num_top_logprobs)
                result.sampled_logprobs.extend(lp.sampled_logprobs)
                result.top_token_ids.extend(lp.top_token_ids)
                result.top_logprobs.extend(lp.top_logprobs)
            for pl in out.prompt_logprobs:
                result.prompt_request_ids.append(pl.request_id)
                result.prompt_first_positions.append(pl.first_position)
                result.prompt_num_tokens.append(len(pl.logprobs))
                result.prompt_num_top.append(len(pl.top_token_ids) // max(1, len(pl.logprobs)))
                result.prompt_logprobs.extend(pl.logprobs)
                result.prompt_top_token_ids.extend(pl.top_token_ids)
                result.prompt_top_logprobs.extend(pl.top_logprobs)
            yield result


def add_args(p: argparse.ArgumentParser) -> None:
    """The worker's flags (also accepted by ``pagedserve serve``)."""
    add_flag(p, "--host", default="127.0.0.1", help="address to bind")
    add_flag(p, "--port", type=PORT, default=50053, help="WorkerService port")
    add_flag(p, "--model", default=None,
             help="transformers folder or .gguf file (default: packaged SmolLM2-135M-Instruct)")
    add_flag(p, "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
             help="compute dtype; auto = bfloat16 on a CPU/GPU with native bf16, else float32")
    add_flag(p, "--device", default="auto", help="cpu, cuda or auto")
    add_flag(p, "--block-size", type=int_in(1, 1024), default=16, help="tokens per KV block")
    add_flag(p, "--kv-cache-memory", type=parse_bytes, default=parse_bytes("2GiB"),
             help="KV cache size on CPU, e.g. 4GiB")
    add_flag(p, "--gpu-memory-utilization", type=float_in(0, 1, lo_open=True), default=0.9,
             help="fraction of GPU memory for weights, activations and KV cache")
    add_flag(p, "--max-num-batched-tokens", type=int_in(1), default=2048,
             help="most tokens computed in one step (the chunked-prefill budget; on CUDA also "
                  "the size of the profiling forward pass)")
    add_flag(p, "--max-model-len", type=int_in(1), default=None,
             help="cap on the context length")
    add_flag(p, "--attention-backend", default="auto", choices=["auto", "torch", "triton"],
             help="auto = triton on CUDA, torch on CPU")
    add_flag(p, "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
             help="log verbosity")


def build_runner(args):
    """Load the model and allocate the KV cache (slow: seconds to minutes)."""
    from services.worker.model_runner import ModelRunner
    return ModelRunner(model=args.model, dtype=args.dtype, device=args.device,
                       block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, attention_backend=args.attention_backend)


def worker_info(runner) -> worker_pb2.GetWorkerInfoResponse:
    """What this rank tells the scheduler at start-up."""
    return worker_pb2.GetWorkerInfoResponse(
        model=runner.model_name, dtype=runner.dtype_name, num_kv_blocks=runner.num_kv_blocks,
        block_size=runner.block_size, max_model_len=runner.max_model_len,
        vocab_size=runner.vocab_size, eos_token_ids=runner.eos_token_ids, rank=0, world_size=1,
        device=str(runner.device), attention_backend=runner.attention_backend_name)


async def serve(args, runner=None, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None):
    """Load the model (unless ``runner`` is given) and serve until stopped."""
    runner = runner or await asyncio.to_thread(build_runner, args)
    server, port, health = await new_server(args.host, args.port)
    args.port = port
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(
        WorkerServicer(runner, worker_info(runner)), server)
    await server.start()
    try:
        await set_serving(health, True, [SERVICE])
        log.info("worker serving on %s:%d: %s %s, %d KV blocks", args.host, port,
                 runner.model_name, runner.dtype_name, runner.num_kv_blocks)
        if ready:
            ready.set()
        await (stop or stop_event_on_signals()).wait()
    finally:
        await set_serving(health, False, [SERVICE])
        await server.stop(grace=1.0)

