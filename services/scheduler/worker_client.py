"""The scheduler's side of the scheduler↔worker protocol: one Execute stream per worker rank.

``WorkerGroup.execute`` turns a ``SchedulerOutput`` into one ``StepRequest`` (new requests in
full, the rest as diffs), sends it to every rank and returns rank 0's ``StepResult``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from itertools import chain

import grpc

from services.common.grpc_utils import CHANNEL_OPTIONS
from services.common.pb.pagedserve.v1 import worker_pb2, worker_pb2_grpc
from services.scheduler.request import EngineSamplingParams
from services.scheduler.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker rank failed, disconnected or answered out of order."""


def _sampling_pb(p: EngineSamplingParams) -> worker_pb2.WorkerSamplingParams:
    """What the worker's sampler needs; stop ids and ignore_eos only when min_tokens > 0."""
    msg = worker_pb2.WorkerSamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, min_tokens=p.min_tokens)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.min_tokens > 0:
        msg.stop_token_ids.extend(p.stop_token_ids)
        msg.ignore_eos = p.ignore_eos
    return msg


def _cached_requests_pb(out: SchedulerOutput) -> worker_pb2.CachedRequests:
    """The scheduled cached requests as the columnar CachedRequests message."""
    cached = out.scheduled_cached_reqs
    n = out.num_scheduled_tokens
    ids = [c.request_id for c in cached]
    return worker_pb2.CachedRequests(
        request_ids=ids,
        new_token_ids=list(chain.from_iterable([c.new_token_ids for c in cached])),
        num_new_token_ids=[len(c.new_token_ids) for c in cached],
        new_block_ids=list(chain.from_iterable([c.new_block_ids for c in cached])),
        num_new_block_ids=[len(c.new_block_ids) for c in cached],
        resumed_from_preemption=[c.resumed_from_preemption for c in cached],
        num_computed_tokens=[c.num_computed_tokens for c in cached],
        num_scheduled_tokens=[n[i] for i in ids])


def build_step_request(out: SchedulerOutput) -> worker_pb2.StepRequest:
    """Encode one scheduler step as the StepRequest every rank receives."""
    n = out.num_scheduled_tokens
    return worker_pb2.StepRequest(
        step_id=out.step_id,
        new_requests=[
            worker_pb2.NewRequest(
                request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                sampling_params=_sampling_pb(r.sampling_params), block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=n[r.request_id])
            for r in out.scheduled_new_reqs],
        cached_requests=_cached_requests_pb(out),
        finished_request_ids=sorted(out.finished_req_ids),
    )


class WorkerGroup:
    """Connections to all worker ranks (rank order = address order).

    Args:
        addresses: ``host:port`` of each rank; rank 0 first.
    """

    def __init__(self, addresses: list[str]):
        if not addresses:
            raise ValueError("--workers must name at least one worker address")
        self.addresses = addresses
        self._channels: list[grpc.aio.Channel] = []
        self._calls: list[grpc.aio.StreamStreamCall] = []
        self.infos: list[worker_pb2.GetWorkerInfoResponse] = []

    async def connect(self, timeout: float) -> list[worker_pb2.GetWorkerInfoResponse]:
        """Wait (up to ``timeout`` seconds) until every rank answers GetWorkerInfo, then open the
        Execute streams.

        Raises:
            WorkerError: a rank did not answer in time.
        """
        await self.close()
        deadline = time.monotonic() + timeout
        self._channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS)
                          for a in self.addresses]
        infos = []
        for addr, ch in zip(self.addresses, self._channels):
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            while True:
                try:
                    infos.append(await stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(),
                                                          timeout=5, wait_for_ready=True))
                    break
                except grpc.RpcError as e:
                    if time.monotonic() > deadline:
                        raise WorkerError(f"worker {addr} not ready after {timeout:.0f}s: "
                                          f"{e.code().name}") from e
                    await asyncio.sleep(0.5)
        self._calls = [worker_pb2_grpc.WorkerServiceStub(ch).Execute() for ch in self._channels]
        self.infos = infos
        return infos

    async def execute(self, out: SchedulerOutput) -> worker_pb2.StepResult:
        """Send one step to every rank; return rank 0's result.

        Raises:
            WorkerError: a rank's stream broke or answered a different step.
        """
        if not self._calls:
            raise WorkerError("no worker connection")
        req = build_step_request(out)
        try:
            await asyncio.gather(*(call.write(req) for call in self._calls))
            results = await asyncio.gather(*(call.read() for call in self._calls))
        except grpc.RpcError as e:
            raise WorkerError(f"worker stream failed: {e.code().name}: {e.details()}") from e
        except asyncio.InvalidStateError as e:
            raise WorkerError(f"worker stream failed: {e}") from e
        for addr, res in zip(self.addresses, results):
            if res is grpc.aio.EOF or res.step_id != out.step_id:
                raise WorkerError(f"worker {addr} closed its stream or answered out of order")
        if len(results[0].request_ids) != len(results[0].sampled_token_ids):
            raise WorkerError(f"worker {self.addresses[0]} sent {len(results[0].request_ids)} "
                              f"request ids but {len(results[0].sampled_token_ids)} tokens")
        return results[0]

    async def close(self) -> None:
        """Cancel the streams and close the channels."""
        for call in self._calls:
            call.cancel()
        for ch in self._channels:
            await ch.close()
        self._calls, self._channels = [], []
