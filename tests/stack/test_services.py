"""Every service serves grpc.health.v1; the router serves reflection; engine stats add up."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_every_service_is_serving(tiny):
    serving = health_pb2.HealthCheckResponse.SERVING
    worker = tiny.scheduler_args.workers
    assert _health(tiny.address) == serving
    assert _health(tiny.address, "pagedserve.v1.GenerationService") == serving
    assert _health(tiny.scheduler_address, "pagedserve.v1.EngineService") == serving
    assert _health(worker, "pagedserve.v1.WorkerService") == serving


def test_router_serves_reflection(tiny):
    with grpc.insecure_channel(tiny.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert "pagedserve.v1.GenerationService" in names and "grpc.health.v1.Health" in names


def test_engine_info_matches_the_worker(tiny):
    info = tiny.info()
    assert info.block_size == 16 and info.num_kv_blocks > 0
    assert info.dtype == "float32" and info.vocab_size == 49152
    s = tiny.stats()
    assert s.num_total_blocks == info.num_kv_blocks
