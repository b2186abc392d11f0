"""The router's side of the router↔scheduler protocol: one long-lived Connect stream.

Submits and aborts go up one outgoing queue (a single writer, as grpc.aio streams require);
one reader task dispatches each TokenBatch's outputs to the queue of the request they belong to.
The reader never waits for a request's consumer (it carries every request of this router): the
caller bounds its queue instead (``generation.OutputQueue``, the router's --max-stream-buffer),
and a queue that overflows aborts its requests from inside ``put_nowait``.
If the stream breaks, every pending request gets an UNAVAILABLE error output and the client
reconnects in the background.

The replica *can serve* (``serving``) while its stream is up and its latest LoadReport does not
say ``waiting_for_workers``: the scheduler sends a batch the moment its worker group goes or
comes back, so ``serving`` follows the engine's workers within one message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from services.common.grpc_utils import CHANNEL_OPTIONS
from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2, engine_pb2_grpc
from services.common.sampling_params import EngineSamplingParams
from services.common.step_wire import lora_to_pb
from services.common.tls import aio_channel
from services.common.tracing import current_traceparent

log = logging.getLogger(__name__)


def _unavailable(request_id: str, why: str) -> engine_pb2.RequestOutput:
    return engine_pb2.RequestOutput(
        request_id=request_id, finish_reason=api_pb2.FINISH_REASON_ABORT,
        error_code=grpc.StatusCode.UNAVAILABLE.value[0], error_message=why)


class EngineClient:
    """A connection to one scheduler replica.

    Args:
        address: the scheduler's ``host:port``.
        on_serving: async callback(bool), awaited when ``serving`` changes: the replica became
            able to serve (stream up and its engine has workers) or is no longer.
        credentials: TLS channel credentials (see ``services.common.tls``); None = plaintext.

    Attributes:
        connected: set while the stream is up (the scheduler's handshake batch arrived).
        serving: set while the replica can serve: ``connected`` and its engine has a complete
            worker group (LoadReport ``waiting_for_workers`` false).
    """

    def __init__(self, address: str, on_serving=None,
                 credentials: grpc.ChannelCredentials | None = None):
        self.address = address
        self.on_serving = on_serving
        self.info: engine_pb2.GetEngineInfoResponse | None = None
        self.load = engine_pb2.LoadReport()
        self._channel = aio_channel(address, credentials, options=CHANNEL_OPTIONS)
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._pending: dict[str, asyncio.Queue] = {}
        self._outgoing: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self.connected = asyncio.Event()
        self.serving = asyncio.Event()
        # RouterMetrics (set by the ReplicaSet): counts each request's final output
        self.metrics = None
        # callback(RequestOutput) on each request's final output (cache_aware's predictions)
        self.on_end: Callable[[engine_pb2.RequestOutput], None] | None = None

    async def start(self, timeout: float) -> engine_pb2.GetEngineInfoResponse:
        """Connect in the background and wait up to ``timeout`` s until the replica can serve.

        Raises:
            TimeoutError: the scheduler did not become ready in time.
        """
        self.connect_in_background()
        try:
            await asyncio.wait_for(self.serving.wait(), timeout)
        except TimeoutError:
            raise TimeoutError(f"scheduler {self.address} not ready after {timeout:.0f}s") from None
        assert self.info is not None  # serving is set only once GetEngineInfo answered
        return self.info

    def connect_in_background(self) -> None:
        """Start the stream task (connect, then reconnect with backoff) without waiting;
        ``connected`` is set once the stream is up, ``serving`` once the engine can serve too.
        A second call does nothing."""
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    @property
    def stub(self) -> engine_pb2_grpc.EngineServiceStub:
        """The EngineService stub on this replica's channel, for other RPCs on the same
        connection (the router's KV event subscription)."""
        return self._stub

    @property
    def num_pending(self) -> int:
        """This router's requests in flight on this scheduler (submitted, not ended)."""
        return len(self._pending)

    def submit(self, request_id: str, prompt_token_ids: list[int],
               params: EngineSamplingParams, *, priority: int = 0,
               queue: asyncio.Queue | None = None, parent_request_id: str = "",
               lora: LoRARequest | None = None) -> asyncio.Queue:
        """Send a request; returns the queue its RequestOutputs arrive on (the last one has
        finish_reason set or an error_code). A request that cannot be sent gets its error output
        in the queue at once: UNAVAILABLE with the scheduler unreachable. The caller refuses an
        id that is still running (``generation.stream_responses``, over every replica): two
        requests of one id here would share one output stream.

        Args:
            priority: scheduling priority (lower runs sooner; 0 under the fcfs policy).
            queue: deliver the outputs to this queue instead of a new one, so several requests
                (the choices of one n > 1 request) can share it; tell them apart by
                ``request_id``.
            parent_request_id: for a choice of an n > 1 request, that request's id (its
                choices share prompt KV blocks even with prefix caching off).
            lora: the LoRA adapter it runs with (sent in full), or None.

        Traced: the current span (the caller's task: the router's ingress span, see
        ``router/tracing.py``) is the parent of the scheduler's, in
        ``SubmitRequest.traceparent``.
        """
        queue = asyncio.Queue() if queue is None else queue
        if not self.connected.is_set():
            self._end(queue, _unavailable(request_id, f"scheduler {self.address} unavailable"))
            return queue
        assert request_id not in self._pending, f"request_id {request_id!r} is already running"
        self._pending[request_id] = queue
        assert self._outgoing is not None  # connected is set only inside _run, after it
        self._outgoing.put_nowait(engine_pb2.EngineRequest(submit=engine_pb2.SubmitRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids,
            sampling_params=params.to_pb(),
            priority=priority, parent_request_id=parent_request_id, lora=lora_to_pb(lora),
            traceparent=current_traceparent())))
        return queue

    def is_running(self, request_id: str) -> bool:
        """Whether a request with this id was submitted here and has not ended (or been
        released)."""
        return request_id in self._pending

    def abort(self, request_id: str) -> None:
        """Ask the engine to end a request; its final output will still arrive (and is dropped
        if the caller stopped listening)."""
        if request_id in self._pending and self._outgoing is not None:
            self._outgoing.put_nowait(engine_pb2.EngineRequest(
                abort=engine_pb2.AbortRequest(request_id=request_id)))

    def release(self, request_id: str) -> None:
        """Forget a request whose caller no longer listens."""
        self._pending.pop(request_id, None)

    def fail_all(self, why: str) -> None:
        """End every request in flight here now with UNAVAILABLE ``why`` (e.g. at the shutdown
        timeout), and ask the scheduler to abort them."""
        for rid, queue in list(self._pending.items()):
            self.abort(rid)
            self._end(queue, _unavailable(rid, why))
        self._pending.clear()

    @staticmethod
    async def _requests(outgoing: asyncio.Queue):
        """The stream's upward messages, until ``None`` (put when the stream ends)."""
        while (msg := await outgoing.get()) is not None:
            yield msg

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            self._outgoing = asyncio.Queue()
            call = None
            try:
                # NOTE: fetched on every (re)connect: a restarted scheduler may have new limits.
                self.info = await self._stub.GetEngineInfo(
                    engine_pb2.GetEngineInfoRequest(), timeout=5, wait_for_ready=True)
                call = self._stub.Connect(self._requests(self._outgoing))
                async for batch in call:
                    if not self.connected.is_set():  # the scheduler's handshake batch
                        backoff = 0.2
                        self.connected.set()
                    self.load = batch.load
                    await self._set_serving(not batch.load.waiting_for_workers)
                    for out in batch.outputs:
                        queue = self._pending.get(out.request_id)
                        if queue is None:
                            continue
                        if out.finish_reason or out.error_code:
                            del self._pending[out.request_id]
                            self._end(queue, out)
                        else:
                            queue.put_nowait(out)
                why = "scheduler closed the stream"
            except grpc.RpcError as e:
                why = f"scheduler stream failed: {e.code().name}"
            finally:
                # NOTE: end _requests() too: grpc's task consuming it is cancelled by
                # call.cancel() only while the call is live; after a call that ended with an
                # error it would wait on this queue forever ("Task was destroyed but it is
                # pending!" at shutdown).
                self._outgoing.put_nowait(None)
                if call is not None:
                    call.cancel()
            was_connected = self.connected.is_set()
            self.connected.clear()
            await self._set_serving(False)
            log.log(logging.WARNING if was_connected or self._pending else logging.DEBUG,
                    "%s (%s); failing %d requests and reconnecting", why, self.address,
                    len(self._pending))
            for rid, queue in self._pending.items():
                self._end(queue, _unavailable(rid, why))
            self._pending.clear()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _end(self, queue: asyncio.Queue, out: engine_pb2.RequestOutput) -> None:
        """Deliver a request's final output, and count it."""
        queue.put_nowait(out)
        if self.metrics is not None:
            self.metrics.replica_request_done(self.address, out.error_code)
        if self.on_end is not None:
            self.on_end(out)

    async def _set_serving(self, serving: bool) -> None:
        """Record whether the replica can serve; call ``on_serving`` when that changed."""
        if serving == self.serving.is_set():
            return
        if serving:
            self.serving.set()
        else:
            self.serving.clear()
        if not serving and self.connected.is_set():  # a broken stream is logged by _run
            log.warning("scheduler %s is waiting for its workers; no new requests go there",
                        self.address)
        if self.on_serving is not None:
            await self.on_serving(serving)

    async def close(self) -> None:
        """Stop the stream and close the channel."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)  # its call is cancelled
        await self._channel.close()
