"""The router's subscription to one scheduler replica's KV events: a task that keeps the
replica's ``KvIndex`` (``kv_index.py``) from its ``SubscribeKvEvents`` stream.

The first request asks for a snapshot (no ``start_sequence_number``). When the stream ends,
fails, or a batch does not follow on (``KvIndex.apply`` is False: a gap, or another publisher),
the index stops being trusted (``synced`` false) and the task reopens the stream with backoff
(0.2 s doubling to 5 s), asking for a replay from the last batch applied + 1 under the
publisher it holds: the scheduler replays what it still buffers, else sends a snapshot (also
when it restarted: a new ``publisher_id``). The index is trusted again at the first batch that
follows on, or after ``RESUME_GRACE`` seconds of an open stream with nothing to replay (the
scheduler sends a snapshot at once when it cannot replay; the calls do not wait for a channel
that is down, so an open call means the scheduler took it). A subscriber cut off for being too slow
(RESOURCE_EXHAUSTED) reconnects the same way.

A replica that refuses the RPC (FAILED_PRECONDITION: its KV events are off; UNIMPLEMENTED: an
older scheduler) has no index (``events_off``): cache_aware routing treats it as
prefix_affinity does. That is logged once; the task asks again every ``OFF_RETRY`` seconds (a
replica restarted with events on is taken up).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.pb.pagedserve.v1 import engine_pb2
from services.router.kv_index import KvIndex

log = logging.getLogger(__name__)

# seconds between subscription attempts on a replica whose KV events are off
OFF_RETRY = 30.0
# seconds a resumed stream must stay open with nothing replayed before the index is trusted
RESUME_GRACE = 0.5
# the RPC's refusal when the replica publishes no events
_EVENTS_OFF = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)


class KvEventSubscriber:
    """Keeps ``index`` from one replica's KV event stream (start with ``start``).

    Args:
        address: the replica's ``host:port`` (for logs).
        stub: an ``EngineServiceStub`` on the replica's channel (the ``EngineClient``'s).
        index: the index to keep (default: a new one).
        off_retry: seconds between attempts while the replica's events are off.

    Attributes:
        events_off: the replica refused the subscription (its events are off): no index.
        batches: batches applied since start (for tests and logs).
    """

    def __init__(self, address: str, stub, index: KvIndex | None = None,
                 off_retry: float = OFF_RETRY):
        self.address = address
        self.stub = stub
        self.index = index if index is not None else KvIndex()
        self.off_retry = off_retry
        self.events_off = False
        self.batches = 0
        self._task: asyncio.Task | None = None

    @property
    def synced(self) -> bool:
        """Whether the index may be trusted for routing now."""
        return self.index.synced and not self.events_off

    def start(self) -> None:
        """Start the subscription task (a second call does nothing)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Stop the task (its call is cancelled)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def request(self) -> engine_pb2.SubscribeKvEventsRequest:
        """The next subscription: a replay from the last batch applied + 1 under the publisher
        held, or (nothing held) a snapshot."""
        index = self.index
        if not index.publisher_id:
            return engine_pb2.SubscribeKvEventsRequest()
        return engine_pb2.SubscribeKvEventsRequest(
            start_sequence_number=index.sequence_number + 1, publisher_id=index.publisher_id)

    async def _run(self) -> None:
        backoff = 0.2
        loop = asyncio.get_running_loop()
        while True:
            request = self.request()
            call = self.stub.SubscribeKvEvents(request)
            timer = (loop.call_later(RESUME_GRACE, self._resumed, call)
                     if request.publisher_id else None)
            why = "the scheduler closed the stream"
            try:
                async for batch in call:
                    if not self.index.apply(batch):
                        why = "its KV events did not follow on"
                        break
                    self.batches += 1
                    if self.events_off or backoff > 0.2:
                        log.info("scheduler %s: KV events synced (%d blocks)", self.address,
                                 len(self.index))
                    self.events_off = False
                    backoff = 0.2
            except grpc.RpcError as e:
                if e.code() in _EVENTS_OFF:
                    if not self.events_off:
                        log.warning("scheduler %s publishes no KV events (%s: %s); cache_aware "
                                    "routes it as prefix_affinity", self.address,
                                    e.code().name, e.details())
                    self.events_off = True
                    self.index.reset()
                    await asyncio.sleep(self.off_retry)
                    continue
                why = f"the stream failed: {e.code().name}"
            finally:
                call.cancel()
                if timer is not None:
                    timer.cancel()
            self.index.desync()
            log.log(logging.WARNING if backoff == 0.2 and self.batches else logging.DEBUG,
                    "scheduler %s: KV events stopped (%s); resubscribing", self.address, why)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _resumed(self, call) -> None:
        if not call.done() and not self.index.synced:
            self.index.resume()
