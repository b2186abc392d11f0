"""``--metrics-names``: the scheduler's metrics under vLLM's names, for the gateways and
autoscalers that read a vLLM server's ``/metrics``.

- ``pagedserve`` (the default): ``pagedserve:NAME`` only, as before.
- ``vllm``: every metric vLLM also has as ``vllm:NAME`` with vLLM's labels and semantics; the
  metrics vLLM does not have (``kv_offload_*``, ``model_config_info``, ``kv_cache_shared_blocks``,
  ``beam_blocks_copied``, ``lora_requests_total``) stay ``pagedserve:NAME`` (a ``vllm:`` name
  promises vLLM's meaning).
- ``both``: every ``pagedserve:`` series, plus the ``vllm:`` ones.

The ``vllm:`` series are made at scrape time from the ``pagedserve:`` registry's families
(``VllmNames``): no metric is defined twice and the engine loop does nothing more per step.
Where they differ from ours (vLLM v1's ``vllm/v1/metrics/loggers.py``):

- an ``engine="0"`` label next to ``model_name`` (vLLM labels its series by engine core; one
  scheduler is one engine), and on ``cache_config_info``;
- ``prefix_cache_hits`` is one series, the sum over our ``tier`` label (vLLM has no KV tier
  label: a scraper that keeps the last sample of a name would otherwise read one tier);
- the names vLLM had before v1 renamed them, which gateways still read (production-stack's
  router: ``vllm_router/stats/engine_stats.py``; GIE before v0.5): ``vllm:gpu_cache_usage_perc``
  (= ``kv_cache_usage_perc``), ``vllm:gpu_prefix_cache_queries`` / ``..._hits`` (counters, as
  ``prefix_cache_queries`` / ``prefix_cache_hits``) and ``vllm:gpu_prefix_cache_hit_rate`` (gauge,
  hits / queries since start, 0 before any query; vLLM v0's was over blocks, ours over tokens).

Docs: docs/fleet.md, "Metrics for gateways and autoscalers" (the mapping table).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from services.common.metrics import METRICS_NAMES
from services.scheduler.metrics import PREFIX

VLLM_PREFIX = "vllm:"
ENGINE = "0"  # vLLM's `engine` label: the engine core's index (a scheduler is one engine)

# Our families (names without the prefix, counters without _total) that vLLM exports with the
# same meaning: GIE's model-server protocol, llm-d's scorers, production-stack's router read
# the first five.
VLLM_FAMILIES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info",
    "lora_requests_info", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
    "prompt_tokens", "generation_tokens", "request_success", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "iteration_tokens_total", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos"})
# vLLM's older names for a family, exported too (see the module docstring).
ALIASES = {"kv_cache_usage_perc": "gpu_cache_usage_perc",
           "prefix_cache_queries": "gpu_prefix_cache_queries",
           "prefix_cache_hits": "gpu_prefix_cache_hits"}
HIT_RATE = "gpu_prefix_cache_hit_rate"
_COLLAPSED = {"prefix_cache_hits": "tier"}  # family -> our label vLLM does not have (summed)


def _renamed(family: Metric, short: str, name: str) -> Metric:
    """``family`` (``pagedserve:SHORT``) as ``vllm:NAME``: samples renamed, ``engine`` added
    next to ``model_name`` (and on ``cache_config_info``), ``_COLLAPSED`` labels summed out."""
    out = Metric(VLLM_PREFIX + name, family.documentation, family.type, family.unit)
    drop = _COLLAPSED.get(short)
    merged: dict[tuple, float] = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k != drop}
        if "model_name" in labels or short == "cache_config_info":
            labels["engine"] = ENGINE
        sample_name = VLLM_PREFIX + name + s.name[len(family.name):]  # keeps _total, _bucket...
        if drop is None:
            out.samples.append(s._replace(name=sample_name, labels=labels))
            continue
        if s.name.endswith("_created"):  # (a sum of creation times means nothing)
            continue
        key = (sample_name, tuple(sorted(labels.items())))
        merged[key] = merged.get(key, 0.0) + s.value
    for (sample_name, labels), value in merged.items():
        out.add_sample(sample_name, dict(labels), value)
    return out


def _total(family: Metric) -> float:
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def vllm_families(families: Iterable[Metric], keep_ours: bool) -> Iterator[Metric]:
    """The ``vllm:`` families of ``families`` (a ``pagedserve:`` registry's ``collect()``), with
    the ``pagedserve:`` ones too when ``keep_ours``, else only those vLLM has no name for."""
    queries = hits = None
    for family in families:
        short = family.name.removeprefix(PREFIX)
        if short not in VLLM_FAMILIES:
            yield family
            continue
        if keep_ours:
            yield family
        yield _renamed(family, short, short)
        if short in ALIASES:
            yield _renamed(family, short, ALIASES[short])
        if short == "prefix_cache_queries":
            queries = family
        elif short == "prefix_cache_hits":
            hits = family
    if queries is not None and hits is not None:
        rate = Metric(VLLM_PREFIX + HIT_RATE, "Prefix cache hit rate since start: hits / "
                      "queries, in tokens (0 before any query; vLLM v0's name).", "gauge")
        model = next((s.labels for s in queries.samples if s.name.endswith("_total")), {})
        labels = {**model, "engine": ENGINE} if "model_name" in model else {}
        asked = _total(queries)
        rate.add_sample(rate.name, labels, _total(hits) / asked if asked else 0.0)
        yield rate


class VllmNames:
    """A collector serving another registry's ``pagedserve:`` families under vLLM's names.

    Args:
        source: the ``pagedserve:`` registry (``SchedulerMetrics.registry``).
        keep_ours: also serve every ``pagedserve:`` family (``--metrics-names both``).
    """

    def __init__(self, source: CollectorRegistry, keep_ours: bool):
        self.source = source
        self.keep_ours = keep_ours

    def collect(self) -> Iterator[Metric]:
        """The families, built now (on a scrape) from the source's."""
        return vllm_families(self.source.collect(), self.keep_ours)


def exposed_registry(registry: CollectorRegistry, names: str) -> CollectorRegistry:
    """The registry to serve on ``/metrics`` for ``--metrics-names names``: ``registry`` itself
    for ``pagedserve``, else a registry of one ``VllmNames`` over it.

    Raises:
        ValueError: ``names`` is not one of ``METRICS_NAMES`` (naming the flag).
    """
    if names not in METRICS_NAMES:
        raise ValueError(f"--metrics-names must be one of {', '.join(METRICS_NAMES)}, "
                         f"got {names!r}")
    if names == "pagedserve":
        return registry
    exposed = CollectorRegistry(auto_describe=False)
    exposed.register(VllmNames(registry, keep_ours=names == "both"))
    return exposed
