"""Run a command and say, while it runs, that it still runs: ``make install``'s quiet pip
installs, which take minutes on a fresh machine.

    python scripts/with_progress.py "installing the Python packages" -- pip install -q ...

prints ``installing the Python packages ...``, then ``  still installing the Python packages:
20 s`` every ``--every`` seconds (default 10), and ``installing the Python packages: done in
95.2 s`` (or ``failed after``) at the end; the command's own output passes through, and its
exit code is this script's. Only the standard library: it runs before the virtual environment
exists (the system ``python3``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(usage="%(prog)s WHAT [--every S] -- COMMAND ...",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("what", help='the step, as a gerund phrase ("installing the packages")')
    p.add_argument("--every", type=float, default=10.0, help="seconds between progress lines")
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = p.parse_args(argv[:split]), argv[split + 1:]
    if not command or not 0 < args.every < float("inf"):
        p.error("need -- COMMAND, and --every > 0")
    start, done = time.monotonic(), threading.Event()

    def tick() -> None:
        while not done.wait(args.every):
            print(f"  still {args.what}: {time.monotonic() - start:.0f} s", flush=True)

    print(f"{args.what} ...", flush=True)
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        code = subprocess.call(command)
    finally:
        done.set()
        ticker.join()
    took = time.monotonic() - start
    print(f"{args.what}: {'done in' if code == 0 else 'failed after'} {took:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
