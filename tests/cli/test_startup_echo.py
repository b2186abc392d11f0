"""``serve --demo`` shows the services' start-up progress on its terminal although their logs
go to a file (services/cli/startup_echo.py), and a line at least every interval."""

from __future__ import annotations

import io
import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from services.cli.startup_echo import StartupEcho, startup_line
from services.common.logs import JsonFormatter
from services.common.ports import free_ports
from services.common.progress import INTERVAL_ENV, STARTUP_LOGGER
from tests.helpers import make_servable_tiny_llama

CLI = [sys.executable, "-m", "services.cli"]


def _record(logger: str, message: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord(logger, level, __file__, 1, message, None, None)


def _text_line(service: str, record: logging.LogRecord) -> str:
    """A line as ``--log-format text`` writes it (services/common/logs.py's format)."""
    record.request_id = None
    return logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s "
                             "[%(request_id)s]: %(message)s").format(record)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_startup_records_are_shown_others_not(fmt):
    def line(service, record):
        return (JsonFormatter(service).format(record) if fmt == "json"
                else _text_line(service, record))

    step = _record(STARTUP_LOGGER, "still compiling the forward: 20 s")
    assert startup_line(line("worker", step)) == "worker: still compiling the forward: 20 s"
    assert startup_line(line("router", _record("services.router.server", "router serving"))) \
        is None
    error = _record("services.worker.server", "rank 0: a step failed", logging.ERROR)
    assert startup_line(line("worker", error)) == "worker: ERROR: rank 0: a step failed"


def test_a_services_last_words_are_shown_other_lines_not():
    assert startup_line("pagedserve worker: --model 'x': not a model folder\n") == \
        "worker: --model 'x': not a model folder"
    for other in ("Converting and de-quantizing GGUF tensors...: 100%", "{not json", "[1, 2]",
                  ""):
        assert startup_line(other) is None


def test_echo_follows_the_file_and_fills_silences(tmp_path):
    """Lines written after the echo started are printed as they come (a line cut in two
    writes once whole); a silence longer than the interval gets a ``still starting`` line;
    ``stop`` prints what is in the file by then."""
    path = tmp_path / "serve.log"
    log = open(path, "ab", buffering=0)  # noqa: SIM115 -- written in pieces below
    out = io.StringIO()
    echo = StartupEcho(str(path), out, interval=0.3, poll=0.02).start()
    record = JsonFormatter("worker").format(_record(STARTUP_LOGGER, "loading tiny ...")) + "\n"
    log.write(record[:20].encode())
    time.sleep(0.1)
    assert "loading" not in out.getvalue()
    log.write(record[20:].encode())
    deadline = time.monotonic() + 5
    while "worker: loading tiny ..." not in out.getvalue():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.8)  # silence: "still starting" at least twice
    fills = re.findall(r"^pagedserve: still starting: \d+ s$", out.getvalue(), re.M)
    assert 2 <= len(fills) <= 3, out.getvalue()
    log.write((JsonFormatter("worker").format(_record(STARTUP_LOGGER, "loading tiny: done in "
                                                      "1.1 s")) + "\n").encode())
    echo.stop()  # at once: the last line is read before it returns
    log.close()
    assert out.getvalue().rstrip().endswith("pagedserve: worker: loading tiny: done in 1.1 s")
    size = len(out.getvalue())
    time.sleep(0.4)
    assert len(out.getvalue()) == size  # stopped: no more lines


@pytest.mark.slow
def test_serve_demo_shows_startup_steps_on_the_terminal(tmp_path):
    """``serve --demo`` (logs to a file): the workers' and waits' start-up lines reach serve's
    stderr, and from start until the stack serves no two lines are further apart than a few
    intervals (0.5 s here; a slow imports phase is covered by ``still starting``)."""
    model = make_servable_tiny_llama(tmp_path / "tiny")
    ports = free_ports(3)
    env = {**os.environ, INTERVAL_ENV: "0.5", "PAGEDSERVE_CACHE_DIR": os.environ.get(
        "PAGEDSERVE_CACHE_DIR", os.path.expanduser("~/.cache/pagedserve"))}
    proc = subprocess.Popen([*CLI, "serve", "--demo", "--port", str(ports[0]),
                                   "--scheduler-port", str(ports[1]), "--worker-port",
                                   str(ports[2]), "--http-port", "-1", "--metrics-port", "-1",
                                   "--model", model, "--kv-cache-memory", "16MiB",
                                   "--enforce-eager"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any("router is serving" in text for _, text in lines):
            assert proc.poll() is None, "\n".join(t for _, t in lines)[-3000:]
            assert time.monotonic() < deadline, "stack not serving in time"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        reader.join(10)
    text = "\n".join(t for _, t in lines)
    up = next(i for i, (_, t) in enumerate(lines) if "router is serving" in t)
    assert re.search(r"^pagedserve: worker: loading tiny on cpu \.\.\.$", text, re.M), text
    assert re.search(r"^pagedserve: worker: loading tiny on cpu: done in \d+\.\d s$", text,
                     re.M), text
    assert re.search(r"^pagedserve: scheduler: waiting for the workers: done in", text, re.M)
    assert re.search(r"^pagedserve: (scheduler: still waiting for the workers|still starting)"
                     r": \d+ s$", text, re.M), text
    for fragment in ('{"time"', '"level"', "services.worker"):
        assert fragment not in text, f"a log line other than start-up's on the terminal: {text}"
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(lines[:up + 1])]
    assert max(gaps) < 4.0, (max(gaps), text)


def test_serve_refuses_a_bad_interval_before_starting_anything():
    ports = free_ports(3)
    out = subprocess.run([*CLI, "serve", "--port", str(ports[0]), "--scheduler-port",
                          str(ports[1]), "--worker-port", str(ports[2]), "--http-port", "-1",
                          "--metrics-port", "-1"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, INTERVAL_ENV: "soon"})
    assert out.returncode == 1
    assert f"pagedserve serve: {INTERVAL_ENV}='soon': must be a number of seconds > 0" in \
        out.stderr
