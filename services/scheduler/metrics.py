"""The scheduler's Prometheus metrics, named as vLLM's under ``pagedserve:``.

Read at scrape time from the core ``Scheduler`` (no bookkeeping of their own):

- gauges ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (used KV
  blocks / all blocks, 0..1 as in vLLM);
- the info gauge ``cache_config_info{block_size, num_gpu_blocks, cache_dtype}`` = 1 (vLLM's;
  ``num_gpu_blocks`` is the KV cache's block count on a CPU too), and ours,
  ``model_config_info{dtype, quantization}`` = 1 (how the weights are stored);
- counters ``num_preemptions_total``, ``prefix_cache_queries_total`` and
  ``prefix_cache_hits_total{tier}`` (tokens looked up / found at admission; ``tier`` ``ram``:
  in the KV cache, ``disk``: in the KV tier on disk, loaded; their sum is vLLM's count);
- the KV tier on disk (with the workers' ``--kv-offload-dir``): gauges ``kv_offload_blocks``,
  ``kv_offload_bytes`` and ``kv_offload_max_bytes`` (the index: every rank's files),
  counters ``kv_offload_evictions_total``, ``kv_offload_stores_total`` (blocks sent to be
  written), ``kv_offload_loads_total`` and ``kv_offload_loads_failed_total`` (the worker's
  metrics say why), and the histogram ``kv_offload_load_wait_seconds`` (a load scheduled ->
  back from every rank: what a request waits for its prefix);
- speculative decoding (with ``--speculative-config``), vLLM's counters
  ``spec_decode_num_drafts_total`` (request steps that verified drafts),
  ``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total`` and
  ``spec_decode_num_accepted_tokens_per_pos_total{position}``; a step's n tokens (accepted
  drafts and the sampled one) count as n inter-token latencies of 1/n of the gap each;
- beam search: a search counts its prompt and its k hypotheses' tokens once, when it ends (it
  has no first token or inter-token latency); gauge ``kv_cache_shared_blocks`` (blocks more
  than one table lists: prefix hits, n > 1, beams) and counter ``beam_blocks_copied_total``
  (copy-on-write copies).

Observed by the engine loop (``SchedulerMetrics.observe_*``), all times ``time.monotonic()``
seconds as the scheduler sees them:

- LoRA (vLLM's info gauge) ``lora_requests_info{running_lora_adapters, waiting_lora_adapters,
  max_lora}`` whose value is the scrape's Unix time (the adapters as comma-separated names,
  sorted); and ours, counter ``lora_requests_total{lora_name}`` (requests that arrived naming
  each adapter).

- counters ``prompt_tokens_total`` (when a request's first token comes, i.e. its prefill is
  done), ``generation_tokens_total``, ``request_success_total{finished_reason}``
  (stop | length | abort);
- histograms ``time_to_first_token_seconds`` (arrival → first token, once per request),
  ``inter_token_latency_seconds`` (between a request's consecutive tokens),
  ``e2e_request_latency_seconds`` (arrival → finish), ``request_queue_time_seconds`` (arrival
  → first scheduled) and ``iteration_tokens_total`` (tokens computed per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.metrics import ITL_BUCKETS, REQUEST_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS
from services.scheduler.outputs import RequestUpdate, ScheduledStep
from services.scheduler.scheduler import Scheduler

PREFIX = "pagedserve:"


class _CoreCollector:
    """Gauges and counters the core scheduler already keeps, read when Prometheus scrapes."""

    def __init__(self, scheduler: Scheduler, labels: dict[str, str]):
        self.scheduler = scheduler
        self.labels = labels

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(PREFIX + name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def _lora_info(self) -> GaugeMetricFamily:
        """vLLM's ``lora_requests_info``: the adapters of the running and of the waiting
        requests, the limit, and the scrape time as its value."""
        s = self.scheduler

        def names(requests) -> str:
            return ",".join(sorted({r.lora.name for r in requests if r.lora is not None}))

        g = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                              labels=["running_lora_adapters", "waiting_lora_adapters",
                                      "max_lora"])
        g.add_metric([names(s.running), names(s.waiting), str(s.config.max_loras)], time.time())
        return g

    def _kv_tier(self):
        tier = self.scheduler.block_manager.tier
        if tier is None:
            return
        index = tier.index
        yield self._gauge("kv_offload_blocks", "Blocks the KV tier on disk holds (the index).",
                          index.num_blocks)
        yield self._gauge("kv_offload_bytes", "Bytes the KV tier's blocks take, every rank's "
                          "files.", index.num_bytes)
        yield self._gauge("kv_offload_max_bytes", "The KV tier's size (--kv-offload-size).",
                          index.max_blocks * index.bytes_per_block)
        yield self._counter("kv_offload_evictions", "KV tier blocks evicted (files deleted).",
                            index.num_evictions_total)
        yield self._counter("kv_offload_stores", "Blocks sent to the workers to be written to "
                            "the KV tier.", tier.num_stores_total)
        yield self._counter("kv_offload_loads", "Blocks the workers were asked to read from "
                            "the KV tier.", tier.num_loads_total)
        yield self._counter("kv_offload_loads_failed", "KV tier loads that failed on a rank "
                            "(the block was computed instead).", tier.num_load_failures_total)

    def collect(self):
        s = self.scheduler
        yield self._gauge("num_requests_running", "Requests in the running set.", s.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                          s.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                          s.block_manager.usage)
        yield self._counter("num_preemptions", "Preemptions (by recompute).",
                            s.num_preemptions_total)
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            s.prefix_cache_queries_total)
        hits = CounterMetricFamily(PREFIX + "prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache, by tier (ram: the "
                                   "KV cache, disk: the KV tier on disk).",
                                   labels=[*self.labels, "tier"])
        tier_hits = s.prefix_cache_tier_hits_total
        hits.add_metric([*self.labels.values(), "ram"], s.prefix_cache_hits_total - tier_hits)
        hits.add_metric([*self.labels.values(), "disk"], tier_hits)
        yield hits
        yield from self._kv_tier()
        yield self._gauge("kv_cache_shared_blocks",
                          "KV blocks listed by more than one block table (prefix cache hits, "
                          "n > 1 choices, beams).", s.block_manager.num_shared_blocks)
        yield self._counter("beam_blocks_copied",
                            "KV blocks copied on write (a beam writing into a block another "
                            "beam still reads).", s.num_blocks_copied_total)
        yield self._lora_info()
        spec = s.config.speculative
        if spec is None:
            return
        stats = s.spec_stats
        yield self._counter("spec_decode_num_drafts",
                            "Request steps that verified draft tokens.", stats.num_drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens verified.",
                            stats.num_draft_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            stats.num_accepted_tokens)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by draft position (0-based).",
                                      labels=[*self.labels, "position"])
        counts = stats.accepted_per_position
        for i in range(spec.num_speculative_tokens):
            per_pos.add_metric([*self.labels.values(), str(i)],
                               counts[i] if i < len(counts) else 0)
        yield per_pos


@dataclass(slots=True)
class _Timing:
    arrival: float  # seconds (monotonic)
    last_token: float | None = None  # when the latest token came; None before the first


class SchedulerMetrics:
    """The scheduler's metrics in their own registry (serve it with ``start_metrics_server``).

    Args:
        scheduler: the core scheduler whose state the gauges read.
        model_name: value of the ``model_name`` label on every metric, as in vLLM.
        cache_config: the labels of vLLM's info gauge ``cache_config_info`` (value 1):
            ``block_size``, ``num_gpu_blocks`` (the KV cache's block count, on a CPU too) and
            ``cache_dtype`` (``--kv-cache-dtype``); None = no such gauge.
        model_config: the labels of the info gauge ``model_config_info`` (value 1): ``dtype``
            (the compute dtype) and ``quantization`` (how the linear weights are stored:
            ``int8``, ``w8a8``, ``gguf`` or ``none``); None = no such gauge.
    """

    def __init__(self, scheduler: Scheduler, model_name: str = "",
                 cache_config: dict[str, str] | None = None,
                 model_config: dict[str, str] | None = None):
        self.registry = CollectorRegistry()
        if cache_config is not None:
            Gauge(PREFIX + "cache_config_info", "Information of the KV cache config (value 1).",
                  list(cache_config), registry=self.registry).labels(**cache_config).set(1)
        if model_config is not None:
            Gauge(PREFIX + "model_config_info", "How the model's weights are stored (value 1).",
                  list(model_config), registry=self.registry).labels(**model_config).set(1)
        labels = {"model_name": model_name}
        names = list(labels)
        self.registry.register(_CoreCollector(scheduler, labels))
        reg = self.registry

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, [*names, *extra], registry=reg)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=reg)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.").labels(
            model_name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(
            model_name)
        self._success = counter("request_success", "Requests finished, by finish_reason.",
                                ["finished_reason"])
        self._lora_requests = counter("lora_requests", "Requests that arrived naming a LoRA "
                                      "adapter, by adapter.", ["lora_name"])
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token (s).",
                              TTFT_BUCKETS).labels(model_name)
        self.itl = histogram("inter_token_latency_seconds", "Between consecutive tokens (s).",
                             ITL_BUCKETS).labels(model_name)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish (s).",
                             REQUEST_BUCKETS).labels(model_name)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduled (s).",
                                    REQUEST_BUCKETS).labels(model_name)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per step.",
                                          TOKEN_BUCKETS).labels(model_name)
        self.kv_offload_load_wait = histogram(
            "kv_offload_load_wait_seconds", "A KV tier load scheduled to back from every "
            "rank (s).", ITL_BUCKETS).labels(model_name)
        self._scheduler = scheduler
        self._model_name = model_name
        self._timings: dict[str, _Timing] = {}
        self._queued: set[str] = set()  # arrived, not yet scheduled

    def observe_arrival(self, request_id: str, now: float, lora_name: str | None = None
                        ) -> None:
        """A request was accepted into the waiting queue at ``now`` (naming LoRA adapter
        ``lora_name``, or None)."""
        if lora_name is not None:
            self._lora_requests.labels(self._model_name, lora_name).inc()
        self._timings[request_id] = _Timing(now)
        self._queued.add(request_id)

    def observe_scheduled(self, out: ScheduledStep, now: float) -> None:
        """A step was scheduled: its token count, and the queue time of first-time requests."""
        self.iteration_tokens.observe(out.total_num_scheduled_tokens)
        for new in out.new_requests:
            if new.request_id in self._queued:  # not again when resumed after preemption
                self._queued.discard(new.request_id)
                self.queue_time.observe(now - self._timings[new.request_id].arrival)

    def observe_updates(self, updates: list[RequestUpdate], now: float) -> None:
        """Tokens and finishes published at ``now`` (after a step, or an abort), and the KV
        tier loads back since the last call."""
        tier = self._scheduler.block_manager.tier
        if tier is not None and tier.load_wait_seconds:
            for seconds in tier.load_wait_seconds:
                self.kv_offload_load_wait.observe(seconds)
            tier.load_wait_seconds.clear()
        for u in updates:
            t = self._timings.get(u.request_id)
            if t is None:
                continue
            if u.beams:  # (a beam search reports its prompt and hypotheses once, at the end)
                self.prompt_tokens.inc(u.num_prompt_tokens)
                self.generation_tokens.inc(sum(len(h.token_ids) for h in u.beams))
            if u.embedding is not None:  # (a pooling request: its prompt, once, at the end)
                self.prompt_tokens.inc(u.num_prompt_tokens)
            if u.new_token_ids:
                self.generation_tokens.inc(len(u.new_token_ids))
                if t.last_token is None:
                    self.ttft.observe(now - t.arrival)
                    self.prompt_tokens.inc(u.num_prompt_tokens)
                else:  # (n tokens at once, accepted drafts: n gaps of 1/n each)
                    n = len(u.new_token_ids)
                    for _ in range(n):
                        self.itl.observe((now - t.last_token) / n)
                t.last_token = now
            if u.finish_reason is not None:
                self._success.labels(self._model_name, str(u.finish_reason)).inc()
                self.e2e.observe(now - t.arrival)
                del self._timings[u.request_id]
                self._queued.discard(u.request_id)
