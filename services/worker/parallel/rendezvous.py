"""Where the ranks of a worker group meet, on one host or several: rank 0's TCPStore at
``--dist-init-addr HOST:PORT`` (or ``MASTER_ADDR`` / ``MASTER_PORT``), and the heartbeat that
ends a rank whose peer is gone.

Rendezvous (``rendezvous``): rank 0 opens the store (it listens on every interface of its
host, on PORT); every other rank connects to it, registers, and waits until rank 0 has seen
all ``world_size`` ranks. A rank that finds a store whose group is already complete (the
previous start's rank 0, not yet gone after a peer restarted) does not join it: it retries
until that rank 0 has exited and its successor opened a fresh store. The wait is at least
``RENDEZVOUS_MIN_S`` seconds (5 minutes), so hosts that start apart (a slow image pull, a pod
scheduled late) still meet; each rank also writes the address the scheduler reaches it on, and
rank 0 logs them all as the scheduler's ``--workers`` value.

Heartbeat (``Heartbeat``): each rank increments its own counter in the store every
``timeout / 5`` seconds and watches everyone else's. A peer whose counter has not moved for
``timeout`` seconds (dead, frozen, or cut off by the network), or a store that cannot be
reached (rank 0 gone), ends this rank with exit code 1: its process group is unusable, and
its supervisor restarts it to form a new group. Counters, not clocks: hosts' clocks differ.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)

RENDEZVOUS_MIN_S = 300.0  # the least a rank waits for its peers at start
_JOINED, _FORMED = "pagedserve/joined", "pagedserve/formed"


def rendezvous_address(init_addr: str | None) -> tuple[str, int]:
    """``--dist-init-addr HOST:PORT`` (``[v6]:PORT`` too), else ``MASTER_ADDR`` (default
    127.0.0.1) and ``MASTER_PORT``.

    Raises:
        ValueError: a malformed address, or neither it nor MASTER_PORT is set.
    """
    if init_addr:
        host, _, port = init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--dist-init-addr {init_addr!r}: must be HOST:PORT (rank 0's "
                             "host, and a free port there for the rendezvous)")
        return host.strip("[]"), int(port)
    env_port = os.environ.get("MASTER_PORT")
    if not env_port:
        raise ValueError("a worker rank of a group needs --dist-init-addr HOST:PORT (or "
                         "MASTER_ADDR and MASTER_PORT): the torch.distributed rendezvous "
                         "address of rank 0")
    return os.environ.get("MASTER_ADDR") or "127.0.0.1", int(env_port)


def rendezvous(host: str, port: int, rank: int, world_size: int, timeout_s: float,
               address: str = "") -> dist.TCPStore:
    """Meet the group's other ranks at rank 0's store ``host:port`` (see the module note);
    return this rank's connection to it, for ``init_process_group`` and the heartbeat.

    ``address``: where the scheduler reaches this rank (logged by rank 0 with the others').

    Raises:
        RuntimeError / DistStoreError: the peers did not all arrive within
            ``max(timeout_s, RENDEZVOUS_MIN_S)`` seconds.
    """
    wait_s = max(timeout_s, RENDEZVOUS_MIN_S)
    deadline = time.monotonic() + wait_s
    timeout = timedelta(seconds=wait_s)
    if rank == 0:
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        store.set("pagedserve/address/0", address)
        while int(store.add(_JOINED, 0)) < world_size - 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0: only {int(store.add(_JOINED, 0)) + 1} of "
                                   f"{world_size} ranks reached the rendezvous at {host}:{port} "
                                   f"within {wait_s:.0f}s")
            time.sleep(0.05)
        store.set(_FORMED, "1")
        addresses = [store.get(f"pagedserve/address/{r}").decode() for r in range(world_size)]
        log.info("all %d ranks met at %s:%d; the scheduler's --workers: %s", world_size, host,
                 port, ",".join(addresses))
        return store
    while True:
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
        store.set(f"pagedserve/address/{rank}", address)
        if int(store.add(_JOINED, 1)) <= world_size - 1:
            store.wait([_FORMED])
            return store
        del store  # a complete group's store: its rank 0 is about to go
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: the rendezvous at {host}:{port} still belongs to "
                               f"an earlier group after {wait_s:.0f}s")
        log.info("rank %d: the store at %s:%d holds an earlier group; waiting for a new rank 0",
                 rank, host, port)
        time.sleep(1.0)


def _exit_now(reason: str) -> None:
    log.error("%s; exiting so the rank group can restart", reason)
    logging.shutdown()
    os._exit(1)  # NOTE: the forward thread may be blocked in a collective on the dead peer


class Heartbeat:
    """A daemon thread proving this rank alive to its peers, and ending it when one is not.

    Args:
        store: a connection to the group's store (its own: the thread uses it alone).
        rank, world_size: this rank and the group's size.
        group_id: the group's id (its keys' prefix: a new group starts from fresh counters).
        timeout_s: seconds without a peer's beat before this rank gives up.
        on_lost: called with the reason once a peer or the store is lost (default: log and
            ``os._exit(1)``).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, group_id: str,
                 timeout_s: float, on_lost: Callable[[str], None] = _exit_now) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix = f"pagedserve/beat/{group_id}/"
        self.timeout_s, self.on_lost = timeout_s, on_lost
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        """Start beating; returns self."""
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop beating (a rank leaving on purpose)."""
        self.stopped.set()

    def _run(self) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in peers}  # rank -> (count, when it changed)
        interval = self.timeout_s / 5
        while not self.stopped.is_set():
            try:
                self.store.add(f"{self.prefix}{self.rank}", 1)
                counts = {r: int(self.store.add(f"{self.prefix}{r}", 0)) for r in peers}
            except (RuntimeError, OSError) as e:  # rank 0 (the store) gone or unreachable
                if not self.stopped.is_set():
                    self.on_lost(f"rank {self.rank}: the group's store is unreachable ({e})")
                return
            now = time.monotonic()
            for r, count in counts.items():
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] > self.timeout_s:
                    self.on_lost(f"rank {self.rank}: rank {r} sent no heartbeat for "
                                 f"{self.timeout_s:g}s (--distributed-timeout)")
                    return
            self.stopped.wait(interval)
