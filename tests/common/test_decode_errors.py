"""Every server ``new_server`` makes answers a unary request that does not parse with
INVALID_ARGUMENT (``decode_errors``), the scheduler's and the worker's as the router's."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.grpc_utils import new_server
from services.common.pb.pagedserve.v1 import engine_pb2, engine_pb2_grpc, worker_pb2_grpc

NOT_PROTOBUF = b"\x0a\xff\xff\xff"  # field 1, length-delimited, a length past the end


class _Scheduler(engine_pb2_grpc.EngineServiceServicer):
    async def GetEngineInfo(self, request, context):
        return engine_pb2.GetEngineInfoResponse(model="m")


@pytest.mark.parametrize("add, method", [
    (lambda server: engine_pb2_grpc.add_EngineServiceServicer_to_server(_Scheduler(), server),
     "/pagedserve.v1.EngineService/GetEngineInfo"),
    (lambda server: worker_pb2_grpc.add_WorkerServiceServicer_to_server(
        worker_pb2_grpc.WorkerServiceServicer(), server),
     "/pagedserve.v1.WorkerService/GetWorkerInfo"),
])
def test_an_unparsable_request_is_invalid_argument(add, method):
    async def main():
        server, port, _ = await new_server("127.0.0.1", 0)
        add(server)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary(method)  # raw bytes out and in
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(NOT_PROTOBUF, timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "is not a valid protobuf message" in err.value.details()
                if method.endswith("GetEngineInfo"):  # a good request is served as before
                    reply = await call(engine_pb2.GetEngineInfoRequest().SerializeToString(),
                                       timeout=10)
                    assert engine_pb2.GetEngineInfoResponse.FromString(reply).model == "m"
        finally:
            await server.stop(None)

    asyncio.run(main())
