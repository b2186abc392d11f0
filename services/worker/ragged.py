"""Ragged index arithmetic over a batch of requests (numpy): each request's run of indices,
flattened request by request."""

from __future__ import annotations

import numpy as np


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``[starts[0], .., starts[0] + counts[0] - 1, starts[1], ...]``: ``[sum(counts)]`` int64
    from ``starts, counts [N]`` int64 (each request's positions, flattened; a count may be 0).
    May return ``starts`` itself (when every count is 1)::

        starts = [3, 10, 7], counts = [2, 0, 3]  ->  [3, 4, 7, 8, 9]
    """
    if len(counts) and (counts == 1).all():
        return starts
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)  # [N]
    return np.repeat(starts - ends + counts, counts) + np.arange(total)
