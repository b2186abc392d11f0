"""``pagedserve serve`` keeps its services running: the restart policy (pure, fake clock), the
supervision loop over fake processes, and the real stack with its worker SIGKILLed."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

import grpc
import psutil
import pytest

from pagedserve_client import Client
from services.cli.supervision import RestartPolicy, ServeMetrics, supervise
from services.common.ports import free_port, free_port_range
from tests.e2e.test_serve import CLI
from tests.helpers import make_servable_tiny_llama


# ---- the policy and the loop, without processes ----------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_to_the_cap_then_gives_up_past_max_restarts():
    clock = FakeClock()
    policy = RestartPolicy(max_restarts=6, window=600, base_delay=1, max_delay=8, clock=clock)
    delays = []
    for _ in range(7):
        delays.append(policy.on_crash())
        clock.now += 1
    assert delays == [1, 2, 4, 8, 8, 8, None]


def test_crashes_older_than_the_window_are_forgotten():
    clock = FakeClock()
    policy = RestartPolicy(max_restarts=2, window=60, clock=clock)
    assert [policy.on_crash(), policy.on_crash()] == [1, 2]
    clock.now += 60  # both crashes leave the window: the backoff starts over
    assert policy.recent_crashes == 0
    assert [policy.on_crash(), policy.on_crash(), policy.on_crash()] == [1, 2, None]
    for _ in range(10):  # one crash a minute never gives up
        clock.now += 61
        assert policy.on_crash() == 1


def test_max_restarts_zero_gives_up_at_the_first_crash():
    assert RestartPolicy(max_restarts=0, clock=FakeClock()).on_crash() is None


@pytest.mark.parametrize("kwargs", [{"max_restarts": -1}, {"window": 0},
                                    {"base_delay": 5, "max_delay": 1}])
def test_policy_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)


class FakeProc:
    def __init__(self, exits_with: int | None = None) -> None:
        self.returncode = exits_with

    def poll(self) -> int | None:
        return self.returncode


def test_supervise_restarts_and_counts_until_a_service_gives_up(capsys):
    procs = {"worker": FakeProc(-9), "scheduler": FakeProc(), "router": FakeProc()}
    spawned = []

    def spawn(name):  # every restarted worker crashes at once with code 1
        spawned.append(name)
        return FakeProc(1)

    policies = {n: RestartPolicy(max_restarts=2, window=60, base_delay=0, max_delay=0)
                for n in procs}
    metrics = ServeMetrics()
    assert supervise(procs, spawn, policies, metrics, poll=0.001) == 1
    assert spawned == ["worker", "worker"]
    assert metrics.registry.get_sample_value("pagedserve:service_restarts_total",
                                             {"service": "worker"}) == 2
    assert metrics.registry.get_sample_value("pagedserve:service_restarts_total",
                                             {"service": "router"}) == 0
    err = capsys.readouterr().err
    assert "worker exited with code -9; restarting it in 0s (restart 1 of at most 2 within 60s)" \
        in err
    assert ("worker exited with code 1 (3 exits within 60s, more than --max-restarts 2 allows; "
            "giving up)") in err


def test_supervise_with_max_restarts_zero_exits_at_the_first_crash(capsys):
    procs = {"worker": FakeProc(), "scheduler": FakeProc(3), "router": FakeProc()}
    policies = {n: RestartPolicy(max_restarts=0) for n in procs}
    assert supervise(procs, lambda n: pytest.fail("restarted"), policies, ServeMetrics()) == 1
    assert "scheduler exited with code 3 (--max-restarts 0)" in capsys.readouterr().err


# ---- the real stack -----------------------------------------------------------------------
class Serve:
    """``pagedserve serve`` as a subprocess; its stderr (and its children's) collected in
    ``lines``. ``stop()`` kills it and every process it started, whatever state they are in."""

    def __init__(self, model: str, *flags: str) -> None:
        self.port = free_port()
        self.metrics_base = free_port_range(4)  # scheduler, router, worker rank 0, serve
        self.address = f"127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self.pids: set[int] = set()  # every descendant seen, to check none outlives serve
        self.proc = subprocess.Popen(
            CLI + ["serve", "--port", str(self.port), "--scheduler-port", str(free_port()),
                   "--worker-port", str(free_port()), "--http-port", "-1",
                   "--metrics-port", str(self.metrics_base), "--model", model,
                   "--dtype", "float32", "--kv-cache-memory", "32MiB",
                   "--shutdown-timeout", "5", "--log-level", "WARNING", *flags],
            stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for_line(self, pattern: str, timeout: float, after: int = 0) -> int:
        """Index of the first line from ``after`` on that matches ``pattern``."""
        deadline = time.monotonic() + timeout
        while True:
            for i in range(after, len(self.lines)):
                if re.search(pattern, self.lines[i]):
                    return i
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{''.join(self.lines)}"
            assert self.proc.poll() is None, \
                f"serve exited ({self.proc.returncode}):\n{''.join(self.lines)}"
            time.sleep(0.2)

    def children(self) -> dict[str, psutil.Process]:
        """serve's live children by service name; records every descendant's pid."""
        me = psutil.Process(self.proc.pid)
        self.pids |= {p.pid for p in me.children(recursive=True)}
        out = {}
        for child in me.children():
            cmd = child.cmdline()
            out[cmd[cmd.index("services.cli") + 1]] = child
        return out

    def restarts(self, service: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_base + 3}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        m = re.search(rf'^pagedserve:service_restarts_total{{service="{service}"}} (\S+)$',
                      text, re.M)
        assert m, text
        return float(m.group(1))

    def assert_no_descendant_left(self, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while alive := [p for p in self.pids if _alive(p)]:
            assert time.monotonic() < deadline, f"processes outlived serve: {alive}"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for pid in self.pids:
            if _alive(pid):
                psutil.Process(pid).kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def tiny_model(tmp_path):
    # a long context, so the streams below are still running when the worker dies
    return make_servable_tiny_llama(tmp_path / "tiny", max_position_embeddings=32768)


def _stream_until_failure(address: str, started: threading.Event, errors: list) -> None:
    try:
        with Client(address) as c:
            for _ in c.stream(prompt_token_ids=[5, 6, 7], ignore_eos=True):
                started.set()
    except grpc.RpcError as e:
        errors.append(e.code())


@pytest.mark.slow
def test_worker_killed_mid_stream_is_restarted_and_counted(tiny_model):
    serve = Serve(tiny_model)
    try:
        serve.wait_for_line("pagedserve: serving on", 180)
        errors: list = []
        started = [threading.Event() for _ in range(3)]
        streams = [threading.Thread(target=_stream_until_failure,
                                    args=(serve.address, e, errors)) for e in started]
        for t in streams:
            t.start()
        assert all(e.wait(30) for e in started), "no token streamed"
        worker = serve.children()["worker"]
        worker.kill()  # SIGKILL
        killed_at = time.monotonic()
        for t in streams:
            t.join(15)
        assert errors == [grpc.StatusCode.UNAVAILABLE] * 3
        first = serve.wait_for_line(r"worker exited with code -9; restarting it in 1s", 10)

        # the stack serves again without any action, within 30 s of the kill
        while True:
            try:
                with Client(serve.address, timeout=10) as c:
                    r = c.generate(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
                break
            except grpc.RpcError:
                assert time.monotonic() - killed_at < 30, "not serving again within 30 s"
                time.sleep(0.5)
        assert r.usage.completion_tokens == 4
        assert serve.restarts("worker") == 1
        assert serve.restarts("scheduler") == serve.restarts("router") == 0
        assert serve.children()["worker"].pid != worker.pid

        # SIGTERM while the next restart waits out its backoff (2 s): serve exits 0, cleanly
        serve.children()["worker"].kill()
        serve.wait_for_line(r"worker exited with code -9; restarting it in 2s", 10, first + 1)
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(30) == 0
        serve.assert_no_descendant_left()
    finally:
        serve.stop()


@pytest.mark.slow
def test_worker_crashing_at_every_restart_makes_serve_give_up(tiny_model):
    serve = Serve(tiny_model, "--max-restarts", "2", "--restart-window", "60")
    try:
        serve.wait_for_line("pagedserve: serving on", 180)
        children = serve.children()
        # every later start of the worker fails to load the model: it is gone
        shutil.rmtree(tiny_model)
        children["worker"].kill()
        assert serve.proc.wait(120) == 1
        serve.reader.join(10)  # serve's stderr read to its end
        text = "".join(serve.lines)
        assert "worker exited with code -9; restarting it in 1s" in text
        assert "worker exited with code 1; restarting it in 2s" in text
        assert ("worker exited with code 1 (3 exits within 60s, more than --max-restarts 2 "
                "allows; giving up)") in text
        serve.assert_no_descendant_left()
    finally:
        serve.stop()
