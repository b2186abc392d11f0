"""Router ``--metrics-names vllm|both``: the gauges an inference gateway reads, on the endpoint
it sends HTTP to.

GIE's endpoint picker (and llm-d's, which is GIE's) and production-stack's router scrape the
pods they route to, at the serving port's ``/metrics`` as on a vLLM server. Those pods are
pagedserve's routers, while the queue and the KV cache live in the schedulers behind them, so
the router re-exports what its replicas last reported (the ``LoadReport`` every TokenBatch
carries) under vLLM's names, summed over the replicas taking requests:

- ``vllm:num_requests_waiting`` (gauge): requests queued in the schedulers, plus the router's
  own requests sent to a replica that has not reported them yet (``num_pending`` over
  ``running + waiting``), so a burst shows before the next report;
- ``vllm:num_requests_running`` (gauge): requests in the schedulers' running sets;
- ``vllm:kv_cache_usage_perc`` (gauge, 0..1) and its older name ``vllm:gpu_cache_usage_perc``:
  the mean of the replicas' KV cache usage (each replica's own fraction; replicas agree on the
  model, not necessarily on their cache sizes).

Every series carries ``model_name`` (the served name) and ``engine="0"`` as the scheduler's
``vllm:`` series do. With ``pagedserve`` (the default) nothing is added: the schedulers' own
metrics (``scheduler/metrics_names.py``) are the per-replica truth. LoRA's
``vllm:lora_requests_info`` is not re-exported: which adapters run and which wait is known
only in the schedulers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily

from services.common.pb.pagedserve.v1 import engine_pb2

VLLM_PREFIX = "vllm:"


class _Replica(Protocol):
    @property
    def load(self) -> engine_pb2.LoadReport: ...

    @property
    def num_pending(self) -> int: ...


class GatewayGauges:
    """A Prometheus collector of the replicas' queue and KV cache gauges under vLLM's names.

    Args:
        replicas: returns the replicas taking requests now (``ReplicaSet.available``), each
            with ``load`` (its latest ``LoadReport``) and ``num_pending`` (this router's
            requests in flight there); read at scrape time.
        model_name: returns the served model's name (``""`` before the engine info is known).
    """

    def __init__(self, replicas: Callable[[], Iterable[_Replica]],
                 model_name: Callable[[], str]):
        self.replicas = replicas
        self.model_name = model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=["model_name", "engine"])
        g.add_metric([self.model_name(), "0"], value)
        return g

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The gauges, from the replicas' latest reports."""
        loads = [(r.load, r.num_pending) for r in self.replicas()]
        running = sum(load.num_running for load, _ in loads)
        waiting = sum(load.num_waiting + max(0, pending - load.num_running - load.num_waiting)
                      for load, pending in loads)
        usage = sum(load.kv_cache_usage for load, _ in loads) / len(loads) if loads else 0.0
        yield self._gauge("num_requests_running", "Requests running in the schedulers behind "
                          "this router.", running)
        yield self._gauge("num_requests_waiting", "Requests waiting in the schedulers behind "
                          "this router (and sent, not yet reported).", waiting)
        for name in ("kv_cache_usage_perc", "gpu_cache_usage_perc"):
            yield self._gauge(name, "KV cache usage of the schedulers behind this router, mean "
                              "over the replicas (1 = full).", usage)
