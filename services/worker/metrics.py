"""A worker rank's Prometheus metrics: time per step and batch size.

- ``pagedserve:worker_step_seconds{rank}``: wall time of one ``execute_step`` (applying the
  diffs, the forward pass, sampling), seconds;
- ``pagedserve:worker_batch_tokens{rank}``: tokens computed per step;
- ``pagedserve:worker_batch_requests{rank}``: sequences per step;
- ``pagedserve:worker_weights_bytes{rank}``, ``pagedserve:worker_kv_cache_bytes{rank}``,
  ``pagedserve:worker_peak_activation_bytes{rank}``: what the rank's memory goes to, set once
  at start (``services/worker/memory_report.py``);
- ``pagedserve:worker_cpu_threads{rank}``: the OpenMP threads the forward uses now
  (``services/worker/cpu_threads.py``, ``cpu_governor.py``);
- with ``--kv-offload-dir``, the KV tier's (``KVTierMetrics``, ``WorkerMetrics.kv_tier``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import TOKEN_BUCKETS

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class WorkerMetrics:
    """One rank's metrics in their own registry (serve with ``start_metrics_server``)."""

    def __init__(self, rank: int = 0):
        self.registry = CollectorRegistry()
        labels = ["rank"]
        self.step_seconds = Histogram(
            "pagedserve:worker_step_seconds", "Wall time of one step on this rank (s).", labels,
            buckets=STEP_BUCKETS, registry=self.registry).labels(str(rank))
        self.batch_tokens = Histogram(
            "pagedserve:worker_batch_tokens", "Tokens computed per step.", labels,
            buckets=TOKEN_BUCKETS, registry=self.registry).labels(str(rank))
        self.batch_requests = Histogram(
            "pagedserve:worker_batch_requests", "Sequences per step.", labels,
            buckets=REQUEST_BUCKETS, registry=self.registry).labels(str(rank))
        self.rank = str(rank)
        self.cpu_threads = Gauge(
            "pagedserve:worker_cpu_threads", "OpenMP threads this rank's forward uses now (a "
            "CPU worker; fewer while other load takes its cores).", labels,
            registry=self.registry)  # (labelled when set)
        # (labelled when set: a gauge never set, e.g. an unmeasured peak, is not exported)
        self.memory = {name: Gauge(f"pagedserve:worker_{name}", what, labels,
                                   registry=self.registry)
                       for name, what in (
                           ("weights_bytes", "Bytes of this rank's weights."),
                           ("kv_cache_bytes", "Bytes of this rank's KV cache."),
                           ("peak_activation_bytes", "Peak bytes of the activations of this "
                                                     "rank's largest (dummy) step."))}
        self._kv_tier: KVTierMetrics | None = None

    @property
    def kv_tier(self) -> KVTierMetrics:
        """The KV tier's metrics, registered at first use (a worker without the tier
        exports none)."""
        if self._kv_tier is None:
            self._kv_tier = KVTierMetrics(self.registry, self.rank)
        return self._kv_tier

    def set_cpu_threads(self, threads: int) -> None:
        """The OpenMP threads the forward uses now (``cpu_threads.CpuPlan.threads``, lowered by
        the governor while other load takes the cores)."""
        self.cpu_threads.labels(self.rank).set(threads)

    def set_memory(self, report) -> None:
        """Set the memory gauges from a ``memory_report.MemoryReport``."""
        self.memory["weights_bytes"].labels(self.rank).set(report.weights_bytes)
        self.memory["kv_cache_bytes"].labels(self.rank).set(report.kv_cache_bytes)
        if report.peak_activation_bytes is not None:  # (a single CPU rank: not measured)
            self.memory["peak_activation_bytes"].labels(self.rank).set(
                report.peak_activation_bytes)

    def observe_step(self, seconds: float, num_tokens: int, num_requests: int) -> None:
        """One step that computed ``num_tokens`` tokens of ``num_requests`` sequences."""
        if num_requests == 0:
            return  # a step that only dropped finished requests
        self.step_seconds.observe(seconds)
        self.batch_tokens.observe(num_tokens)
        self.batch_requests.observe(num_requests)


STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5)


class KVTierMetrics:
    """The KV tier's metrics (``services/worker/kv_tier.py``), in a rank's registry:

    - ``pagedserve:kv_offload_store_seconds{rank}`` / ``..._load_seconds{rank}``: time to write
      / read and check one block file, seconds;
    - ``pagedserve:kv_offload_store_failures_total{rank,reason}``: errors that turned writing
      off (reason: the errno's name, e.g. ENOSPC);
    - ``pagedserve:kv_offload_load_failures_total{rank,reason}``: loads failed (missing,
      truncated, corrupt, foreign, error);
    - ``pagedserve:kv_offload_stores_dropped_total{rank}``: blocks not stored because the
      writer's queue was full;
    - ``pagedserve:kv_offload_writes_enabled{rank}``: 1 while the tier writes, 0 once off.
    """

    def __init__(self, registry: CollectorRegistry, rank: str):
        labels = ["rank"]
        self.rank = rank
        self.store_seconds = Histogram(
            "pagedserve:kv_offload_store_seconds", "Time to write one KV block file (s).",
            labels, buckets=STORE_BUCKETS, registry=registry).labels(rank)
        self.load_seconds = Histogram(
            "pagedserve:kv_offload_load_seconds", "Time to read and check one KV block file "
            "(s).", labels, buckets=STORE_BUCKETS, registry=registry).labels(rank)
        self.store_failures = Counter(
            "pagedserve:kv_offload_store_failures_total", "Errors that turned writing KV block "
            "files off, by errno name.", [*labels, "reason"], registry=registry)
        self.load_failures = Counter(
            "pagedserve:kv_offload_load_failures_total", "KV block files that failed to load, "
            "by reason (missing, truncated, corrupt, foreign, error).", [*labels, "reason"],
            registry=registry)
        self.dropped = Counter(
            "pagedserve:kv_offload_stores_dropped_total", "KV blocks not stored: the writer's "
            "queue was full.", labels, registry=registry).labels(rank)
        self.writes_enabled = Gauge(
            "pagedserve:kv_offload_writes_enabled", "1 while the KV tier writes block files, 0 "
            "once an error turned writing off.", labels, registry=registry).labels(rank)
        self.writes_enabled.set(1)

    def observe_store(self, seconds: float) -> None:
        self.store_seconds.observe(seconds)

    def observe_load(self, seconds: float) -> None:
        self.load_seconds.observe(seconds)

    def store_failed(self, reason: str) -> None:
        self.store_failures.labels(self.rank, reason).inc()

    def load_failed(self, reason: str) -> None:
        self.load_failures.labels(self.rank, reason).inc()

    def stores_dropped(self, n: int) -> None:
        self.dropped.inc(n)

    def set_writes_enabled(self, enabled: bool) -> None:
        self.writes_enabled.set(1 if enabled else 0)
