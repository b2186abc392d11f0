"""A throwaway PostgreSQL server for tests, from the distribution's packages (``initdb`` and
``pg_ctl``: Debian's postgresql package, /usr/lib/postgresql/<version>/bin). PostgreSQL refuses
to run as root, so under root it runs as the ``postgres`` user (``runuser``) in a temporary
folder that user owns; it listens on 127.0.0.1 on a free port, trusts local connections, and
keeps nothing on disk after ``remove``.

``PostgresServer.find()`` says why it cannot run (no binaries, root without a ``postgres``
user): the tests that need it skip with that reason.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile

from services.common.ports import free_port

USER = "pagedserve"  # the database superuser initdb creates


def _bin_dir() -> str | None:
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl", path=os.path.dirname(os.path.realpath(found))):
        return os.path.dirname(os.path.realpath(found))
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(f"{d}/initdb") and os.path.exists(f"{d}/pg_ctl"):
            return d
    return None


class PostgresServer:
    """One server: ``start()``, ``stop(mode)`` (``immediate``: as if killed), ``start()``
    again on the same port and data, ``remove()``. ``url``: its ``postgresql://`` URL."""

    def __init__(self, bin_dir: str, run_as: str | None):
        self.bin_dir, self.run_as = bin_dir, run_as
        self.dir = tempfile.mkdtemp(prefix="pagedserve-pg-")
        self.port = free_port()
        self.url = f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"
        if run_as is not None:
            user = pwd.getpwnam(run_as)
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        self._run("initdb", "-D", f"{self.dir}/data", "-U", USER, "-A", "trust", "-E", "UTF8",
                  "--no-sync", "--no-instructions")

    @staticmethod
    def find() -> tuple[str | None, str | None, str]:
        """``(bin_dir, run_as, why_not)``: where the binaries are and which user runs them
        (None: this one), or why no server can run here (``why_not`` non-empty)."""
        bin_dir = _bin_dir()
        if bin_dir is None:
            return None, None, ("PostgreSQL server binaries (initdb, pg_ctl) not found: "
                                "apt-get install postgresql (the distribution's package)")
        if os.geteuid() != 0:
            return bin_dir, None, ""
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return bin_dir, None, "running as root and there is no 'postgres' user to run " \
                                  "PostgreSQL as (it refuses root)"
        if shutil.which("runuser") is None:
            return bin_dir, None, "running as root without runuser to start PostgreSQL as " \
                                  "'postgres'"
        return bin_dir, "postgres", ""

    def _run(self, tool: str, *args: str, timeout: float = 60) -> None:
        argv = [f"{self.bin_dir}/{tool}", *args]
        if self.run_as is not None:
            argv = ["runuser", "-u", self.run_as, "--", *argv]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.dir)
        if out.returncode != 0:
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stderr[-2000:]}")

    def start(self) -> PostgresServer:
        """Start (or restart) the server and wait until it accepts connections."""
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c full_page_writes=off")
        self._run("pg_ctl", "-D", f"{self.dir}/data", "-o", options, "-l", f"{self.dir}/log",
                  "-w", "-t", "60", "start", timeout=90)
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop it: ``fast`` (clean) or ``immediate`` (no shutdown: as if the process died)."""
        self._run("pg_ctl", "-D", f"{self.dir}/data", "-m", mode, "-w", "stop")

    def remove(self) -> None:
        """Stop it if it runs, and delete its folder."""
        try:
            self.stop("immediate")
        except (RuntimeError, subprocess.TimeoutExpired):
            pass  # (not running)
        shutil.rmtree(self.dir, ignore_errors=True)


def server_or_skip():
    """A started ``PostgresServer`` (generator, for a pytest fixture: removed afterwards), or
    ``pytest.skip`` with the reason none can run here."""
    import pytest

    bin_dir, run_as, why_not = PostgresServer.find()
    if why_not:
        pytest.skip(why_not)
    assert bin_dir is not None
    server = PostgresServer(bin_dir, run_as)
    try:
        yield server.start()
    finally:
        server.remove()
