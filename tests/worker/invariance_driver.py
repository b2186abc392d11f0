"""One request through a ``ModelRunner`` in different step shapes, for the invariance tests:
``benchmarks.engine_steps`` (shared with the benchmarks, which import nothing from tests)."""

from benchmarks.engine_steps import TOP, Shape, generate  # noqa: F401
