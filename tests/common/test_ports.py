"""free_port / free_port_range: bindable runs below the kernel's ephemeral range."""

from __future__ import annotations

import socket

from services.common import ports


def test_ports_are_free_and_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    for n in (1, 4):
        base = ports.free_port_range(n)
        assert ports._FLOOR <= base and base + n <= low
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
        finally:
            for s in socks:
                s.close()
    assert ports._FLOOR <= ports.free_port() < low


def test_a_taken_port_is_never_returned(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    draws = iter([taken, taken + 1 if taken + 1 < 60000 else taken - 1])
    monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws))
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65000)
    try:
        assert ports.free_port_range(1) != taken
    finally:
        held.close()
