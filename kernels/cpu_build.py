"""Build (once) and load the native CPU kernels: ``kernels/csrc/*.cpp`` (paged attention, the
KV-cache write, row-invariant linear layers) and the headers they share.

The extension is a plain shared library of torch custom ops (``torch.ops.pagedserve.*``, no
Python module), compiled by ``torch.utils.cpp_extension.load`` (g++ and ninja, ``-O3
-fopenmp``) into a folder named after a hash of everything that goes into it: the source, the
flags and the torch version. A changed source therefore builds into a new folder, and an
unchanged one is loaded straight from the finished library with ``torch.ops.load_library``,
which needs neither ninja nor a compiler (the worker image builds at image build time and runs
without a compiler).

Cache location: ``$PAGEDSERVE_CACHE_DIR/cpu_kernels`` (default ``~/.cache/pagedserve``, the
same root the model cache uses), e.g. ``~/.cache/pagedserve/cpu_kernels/pagedserve_cpu-1a2b.../``.

``python -m kernels.cpu_build`` builds (or finds) the library and prints its path, the build
time and the instruction-set path the kernels will take (``make install`` runs it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch

NAME = "pagedserve_cpu"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "cpu_paged_attention.cpp", CSRC / "cpu_linear.cpp", CSRC / "cpu_rotary.cpp",
           CSRC / "cpu_argmax.cpp", CSRC / "cpu_int8_linear.cpp", CSRC / "cpu_a8_linear.cpp",
           CSRC / "cpu_threads.cpp"]
HEADERS = [CSRC / "cpu_isa.h", CSRC / "cpu_math.h", CSRC / "cpu_epilogue.h",
           CSRC / "cpu_vnni.h", CSRC / "cpu_attention_i8.h"]
# NOTE: -fopenmp on both sides links libgomp.so.1, the same soname as the libgomp torch's CPU
# wheel ships and has already loaded, so the process keeps one OpenMP runtime (one thread pool).
# -fno-trapping-math: without it GCC will not turn the clamps and selects of the kernels' exp
# into vector blends (a float compare may raise an FP exception), and the softmax loops stay
# scalar; no result changes (nothing reads the FP exception flags).
CFLAGS = ["-O3", "-fno-trapping-math", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_loaded: Path | None = None


def _no_progress(_what: str) -> AbstractContextManager[object]:
    return nullcontext()


# Wraps the compile (not a load from the cache), given what it does ("building the CPU
# kernels ..."): the worker sets its start-up progress reporter here
# (services/common/progress.py; this package imports nothing from services/), ``main`` a
# printer of its own.
progress: Callable[[str], AbstractContextManager[object]] = _no_progress


def cache_root() -> Path:
    """``$PAGEDSERVE_CACHE_DIR/cpu_kernels``, default ``~/.cache/pagedserve/cpu_kernels``."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pagedserve")
    return Path(root) / "cpu_kernels"


def build_key() -> str:
    """16 hex digits of sha256 over the sources and headers, the flags and the torch version."""
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(repr((CFLAGS, LDFLAGS, torch.__version__, sys.version_info[:2])).encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    """Where the finished library for the current source lives (whether built or not)."""
    return cache_root() / f"{NAME}-{build_key()}" / f"{NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile the library unless it is already in the cache; return its path.

    The compile happens in ``<folder>/build`` (ninja, with cpp_extension's file lock against
    concurrent builds) and the result is copied to ``<folder>/pagedserve_cpu.so`` with an atomic
    rename, so another process never loads a half-written file. Loads the library into this
    process as a side effect when it compiles.

    Raises:
        RuntimeError: the compiler or ninja is missing, or the compile fails.
    """
    final = library_path()
    if final.exists():
        return final
    build_dir = final.parent / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    # NOTE: cpp_extension runs `ninja` from PATH; the PyPI ninja sits in the venv's bin folder,
    # which is not on PATH when the venv's python is run directly (as `make install` does).
    try:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    with progress("building the CPU kernels"):
        built = cpp_extension.load(
            name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS, build_directory=str(build_dir), is_python_module=False,
            verbose=verbose)
    global _loaded
    _loaded = Path(built)
    tmp = final.with_suffix(f".tmp{os.getpid()}")
    shutil.copyfile(built, tmp)
    os.replace(tmp, final)
    return final


def load() -> None:
    """Register ``torch.ops.pagedserve.*`` in this process (building first if needed); once.

    Raises:
        RuntimeError: as ``build``.
    """
    global _loaded
    if _loaded is not None:
        return
    with _lock:
        if _loaded is None:
            path = build()
            if _loaded is None:  # found in the cache, not loaded by the build
                torch.ops.load_library(str(path))
                _loaded = path


def is_loaded() -> bool:
    """Whether ``load`` has registered the ops in this process (nothing is built or loaded)."""
    return _loaded is not None


@contextmanager
def _print_progress(what: str, every: float = 10.0) -> Iterator[None]:
    """``progress`` for ``main``: says ``what`` on stdout, then every ``every`` seconds how long
    it has been running (``make install`` shows it)."""
    start, done = time.monotonic(), threading.Event()

    def tick() -> None:
        while not done.wait(every):
            print(f"  still building: {time.monotonic() - start:.0f} s", flush=True)

    print(f"{what} ...", flush=True)
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


def main() -> None:
    global progress
    progress = _print_progress
    start = time.perf_counter()
    cached = library_path().exists()
    load()
    print(f"{_loaded} ({'cached' if cached else 'built'} in {time.perf_counter() - start:.1f} s, "
          f"isa {torch.ops.pagedserve.cpu_isa()})")


if __name__ == "__main__":
    main()
