"""Per-key limits on the router's public API: requests per minute, tokens per minute, requests
at once, and a priority ceiling (``--api-keys-file``, ``docs/tenants.md``).

One ``Quotas`` object per router, shared by its gRPC and HTTP edges, so a key's limits count
both protocols together. The edge that identified the key (``services.router.auth``) admits
each request that does engine work (gRPC Generate / Chat / Embed; HTTP POST of the
``QUOTA_PATHS``) with ``Quotas.admit`` BEFORE the request is validated, tokenized or queued:

- ``requests_per_minute`` and ``tokens_per_minute`` are token buckets that hold a minute's
  worth (a key may burst that much) and refill continuously at limit/60 per second. A request
  is admitted while the requests bucket holds at least one request (it takes one) and the
  tokens bucket holds at least one token.
- Tokens are charged as they become known, to the bucket of the key that sent the request:
  the prompt's tokens once it is tokenized (``RequestLog.accepted``; embeddings: their inputs'
  tokens), each completion token as it streams (``RequestLog.observe``; the one place HTTP and
  gRPC both pass). The bucket may go negative (a long prompt, a long answer); the key is then
  refused until it has refilled to one token. So a request is never cut short by its quota.
- ``max_concurrent_requests``: requests of the key admitted and not yet ended (finished,
  failed, or the client gone: the edge releases the slot however the call ends).
- ``max_priority``: the most urgent scheduling priority (lower runs sooner) the key's requests
  may ask for; a request asking for a lower number is clamped up to it (``clamp_priority``, in
  ``generation.prepare``) under ``--scheduling-policy priority``.

A refused request is ``QuotaExceeded``: HTTP 429 with OpenAI's error body and ``Retry-After``,
gRPC RESOURCE_EXHAUSTED with trailing metadata ``retry-after`` (whole seconds, rounded up),
counted in ``pagedserve:router_quota_rejections_total{key_id, limit}``.
"""

from __future__ import annotations

import contextvars
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily

# HTTP routes (POST) whose requests are admitted against the key's limits (engine work).
QUOTA_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                         "/v1/embeddings", "/v1/messages"})
# gRPC methods of GenerationService admitted against the key's limits.
QUOTA_METHODS = frozenset({"/pagedserve.v1.GenerationService/Generate",
                           "/pagedserve.v1.GenerationService/Chat",
                           "/pagedserve.v1.GenerationService/Embed"})
PRIORITY_POLICY = "priority"  # the scheduling policy under which priorities apply


@dataclass(frozen=True, slots=True)
class Limits:
    """One key's limits; None = no limit.

    Attributes:
        requests_per_minute: requests admitted per minute (>= 1).
        tokens_per_minute: prompt + completion tokens per minute (>= 1).
        max_concurrent_requests: requests running at once (>= 1).
        max_priority: the lowest (most urgent) priority its requests run with.
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_priority: int | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute,
                                           self.max_concurrent_requests, self.max_priority))


class TokenBucket:
    """Holds up to ``per_minute`` units and refills at ``per_minute / 60`` per second.

    ``level`` may go below zero (``take`` charges what was used, however much).
    """

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # units per second
        self.level = self.capacity
        self.stamp = now

    def refill(self, now: float) -> float:
        """Add what has refilled since the last call (seconds of ``now``); returns the level."""
        self.level = min(self.capacity, self.level + max(0.0, now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)
        return self.level

    def seconds_until(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds ``amount`` (0: it does now)."""
        return max(0.0, (amount - self.refill(now)) / self.rate)

    def take(self, amount: float, now: float) -> None:
        """Remove ``amount`` units (the level may go negative)."""
        self.refill(now)
        self.level -= amount

    def resize(self, per_minute: int, now: float) -> None:
        """Change the limit, keeping what the bucket holds (at most the new capacity)."""
        self.refill(now)
        self.capacity, self.rate = float(per_minute), per_minute / 60.0
        self.level = min(self.level, self.capacity)


class QuotaExceeded(Exception):
    """A request refused by one of its key's limits.

    Attributes:
        key_id: the key's id (never the key).
        limit: the limit's name (``requests_per_minute``, ``tokens_per_minute``,
            ``max_concurrent_requests``); also the error's ``code``.
        retry_after: whole seconds (>= 1) after which the request may be admitted.
    """

    def __init__(self, key_id: str, limit: str, message: str, retry_after: int):
        super().__init__(message)
        self.key_id, self.limit, self.message, self.retry_after = (
            key_id, limit, message, retry_after)

    def openai_body(self) -> dict:
        """OpenAI's 429 error body."""
        return {"error": {"message": self.message, "type": "rate_limit_error", "param": None,
                          "code": self.limit}}

    def anthropic_body(self) -> dict:
        """Anthropic's 429 error body (``/v1/messages``)."""
        return {"type": "error", "error": {"type": "rate_limit_error", "message": self.message}}


def _seconds(wait: float) -> int:
    """A wait as ``Retry-After``: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(wait - 1e-9))


class KeyQuota:
    """The limit state of one key: its buckets and its requests running."""

    def __init__(self, key_id: str, limits: Limits, owner: Quotas):
        self.key_id = key_id
        self.limits = limits
        self.owner = owner  # its clock and lock
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.running = 0
        self.update(limits, owner.clock())

    def update(self, limits: Limits, now: float) -> None:
        """New limits (a reload): buckets that stay keep their level; ``running`` is kept."""
        self.limits = limits
        self.requests = _bucket(self.requests, limits.requests_per_minute, now)
        self.tokens = _bucket(self.tokens, limits.tokens_per_minute, now)

    def refusal(self, now: float) -> QuotaExceeded | None:
        """Why a new request cannot be admitted now (the limit with the longest wait), or
        None."""
        found: list[QuotaExceeded] = []
        lim, key = self.limits, self.key_id
        if self.requests is not None and (wait := self.requests.seconds_until(1, now)) > 0:
            found.append(QuotaExceeded(
                key, "requests_per_minute",
                f"key {key!r} is over its requests_per_minute limit of "
                f"{lim.requests_per_minute}: {max(self.requests.level, 0.0):.2f} requests left "
                f"in its bucket; retry after {_seconds(wait)} s", _seconds(wait)))
        if self.tokens is not None and (wait := self.tokens.seconds_until(1, now)) > 0:
            found.append(QuotaExceeded(
                key, "tokens_per_minute",
                f"key {key!r} is over its tokens_per_minute limit of {lim.tokens_per_minute}: "
                f"its bucket holds {self.tokens.level:.0f} tokens (prompt and completion "
                f"tokens used); retry after {_seconds(wait)} s", _seconds(wait)))
        if lim.max_concurrent_requests is not None and (
                self.running >= lim.max_concurrent_requests):
            found.append(QuotaExceeded(
                key, "max_concurrent_requests",
                f"key {key!r} is over its max_concurrent_requests limit of "
                f"{lim.max_concurrent_requests}: {self.running} requests running; retry after "
                "1 s", 1))
        return max(found, key=lambda e: e.retry_after) if found else None


def _bucket(old: TokenBucket | None, per_minute: int | None, now: float) -> TokenBucket | None:
    if per_minute is None:
        return None
    if old is None:
        return TokenBucket(per_minute, now)
    old.resize(per_minute, now)
    return old


# The limit state of the key whose request the current task serves (set at admission).
_admitted: contextvars.ContextVar[KeyQuota | None] = contextvars.ContextVar(
    "admitted_quota", default=None)


class Quotas:
    """Every limited key's state, shared by a router's HTTP and gRPC edges.

    Thread-safe (a lock around each update): requests run on the router's loop, but tokens
    may be charged from ``prepare`` on a worker thread.

    Args:
        clock: seconds, monotonic (injected by tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._keys: dict[str, KeyQuota] = {}
        self.lock = threading.Lock()
        self.rejections: Counter[tuple[str, str]] = Counter()  # (key_id, limit) -> refusals

    def configure(self, limits: Mapping[str, Limits]) -> None:
        """Set the limited keys (key id -> its limits; keys without limits may be left out).
        A key that stays keeps its buckets and running count; a key left out loses its
        state (requests of it still running release nothing that matters)."""
        now = self.clock()
        with self.lock:
            kept = {}
            for key_id, lim in limits.items():
                if not lim:
                    continue
                state = self._keys.get(key_id)
                if state is None:
                    state = KeyQuota(key_id, lim, self)
                else:
                    state.update(lim, now)
                kept[key_id] = state
            self._keys = kept

    def state(self, key_id: str) -> KeyQuota | None:
        """The limit state of ``key_id`` (None: the key has no limits)."""
        return self._keys.get(key_id)

    def acquire(self, key_id: str) -> KeyQuota | None:
        """Admit one request of ``key_id``: take one request from its bucket and a
        concurrency slot (give it back with ``release`` however the request ends), and make
        the tokens of this task's request charge the key (``charge_tokens``) and its priority
        be clamped (``clamp_priority``). Returns the key's state (None: it has no limits).

        Raises:
            QuotaExceeded: a limit refuses it (nothing is taken; counted).
        """
        state = self._keys.get(key_id)
        if state is None:
            return None
        with self.lock:
            now = self.clock()
            refusal = state.refusal(now)
            if refusal is not None:
                self.rejections[(key_id, refusal.limit)] += 1
                raise refusal
            if state.requests is not None:
                state.requests.take(1, now)
            state.running += 1
        _admitted.set(state)
        return state

    def release(self, state: KeyQuota | None) -> None:
        """The request ``acquire`` admitted has ended: free its concurrency slot."""
        if state is not None:
            with self.lock:
                state.running -= 1

    @contextmanager
    def admit(self, key_id: str) -> Iterator[KeyQuota | None]:
        """``acquire`` for the ``with`` block, ``release`` when it ends.

        Raises:
            QuotaExceeded: as ``acquire``.
        """
        state = self.acquire(key_id)
        try:
            yield state
        finally:
            self.release(state)

    def collect(self):
        """Prometheus collector: ``pagedserve:router_quota_rejections_total{key_id, limit}``."""
        c = CounterMetricFamily("pagedserve:router_quota_rejections",
                                "Requests refused by a per-key limit (--api-keys-file).",
                                labels=["key_id", "limit"])
        for (key_id, limit), n in sorted(self.rejections.items()):
            c.add_metric([key_id, limit], n)
        yield c


def charge_tokens(tokens: int) -> None:
    """Charge ``tokens`` (prompt or completion) to the key of the request this task serves;
    nothing when it has no tokens_per_minute limit or no key was admitted."""
    state = _admitted.get()
    if state is not None and state.tokens is not None and tokens:
        with state.owner.lock:
            state.tokens.take(tokens, state.owner.clock())


def clamp_priority(priority: int, scheduling_policy: str) -> int:
    """``priority`` raised to the admitted key's ``max_priority`` (lower runs sooner, so a
    request cannot run sooner than its key allows); unchanged without a ceiling or when the
    engine's policy is not "priority" (priorities are all 0 there)."""
    state = _admitted.get()
    if state is None or state.limits.max_priority is None or (
            scheduling_policy != PRIORITY_POLICY):
        return priority
    return max(priority, state.limits.max_priority)
