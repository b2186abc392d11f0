"""The thread-count governor (services/worker/cpu_governor.py): its rule, and the governor
driven by a fake clock and fake run-queue / idle readings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.worker.cpu_governor import (
    WINDOW,
    ThreadGovernor,
    decide,
    governor_for,
    idle_seconds,
    run_delay_ns,
)
from services.worker.cpu_threads import CpuPlan


def test_the_rule():
    assert decide(2, 2, wait=0.95, idle=0.0) == 1  # a busy neighbour on 2 cores
    assert decide(2, 2, wait=0.2, idle=0.1) == 2  # the stack's own processes: stay
    assert decide(1, 2, wait=0.0, idle=0.0) == 1  # the neighbour still there
    assert decide(1, 2, wait=0.0, idle=0.9) == 2  # gone
    assert decide(16, 16, wait=1.1, idle=0.0) == 15  # one busy thread beside 16
    assert decide(16, 16, wait=6.4, idle=0.0) == 10
    assert decide(3, 16, wait=0.0, idle=5.3) == 8
    assert decide(1, 1, wait=3.0, idle=0.0) == 1
    assert decide(2, 2, wait=9.0, idle=0.0) == 1  # never below one


class Fake:
    """The governor's clock and readers, advanced by hand."""

    def __init__(self):
        self.now, self.wait_ns, self.idle = 0.0, 0, 0.0
        self.asked: list[list[int]] = []
        self.set: list[int] = []  # the counts the governor applied

    def run(self, seconds: float, wait: float, idle: float) -> None:
        self.now += seconds
        self.wait_ns += int(wait * seconds * 1e9)
        self.idle += idle * seconds

    def governor(self, threads=2):
        def wait_ns(tids):
            self.asked.append(list(tids))
            return self.wait_ns
        return ThreadGovernor(threads, list(range(100, 100 + threads)), {0, 1},
                              self.set.append, None, wait_ns, lambda cpus: self.idle,
                              lambda: self.now)


def test_threads_drop_beside_load_and_come_back_when_it_leaves():
    fake = Fake()
    gov = fake.governor()
    changes = []
    gov.on_change = changes.append
    for _ in range(3):  # alone: ~0.15 CPUs of wait from the stack's own processes
        gov.before_step()
        fake.run(0.1, wait=0.15, idle=0.05)
        gov.after_step()
    assert gov.threads == 2 and fake.set == []
    for _ in range(3):  # a busy neighbour
        gov.before_step()
        fake.run(0.1, wait=1.0, idle=0.0)
        gov.after_step()
    assert gov.threads == 1 and fake.set == [1] and changes == [1]
    assert fake.asked[-1] == [100]  # only the threads in use are watched
    for _ in range(6):  # still there: one thread runs, the other core is busy
        gov.before_step()
        fake.run(0.1, wait=0.0, idle=0.02)
        gov.after_step()
    assert gov.threads == 1
    for _ in range(3):  # gone
        gov.before_step()
        fake.run(0.1, wait=0.0, idle=0.9)
        gov.after_step()
    assert gov.threads == 2 and fake.set == [1, 2]


def test_a_window_needs_steps_and_an_idle_gap_starts_afresh():
    fake = Fake()
    gov = fake.governor()
    gov.before_step()
    fake.run(WINDOW / 2, wait=1.0, idle=0.0)
    gov.after_step()  # half a window: no decision yet
    assert gov.threads == 2
    fake.run(10.0, wait=0.0, idle=2.0)  # an idle server (no step) ...
    gov.before_step()  # ... is not part of the next window
    fake.run(WINDOW, wait=1.0, idle=0.0)
    gov.after_step()
    assert gov.threads == 1


def test_a_long_collapsed_step_decides_at_once():
    fake = Fake()
    gov = fake.governor()
    gov.before_step()
    fake.run(2.0, wait=1.0, idle=0.0)  # one step of 2 s beside a busy thread
    gov.after_step()
    assert gov.threads == 1


def test_run_runs_the_step_and_watches_even_when_it_raises():
    fake = Fake()
    gov = fake.governor()
    assert gov.run(lambda x: fake.run(1.0, wait=1.0, idle=0.0) or x * 2, 21) == 42
    assert gov.threads == 1

    def fails():
        fake.run(1.0, wait=0.0, idle=1.0)
        raise RuntimeError("kernel error")
    with pytest.raises(RuntimeError):
        gov.run(fails)
    assert gov.threads == 2


def test_no_governor_where_it_must_not_or_cannot_run():
    cpu = SimpleNamespace(device=SimpleNamespace(type="cpu"), batch_invariant=False)
    two = CpuPlan(2, None, None, "test")
    assert governor_for(two, cpu, adaptive=False) is None
    assert governor_for(CpuPlan(1, None, None, "test"), cpu, adaptive=True) is None
    assert governor_for(two, SimpleNamespace(device=SimpleNamespace(type="cuda")), True) is None
    assert governor_for(two, SimpleNamespace(device=cpu.device, batch_invariant=True),
                        True) is None


def test_the_readers_read_this_machine():
    import threading
    assert run_delay_ns([threading.get_native_id()]) >= 0
    assert run_delay_ns([2 ** 30]) == 0  # a thread that is gone counts nothing
    assert idle_seconds({0}) > 0
