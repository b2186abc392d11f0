"""free_port / free_port_range: bindable runs below the kernel's ephemeral range."""

from __future__ import annotations

import socket

import pytest

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


def test_one_process_never_hands_out_a_port_twice(monkeypatch):
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setenv("PAGEDSERVE_PORT_SLICE", "0/1")
    draws = iter([20000, 20000, 20001, 20001, 20003])
    monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws))
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 32768)
    monkeypatch.setattr(ports.socket, "socket", _NoopSocket)
    assert [ports.free_port(), ports.free_port(), ports.free_port_range(2)] \
        == [20000, 20001, 20003]


class _NoopSocket:  # every port binds: only the handed-out set decides
    def bind(self, address):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("k", [0, 1, 2])
def test_slices_are_disjoint_and_inside_the_range(monkeypatch, k):
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setenv("PAGEDSERVE_PORT_SLICE", f"{k}/3")
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 32768)
    width = (32768 - ports._FLOOR) // 3
    for _ in range(50):
        base = ports.free_port_range(4)
        assert ports._FLOOR + k * width <= base and base + 4 <= ports._FLOOR + (k + 1) * width


@pytest.mark.parametrize("spec", ["1", "a/2", "2/2", "-1/2"])
def test_a_malformed_slice_is_refused(monkeypatch, spec):
    monkeypatch.setenv("PAGEDSERVE_PORT_SLICE", spec)
    with pytest.raises(ValueError, match="PAGEDSERVE_PORT_SLICE"):
        ports.free_port()
