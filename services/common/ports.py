"""Free TCP ports on 127.0.0.1, for rendezvous addresses, benchmarks and tests."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (the OS picks it; free when this returns, not reserved)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int, tries: int = 200) -> int:
    """A base port such that ``base .. base + n - 1`` are all free on 127.0.0.1 now (e.g. a
    ``--port`` for n worker ranks, or a ``--metrics-port`` BASE for ``serve``).

    Raises:
        RuntimeError: no such run of ports found in ``tries`` random attempts.
    """
    for _ in range(tries):
        base = random.randrange(20000, 60000 - n)
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
