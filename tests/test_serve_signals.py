"""``pagedserve serve``'s signal handling while it stops the stack."""

from __future__ import annotations

import os
import signal

from services.cli.launcher import _stop_all


def test_signals_after_the_second_are_ignored_while_the_stack_is_killed():
    """``serve``'s stop: a second Ctrl-C / SIGTERM kills what is left, and one more arriving
    while it waits for the killed processes is ignored (it used to end serve with a
    KeyboardInterrupt traceback)."""
    class Supervisor:
        killed = False

        def stop(self, names, timeout):
            raise KeyboardInterrupt  # the second signal, during the graceful stop

        def kill_all(self):
            os.kill(os.getpid(), signal.SIGTERM)  # a third one meanwhile
            self.killed = True

    def on_signal(_signum, _frame):
        raise KeyboardInterrupt  # as serve's SIGTERM handler

    saved = signal.signal(signal.SIGTERM, on_signal), signal.getsignal(signal.SIGINT)
    try:
        supervisor = Supervisor()
        _stop_all(supervisor)  # type: ignore[arg-type]
        assert supervisor.killed
    finally:
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGINT, saved[1])
