"""A worker group spanning two hosts: greedy tokens equal one rank's (float32, exactly) through
router -> scheduler -> ranks, for PP=2 (one stage per host) and TP=2 (one shard per host); and
the remote rank killed mid-stream: in-flight requests end UNAVAILABLE, the scheduler reports
NOT_SERVING, and the group serves again once the remote host's launcher restarted its rank;
then (network namespaces only) the link to the remote host cut while idle: NOT_SERVING within
the timeout, serving again once the link is back.

The two hosts: this network namespace ("host A": the router, the scheduler and node 0's
launcher with rank 0) and a network namespace made here ("host B": node 1's launcher, started
with ``ip netns exec``), joined by a veth pair; each launcher is ``pagedserve worker --nnodes 2
--node-rank k --dist-init-addr A:PORT``, so the ranks meet over the veth link. Where network
namespaces cannot be made (not root, no ``ip``), ``test_two_hosts_netns`` skips with the reason
and ``test_two_hosts_loopback_addresses`` runs the same checks on one host, the ranks bound to
127.0.0.2 and 127.0.0.3.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
import psutil
import pytest

from pagedserve_client import Client
from services.common.grpc_utils import health_status
from services.common.ports import free_port, free_port_range
from services.worker import server as worker_server
from tests.parallel.conftest import (
    PROMPTS,
    WORKER_FLAGS,
    ParallelStack,
    reference_greedy,
    stack_greedy,
    stream_in_background,
    wait_for,
)
from tests.stack_harness import _args

pytestmark = pytest.mark.slow  # rank processes on two hosts, twice

MAX_TOKENS = 5
TIMEOUT = "4"  # --distributed-timeout: seconds a rank waits on a silent peer


@dataclass
class Hosts:
    """Two addresses the ranks bind to, and how to run a command on the second host."""

    a: str
    b: str
    prefix_b: list[str]  # argv prefix that runs a command on host B
    link: str = ""  # host A's end of the link to B (network namespaces only)


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=10)


def _make_netns() -> tuple[Hosts | None, str, list[list[str]]]:
    """(hosts, why not, clean-up commands): a namespace joined to this one by a veth pair."""
    tag = f"ps{os.getpid() % 100000}"
    net = 10 + os.getpid() % 200
    ns, va, vb = f"{tag}b", f"{tag}a", f"{tag}v"
    cleanup = [["ip", "netns", "del", ns], ["ip", "link", "del", va]]
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb, "netns", ns)
        _sh("ip", "addr", "add", f"10.213.{net}.1/24", "dev", va)
        _sh("ip", "link", "set", va, "up")
        for cmd in (["addr", "add", f"10.213.{net}.2/24", "dev", vb], ["link", "set", vb, "up"],
                    ["link", "set", "lo", "up"]):
            _sh("ip", "netns", "exec", ns, "ip", *cmd)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        for cmd in cleanup:
            subprocess.run(cmd, capture_output=True)
        return None, f"cannot make a network namespace here: {e} {detail.decode().strip()}", []
    return (Hosts(f"10.213.{net}.1", f"10.213.{net}.2", ["ip", "netns", "exec", ns], va), "",
            cleanup)


@pytest.fixture(scope="module")
def netns():
    hosts, why, cleanup = _make_netns()
    yield hosts, why
    for cmd in cleanup:
        subprocess.run(cmd, capture_output=True)


class TwoHostStack(ParallelStack):
    """Node 0's launcher here (``supervisor``), node 1's in a subprocess on host B
    (``remote``), the scheduler listing both hosts' ranks, and the router."""

    def __init__(self, model: str, hosts: Hosts, tp: int, pp: int):
        self.hosts, world = hosts, tp * pp
        port, rendezvous = free_port_range(world), free_port()
        self.common = ["--port", str(port), "--tensor-parallel-size", str(tp),
                       "--pipeline-parallel-size", str(pp), "--model", model, *WORKER_FLAGS,
                       "--distributed-timeout", TIMEOUT, "--metrics-port", "-1", "--nnodes", "2",
                       "--dist-init-addr", f"{hosts.a}:{rendezvous}"]
        super().__init__(model, tp, pp)
        self.worker_args = _args(worker_server, [*self.common, "--host", hosts.a,
                                                 "--node-rank", "0"])
        from services.cli.ranks import RankSupervisor
        self.supervisor = RankSupervisor(self.worker_args, base_delay=0.1)
        per_host = world // 2
        self.scheduler_args.workers = ",".join(
            [f"{h}:{port + i}" for h in (hosts.a, hosts.b) for i in range(per_host)])
        self.remote: subprocess.Popen | None = None

    async def _start(self):
        self.remote = subprocess.Popen(
            [*self.hosts.prefix_b, sys.executable, "-m", "services.cli", "worker", *self.common,
             "--host", self.hosts.b, "--node-rank", "1", "--max-restarts", "10"],
            start_new_session=True)
        await super()._start()

    def remote_ranks(self) -> list[psutil.Process]:
        """Node 1's rank processes (children of its launcher)."""
        assert self.remote is not None
        return psutil.Process(self.remote.pid).children()

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            if self.remote is not None:
                self.remote.send_signal(signal.SIGTERM)
                try:
                    self.remote.wait(20)
                except subprocess.TimeoutExpired:
                    self.remote.kill()
                    self.remote.wait()


def _kill_remote_rank_mid_stream(stack: TwoHostStack, expected: list[int]) -> None:
    health = lambda: asyncio.run(health_status(stack.scheduler_address, 1.0))  # noqa: E731
    t, errors = stream_in_background(stack.address)
    [rank] = stack.remote_ranks()
    rank.kill()
    killed_at = time.monotonic()
    t.join(20)
    assert not t.is_alive(), "the in-flight request never ended"
    assert errors and errors[0][0] == grpc.StatusCode.UNAVAILABLE, errors
    assert errors[0][1] - killed_at < float(TIMEOUT) + 3, "not failed within the timeout"
    wait_for(lambda: health() == "NOT_SERVING", 5, "scheduler NOT_SERVING")
    wait_for(lambda: health() == "SERVING", 90, "scheduler serving again")
    with Client(stack.address) as c:
        r = c.generate(prompt_token_ids=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                       ignore_eos=True)
    assert list(r.token_ids) == expected


def _cut_the_link_while_idle(stack: TwoHostStack, expected: list[int]) -> None:
    """Host B unreachable (its link down), no rank dead: the heartbeat ends the ranks on both
    sides within the timeout, the scheduler turns NOT_SERVING, and once the link is back the
    hosts' launchers restart their ranks, which meet again."""
    health = lambda: asyncio.run(health_status(stack.scheduler_address, 1.0))  # noqa: E731
    _sh("ip", "link", "set", stack.hosts.link, "down")
    try:
        wait_for(lambda: health() == "NOT_SERVING", float(TIMEOUT) + 5, "NOT_SERVING (cut)")
    finally:
        _sh("ip", "link", "set", stack.hosts.link, "up")
    wait_for(lambda: health() == "SERVING", 90, "scheduler serving again (link back)")
    assert stack_greedy(stack, PROMPTS[:1], MAX_TOKENS) == [expected]


def _check_two_hosts(model: str, hosts: Hosts) -> None:
    expected = reference_greedy(model, PROMPTS, MAX_TOKENS)
    for tp, pp in ((1, 2), (2, 1)):
        stack = TwoHostStack(model, hosts, tp, pp).start()
        try:
            assert stack_greedy(stack, PROMPTS, MAX_TOKENS) == expected, (tp, pp)
            if pp == 2:
                _kill_remote_rank_mid_stream(stack, expected[0])
                if hosts.link:
                    _cut_the_link_while_idle(stack, expected[0])
        finally:
            stack.stop()


def test_two_hosts_netns(tiny_model, netns):
    hosts, why = netns
    if hosts is None:
        pytest.skip(why + " (test_two_hosts_loopback_addresses runs instead)")
    _check_two_hosts(tiny_model, hosts)


def test_two_hosts_loopback_addresses(tiny_model, netns):
    if netns[0] is not None:
        pytest.skip("network namespaces work here: test_two_hosts_netns covers two hosts")
    _check_two_hosts(tiny_model, Hosts("127.0.0.2", "127.0.0.3", []))
