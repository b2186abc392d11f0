"""Routing across several scheduler replicas: a ``ReplicaSet`` of ``EngineClient``s.

``ReplicaSet`` has the interface ``generation`` / ``server`` / ``openai.http`` / ``text_api`` use
on one ``EngineClient`` (``submit``, ``abort``, ``release``, ``is_running``, ``info``,
``serving``, ``start``, ``close``), so they do not know whether one scheduler or many serve
them. It picks a replica per request at ``submit`` time:

- ``round_robin``: the available replicas in turn.
- ``least_loaded``: the smallest load, where load = max(running + waiting of the replica's latest
  ``LoadReport``, this router's in-flight requests there). The report arrives only with a
  TokenBatch, so between reports this router's own count keeps a burst from piling onto one
  replica; ties go to the lower ``kv_cache_usage``, then in turn.
- ``prefix_affinity`` (the default): the prompt's first ``affinity_blocks`` full KV blocks
  (``block_size`` from the engine info) are hashed onto a replica by rendezvous (highest random
  weight) hashing, so requests that share that prefix meet the same prefix cache, and adding or
  removing a replica moves only the keys of that replica. If the chosen replica's load exceeds
  the least-loaded one's by more than ``AFFINITY_MARGIN`` requests, or the prompt has no full
  block, the request goes least_loaded instead.
- ``cache_aware``: the replica whose prefix cache holds the longest prefix of the prompt, known
  exactly from every replica's KV events (``SubscribeKvEvents``: ``kv_event_subscriber.py``
  keeps a ``kv_index.KvIndex`` per replica, resyncing by replay or snapshot after a broken
  stream or a restarted scheduler), when it covers at least ``--cache-threshold`` of the
  prompt; SGLang's guard first (busiest load > idlest + ``--balance-abs-threshold`` and >
  ``--balance-rel-threshold`` x idlest: least_loaded); a cold prompt goes where its first
  blocks are in flight, else to the least loaded; with no synced index (events off) it is
  prefix_affinity (``cache_aware.py``). The router counts its
  predicted hit tokens against the replicas' reported ``num_cached_tokens``
  (``RouterMetrics.cache_prediction``).

NOTE: prefix_affinity is the default because prefix caching is on by default: round_robin
would split every shared prefix (system prompt, few-shot examples, a conversation's history)
over all replicas and compute it once per replica, while the margin bounds the imbalance that
affinity can cause. With one replica every policy is the same.

The choices of an ``n > 1`` request must land on one replica (they share their prompt's blocks
there): ``submit`` routes by ``parent_request_id`` when set, and every later choice of the same
parent goes to the replica of the first one. Which replica owns a request is asked of the
replicas themselves (each knows its in-flight ids), so ``abort`` / ``release`` / ``is_running``
need no bookkeeping that could go stale.

A replica is *available* while it can serve (``EngineClient.serving``: its stream is up and its
engine has a complete worker group) and its engine info agrees with the first replica accepted
(model, vocab_size, max_model_len); one that disagrees is logged as an error and kept out (while
no other replica is available, the next one to connect is the reference). A replica whose
stream breaks fails its in-flight requests with UNAVAILABLE (``EngineClient``) and gets no new
ones until it reconnects; one whose engine lost its workers gets no new ones until they are
back. ``serving`` is set while at least one replica is available: the router's readiness
(gRPC health, ``GET /health``) follows it.

Replicas come from a list of ``host:port`` or from one ``dns:///name:port`` target, resolved
again every ``dns_refresh`` seconds (e.g. a Kubernetes headless Service): a new address gets a
new ``EngineClient``; a vanished one takes no new requests and is closed once its in-flight
requests have ended (checked at each release and each refresh).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import socket
import struct
from collections.abc import Sequence

from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.cache_aware import CacheAware, CacheAwareConfig, Choice
from services.router.engine_client import EngineClient, _unavailable

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_loaded", "prefix_affinity", "cache_aware")
DNS_PREFIX = "dns:///"
# prefix_affinity falls back to least_loaded when the chosen replica's load (requests running +
# waiting) exceeds the least-loaded replica's by more than this.
AFFINITY_MARGIN = 8
# Engine info fields every replica must share with the first one accepted.
AGREEING_FIELDS = ("model", "vocab_size", "max_model_len")


def parse_targets(spec: str) -> tuple[list[str], str | None]:
    """Split a ``--schedulers`` value into static addresses or one DNS target.

    Returns:
        ``(addresses, None)`` for ``"host:port,host:port"``, or ``([], "name:port")`` for
        ``"dns:///name:port"``.

    Raises:
        ValueError: an empty list, an entry without ``:port``, or a dns target mixed with
            other entries.
    """
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if not entries:
        raise ValueError("no scheduler address given")
    dns = [e for e in entries if e.startswith(DNS_PREFIX)]
    if dns:
        if len(entries) > 1:
            raise ValueError(f"a {DNS_PREFIX} target must be the only entry, got {spec!r}")
        target = dns[0][len(DNS_PREFIX):]
        entries_to_check = [target]
    else:
        target = None
        entries_to_check = entries
    for e in entries_to_check:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"scheduler address must be host:port, got {e!r}")
    if len(set(entries)) != len(entries):
        raise ValueError(f"scheduler addresses repeat: {spec!r}")
    return ([], target) if target else (entries, None)


def _weight(key: bytes, address: str) -> int:
    """Rendezvous weight of ``key`` on one replica (higher wins)."""
    digest = hashlib.blake2b(key + b"\0" + address.encode(), digest_size=8).digest()
    return struct.unpack(">Q", digest)[0]


def prefix_key(prompt_token_ids, block_size: int, num_blocks: int) -> bytes | None:
    """The bytes hashed by prefix_affinity: the first ``min(num_blocks, full blocks)`` full
    blocks of the prompt (token ids as little-endian int32), or None without a full block."""
    full = min(num_blocks, len(prompt_token_ids) // max(block_size, 1))
    if full <= 0:
        return None
    return struct.pack(f"<{full * block_size}i", *prompt_token_ids[:full * block_size])


def pick_rendezvous(key: bytes, addresses: list[str]) -> str:
    """The address with the highest rendezvous weight for ``key`` (``addresses`` not empty)."""
    return max(addresses, key=lambda a: _weight(key, a))


class ReplicaSet:
    """Several scheduler replicas behind the interface of one ``EngineClient``.

    Args:
        addresses: static ``host:port`` list (ignored when ``dns_target`` is set).
        policy: one of ``POLICIES``.
        dns_target: ``name:port`` resolved every ``dns_refresh`` seconds into the replicas.
        dns_refresh: seconds between DNS resolutions (> 0).
        affinity_blocks: full KV blocks of the prompt hashed by prefix_affinity (>= 1).
        on_serving: async callback(bool): at least one replica became available (True) or
            none is any more (False).
        client_factory: builds one replica's client from ``(address, on_serving)``
            (default ``EngineClient``; tests pass fakes).
        metrics: ``RouterMetrics`` counting each replica's engine requests (or None).
        cache_aware: cache_aware's thresholds (default ``CacheAwareConfig()``).
        kv_subscriber_factory: builds a replica's ``KvEventSubscriber`` from its client under
            cache_aware (default: on the client's channel; tests pass fakes).

    Raises:
        ValueError: an unknown policy, or neither addresses nor a DNS target.
    """

    def __init__(self, addresses: Sequence[str] = (), *, policy: str = "prefix_affinity",
                 dns_target: str | None = None, dns_refresh: float = 30.0,
                 affinity_blocks: int = 2, on_serving=None, client_factory=EngineClient,
                 metrics=None, cache_aware: CacheAwareConfig | None = None,
                 kv_subscriber_factory=None):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        if not addresses and not dns_target:
            raise ValueError("no scheduler address given")
        self.policy = policy
        self.dns_target = dns_target
        self.dns_refresh = dns_refresh
        self.affinity_blocks = affinity_blocks
        self.on_serving = on_serving
        self._factory = client_factory
        self.metrics = metrics  # RouterMetrics, handed to every replica's client
        self._static = list(addresses)
        self.replicas: dict[str, EngineClient] = {}  # address -> client, taking new requests
        self._draining: dict[str, EngineClient] = {}  # vanished from DNS, closing when idle
        self._refused: set[str] = set()  # addresses whose engine info disagrees
        self._reference: engine_pb2.GetEngineInfoResponse | None = None
        self._turn = itertools.count()
        # parent_request_id -> (client, child ids sent there): the n choices stay together
        self._parents: dict[str, tuple[EngineClient, list[str]]] = {}
        self._parents_pruned_at = 0
        self._refresh_task: asyncio.Task | None = None
        self.serving = asyncio.Event()  # at least one replica is available
        self.cache_aware: CacheAware | None = None
        if policy == "cache_aware":
            self.cache_aware = CacheAware(cache_aware or CacheAwareConfig(),
                                          kv_subscriber_factory, metrics, affinity_blocks,
                                          AFFINITY_MARGIN)

    # ---- the EngineClient interface -----------------------------------------------------
    @property
    def info(self) -> engine_pb2.GetEngineInfoResponse | None:
        """The engine info every available replica agrees with (the first accepted one's);
        None until a replica has connected."""
        return self._reference

    async def start(self, timeout: float) -> engine_pb2.GetEngineInfoResponse:
        """Resolve the replicas, connect to all in the background and wait up to ``timeout`` s
        until one is available.

        Raises:
            TimeoutError: no replica became available in time.
        """
        if self.dns_target:
            await self.refresh()  # a name that does not resolve yet is retried every second
            self._refresh_task = asyncio.create_task(self._refresh_loop())
        else:
            for address in self._static:
                self._add(address)
        try:
            await asyncio.wait_for(self.serving.wait(), timeout)
        except TimeoutError:
            names = self.dns_target or ",".join(self._static)
            raise TimeoutError(f"no scheduler of {names} ready after {timeout:.0f}s") from None
        assert self._reference is not None  # set by the replica that made it serve
        return self._reference

    def submit(self, request_id: str, prompt_token_ids: list[int],
               params: EngineSamplingParams, *, priority: int = 0,
               queue: asyncio.Queue | None = None, parent_request_id: str = "",
               lora: LoRARequest | None = None) -> asyncio.Queue:
        """``EngineClient.submit`` on the replica the policy picks (the choices of one n > 1
        request, i.e. one ``parent_request_id``, all on the first one's replica). With no
        replica available the request gets its UNAVAILABLE output in the queue at once. The
        caller refuses a request id still running on any replica (``is_running``; see
        ``generation.stream_responses``).
        """
        queue = asyncio.Queue() if queue is None else queue
        client = None
        if parent_request_id:
            self._prune_parents()
            entry = self._parents.get(parent_request_id)
            if entry is not None and self._available(entry[0]):
                client = entry[0]
        choice = None
        if client is None:
            client, choice = self._pick(prompt_token_ids, lora, params)
        if client is None:
            queue.put_nowait(_unavailable(request_id, self.unavailable_reason()))
            return queue
        if parent_request_id:
            entry = self._parents.get(parent_request_id)
            if entry is None or entry[0] is not client:
                entry = self._parents[parent_request_id] = (client, [])
            entry[1].append(request_id)
        elif self.cache_aware is not None and choice is not None:
            self.cache_aware.expect(request_id, client.address, choice)
        return client.submit(request_id, prompt_token_ids, params, priority=priority,
                             queue=queue, parent_request_id=parent_request_id, lora=lora)

    def is_running(self, request_id: str) -> bool:
        """Whether a request with this id is in flight on any replica (draining ones too)."""
        return self._owner(request_id) is not None

    def abort(self, request_id: str) -> None:
        """``EngineClient.abort`` on the replica that runs the request (none: nothing)."""
        owner = self._owner(request_id)
        if owner is not None:
            owner.abort(request_id)

    def release(self, request_id: str) -> None:
        """``EngineClient.release`` on the replica that runs the request (none: nothing)."""
        owner = self._owner(request_id)
        if owner is not None:
            owner.release(request_id)
        if self.cache_aware is not None:
            self.cache_aware.drop(request_id)
        self._maybe_close_drained()

    def fail_all(self, why: str) -> None:
        """``EngineClient.fail_all`` on every replica (draining ones too)."""
        for client in [*self.replicas.values(), *self._draining.values()]:
            client.fail_all(why)

    async def close(self) -> None:
        """Stop the DNS refresh and close every replica's stream."""
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        if self.cache_aware is not None:
            await self.cache_aware.close()
        for client in [*self.replicas.values(), *self._draining.values()]:
            await client.close()
        self.replicas.clear()
        self._draining.clear()

    def unavailable_reason(self) -> str:
        """Why no replica can take a request now (the message of the UNAVAILABLE / 503)."""
        names = self.dns_target or ",".join(self._static)
        if any(c.connected.is_set() and not c.serving.is_set() for c in self.replicas.values()):
            return f"scheduler {names}: engine has no worker; retry later"
        return f"scheduler {names} unavailable"

    # ---- routing ------------------------------------------------------------------------
    def available(self) -> list[EngineClient]:
        """The replicas that take new requests: able to serve, engine info agreeing."""
        return [c for c in self.replicas.values() if self._available(c)]

    def pick(self, prompt_token_ids, lora: LoRARequest | None = None,
             params: EngineSamplingParams | None = None) -> EngineClient | None:
        """The replica the policy picks for a prompt (run with ``lora``, and ``params``: both
        only matter to cache_aware); None when none is available."""
        return self._pick(prompt_token_ids, lora, params)[0]

    def _pick(self, prompt_token_ids, lora: LoRARequest | None,
              params: EngineSamplingParams | None
              ) -> tuple[EngineClient | None, Choice | None]:
        """``pick``, and under cache_aware its ``Choice`` (predictions, prefix key)."""
        candidates = self.available()
        if not candidates:
            return None, None
        if self.policy == "round_robin":
            return candidates[next(self._turn) % len(candidates)], None
        least = self._least_loaded(candidates)
        if self.policy == "least_loaded" or (len(candidates) == 1 and self.cache_aware is None):
            return least, None
        assert self._reference is not None  # an available replica was checked against it
        if self.cache_aware is not None:
            choice = self.cache_aware.choose(candidates, prompt_token_ids, lora,
                                             self._reference, least, load, params)
            if choice.client is not None:
                return choice.client, choice
            return self._affinity(candidates, prompt_token_ids, least), choice
        return self._affinity(candidates, prompt_token_ids, least), None

    def _affinity(self, candidates: list[EngineClient], prompt_token_ids,
                  least: EngineClient) -> EngineClient:
        """prefix_affinity's choice: the rendezvous replica of the prompt's first blocks,
        unless it is more than ``AFFINITY_MARGIN`` busier than ``least``."""
        assert self._reference is not None
        key = prefix_key(prompt_token_ids, self._reference.block_size, self.affinity_blocks)
        if key is None:
            return least
        by_address = {c.address: c for c in candidates}
        chosen = by_address[pick_rendezvous(key, list(by_address))]
        if load(chosen) - load(least) > AFFINITY_MARGIN:
            return least
        return chosen

    def _least_loaded(self, candidates: list[EngineClient]) -> EngineClient:
        # NOTE: rotate the start so equal loads are taken in turn, not always the first.
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda c: (load(c), c.load.kv_cache_usage))

    def _available(self, client: EngineClient) -> bool:
        return (client.serving.is_set() and client.address in self.replicas
                and client.address not in self._refused)

    def _owner(self, request_id: str) -> EngineClient | None:
        for client in itertools.chain(self.replicas.values(), self._draining.values()):
            if client.is_running(request_id):
                return client
        return None

    def _prune_parents(self) -> None:
        """Forget parents none of whose choices still run (amortised: when the map doubled)."""
        if len(self._parents) <= 2 * self._parents_pruned_at + 64:
            return
        self._parents = {p: (c, ids) for p, (c, ids) in self._parents.items()
                         if any(c.is_running(i) for i in ids)}
        self._parents_pruned_at = len(self._parents)

    # ---- membership ---------------------------------------------------------------------
    def _add(self, address: str) -> None:
        if address in self._draining:  # came back before it drained: take it again
            self.replicas[address] = self._draining.pop(address)
            return
        client = self._factory(address, on_serving=self._watch(address))
        client.metrics = self.metrics
        self.replicas[address] = client
        client.connect_in_background()
        if self.cache_aware is not None:
            self.cache_aware.watch(client)

    def _watch(self, address: str):
        async def on_serving(up: bool) -> None:
            client = self.replicas.get(address) or self._draining.get(address)
            if up and client is not None:
                assert client.info is not None  # a client serves only once it has its info
                self._check_info(address, client.info)
            await self._update_serving()
        return on_serving

    def _check_info(self, address: str, info: engine_pb2.GetEngineInfoResponse) -> None:
        """Accept the replica, or refuse it when its info disagrees with the reference."""
        # NOTE: with no other replica available, the one coming up sets the reference: a lone
        # scheduler restarted with new limits is taken as it is now (as one EngineClient was).
        if not any(c.address != address for c in self.available()):
            self._reference = info
        diff = [f"{f}={getattr(info, f)!r} (expected {getattr(self._reference, f)!r})"
                for f in AGREEING_FIELDS if getattr(info, f) != getattr(self._reference, f)]
        if diff:
            if address not in self._refused:
                log.error("scheduler %s refused: its engine differs from the others: %s",
                          address, ", ".join(diff))
            self._refused.add(address)
        else:
            self._refused.discard(address)
            log.info("scheduler replica %s available (%d replicas)", address,
                     len(self.available()))

    async def _update_serving(self) -> None:
        up = bool(self.available())
        if up != self.serving.is_set():
            if up:
                self.serving.set()
            else:
                self.serving.clear()
            if self.on_serving is not None:
                await self.on_serving(up)

    async def _resolve(self) -> list[str]:
        """The DNS target's addresses as ``ip:port`` (IPv6 as ``[ip]:port``), sorted.

        Raises:
            OSError: the name does not resolve.
        """
        assert self.dns_target is not None  # only resolved with a DNS target
        host, _, port = self.dns_target.rpartition(":")
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM)
        out = set()
        for family, _, _, _, sockaddr in infos:
            ip = sockaddr[0]
            out.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
        return sorted(out)

    async def refresh(self) -> None:
        """Resolve the DNS target once more and apply the difference: new addresses are added,
        vanished ones drain (no new requests; closed when their in-flight requests end). A
        failed resolution keeps the current replicas (logged)."""
        try:
            addresses = set(await self._resolve())
        except OSError as e:
            log.warning("cannot resolve %s (%s); keeping %d replicas", self.dns_target, e,
                        len(self.replicas))
            return
        if not addresses:
            return
        for address in sorted(addresses - set(self.replicas)):
            log.info("scheduler replica %s appeared in %s", address, self.dns_target)
            self._add(address)
        for address in sorted(set(self.replicas) - addresses):
            log.info("scheduler replica %s left %s; draining", address, self.dns_target)
            self._draining[address] = self.replicas.pop(address)
        await self._update_serving()
        await self._close_drained()

    def _maybe_close_drained(self) -> None:
        if any(c.num_pending == 0 for c in self._draining.values()):
            asyncio.get_running_loop().create_task(self._close_drained())

    async def _close_drained(self) -> None:
        for address, client in list(self._draining.items()):
            if client.num_pending == 0:
                del self._draining[address]
                self._refused.discard(address)
                if self.cache_aware is not None:
                    await self.cache_aware.forget(address)
                await client.close()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.dns_refresh if self.replicas else min(self.dns_refresh, 1))
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad round end the refreshing
                log.exception("refreshing scheduler replicas of %s failed", self.dns_target)


def load(client: EngineClient) -> int:
    """A replica's load in requests: max(running + waiting of its latest LoadReport, this
    router's requests in flight there)."""
    return max(client.load.num_running + client.load.num_waiting, client.num_pending)

