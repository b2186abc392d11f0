"""Prompt lookup (n-gram) drafts: vLLM's ``v1/spec_decode/ngram_proposer.py`` idea.

Text often repeats what came before (code edits, quoting the prompt, lists): when the last
``n`` tokens of a request's context already occurred earlier in its prompt + output, the
tokens that followed that occurrence are a good guess for what follows now (Saxena, "Prompt
Lookup Decoding", 2023). No model, no KV cache: the proposal costs one numpy scan::

    context  a b c x y a b c ? ...          n = 3: suffix "a b c"
             ^^^^^                          its most recent earlier occurrence, at 0
                   x y a ...                proposal: the k tokens after it (fewer if the
                                            context ends first)

Lengths from ``prompt_lookup_max`` down to ``prompt_lookup_min`` are tried, the longest that
matches wins; no match proposes nothing.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes drafts by prompt lookup.

    Args:
        prompt_lookup_min / prompt_lookup_max: the shortest / longest suffix looked up
            (``1 <= min <= max``).

    Raises:
        ValueError: the lengths are out of order or below 1.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt lookup lengths must satisfy 1 <= min <= max, got "
                             f"min {prompt_lookup_min}, max {prompt_lookup_max}")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` drafts to follow ``token_ids`` (``[L]`` int, a request's prompt and
        output so far); ``[]`` when no suffix of ``min..max`` tokens occurred earlier.

        An occurrence is earlier when it starts before the suffix itself (it may overlap
        it); the most recent such one is used. O(L + C * n) per length tried (C: the windows
        ending in the context's last token), numpy only.
        """
        size = len(token_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # windows starting at 0 .. size - n - 1: each has at least one token after it
            windows = sliding_window_view(token_ids[:size - 1], n)  # [size - n, n] (a view)
            # NOTE: the windows ending in the last token first (O(L)), then only those whole
            ends = np.flatnonzero(windows[:, -1] == token_ids[-1])  # [C] window starts
            hits = ends[(windows[ends] == token_ids[size - n:]).all(axis=1)]
            if len(hits):
                start = int(hits[-1]) + n
                return token_ids[start:start + k].tolist()
        return []
