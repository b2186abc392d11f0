"""Free TCP ports on 127.0.0.1, for rendezvous addresses, benchmarks and tests.

Ports are drawn below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``): a port
found free there can still be taken before its listener binds, but only by another explicit
bind, never by the source port of some outgoing connection (gloo, gRPC and HTTP clients open
many), which is how a port picked from the whole range used to vanish between check and use.
"""

from __future__ import annotations

import random
import socket

_FLOOR = 10000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """An unused TCP port on 127.0.0.1, below the ephemeral range (free when this returns,
    not reserved)."""
    return free_port_range(1)


def free_port_range(n: int, tries: int = 200) -> int:
    """A base port such that ``base .. base + n - 1`` are all free on 127.0.0.1 now (e.g. a
    ``--port`` for n worker ranks, or a ``--metrics-port`` BASE for ``serve``), all below the
    ephemeral range.

    Raises:
        RuntimeError: no such run of ports found in ``tries`` random attempts.
    """
    high = _ephemeral_low() - n
    if high <= _FLOOR:
        high = 60000 - n  # an unusual ephemeral range: fall back to the whole space
    for _ in range(tries):
        base = random.randrange(_FLOOR, high)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports on 127.0.0.1")
