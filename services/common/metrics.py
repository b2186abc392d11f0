"""Prometheus plumbing shared by the services: the ``--metrics-port`` flag and its HTTP server.

Every service instance keeps its own ``CollectorRegistry`` (so several services, or several test
stacks, can live in one process) and serves it on ``http://HOST:PORT/metrics`` from a
background thread (``prometheus_client``'s WSGI server). Metric names mirror vLLM's under the
``pagedserve:`` prefix (``pagedserve:num_requests_running``, ...).

Default ports: scheduler 9090, router 9091, worker rank r 9092 + r (``pagedserve serve
--metrics-port BASE`` shifts them all: BASE, BASE + 1, BASE + 2 + r).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from services.common.config import add_flag, int_in

log = logging.getLogger(__name__)

DISABLED = -1  # --metrics-port -1: no metrics server
SCHEDULER_PORT, ROUTER_PORT, WORKER_PORT = 9090, 9091, 9092
# --metrics-names choices (scheduler and router; the first is the default): our names, vLLM's,
# or both (docs/fleet.md)
METRICS_NAMES = ("pagedserve", "vllm", "both")

# Latency buckets in seconds, as vLLM's (TTFT/ITL/e2e span 1 ms .. minutes).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def add_metrics_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    """``--metrics-port`` (-1 = off, 0 = any free port) and ``--metrics-host``."""
    add_flag(p, "--metrics-port", type=int_in(DISABLED, 65535), default=default_port,
             help="Prometheus /metrics port (-1: off, 0: any free port)")
    add_flag(p, "--metrics-host", default=None,
             help="address the metrics server binds (default: the service's --host)")


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; ``port`` is the bound port (useful with port 0)."""

    port: int
    _httpd: WSGIServer

    def close(self) -> None:
        """Stop serving (the thread ends with the server)."""
        self._httpd.shutdown()
        self._httpd.server_close()


def start_metrics_server(registry: CollectorRegistry, host: str,
                         port: int) -> MetricsServer | None:
    """Serve ``registry`` on ``http://host:port/metrics``; ``None`` when ``port`` is -1.

    Raises:
        OSError: the port is taken (the message names it).
    """
    if port == DISABLED:
        return None
    try:
        httpd, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(f"--metrics-port {port} on {host}: {e.strerror or e}") from e
    bound = httpd.server_port
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(bound, httpd)
