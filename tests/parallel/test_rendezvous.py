"""The rendezvous at rank 0's store and the heartbeat, in one process (threads as ranks): ranks
meet and rank 0 learns their addresses; a store whose group is complete is not joined again;
a silent peer or a lost store is reported within the timeout."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from services.common.ports import free_port
from services.worker.parallel import rendezvous as rdv


def test_ranks_meet_and_a_complete_group_is_not_joined_again(monkeypatch, caplog):
    monkeypatch.setattr(rdv, "RENDEZVOUS_MIN_S", 3.0)
    port = free_port()
    caplog.set_level("INFO", logger=rdv.__name__)
    with ThreadPoolExecutor(3) as pool:
        stores = list(pool.map(lambda r: rdv.rendezvous("127.0.0.1", port, r, 3, 1.0,
                                                        f"host{r}:5005{r}"), range(3)))
    assert "the scheduler's --workers: host0:50050,host1:50051,host2:50052" in caplog.text
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="still belongs to an earlier group after 3s"):
        rdv.rendezvous("127.0.0.1", port, 1, 3, 1.0)  # a restarted rank, rank 0 still old
    assert time.monotonic() - t0 < 8
    del stores


def _beats(port: int, timeout: float) -> tuple[list, list[rdv.Heartbeat]]:
    lost: list = []
    beats = []
    for r in range(2):
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                              timeout=timedelta(seconds=timeout))
        beats.append(rdv.Heartbeat(store, r, 2, "g", timeout,
                                   on_lost=lambda why: lost.append((why, time.monotonic())))
                     .start())
    return lost, beats


def test_a_silent_peer_and_a_lost_store_are_noticed_within_the_timeout():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    lost, beats = _beats(port, 1.0)
    time.sleep(1.5)
    assert not lost, "live peers reported lost"
    beats[1].stop()  # rank 1 falls silent
    stopped = time.monotonic()
    beats[0].thread.join(3)
    assert lost and "rank 0: rank 1 sent no heartbeat for 1s" in lost[0][0]
    assert lost[0][1] - stopped < 1.0 + 0.5

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    lost, beats = _beats(port, 1.0)
    time.sleep(0.5)
    del master  # rank 0's process (the store) is gone
    for b in beats:
        b.thread.join(3)
    assert len(lost) == 2 and all("the group's store is unreachable" in w for w, _ in lost)
