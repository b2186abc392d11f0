"""gRPC plumbing shared by the three services: server options, health, reflection, shutdown.

Health has two meanings, under two names of the standard ``grpc.health.v1.Health`` service:

- readiness, the overall status ``""`` and the service's own name (e.g.
  ``pagedserve.v1.GenerationService``): SERVING while the service can serve requests now — the
  worker once its model is loaded, the scheduler while it has a complete worker group, the
  router while at least one scheduler replica can serve; NOT_SERVING while draining. Load
  balancers, readiness probes, ``pagedserve health`` and ``pagedserve serve`` check this.
- liveness, ``LIVENESS``: SERVING from the moment the server answers until the process exits,
  whatever its dependencies do, so a liveness probe never restarts a service that only waits
  for its workers or its scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.decode_errors import DecodeErrorInterceptor

log = logging.getLogger(__name__)

# NOTE: explicit message-size limits (grpc's default receive limit is 4 MiB). A StepRequest for
# a full batch of new 8k-token prompts is ~256 * 8192 * 5 bytes ~ 10 MiB, hence 64 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # NOTE: gRPC's default lets the reconnect backoff grow to 120 s, so a scheduler that waited
    # through a worker's first start (two minutes) noticed the serving worker up to a minute
    # late; a retry every 2 s at most costs nothing on these links.
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# The health service name that reports liveness (see the module note); "" reports readiness.
LIVENESS = "liveness"
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


def run_service(name: str, coro) -> None:
    """Run a service's ``serve()`` coroutine on uvloop until it returns.

    A start-up error the user can fix (bad flag value, missing model, peer not reachable) ends
    the process with one line naming the service, not a traceback.
    """
    install_uvloop()
    try:
        asyncio.run(coro)
    except (ValueError, FileNotFoundError, TimeoutError, ConnectionError, RuntimeError) as e:
        log.debug("%s failed to start", name, exc_info=True)  # --log-level DEBUG: traceback
        raise SystemExit(f"pagedserve {name}: {e}") from None
    except KeyboardInterrupt:
        pass


def install_uvloop() -> None:
    """Use uvloop as the asyncio event loop policy (falls back silently where unavailable)."""
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        pass


async def new_server(host: str, port: int, *, tls=None, interceptors=(),
                     max_receive_bytes: int | None = None
                     ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Create a grpc.aio server bound to host:port with standard health checking. A unary
    request message that does not parse is answered INVALID_ARGUMENT, on every service
    (``decode_errors.DecodeErrorInterceptor``, after ``interceptors``).

    Args:
        tls: a ``services.common.tls.TLSConfig`` (TLS; mTLS when it has a CA bundle), or None
            for plaintext.
        interceptors: grpc.aio server interceptors (e.g. the router's API-key check), outermost
            first.
        max_receive_bytes: the largest request message accepted (larger ones are refused with
            RESOURCE_EXHAUSTED); None = ``MAX_MESSAGE_BYTES``, the internal links' limit.

    Returns:
        (server, bound port — useful with port 0 —, health servicer: readiness ``""``
        NOT_SERVING until the service calls ``set_serving``, ``LIVENESS`` SERVING).

    Raises:
        RuntimeError: the port could not be bound.
        ValueError: ``tls`` without a certificate and key.
    """
    options = SERVER_OPTIONS if max_receive_bytes is None else [
        o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"] + [
        ("grpc.max_receive_message_length", max_receive_bytes)]
    server = grpc.aio.server(options=options,
                             interceptors=[*interceptors, DecodeErrorInterceptor()])
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    health_servicer = health.aio.HealthServicer()
    # NOTE: grpc's HealthServicer starts with "" = SERVING; we are not, until start-up ends.
    await set_serving(health_servicer, False, [])
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, bound, health_servicer


async def set_serving(health_servicer, serving: bool, services: list[str]) -> None:
    """Set the readiness: the overall ("") and per-service health status (``LIVENESS`` is
    left as it is)."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *services]:
        await health_servicer.set(name, status)


def stop_event_on_signals() -> asyncio.Event:
    """An event set on SIGINT/SIGTERM, for a clean shutdown of the running loop."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, event.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    return event


async def health_status(address: str, timeout: float = 2.0, service: str = "",
                        credentials: grpc.ChannelCredentials | None = None) -> str:
    """The gRPC health status at ``address`` ("SERVING", "NOT_SERVING", ...), or
    "UNREACHABLE (<code>)" when nothing answers within ``timeout`` seconds.

    ``credentials``: TLS channel credentials (``TLSConfig.channel_credentials()``) for a
    service serving TLS; None = plaintext."""
    from services.common.tls import aio_channel
    try:
        async with aio_channel(address, credentials) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                    timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError as e:
        return f"UNREACHABLE ({e.code().name})"


async def check_health(address: str, timeout: float = 2.0, service: str = "",
                       credentials: grpc.ChannelCredentials | None = None) -> bool:
    """True when the gRPC health service at ``address`` answers SERVING within ``timeout`` s
    (``credentials`` as in ``health_status``)."""
    return await health_status(address, timeout, service, credentials) == "SERVING"
