"""The whole stack — worker, scheduler, router — in one background thread on ephemeral ports.

Every link is real gRPC over loopback; only the processes are shared, which keeps the tests
fast. ``tests/e2e`` runs the same services as separate processes through ``pagedserve serve``.
``MultiReplicaStack`` runs several worker + scheduler pairs behind one router.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import grpc

from services.common.pb.pagedserve.v1 import engine_pb2, engine_pb2_grpc
from services.common.tls import client_credentials, tls_from_args
from services.router import server as router_server
from services.scheduler import server as scheduler_server
from services.worker import server as worker_server


def _args(module, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_args(p)
    if "--metrics-port" in p._option_string_actions and "--metrics-port" not in argv:
        argv = ["--metrics-port", "0", *argv]  # a free port: stacks run side by side in tests
    return p.parse_args(argv)


def _channel(address: str, credentials=None) -> grpc.Channel:
    """A blocking channel: TLS with ``credentials`` (a stack started with --ssl-*), else
    plaintext."""
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials)


def _stats(address: str, credentials=None) -> engine_pb2.GetEngineStatsResponse:
    with _channel(address, credentials) as ch:
        return engine_pb2_grpc.EngineServiceStub(ch).GetEngineStats(
            engine_pb2.GetEngineStatsRequest(), timeout=10)


def _wait_idle(address: str, timeout: float, credentials=None
               ) -> engine_pb2.GetEngineStatsResponse:
    """Poll the scheduler at ``address`` until no request runs or waits (or ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        s = _stats(address, credentials)
        if (s.num_running == 0 and s.num_waiting == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


class _BackgroundStack:
    """An asyncio loop in a daemon thread that runs services' ``serve()`` coroutines.
    Subclasses implement ``_start`` (start the services) and ``stop``."""

    def __init__(self):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.address = ""
        self.http_url = ""  # the OpenAI-compatible API's base URL, e.g. http://127.0.0.1:PORT
        self._stop: asyncio.Event | None = None  # set: every service's serve() returns
        self._tasks: list = []  # the services' serve() tasks

    def _stop_services(self) -> None:
        """Set the stop event and wait (60 s at most) until every service task has ended."""
        async def stop():
            if self._stop is None:
                return
            self._stop.set()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._run(stop(), timeout=60)

    def _run(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _serve(self, module, args, stop: asyncio.Event) -> asyncio.Future:
        """Start ``module.serve(args)``; return its task once it is ready.

        Raises:
            RuntimeError: serve() returned before it was ready (or its own error).
        """
        ready = asyncio.Event()
        task = asyncio.ensure_future(module.serve(args, ready=ready, stop=stop))
        waiter = asyncio.ensure_future(ready.wait())
        done, _ = await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()  # (left pending, it would outlive the stack and fail its stop())
        if task in done:  # serve() returned or raised before it was ready
            task.result()
            raise RuntimeError(f"{module.__name__} stopped during start-up")
        return task

    def _router_started(self, router_args) -> None:
        self.address = f"127.0.0.1:{router_args.port}"
        if router_args.http_port > 0:
            scheme = "https" if getattr(router_args, "ssl_certfile", None) else "http"
            self.http_url = f"{scheme}://127.0.0.1:{router_args.http_port}"

    async def _start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        try:
            self._run(self._start())
        except BaseException:
            self.stop()
            raise
        return self

    def _close_loop(self) -> None:
        """Tear the loop down as ``asyncio.run`` does: cancel and await whatever is still
        running (so no task is destroyed pending at garbage collection), close async
        generators, stop the thread and close the loop.

        Raises:
            AssertionError: a task outlived the services' ``serve()`` — a service that does not
                end what it started (a stream's request iterator, a reader) on shutdown.
        """
        if not self._thread.is_alive():
            self._loop.close()
            return

        async def _cancel_rest():
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            if rest:
                await asyncio.wait(rest, timeout=10)
            await asyncio.get_running_loop().shutdown_asyncgens()
            return [t.get_coro() for t in rest]

        left = self._run(_cancel_rest(), timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
        assert not left, f"tasks still running after the services stopped: {left}"


class InProcessStack(_BackgroundStack):
    """Start with ``start()``, stop with ``stop()``; ``address`` is the router's gRPC address,
    ``http_url`` its OpenAI-compatible HTTP base URL.

    Args:
        model: model folder or .gguf (None = packaged SmolLM2).
        worker_argv / scheduler_argv / router_argv: extra flags for those services (e.g. the
            ``--ssl-*`` flags: the harness's own calls to the scheduler then use the
            scheduler's certificate and CA; ``http_url`` is https:// when the router has a
            certificate).
    """

    def __init__(self, model: str | None, worker_argv: list[str] = (),
                 scheduler_argv: list[str] = (), router_argv: list[str] = ()):
        model_flag = ["--model", model] if model else []
        self.worker_args = _args(worker_server, ["--port", "0", *model_flag, *worker_argv])
        self.scheduler_args = _args(scheduler_server, ["--port", "0", *scheduler_argv])
        # an ephemeral HTTP port unless router_argv says otherwise (--http-port -1: none)
        self.router_args = _args(router_server, ["--port", "0", "--http-port", "0", *model_flag,
                                                 *router_argv])
        super().__init__()
        self.scheduler_address = ""
        # the scheduler's own --ssl-* flags (if any) also serve for the introspection calls
        self.scheduler_credentials = client_credentials(tls_from_args(self.scheduler_args))

    async def _start(self):
        self._stop = asyncio.Event()
        for args, module in ((self.worker_args, worker_server),
                             (self.scheduler_args, scheduler_server),
                             (self.router_args, router_server)):
            self._tasks.append(await self._serve(module, args, self._stop))
            if module is worker_server:
                self.scheduler_args.workers = f"127.0.0.1:{args.port}"
            if module is scheduler_server:
                self.router_args.scheduler = f"127.0.0.1:{args.port}"
                self.scheduler_address = f"127.0.0.1:{args.port}"
        self._router_started(self.router_args)

    def stop(self) -> None:
        self._stop_services()
        self._close_loop()

    # ---- introspection for tests --------------------------------------------------------
    def stats(self) -> engine_pb2.GetEngineStatsResponse:
        """The scheduler's block and request counters."""
        return _stats(self.scheduler_address, self.scheduler_credentials)

    def info(self) -> engine_pb2.GetEngineInfoResponse:
        with _channel(self.scheduler_address, self.scheduler_credentials) as ch:
            return engine_pb2_grpc.EngineServiceStub(ch).GetEngineInfo(
                engine_pb2.GetEngineInfoRequest(), timeout=10)

    def wait_idle(self, timeout: float = 30.0) -> engine_pb2.GetEngineStatsResponse:
        """Wait until no request runs or waits (aborts propagate asynchronously)."""
        return _wait_idle(self.scheduler_address, timeout, self.scheduler_credentials)


class MultiReplicaStack(_BackgroundStack):
    """``replicas`` × (worker + scheduler) and one router routing across them, in one
    background thread on ephemeral ports. ``address`` / ``http_url`` are the router's;
    ``scheduler_addresses[i]`` replica i's scheduler; ``stop_replica(i)`` stops replica i's
    scheduler and worker (the router sees its stream break).

    Args:
        model: model folder or .gguf (None = packaged SmolLM2).
        replicas: number of scheduler replicas (each with its own worker).
        worker_argv / scheduler_argv / router_argv: extra flags for those services (router:
            e.g. ``["--routing-policy", "round_robin"]``).
    """

    def __init__(self, model: str | None, replicas: int = 2, worker_argv: list[str] = (),
                 scheduler_argv: list[str] = (), router_argv: list[str] = ()):
        model_flag = ["--model", model] if model else []
        self.worker_args = [_args(worker_server, ["--port", "0", *model_flag, *worker_argv])
                            for _ in range(replicas)]
        self.scheduler_args = [_args(scheduler_server, ["--port", "0", *scheduler_argv])
                               for _ in range(replicas)]
        self.router_args = _args(router_server, ["--port", "0", "--http-port", "0",
                                                 *model_flag, *router_argv])
        super().__init__()
        self._stops: list[asyncio.Event] = []  # one per replica, then the router's
        self._tasks: list[list] = []  # the serve tasks, per replica, then the router's
        self.scheduler_addresses: list[str] = []

    async def _start(self):
        for worker_args, scheduler_args in zip(self.worker_args, self.scheduler_args):
            stop = asyncio.Event()
            self._stops.append(stop)
            self._tasks.append([])
            self._tasks[-1].append(await self._serve(worker_server, worker_args, stop))
            scheduler_args.workers = f"127.0.0.1:{worker_args.port}"
            self._tasks[-1].append(await self._serve(scheduler_server, scheduler_args, stop))
            self.scheduler_addresses.append(f"127.0.0.1:{scheduler_args.port}")
        self.router_args.schedulers = ",".join(self.scheduler_addresses)
        self._stops.append(asyncio.Event())
        self._tasks.append([await self._serve(router_server, self.router_args,
                                              self._stops[-1])])
        self._router_started(self.router_args)

    async def _stop_group(self, i: int) -> None:
        self._stops[i].set()
        await asyncio.gather(*self._tasks[i], return_exceptions=True)

    def stop_replica(self, i: int) -> None:
        """Stop replica i's scheduler and worker, and wait until they have stopped."""
        self._run(self._stop_group(i), timeout=60)

    def stop(self) -> None:
        async def _stop():
            for i in reversed(range(len(self._stops))):  # the router first
                await self._stop_group(i)
        self._run(_stop(), timeout=120)
        self._close_loop()

    # ---- introspection for tests --------------------------------------------------------
    def stats(self, i: int) -> engine_pb2.GetEngineStatsResponse:
        """Replica i's scheduler counters."""
        return _stats(self.scheduler_addresses[i])

    def wait_idle(self, i: int, timeout: float = 30.0) -> engine_pb2.GetEngineStatsResponse:
        """Wait until no request runs or waits on replica i."""
        return _wait_idle(self.scheduler_addresses[i], timeout)
