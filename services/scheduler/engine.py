"""The scheduler's asyncio engine loop: schedule → one StepRequest to every rank → results →
one TokenBatch per router stream.

Routers attach a ``RouterSink`` per Connect stream; every request remembers its sink so its
tokens go back down the stream that submitted it. The loop sleeps while nothing is unfinished.

Health: the engine can serve while it has a complete worker group (``healthy``). When a rank
fails (mid-step, or while idle) it turns unhealthy at once, and again healthy once the group is
back; each change calls ``on_health`` (the servicer's gRPC health) and sends every attached
router a TokenBatch whose LoadReport says so (``waiting_for_workers``), so routers stop routing
here within one message, not at the next step.

NOTE: the core ``Scheduler`` is only touched from this event loop's thread, so submits and
aborts that arrive while a step is on the workers interleave between steps safely: an aborted
request's sampled token is ignored by ``update_from_output``.

The loop never dies silently: an unexpected exception (a bug) is logged with its traceback,
turns health NOT_SERVING, fails every request in flight with INTERNAL naming the error, and the
loop starts again on fresh worker streams. If the scheduler is left holding requests or blocks
after that, the loop gives up and ``run`` raises (the server exits non-zero for a supervisor).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.common.shutdown import SHUTTING_DOWN
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.outputs import RequestUpdate
from services.scheduler.request import FinishReason, Request
from services.scheduler.scheduler import QueueFullError, Scheduler
from services.scheduler.tracing import request_tracer
from services.scheduler.worker_client import WorkerError, WorkerGroup

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RouterSink:
    """One router's Connect stream: the TokenBatches waiting to be sent down it."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_ids: set[str] = field(default_factory=set)


def error_output(request_id: str, code: grpc.StatusCode, message: str) -> engine_pb2.RequestOutput:
    """A final RequestOutput that ends a request with an error."""
    return engine_pb2.RequestOutput(
        request_id=request_id, finish_reason=FinishReason.ABORT.pb,
        error_code=code.value[0], error_message=message)


class Engine:
    """Runs the core ``Scheduler`` against a ``WorkerGroup`` and fans results out to routers.

    Args:
        scheduler: the pure-Python core (owns queues and blocks).
        workers: connected worker ranks.
        on_health: async callback(bool), awaited when the workers go (False) and come back
            (True).
        metrics: the ``SchedulerMetrics`` to feed (arrivals, steps, tokens, finishes), or None.
    """

    def __init__(self, scheduler: Scheduler, workers: WorkerGroup, on_health=None,
                 reconnect_timeout: float = 3600.0, metrics: SchedulerMetrics | None = None):
        self.scheduler = scheduler
        self.metrics = metrics
        self.workers = workers
        self._sinks: dict[str, RouterSink] = {}  # request id -> the stream it came from
        self._routers: set[RouterSink] = set()  # every attached Connect stream
        self._wakeup = asyncio.Event()
        self.on_health = on_health
        self._reconnect_timeout = reconnect_timeout
        self.num_steps_total = 0
        self.num_loop_failures_total = 0  # unexpected exceptions the loop recovered from
        self.healthy = True
        self.draining = False  # shutting down: refuse new submits, finish the running ones
        # (router stream, the router's adapter id) -> the adapter under its engine-wide id:
        # router ids are per router, so two routers' id 1 may be two adapters
        self._loras: dict[tuple[RouterSink, int], LoRARequest] = {}
        self._num_loras = 0
        self.lora_slots = 0  # the workers' max_loras: 0 = they run no adapter (refused here)
        self.tracer = request_tracer()  # None while tracing is off (services/common/tracing.py)

    # ---- requests from routers -------------------------------------------------------------
    def submit(self, sink: RouterSink, msg: engine_pb2.SubmitRequest) -> None:
        """Queue a request; a rejected one gets an error output on its sink at once."""
        rid = msg.request_id
        if self.draining:
            sink.queue.put_nowait(self._batch([error_output(
                rid, grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)]))
            return
        if not self.healthy:
            sink.queue.put_nowait(self._batch([error_output(
                rid, grpc.StatusCode.UNAVAILABLE, "engine has no worker; retry later")]))
            return
        try:  # NOTE: add_request refuses an id still running (two routers' clients may collide)
            req = Request(request_id=rid, prompt_token_ids=list(msg.prompt_token_ids),
                          sampling_params=EngineSamplingParams.from_pb(msg.sampling_params),
                          arrival_time=time.monotonic(), priority=msg.priority,
                          parent_request_id=msg.parent_request_id,
                          lora=self._engine_lora(sink, msg))
            self.scheduler.add_request(req)
        except ValueError as e:
            sink.queue.put_nowait(self._batch([error_output(
                rid, grpc.StatusCode.INVALID_ARGUMENT, str(e))]))
            return
        except QueueFullError as e:  # load shedding: refuse now rather than queue forever
            sink.queue.put_nowait(self._batch([error_output(
                rid, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))]))
            return
        self._sinks[rid] = sink
        sink.request_ids.add(rid)
        if msg.traceparent and self.tracer is not None:
            self.tracer.submitted(req, msg.traceparent)
        if self.metrics is not None:
            self.metrics.observe_arrival(rid, req.arrival_time,
                                         req.lora.name if req.lora is not None else None)
        log.debug("request queued: %d prompt tokens, priority %d", len(req.prompt_token_ids),
                  req.priority, extra={"request_id": rid})
        self._wakeup.set()

    def _engine_lora(self, sink: RouterSink, msg: engine_pb2.SubmitRequest
                     ) -> LoRARequest | None:
        """The request's adapter under its engine-wide id (one per router stream and router
        id, numbered from 1 in order of first use; never reused), or None without one.

        Raises:
            ValueError: the workers run no adapters, or a lora_id below 1, or an empty name
                or path.
        """
        if not msg.HasField("lora"):
            return None
        theirs = msg.lora
        if not self.lora_slots:
            raise ValueError(f"model {theirs.name!r} is a LoRA adapter but the workers run no "
                             "adapters: start them with --enable-lora")
        if theirs.lora_id < 1 or not theirs.name or not theirs.path:
            raise ValueError(f"lora: an adapter needs a lora_id >= 1, a name and a path, got "
                             f"id {theirs.lora_id}, name {theirs.name!r}, path {theirs.path!r}")
        key = (sink, theirs.lora_id)
        lora = self._loras.get(key)
        if lora is None or (lora.name, lora.path) != (theirs.name, theirs.path):
            self._num_loras += 1
            lora = self._loras[key] = LoRARequest(self._num_loras, theirs.name, theirs.path)
        return lora

    def abort(self, request_id: str) -> None:
        """Abort a request now (frees its blocks) and send its final output."""
        update = self.scheduler.abort_request(request_id)
        if update is not None:
            self._publish([update])

    def attach(self) -> RouterSink:
        """A router opened a Connect stream: its sink, with the handshake batch (the current
        load, and whether the engine can serve) already queued."""
        sink = RouterSink()
        sink.queue.put_nowait(self.load_batch())
        self._routers.add(sink)
        return sink

    def close_streams(self) -> None:
        """End every router's Connect stream once the batches queued on it are sent."""
        for sink in self._routers:
            sink.queue.put_nowait(None)

    def detach(self, sink: RouterSink) -> None:
        """A router stream ended: abort everything it still has in flight."""
        self._routers.discard(sink)
        self._loras = {key: lora for key, lora in self._loras.items() if key[0] is not sink}
        for rid in list(sink.request_ids):
            self._abort_unpublished(rid)
            self._sinks.pop(rid, None)
        sink.request_ids.clear()

    def begin_drain(self) -> None:
        """Shutting down: refuse new submits with UNAVAILABLE; running requests go on."""
        self.draining = True

    @property
    def idle(self) -> bool:
        """No request is queued, running, or waiting for its final output, and no KV tier load
        is owed a report."""
        return not self._sinks and not self.scheduler.has_work()

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        """End every request now with an error output ``code``/``message`` on its router's
        stream, and free its blocks."""
        for rid, sink in list(self._sinks.items()):
            self._abort_unpublished(rid)
            sink.queue.put_nowait(self._batch([error_output(rid, code, message)]))
            sink.request_ids.discard(rid)
        self._sinks.clear()

    def _abort_unpublished(self, request_id: str) -> None:
        """Abort a request whose final output is sent some other way (or nowhere)."""
        update = self.scheduler.abort_request(request_id)
        if update is not None and self.metrics is not None:
            self.metrics.observe_updates([update], time.monotonic())
        if update is not None and self.tracer is not None and self.tracer.active:
            self.tracer.observe_updates([update])

    # ---- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Step forever; on a worker failure fail every request and reconnect; on any other
        exception do the same with INTERNAL (see the module docstring).

        Raises:
            RuntimeError: recovery left requests or KV blocks behind in the scheduler.
        """
        while True:
            try:
                await self._loop()
            except Exception as e:  # a bug: fail loudly, never silently
                log.exception("engine loop failed; failing %d requests", len(self._sinks))
                self.num_loop_failures_total += 1
                await self._fail_and_reconnect(
                    f"engine loop failed: {type(e).__name__}: {e}", grpc.StatusCode.INTERNAL)
                s = self.scheduler
                if s.has_unfinished_requests() or (
                        s.block_manager.num_free_blocks != s.block_manager.num_blocks):
                    raise RuntimeError("the engine could not recover from a failed loop: "
                                       f"{s.num_running + s.num_waiting} requests, "
                                       f"{s.block_manager.num_free_blocks} of "
                                       f"{s.block_manager.num_blocks} blocks free") from e

    async def _loop(self) -> None:
        """Step until an unexpected exception: keeps up to ``max_steps_in_flight`` steps (the
        pipeline-parallel size) sent before the oldest result is back, so every pipeline stage
        has a micro-batch to work on; a worker failure fails every request and reconnects."""
        pending: deque = deque()  # ScheduledSteps sent, oldest first
        limit = self.scheduler.config.max_steps_in_flight
        while True:
            try:
                while len(pending) < limit and self.scheduler.has_work():
                    out = self.scheduler.schedule()
                    if not (out.total_num_scheduled_tokens or out.finished_request_ids
                            or out.kv_stores or out.kv_loads or (
                                not pending and self.scheduler.num_kv_loads_in_flight)):
                        break  # everything runnable is in flight (or nothing fits)
                    # NOTE: with KV tier loads in flight and nothing else to send, an empty
                    # step polls for them (the worker waits a little for one: kv_tier.py)
                    if self.metrics is not None and out.total_num_scheduled_tokens:
                        self.metrics.observe_scheduled(out, time.monotonic())
                    if self.tracer is not None and self.tracer.active:
                        self.tracer.scheduled(out)  # (before it is sent: its traceparents)
                    await self.workers.send(out)
                    pending.append(out)
                if not pending:
                    if self.scheduler.has_work():
                        await asyncio.sleep(0.001)  # nothing fits this step; should not happen
                    else:
                        self._flush_kv_events()  # (nothing may linger while idle)
                        await self._idle()
                    continue
                out = pending.popleft()
                result = await self.workers.receive(out)
            except WorkerError as e:
                pending.clear()
                await self._fail_and_reconnect(f"worker failed: {e}")
                continue
            self.num_steps_total += 1
            if out.traceparents and self.tracer is not None:
                self.tracer.step_done(out)
            self._fail_requests(result.failed_request_ids, result.failed_messages)
            self._break_requests(result.broken_request_ids, result.broken_messages)
            self._publish(self.scheduler.update_from_output(out, result))
            self._flush_kv_events()

    def _flush_kv_events(self) -> None:
        """The prefix cache's changes since the last call as one KV event batch (none without
        changes, or with KV events off: ``kv_events.py``)."""
        events = self.scheduler.block_manager.events
        if events is not None:
            events.flush()

    def _fail_requests(self, request_ids: list[str], messages: list[str]) -> None:
        """End the requests a step left out because they cannot run (``StepOutput.
        failed_request_ids``: a LoRA adapter the workers could not load) with
        INVALID_ARGUMENT and the worker's message (it names the adapter and the problem),
        freeing their blocks; the rest of the step stands. Before ``update_from_output``, which
        would otherwise recompute a request that got no token.

        NOTE: every other request of a failed adapter ends too, and the adapter gets a new
        engine-wide id for the requests that come later (a retry loads it again); the blocks
        they registered in the prefix cache hold K/V the workers never wrote: forgotten
        (``BlockManager.forget``; the workers did not write them to the KV tier either).
        """
        for request_id, message in zip(request_ids, messages, strict=True):
            request = self.scheduler.get_request(request_id)
            if request is None:
                continue  # (ended already: aborted, or with its adapter's first failure)
            doomed = [request]
            if request.lora is not None:
                bad = request.lora.lora_id
                self._loras = {k: v for k, v in self._loras.items() if v.lora_id != bad}
                doomed += [r for r in self.scheduler.requests.values()
                           if r is not request and r.lora is not None and r.lora.lora_id == bad]
            for r in doomed:
                self.scheduler.block_manager.forget(r)
            for rid in dict.fromkeys(r.beam_group.root.request_id if r.beam_group is not None
                                     else r.request_id for r in doomed):  # (a group is one)
                self._end_with_error(rid, grpc.StatusCode.INVALID_ARGUMENT, message)

    def _break_requests(self, request_ids: list[str], messages: list[str]) -> None:
        """End the constrained requests whose grammar broke this step (``StepOutput.
        broken_request_ids``) with INTERNAL and the worker's message (the constraint kind and
        llguidance's error), freeing their blocks: never a normal "stop". Before
        ``update_from_output``, so the token that broke the grammar is not output (an ended
        request's results are skipped); its K/V was written by steps that stand, so the blocks
        stay in the prefix cache."""
        for request_id, message in zip(request_ids, messages, strict=True):
            request = self.scheduler.get_request(request_id)
            if request is None:
                continue  # (ended already: aborted, or finished meanwhile)
            group = request.beam_group
            self._end_with_error(group.root.request_id if group is not None else request_id,
                                 grpc.StatusCode.INTERNAL, message)

    def _end_with_error(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        """Abort ``request_id`` in the scheduler (its blocks freed) and send its router the
        error output ``code`` / ``message`` in place of a finish."""
        log.warning("request failed: %s", message, extra={"request_id": request_id})
        self._abort_unpublished(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.request_ids.discard(request_id)
            sink.queue.put_nowait(self._batch([error_output(request_id, code, message)]))

    async def _idle(self) -> None:
        """Sleep until a request arrives; raise WorkerError if a rank's stream ends meanwhile
        (a rank died while idle: report NOT_SERVING now, not at the next request)."""
        self._wakeup.clear()
        broken = self.workers.broken
        waits = [asyncio.ensure_future(e.wait()) for e in (self._wakeup, broken) if e is not None]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if broken is not None and broken.is_set() and not self._wakeup.is_set():
            raise WorkerError("a worker rank's stream ended while idle")

    async def _fail_and_reconnect(self, reason: str,
                                  code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        """Turn unhealthy, fail every request with ``code`` and ``reason``, forget the prefix
        cache, reopen the worker streams (waiting for the ranks), turn healthy again."""
        log.error("%s; failing %d requests", reason, len(self._sinks))
        await self._set_healthy(False)
        self.fail_all(code, reason)
        # NOTE: the step that failed may not have written blocks it registered, and a restarted
        # worker has an empty KV cache: no cached prefix can be trusted any more.
        self.scheduler.reset_prefix_cache()
        self._flush_kv_events()
        while True:
            try:
                await self.workers.connect(timeout=self._reconnect_timeout)
                break
            except WorkerError as e:  # e.g. a rank restarted with other flags refuses us
                log.warning("reconnecting to workers: %s", e)
                await asyncio.sleep(1.0)
        log.info("workers back; serving again")
        await self._set_healthy(True)

    async def _set_healthy(self, healthy: bool) -> None:
        """Record whether the engine can serve; tell gRPC health (not SERVING again while
        draining) and every router (a load batch: ``waiting_for_workers``)."""
        self.healthy = healthy
        if self.on_health and not (healthy and self.draining):
            await self.on_health(healthy)
        for sink in self._routers:
            sink.queue.put_nowait(self.load_batch())

    # ---- results -----------------------------------------------------------------------------
    def load_batch(self) -> engine_pb2.TokenBatch:
        """A TokenBatch with no outputs, only the current load."""
        return self._batch([])

    def _batch(self, outputs: list[engine_pb2.RequestOutput]) -> engine_pb2.TokenBatch:
        s = self.scheduler
        return engine_pb2.TokenBatch(outputs=outputs, load=engine_pb2.LoadReport(
            num_running=s.num_running, num_waiting=s.num_waiting,
            kv_cache_usage=s.block_manager.usage, waiting_for_workers=not self.healthy))

    def _publish(self, updates: list[RequestUpdate]) -> None:
        if self.metrics is not None:
            self.metrics.observe_updates(updates, time.monotonic())
        if self.tracer is not None and self.tracer.active:
            self.tracer.observe_updates(updates)
        by_sink: dict[int, tuple[RouterSink, list]] = {}
        for u in updates:
            sink = self._sinks.get(u.request_id)
            if sink is None:
                continue
            out = engine_pb2.RequestOutput(
                request_id=u.request_id, new_token_ids=u.new_token_ids,
                finish_reason=None if u.finish_reason is None else u.finish_reason.pb,
                num_cached_tokens=u.num_cached_tokens)
            if u.logprobs is not None:
                out.new_token_logprobs.extend(u.logprobs.logprobs)
                out.top_token_ids.extend(u.logprobs.top_token_ids)
                out.top_logprobs.extend(u.logprobs.top_logprobs)
            if u.embedding is not None:
                out.embedding.extend(u.embedding)
            if u.beams is not None:
                out.beams.extend(engine_pb2.BeamHypothesis(
                    token_ids=h.token_ids, score=h.score,
                    cumulative_logprob=h.cumulative_logprob, finish_reason=h.finish_reason.pb)
                    for h in u.beams)
            if u.prompt_logprobs is not None:
                pl = u.prompt_logprobs
                out.prompt_logprobs_start = pl.start
                out.prompt_logprobs.extend(pl.logprobs)
                out.prompt_top_token_ids.extend(pl.top_token_ids)
                out.prompt_top_logprobs.extend(pl.top_logprobs)
            by_sink.setdefault(id(sink), (sink, []))[1].append(out)
            if u.finish_reason is not None:
                del self._sinks[u.request_id]
                sink.request_ids.discard(u.request_id)
                log.debug("request finished: %s, %d output tokens", u.finish_reason,
                          u.num_output_tokens, extra={"request_id": u.request_id})
        for sink, outs in by_sink.values():
            sink.queue.put_nowait(self._batch(outs))
