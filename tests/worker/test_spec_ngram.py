"""Prompt lookup (services/worker/spec_decode/ngram_proposer.py): the longest suffix first, its
most recent earlier occurrence, up to k tokens after it, nothing without a match."""

from __future__ import annotations

import numpy as np
import pytest

from services.worker.spec_decode.ngram_proposer import NgramProposer


def propose(tokens: list[int], k: int, lo: int = 1, hi: int = 3) -> list[int]:
    return NgramProposer(lo, hi).propose(np.array(tokens, dtype=np.int32), k)


@pytest.mark.parametrize("tokens, k, lo, hi, expected", [
    ([1, 2, 3, 9, 8, 1, 2, 3], 2, 1, 3, [9, 8]),  # "1 2 3" occurred at 0
    ([1, 2, 3, 9, 8, 1, 2, 3], 5, 1, 3, [9, 8, 1, 2, 3]),  # up to k, running into the suffix
    ([1, 2, 3, 4, 7, 5, 2, 3, 4, 6, 2, 3, 4], 1, 1, 3, [6]),  # the most recent occurrence
    ([5, 6, 1, 2, 7, 3, 2, 9, 2], 2, 1, 3, [9, 2]),  # only "2" matches: latest earlier "2"
    ([4, 4, 4, 4], 3, 1, 3, [4]),  # overlapping occurrences; the context ends first
    ([1, 2, 3, 4], 3, 1, 3, []),  # no earlier occurrence of any suffix
    ([1, 2, 9, 2], 3, 2, 3, []),  # "2" recurs but min is 2: no "9 2" earlier
    ([7], 3, 1, 3, []),  # nothing before the suffix
    ([], 3, 1, 3, []),
    ([1, 2, 3, 1, 2, 3], 0, 1, 3, []),  # k = 0
])
def test_prompt_lookup_cases(tokens, k, lo, hi, expected):
    assert propose(tokens, k, lo, hi) == expected


def test_the_longest_matching_suffix_wins_over_a_more_recent_shorter_one():
    # "1 2 3" was followed by 8 (at 0), a more recent "2 3" by 5, the latest "3" by 6
    tokens = [1, 2, 3, 8, 0, 2, 3, 5, 3, 6, 1, 2, 3]
    assert propose(tokens, 1, 1, 3) == [8]
    assert propose(tokens, 1, 1, 2) == [5]
    assert propose(tokens, 1, 1, 1) == [6]


def test_matches_a_python_reference_on_random_token_lists():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(0, 40))).tolist()
        lo, hi = sorted(rng.integers(1, 5, size=2).tolist())
        k = int(rng.integers(0, 6))
        assert propose(tokens, k, lo, hi) == _reference(tokens, k, lo, hi), (tokens, k, lo, hi)


def _reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    if k <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_refuses_lengths_out_of_order():
    with pytest.raises(ValueError, match="1 <= min <= max"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        NgramProposer(0, 2)
