"""Free TCP ports on 127.0.0.1, for rendezvous addresses, benchmarks and tests.

Ports are drawn below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``): a port
found free there can still be taken before its listener binds, but only by another explicit
bind, never by the source port of some outgoing connection (gloo, gRPC and HTTP clients open
many), which is how a port picked from the whole range used to vanish between check and use.

Two more rules keep pickers from taking each other's ports in the window between the pick and
the bind (a ``serve`` binds its router seconds after its ports were picked):

- one process never hands out the same port twice (until it has handed out most of its range);
- ``PAGEDSERVE_PORT_SLICE=K/N`` (0 <= K < N) restricts a process, and the processes it starts,
  to the K-th of N equal slices of the range, so that N cooperating processes (the test suite's
  pytest workers) never draw the same port.
"""

from __future__ import annotations

import os
import random
import socket

_FLOOR = 10000
_CEILING = 60000  # the top of the range where the ephemeral range cannot be used
_handed_out: set[int] = set()  # every port this process has returned


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice(low: int, high: int) -> tuple[int, int]:
    """``[low, high)`` narrowed to this process's ``PAGEDSERVE_PORT_SLICE``.

    Raises:
        ValueError: the variable is set but not ``K/N`` with 0 <= K < N.
    """
    spec = os.environ.get("PAGEDSERVE_PORT_SLICE")
    if not spec:
        return low, high
    try:
        k, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise ValueError(f"PAGEDSERVE_PORT_SLICE={spec!r}: expected K/N") from None
    if not 0 <= k < n:
        raise ValueError(f"PAGEDSERVE_PORT_SLICE={spec!r}: K must be in [0, N)")
    width = (high - low) // n
    return low + k * width, low + (k + 1) * width


def free_port() -> int:
    """An unused TCP port on 127.0.0.1, below the ephemeral range (free when this returns,
    not reserved)."""
    return free_port_range(1)


def free_ports(n: int) -> list[int]:
    """``n`` distinct unused TCP ports on 127.0.0.1 (``free_port`` each: e.g. a ``serve``'s
    router, scheduler and worker ports)."""
    return [free_port() for _ in range(n)]


def free_port_range(n: int, tries: int = 200) -> int:
    """A base port such that ``base .. base + n - 1`` are all free on 127.0.0.1 now (e.g. a
    ``--port`` for n worker ranks, or a ``--metrics-port`` BASE for ``serve``), all below the
    ephemeral range, inside this process's ``PAGEDSERVE_PORT_SLICE`` and none handed out by
    this process before.

    Raises:
        RuntimeError: no such run of ports found in ``tries`` random attempts.
        ValueError: ``PAGEDSERVE_PORT_SLICE`` is malformed.
    """
    high = _ephemeral_low()
    if high - n <= _FLOOR:
        high = _CEILING  # an unusual ephemeral range: fall back to the whole space
    low, high = _slice(_FLOOR, high)
    if len(_handed_out) > (high - low) // 2:
        _handed_out.clear()  # most of the slice used: old picks are long bound or gone
    for _ in range(tries):
        base = random.randrange(low, high - n + 1)
        run = range(base, base + n)
        if _handed_out.intersection(run):
            continue
        socks = []
        try:
            for port in run:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _handed_out.update(run)
        return base
    raise RuntimeError(f"no run of {n} free ports on 127.0.0.1 in [{low}, {high})")
