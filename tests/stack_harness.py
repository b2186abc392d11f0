"""The in-process stack for tests: ``benchmarks.stack_harness`` (shared with the benchmarks,
which import nothing from tests)."""

from benchmarks.stack_harness import (  # noqa: F401
    InProcessStack,
    MultiReplicaStack,
    _args,
    _BackgroundStack,
    _wait_idle,
)
