"""The scheduler's side of the scheduler↔worker protocol: one Execute stream per worker rank.

``WorkerGroup.send`` encodes each rank's view of a ``ScheduledStep`` (``StepInput.for_rank``)
as one ``StepRequest`` (new requests in full, the rest as diffs;
``services/common/step_wire.py``) and sends it to every rank;
``WorkerGroup.receive`` returns the driver's answer to the oldest step sent, decoded.

Connecting pushes the scheduler's limits (block_size, max_model_len, max_num_seqs,
max_num_batched_tokens) to every rank in GetWorkerInfo; a rank started for other ones refuses
(FAILED_PRECONDITION naming both values) and the connection fails at once with that message.
Ranks of a tensor/pipeline-parallel group may be listed in any order: each reports its rank,
the group's sizes and a group id in GetWorkerInfo. The driver is tp rank 0 of the last pipeline
stage (rank ``(pp_size - 1) * tp_size``); every other rank answers an empty StepResult that
only acknowledges the step, so a dead rank is noticed at the step it misses.

KV cache groups: every rank reports the model's groups (``kv_cache_groups``: sliding window and
global layer ids of each; none = one full-attention group) and all must report the same; the
block tables of a step are sent concatenated group by group (see ``block_manager.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import grpc

from services.common.grpc_utils import CHANNEL_OPTIONS
from services.common.pb.pagedserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.step import StepInput, StepOutput
from services.common.step_wire import step_output_from_pb, step_to_pb
from services.common.tls import aio_channel
from services.scheduler.kv_tier import RankLoadReports
from services.scheduler.outputs import ScheduledStep

log = logging.getLogger(__name__)


def step_requests(step: StepInput, samples: Iterable[bool]
                  ) -> dict[bool, worker_pb2.StepRequest]:
    """The StepRequest of each kind of rank in ``samples`` (True: a rank of the last pipeline
    stage, which samples; False: an earlier stage, which cannot know the sampled tokens): the
    encoding of its view of ``step`` (``StepInput.for_rank``), one per kind."""
    return {kind: step_to_pb(step.for_rank(kind)) for kind in set(samples)}


class WorkerError(RuntimeError):
    """A worker rank failed, disconnected or answered out of order."""


KVGroup = tuple[int, tuple[int, ...]]  # (sliding window, 0 = full; global layer ids)


def describe_kv_cache_groups(groups: list[KVGroup]) -> str:
    """E.g. ``[window 512: layers 0,1,2; full: layers 5,11,17]``."""
    return "[" + "; ".join(
        f"{f'window {w}' if w else 'full'}: layers {','.join(map(str, ids)) or 'all'}"
        for w, ids in groups) + "]"


def check_kv_cache_groups(infos: list[worker_pb2.GetWorkerInfoResponse],
                          addresses: list[str]) -> list[KVGroup]:
    """The KV cache groups every rank reports (none reported = one full-attention group).

    Raises:
        WorkerError: two ranks report different groups (naming both ranks and their groups).
    """
    reported = [[(g.sliding_window, tuple(g.layer_ids)) for g in i.kv_cache_groups] or [(0, ())]
                for i in infos]
    for addr, groups in zip(addresses, reported, strict=True):
        if groups != reported[0]:
            raise WorkerError(
                f"worker {addresses[0]} reports KV cache groups "
                f"{describe_kv_cache_groups(reported[0])} but worker {addr} reports "
                f"{describe_kv_cache_groups(groups)}; every rank must serve the same model")
    return reported[0]


class WorkerGroup:
    """Connections to all worker ranks (``broken``: set once a rank's stream has ended).

    Args:
        addresses: ``host:port`` of each rank of one group, in any order.
        credentials: TLS channel credentials (see ``services.common.tls``); None = plaintext.
        limits: the scheduler's limits, sent to every rank on connecting (a field left 0 is not
            checked by the rank).

    Attributes:
        driver: index into ``addresses`` of the rank whose results carry the tokens.
        pipeline_parallel_size: stages of the group (1 without pipeline parallelism).
        kv_cache_groups: the model's KV cache groups, as every rank reported them (set by the
            first ``connect``; a later one must find the same).
    """

    def __init__(self, addresses: list[str], credentials: grpc.ChannelCredentials | None = None,
                 limits: worker_pb2.GetWorkerInfoRequest | None = None):
        if not addresses:
            raise ValueError("--workers must name at least one worker address")
        self.addresses = addresses
        self.credentials = credentials
        self.limits = limits or worker_pb2.GetWorkerInfoRequest()
        self._channels: list[grpc.aio.Channel] = []
        self._calls: list[grpc.aio.StreamStreamCall] = []
        self.infos: list[worker_pb2.GetWorkerInfoResponse] = []
        self.driver = 0
        self.pipeline_parallel_size = 1
        self.kv_cache_groups: list[KVGroup] = []
        self._samples: list[bool] = []  # per rank: in the last pipeline stage (keeps tokens)
        self.broken: asyncio.Event | None = None  # set when any rank's Execute stream ends
        self._load_reports = RankLoadReports(1)  # (KV tier loads, per connect)

    async def connect(self, timeout: float) -> list[worker_pb2.GetWorkerInfoResponse]:
        """Wait (up to ``timeout`` seconds) until every rank answers GetWorkerInfo, then open the
        Execute streams.

        Retries while the ranks report different group ids (a group restarting: some old ranks
        still up, some new ones already).

        Raises:
            WorkerError: a rank did not answer in time, refused the scheduler's limits, the
                ranks do not form one group, or they report different KV cache groups (from
                each other, or from the first connect: the block tables would not fit).
        """
        deadline = time.monotonic() + timeout
        while True:
            infos = await self._get_infos(deadline, timeout)
            if len({i.group_id for i in infos}) == 1 or time.monotonic() > deadline:
                break
            log.info("worker ranks report different group ids (restarting?); retrying")
            await asyncio.sleep(0.5)
        self.driver = self._check_group(infos)
        groups = check_kv_cache_groups(infos, self.addresses)
        if self.kv_cache_groups and groups != self.kv_cache_groups:
            raise WorkerError(
                f"the workers now report KV cache groups {describe_kv_cache_groups(groups)} but "
                f"this scheduler runs {describe_kv_cache_groups(self.kv_cache_groups)}; "
                f"restart the scheduler")
        self.kv_cache_groups = groups
        self.pipeline_parallel_size = pp = max(1, infos[self.driver].pipeline_parallel_size)
        tp = max(1, infos[self.driver].tensor_parallel_size)
        self._samples = [i.rank // tp == pp - 1 for i in infos]
        self._calls = [worker_pb2_grpc.WorkerServiceStub(ch).Execute() for ch in self._channels]
        broken = asyncio.Event()  # NOTE: a fresh one: close() ending the old calls sets the old
        for call in self._calls:
            call.add_done_callback(lambda _call: broken.set())
        self.broken = broken
        self.infos = infos
        self._load_reports = RankLoadReports(len(infos))
        return infos

    def kv_tier_folders(self) -> tuple[list[str], int]:
        """The KV tier on disk the ranks report: every rank's folder in rank order and the
        bytes of one block file (([], 0): no tier).

        Raises:
            WorkerError: some ranks run a tier and others not, or with other block sizes.
        """
        infos = sorted(self.infos, key=lambda i: i.rank)
        paths = [i.kv_offload_path for i in infos]
        sizes = {i.kv_offload_block_bytes for i in infos}
        if not any(paths):
            return [], 0
        if not all(paths) or len(sizes) != 1:
            raise WorkerError(f"worker ranks disagree on the KV tier (--kv-offload-dir): "
                              f"folders {paths}, block file sizes {sorted(sizes)}")
        return paths, sizes.pop()

    @property
    def sliding_windows(self) -> list[int]:
        """Per KV cache group, its sliding window (0 = full attention)."""
        return [w for w, _ in self.kv_cache_groups]

    async def _get_infos(self, deadline: float, timeout: float
                         ) -> list[worker_pb2.GetWorkerInfoResponse]:
        await self.close()
        self._channels = [aio_channel(a, self.credentials, options=CHANNEL_OPTIONS)
                          for a in self.addresses]
        infos = []
        for addr, ch in zip(self.addresses, self._channels, strict=True):
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            while True:
                try:
                    infos.append(await stub.GetWorkerInfo(self.limits, timeout=5,
                                                          wait_for_ready=True))
                    break
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # retrying cannot help
                        raise WorkerError(f"worker {addr} refused this scheduler: "
                                          f"{e.details()}") from e
                    if time.monotonic() > deadline:
                        raise WorkerError(f"worker {addr} not ready after {timeout:.0f}s: "
                                          f"{e.code().name}") from e
                    await asyncio.sleep(0.5)
        return infos

    def _check_group(self, infos: list[worker_pb2.GetWorkerInfoResponse]) -> int:
        """Index of the driver; raises WorkerError unless the ranks are exactly one group."""
        world = max(1, infos[0].world_size)
        ranks = sorted(i.rank for i in infos)
        if len({i.group_id for i in infos}) != 1 or ranks != list(range(world)) or any(
                (i.world_size or 1) != world for i in infos):
            raise WorkerError(
                f"--workers {','.join(self.addresses)} are not one worker group: ranks {ranks}, "
                f"world sizes {[i.world_size for i in infos]}; list every rank's address once")
        tp = max(1, infos[0].tensor_parallel_size)
        pp = max(1, infos[0].pipeline_parallel_size)
        return next(k for k, i in enumerate(infos) if i.rank == (pp - 1) * tp)

    async def send(self, out: ScheduledStep) -> None:
        """Send one step to every rank without waiting for its result (pipelining: several
        steps may be sent before the oldest result is received; results come back in order).

        Raises:
            WorkerError: a rank's stream broke.
        """
        if not self._calls:
            raise WorkerError("no worker connection")
        views = step_requests(out, self._samples)
        try:
            await asyncio.gather(*(call.write(views[samples])
                                   for call, samples in zip(self._calls, self._samples,
                                                            strict=True)))
        except grpc.RpcError as e:
            raise WorkerError(f"worker stream failed: {e.code().name}: {e.details()}") from e
        except asyncio.InvalidStateError as e:
            raise WorkerError(f"worker stream failed: {e}") from e

    async def receive(self, out: ScheduledStep) -> StepOutput:
        """Every rank's answer to ``out`` (the oldest step sent); return the driver's, with the
        KV tier loads every rank has now reported (``RankLoadReports``).

        Raises:
            WorkerError: a rank's stream broke or answered a different step, or the driver's
                answer is malformed.
        """
        if not self._calls:
            raise WorkerError("no worker connection")
        try:
            results = await asyncio.gather(*(call.read() for call in self._calls))
        except grpc.RpcError as e:
            raise WorkerError(f"worker stream failed: {e.code().name}: {e.details()}") from e
        except asyncio.InvalidStateError as e:
            raise WorkerError(f"worker stream failed: {e}") from e
        for addr, res in zip(self.addresses, results, strict=True):
            if res is grpc.aio.EOF or res.step_id != out.step_id:
                raise WorkerError(f"worker {addr} closed its stream or answered out of order")
        try:
            output = step_output_from_pb(results[self.driver])
        except ValueError as e:
            raise WorkerError(f"worker {self.addresses[self.driver]} sent {e}") from e
        if len(results) > 1:  # (one rank: its reports are the group's)
            for res in results:
                self._load_reports.add(list(res.kv_loads_done), list(res.kv_loads_failed))
            output.kv_loads_done, output.kv_loads_failed = self._load_reports.take()
        return output

    async def close(self) -> None:
        """Cancel the streams and close the channels."""
        for call in self._calls:
            call.cancel()
        for ch in self._channels:
            await ch.close()
        self._calls, self._channels = [], []
