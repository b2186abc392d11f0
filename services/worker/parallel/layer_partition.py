"""``--pipeline-layer-partition`` (vLLM's ``VLLM_PP_LAYER_PARTITION``): how many layers each
pipeline stage holds, when an even split would leave one stage short of memory (a stage whose
layers cost more, or a host with less). Torch-free: ``serve``'s flag parser checks it too.
"""

from __future__ import annotations


def format_partition(partition: tuple[int, ...]) -> str:
    """``(10, 20)`` -> ``"10,20"`` (the flag's form)."""
    return ",".join(map(str, partition))


def parse_partition(text: str | None) -> tuple[int, ...] | None:
    """``--pipeline-layer-partition`` (or vLLM's ``VLLM_PP_LAYER_PARTITION``) text, e.g.
    ``"10,20"``: layers per pipeline stage, in stage order; None or "" = the even split.

    Raises:
        ValueError: not comma-separated integers, or a stage given fewer than 1 layer.
    """
    if text is None or not text.strip():
        return None
    try:
        parts = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"--pipeline-layer-partition {text!r}: must be comma-separated layer "
                         "counts, one per pipeline stage, e.g. 10,20") from None
    if min(parts) < 1:
        raise ValueError(f"--pipeline-layer-partition {text!r}: every stage needs at least 1 "
                         "layer")
    return parts
