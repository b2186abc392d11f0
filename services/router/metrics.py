"""The router's Prometheus metrics: requests and errors, per public method, per scheduler
replica, and per status code.

- ``pagedserve:router_requests_total{method, code}``: every public call when it ends. gRPC
  methods are ``Generate``, ``Chat``, ... with the gRPC status name (``OK``,
  ``INVALID_ARGUMENT``, ``CANCELLED``, ...); HTTP endpoints are their path
  (``/v1/completions``) with the HTTP status (``200``, ``400``, ...).
- ``pagedserve:router_replica_requests_total{replica, code}``: every engine request sent to a
  scheduler replica (``host:port``), by the status of its final output (``OK``, or the error the
  replica or the router's stream to it reported, e.g. ``UNAVAILABLE``). One n > 1 request is n
  engine requests.
- ``pagedserve:router_replicas_available``: scheduler replicas taking requests now.
- ``pagedserve:router_predicted_cached_tokens_total{replica}`` and
  ``pagedserve:router_cached_tokens_total{replica}``: under ``--routing-policy cache_aware``, for
  each request routed with a synced KV index that finished normally, the prompt tokens the
  router predicted the replica would find in its prefix cache, and the ``num_cached_tokens`` the
  replica reported (``cache_aware.py``): their ratio is the prediction's accuracy.
- ``pagedserve:router_tokens_total{key_id, kind}``: tokens of every finished public request
  (generation and embeddings) by the caller's key id, ``kind`` prompt, cached (prompt tokens
  served from the prefix cache) or completion, as the responses' ``usage`` counts them
  (``usage.recorder``; docs/usage.md).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def code_name(code: grpc.StatusCode | int | str) -> str:
    """``OK``/``UNAVAILABLE``/... for a gRPC status or its number; strings pass through."""
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        return _CODE_NAMES.get(code, str(code))
    return code


class _Available:
    def __init__(self, count: Callable[[], int]):
        self.count = count

    def collect(self):
        g = GaugeMetricFamily("pagedserve:router_replicas_available",
                              "Scheduler replicas taking requests.")
        g.add_metric([], self.count())
        yield g


class RouterMetrics:
    """The router's metrics in their own registry (serve with ``start_metrics_server``).

    Args:
        available: returns the number of replicas taking requests (read at scrape time).
    """

    def __init__(self, available: Callable[[], int] = lambda: 0):
        self.registry = CollectorRegistry()
        self.registry.register(_Available(available))
        self._requests = Counter("pagedserve:router_requests", "Public requests by end status.",
                                 ["method", "code"], registry=self.registry)
        self._replica = Counter("pagedserve:router_replica_requests",
                                "Engine requests per scheduler replica by final status.",
                                ["replica", "code"], registry=self.registry)
        self._predicted = Counter("pagedserve:router_predicted_cached_tokens",
                                  "Prompt tokens cache_aware predicted a replica had cached.",
                                  ["replica"], registry=self.registry)
        self._cached = Counter("pagedserve:router_cached_tokens",
                               "Cached prompt tokens the replicas reported for the requests "
                               "cache_aware predicted.", ["replica"], registry=self.registry)
        self._tokens = Counter("pagedserve:router_tokens", "Tokens of finished requests by "
                               "key id and kind (prompt, cached, completion).",
                               ["key_id", "kind"], registry=self.registry)

    def request_done(self, method: str, code: grpc.StatusCode | int | str) -> None:
        """A public call ended (``code``: gRPC status, or HTTP status as int/str)."""
        self._requests.labels(method, str(code) if isinstance(code, int) else code_name(code)).inc()

    def replica_request_done(self, replica: str, error_code: int) -> None:
        """An engine request on ``replica`` got its final output (``error_code`` 0 = OK)."""
        self._replica.labels(replica, code_name(error_code)).inc()

    def cache_prediction(self, replica: str, predicted: int, reported: int) -> None:
        """A cache_aware request on ``replica`` finished: ``predicted`` cached prompt tokens,
        ``reported`` the replica's ``num_cached_tokens``."""
        self._predicted.labels(replica).inc(predicted)
        self._cached.labels(replica).inc(reported)

    def tokens_done(self, key_id: str, prompt: int, cached: int, completion: int) -> None:
        """A request of ``key_id`` finished with these token counts."""
        for kind, n in (("prompt", prompt), ("cached", cached), ("completion", completion)):
            self._tokens.labels(key_id, kind).inc(n)
