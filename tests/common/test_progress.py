"""Start-up progress (services/common/progress.py): a step says what it does, ticks while it
runs (only the innermost of nested steps), and says how long it took or that it failed."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest

from services.common.progress import (
    INTERVAL_ENV,
    STARTUP_LOGGER,
    progress_interval,
    startup_step,
    waiting_step,
)

TICK = 0.05  # seconds between progress lines in these tests


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == STARTUP_LOGGER]


@pytest.fixture(autouse=True)
def _startup_log(caplog):
    caplog.set_level(logging.INFO, logger=STARTUP_LOGGER)


def test_step_says_start_progress_and_duration(caplog):
    with startup_step("compiling the forward", TICK):
        time.sleep(TICK * 4.5)
    lines = _messages(caplog)
    assert lines[0] == "compiling the forward ..."
    ticks = lines[1:-1]
    assert 3 <= len(ticks) <= 4, lines  # at 1, 2, 3, 4 intervals (a slow machine may lose one)
    assert all(re.fullmatch(r"still compiling the forward: \d+ s", t) for t in ticks), ticks
    done = re.fullmatch(r"compiling the forward: done in (\d+\.\d) s", lines[-1])
    assert done and float(done.group(1)) >= round(TICK * 4.5, 1) - 0.05, lines[-1]


def test_a_short_step_has_no_progress_line(caplog):
    with startup_step("loading the compiled forward", 10.0):
        pass
    assert _messages(caplog) == ["loading the compiled forward ...",
                                 "loading the compiled forward: done in 0.0 s"]


def test_detail_is_on_the_first_line_only(caplog):
    with startup_step("compiling the forward", TICK, detail="once; saved for later starts"):
        time.sleep(TICK * 1.5)
    lines = _messages(caplog)
    assert lines[0] == "compiling the forward (once; saved for later starts) ..."
    assert lines[1] == "still compiling the forward: 0 s" and "once" not in lines[-1]


def test_no_tick_after_the_step_ended(caplog):
    with startup_step("building the CPU kernels", TICK):
        time.sleep(TICK * 1.5)
    n = len(_messages(caplog))
    time.sleep(TICK * 3)
    assert len(_messages(caplog)) == n
    assert _messages(caplog)[-1].startswith("building the CPU kernels: done in")


def test_failure_is_logged_and_raised(caplog):
    with pytest.raises(RuntimeError, match="no compiler"), \
            startup_step("building the CPU kernels", TICK):
        raise RuntimeError("no compiler")
    record = [r for r in caplog.records if r.name == STARTUP_LOGGER][-1]
    assert record.levelno == logging.WARNING
    assert re.fullmatch(r"building the CPU kernels: failed after \d+\.\d s \(RuntimeError\)",
                        record.getMessage())


def test_only_the_innermost_step_ticks(caplog):
    with startup_step("loading the model", TICK):
        with startup_step("converting the model", TICK):
            time.sleep(TICK * 3.5)
        time.sleep(TICK * 2.5)
    lines = _messages(caplog)
    end_inner = lines.index(next(x for x in lines if x.startswith("converting the model: done")))
    inner_part, outer_part = lines[:end_inner], lines[end_inner + 1:]
    assert not any(x.startswith("still loading") for x in inner_part), lines
    assert any(x.startswith("still converting") for x in inner_part), lines
    assert any(x.startswith("still loading") for x in outer_part), lines  # silent no more
    assert lines[-1].startswith("loading the model: done in")


def test_concurrent_tasks_steps_each_tick(caplog):
    """Two asyncio tasks' steps are siblings (the in-process stack's services): both tick."""
    async def step(what):
        with startup_step(what, TICK):
            await asyncio.sleep(TICK * 3.5)

    async def both():
        await asyncio.gather(step("waiting for the workers"), step("waiting for the scheduler"))

    asyncio.run(both())
    lines = _messages(caplog)
    assert any(x.startswith("still waiting for the workers") for x in lines), lines
    assert any(x.startswith("still waiting for the scheduler") for x in lines), lines


def test_interval_from_the_environment(monkeypatch, caplog):
    monkeypatch.setenv(INTERVAL_ENV, str(TICK))
    assert progress_interval() == TICK
    with startup_step("warming up the forward"):
        time.sleep(TICK * 2.5)
    assert any(x.startswith("still warming up") for x in _messages(caplog))
    monkeypatch.delenv(INTERVAL_ENV)
    assert progress_interval() == 10.0


def test_waits_tick_less_often(monkeypatch, caplog):
    monkeypatch.setenv(INTERVAL_ENV, str(TICK))
    with waiting_step("the scheduler"):
        time.sleep(TICK * 3)
    assert _messages(caplog)[0] == "waiting for the scheduler ..."
    assert not any(x.startswith("still") for x in _messages(caplog))  # every 6 intervals


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_bad_interval_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(INTERVAL_ENV, value)
    with pytest.raises(ValueError, match=f"{INTERVAL_ENV}={value!r}: must be a number of "
                                         "seconds > 0"):
        progress_interval()
    with pytest.raises(ValueError, match=INTERVAL_ENV), startup_step("x"):
        pass
