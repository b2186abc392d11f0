"""The ``cache_aware`` routing policy (``ReplicaSet``): the replica that holds the longest
prefix of the prompt, known exactly from each replica's KV events (``kv_index.py``,
``kv_event_subscriber.py``), with SGLang's load guard (sgl-router's ``cache_aware``:
``--cache-threshold``, ``--balance-abs-threshold``, ``--balance-rel-threshold``).

For a prompt, in order:

1. *Imbalance*: when the busiest available replica's load exceeds the idlest one's by more than
   ``balance_abs_threshold`` requests AND is more than ``balance_rel_threshold`` times it, the
   least-loaded replica (load as ``replicas.load``: running + waiting).
2. *Cache hit*: the prompt's full blocks are keyed as the scheduler keys them
   (``common/block_hash.chain_hashes``, with the LoRA adapter's extra key), and each replica's
   index says how many leading blocks it holds. The replica with the most, if those tokens are
   at least ``cache_threshold`` of the prompt (ties: the lower load).
3. *Cold prefix*: the replica where a request with the same first blocks (the
   ``affinity_blocks`` prefix_affinity hashes) is in flight, routed here before its blocks
   showed up in the events (so the requests of a new system prompt that arrive together
   gather on one replica), unless it is more than ``affinity_margin`` busier than the least
   loaded; otherwise the least-loaded replica. (SGLang sends a cold prompt to the replica
   with the smallest cache; we spread by load, which is what TTFT feels, and the prefix draws
   the next requests to it from then on.)

A replica whose index is not synced (its stream is down or resyncing) or that publishes no
events is never chosen for its cache; with no synced index at all the choice is
prefix_affinity's (``None``: the caller's rendezvous of the first blocks with its load margin),
so a router whose schedulers publish no events routes as prefix_affinity.

The prediction: the tokens the chosen replica would report as the request's
``num_cached_tokens``: matched blocks x block_size, at most ``(prompt_len - 1) // block_size``
blocks (the scheduler always computes the last prompt token); 0 for a request with prompt
logprobs or on a pooling model (neither looks up the cache). ``expect`` records it per request
and ``observe`` counts it against the replica's report on the request's final output
(``RouterMetrics.cache_prediction``). It can differ from the report when the cache changes
between routing and admission (a block evicted; a block of a request ahead stored meanwhile),
and it misses KV tier hits (the tier's blocks are not in the events). The n choices of one
request follow the first one's replica (``ReplicaSet.submit``) and are not counted.

NOTE (defaults): ``cache_threshold`` 0.5, above vllm-router / sgl-router's 0.3: a prompt below
it counts as cold and spreads by load. In a multi-turn chat every prompt after a conversation's
first matches at least its system prompt (about 0.9 of a first turn in the benchmark, more
later), so 0.5 keeps those on their cache, while a short accidental match (a chat template's
preamble, a block or two) does not pull traffic onto one replica. ``balance_abs_threshold`` 32,
half of SGLang's 64: our load counts waiting requests too, and replicas here run smaller
batches (a replica 32 requests behind another is several steps behind).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from services.common.block_hash import chain_hashes, external_block_hash, lora_extra_key
from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.router.engine_client import EngineClient
from services.router.kv_event_subscriber import KvEventSubscriber

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """cache_aware's thresholds (the router's flags of the same names).

    Attributes:
        cache_threshold: least share of the prompt, in [0, 1], the best replica's matched
            tokens must reach to win on the cache.
        balance_abs_threshold: requests by which the busiest replica must exceed the idlest
            one (with ``balance_rel_threshold``) for load to win (>= 0).
        balance_rel_threshold: how many times the idlest replica's load the busiest one must
            exceed (>= 1).
    """

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5


class Choice(NamedTuple):
    """What ``CacheAware.choose`` decided.

    Attributes:
        client: the replica, or None for prefix_affinity's choice (no synced index).
        predicted: cached tokens predicted per address, for each candidate with a synced index.
        prefix: the hash of the prompt's ``affinity_blocks``-th block (its cold-prefix key;
            None without a full block), to pass to ``expect``.
    """

    client: EngineClient | None
    predicted: dict[str, int]
    prefix: int | None


def _stub_subscriber(client: EngineClient) -> KvEventSubscriber:
    return KvEventSubscriber(client.address, client.stub)


class CacheAware:
    """cache_aware's state: a KV event subscriber per replica, and the predictions of the
    requests in flight.

    Args:
        config: the thresholds.
        subscriber_factory: builds a replica's (not started) ``KvEventSubscriber`` from its
            client (None: on the client's own channel, ``EngineClient.stub``).
        metrics: ``RouterMetrics`` (or None) counting predicted vs reported cached tokens.
        affinity_blocks: the leading blocks that key a cold prefix (``--prefix-affinity-blocks``).
        affinity_margin: how much busier than the least loaded a cold prefix's replica may be.
    """

    def __init__(self, config: CacheAwareConfig,
                 subscriber_factory: Callable[..., KvEventSubscriber] | None = None,
                 metrics=None, affinity_blocks: int = 2, affinity_margin: int = 8):
        self.config = config
        self.affinity_blocks = affinity_blocks
        self.affinity_margin = affinity_margin
        self._factory = subscriber_factory or _stub_subscriber
        self.metrics = metrics
        self.subscribers: dict[str, KvEventSubscriber] = {}
        # request id -> (address, predicted tokens or None, cold-prefix key or None)
        self._expected: dict[str, tuple[str, int | None, int | None]] = {}
        self._in_flight: dict[int, tuple[str, int]] = {}  # prefix key -> (address, requests)
        self._fell_back = False

    def watch(self, client: EngineClient) -> None:
        """Subscribe to a new replica's events (and observe its requests' final outputs)."""
        sub = self.subscribers[client.address] = self._factory(client)
        client.on_end = lambda out, address=client.address: self.observe(address, out)
        sub.start()

    async def forget(self, address: str) -> None:
        """Stop following a replica that left."""
        sub = self.subscribers.pop(address, None)
        if sub is not None:
            await sub.close()

    async def close(self) -> None:
        """Stop every subscription."""
        for address in list(self.subscribers):
            await self.forget(address)

    # ---- the choice ---------------------------------------------------------------------
    def choose(self, candidates: list[EngineClient], prompt: Sequence[int],
               lora: LoRARequest | None, info: engine_pb2.GetEngineInfoResponse,
               least: EngineClient, load: Callable[[EngineClient], int],
               params=None) -> Choice:
        """cache_aware's choice among ``candidates`` (>= 1 available clients; see the module
        docstring).

        Args:
            prompt: the prompt's token ids.
            lora: the adapter the request runs with (its blocks are keyed with it), or None.
            info: the engine info the replicas agree on (``block_size``, ``runner``).
            least: the least-loaded candidate (the caller's tie rotation).
            load: a client's load in requests.
            params: the request's ``EngineSamplingParams`` (prompt logprobs: no cache lookup).
        """
        hashes = self._hashes(prompt, lora, info)
        matched = self._matched(candidates, hashes, info.block_size)
        predicted = matched
        if info.runner == "pooling" or (params is not None
                                        and params.prompt_logprobs is not None):
            predicted = dict.fromkeys(matched, 0)
        prefix = hashes[min(self.affinity_blocks, len(hashes)) - 1] if hashes else None
        cfg = self.config
        loads = [load(c) for c in candidates]
        hi, lo = max(loads), min(loads)
        if len(candidates) == 1 or (hi - lo > cfg.balance_abs_threshold
                                    and hi > cfg.balance_rel_threshold * lo):
            return Choice(least, predicted, prefix)
        if not matched:
            if not self._fell_back:
                log.warning("cache_aware: no replica has synced KV events; routing as "
                            "prefix_affinity until one has")
                self._fell_back = True
            return Choice(None, predicted, prefix)
        self._fell_back = False
        by_address = {c.address: c for c in candidates}
        best = max(matched, key=lambda a: (matched[a], -load(by_address[a])))
        tokens = matched[best]
        if tokens > 0 and tokens >= cfg.cache_threshold * len(prompt):
            return Choice(by_address[best], predicted, prefix)
        entry = self._in_flight.get(prefix) if prefix is not None else None
        if entry is not None and entry[0] in by_address:
            there = by_address[entry[0]]
            if load(there) - load(least) <= self.affinity_margin:
                return Choice(there, predicted, prefix)
        return Choice(least, predicted, prefix)

    @staticmethod
    def _hashes(prompt: Sequence[int], lora: LoRARequest | None,
                info: engine_pb2.GetEngineInfoResponse) -> list[int]:
        """The external hashes of the prompt's blocks the scheduler may find cached: the full
        blocks before its last token."""
        bs = info.block_size
        n = (len(prompt) - 1) // bs if bs > 0 else 0
        if n <= 0:
            return []
        extra = lora_extra_key(lora.name, lora.path) if lora is not None else b""
        return [external_block_hash(k) for k in chain_hashes(prompt, bs, extra, n)]

    def _matched(self, candidates: list[EngineClient], hashes: list[int],
                 block_size: int) -> dict[str, int]:
        """Matched tokens per candidate with a synced index."""
        out = {}
        for c in candidates:
            sub = self.subscribers.get(c.address)
            if sub is not None and sub.synced:
                out[c.address] = sub.index.match(hashes) * block_size if hashes else 0
        return out

    # ---- predictions vs reports ---------------------------------------------------------
    def expect(self, request_id: str, address: str, choice: Choice) -> None:
        """Record a request sent to ``address`` after ``choice``: its prediction (if its
        replica has a synced index) and its prefix in flight there, until it ends."""
        if choice.prefix is not None:
            entry = self._in_flight.get(choice.prefix)
            count = entry[1] if entry is not None and entry[0] == address else 0
            self._in_flight[choice.prefix] = (address, count + 1)
        self._expected[request_id] = (address, choice.predicted.get(address), choice.prefix)

    def drop(self, request_id: str) -> None:
        """Forget a request (its caller stopped listening: no final output comes)."""
        entry = self._expected.pop(request_id, None)
        if entry is not None:
            self._ended(entry[0], entry[2])

    def _ended(self, address: str, prefix: int | None) -> None:
        """One request with ``prefix`` left ``address``."""
        if prefix is None:
            return
        entry = self._in_flight.get(prefix)
        if entry is None or entry[0] != address:
            return
        if entry[1] > 1:
            self._in_flight[prefix] = (address, entry[1] - 1)
        else:
            del self._in_flight[prefix]

    def observe(self, address: str, out: engine_pb2.RequestOutput) -> None:
        """A request's final output on ``address``: count its prediction against its
        ``num_cached_tokens`` when it finished normally (an error or an abort may have come
        before it was scheduled: not counted)."""
        entry = self._expected.get(out.request_id)
        if entry is None or entry[0] != address:
            return
        del self._expected[out.request_id]
        self._ended(address, entry[2])
        if entry[1] is None or out.error_code or out.finish_reason == api_pb2.FINISH_REASON_ABORT:
            return
        if self.metrics is not None:
            self.metrics.cache_prediction(address, entry[1], out.num_cached_tokens)
