"""From a finished request's access log entry (``generation.RequestLog``) to its usage row
(``sink``) and the ``pagedserve:router_tokens_total{key_id,kind}`` counter.

The key id is the request's ``callers.caller_var`` (set by the edge that checked its key) as
the request saw it when it was accepted (``RequestLog.caller``), else when it ends. A request
refused for its key (HTTP 401, gRPC UNAUTHENTICATED) has no key to charge: it gets no row, so
requests without a key cannot fill the table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime

from services.common.pb.pagedserve.v1 import api_pb2
from services.router.callers import caller_var
from services.router.usage.database import UsageRow
from services.router.usage.sink import UsageSink

log = logging.getLogger(__name__)
UNCHARGED = frozenset({"401", "UNAUTHENTICATED"})  # statuses that get no row


def finish_reason_name(value: int) -> str:
    """"stop", "length", "abort" for api.proto's ``FinishReason`` value ("" for none)."""
    if not value:
        return ""
    try:
        return api_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()
    except ValueError:
        return str(value)


class UsageRecorder:
    """Counts each finished request's tokens and hands its row to the sink.

    Args:
        sink: where rows go (None: only the counter, no database).
        model: returns the served model's name now ("" while unknown).
        count_tokens: ``callable(key_id, prompt, cached, completion)``, e.g.
            ``RouterMetrics.tokens_done``; None: not counted.
    """

    def __init__(self, sink: UsageSink | None, model: Callable[[], str],
                 count_tokens: Callable[[str, int, int, int], None] | None = None):
        self.sink, self.model, self.count_tokens = sink, model, count_tokens

    def finished(self, entry, status: int | str, finished_at: float) -> None:
        """Record ``entry`` (a ``generation.RequestLog``) that ended with ``status`` at
        ``finished_at`` (``time.time()``). Never raises: accounting never fails a request."""
        try:
            self._finished(entry, str(status), finished_at)
        except Exception:  # a bug here must not fail the request (logged)
            log.exception("usage: could not record request %s", entry.request_id)

    def _finished(self, entry, status: str, finished_at: float) -> None:
        if status in UNCHARGED:
            return
        key_id = (entry.caller or caller_var.get()).key_id
        prompt, cached, completion = (entry.prompt_tokens, entry.cached_tokens,
                                      entry.completion_tokens)
        if self.count_tokens is not None:
            self.count_tokens(key_id, prompt, cached, completion)
        if self.sink is None:
            return
        finished = datetime.fromtimestamp(finished_at, UTC)
        self.sink.put(UsageRow(
            key_id=key_id, day=finished.date(), request_id=entry.request_id or "",
            route=entry.route, model=self.model(), lora=entry.lora,
            prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
            started=datetime.fromtimestamp(entry.started_at, UTC), finished=finished,
            finish_reasons=",".join(finish_reason_name(entry.finish_reasons[i])
                                    for i in sorted(entry.finish_reasons)),
            status=status, error=entry.error))
