"""Every service listens on 127.0.0.1 unless told otherwise (issue 9)."""

from __future__ import annotations

import argparse


def test_services_bind_localhost_by_default(monkeypatch):
    """Internal services, metrics and HTTP listen on 127.0.0.1 unless told otherwise."""
    from services.router import server as router_server
    from services.scheduler import server as scheduler_server
    from services.worker import server as worker_server
    for var in ("PAGEDSERVE_HOST", "PAGEDSERVE_HTTP_HOST", "PAGEDSERVE_METRICS_HOST"):
        monkeypatch.delenv(var, raising=False)
    for module in (router_server, scheduler_server, worker_server):
        p = argparse.ArgumentParser()
        module.add_args(p)
        args = p.parse_args([])
        assert args.host == "127.0.0.1", module.__name__
        assert args.metrics_host is None  # = --host
    p = argparse.ArgumentParser()
    router_server.add_args(p)
    assert p.parse_args([]).http_host is None  # = --host
