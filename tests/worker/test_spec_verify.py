"""Draft verification (services/worker/spec_decode/verify.py): accept while the sample equals the
draft, output the accepted drafts and the sample after them."""

from __future__ import annotations

import numpy as np
import pytest

from services.worker.spec_decode.verify import verify_drafts


def verify(sampled: list[int], drafts: list[int], num_drafts: list[int]
           ) -> tuple[list[int], list[int]]:
    """(accepted counts, output tokens)."""
    s = np.array(sampled, dtype=np.int64)
    v = verify_drafts(s, np.array(drafts, dtype=np.int64), np.array(num_drafts, dtype=np.int64))
    return v.num_accepted.tolist(), s[v.output_rows].tolist()


def test_accepts_the_matching_prefix_and_outputs_the_sample_after_it():
    # drafts 5 6 7: the samples agree on 5 and 6, then 9 instead of 7 (the last row is unused)
    assert verify([5, 6, 9, 4], [5, 6, 7], [3]) == ([2], [5, 6, 9])


def test_all_accepted_outputs_the_bonus_token():
    assert verify([5, 6, 7, 8], [5, 6, 7], [3]) == ([3], [5, 6, 7, 8])


def test_none_accepted_outputs_the_first_sample():
    assert verify([1, 6, 7, 8], [5, 6, 7], [3]) == ([0], [1])


def test_a_mismatch_ends_acceptance_even_when_later_drafts_match():
    assert verify([5, 0, 7, 8], [5, 6, 7], [3]) == ([1], [5, 0])


def test_mixed_requests_with_and_without_drafts():
    # req 0: 2 drafts, 1 accepted; req 1: none; req 2: 1 draft, accepted; req 3: 2, none
    sampled = [3, 9, 1] + [4] + [7, 2] + [0, 5, 6]  # noqa: RUF005 (per request)
    drafts = [3, 8] + [] + [7] + [1, 5]  # noqa: RUF005
    assert verify(sampled, drafts, [2, 0, 1, 2]) == ([1, 0, 1, 0], [3, 9, 4, 7, 2, 0])


def test_no_drafts_at_all_is_one_token_each():
    assert verify([4, 2, 8], [], [0, 0, 0]) == ([0, 0, 0], [4, 2, 8])
    assert verify([], [], []) == ([], [])


def test_matches_a_python_reference_on_random_layouts():
    rng = np.random.default_rng(0)
    for _ in range(200):
        num_drafts = rng.integers(0, 5, size=int(rng.integers(1, 8)))
        sampled = rng.integers(0, 3, size=int((num_drafts + 1).sum()))
        drafts = rng.integers(0, 3, size=int(num_drafts.sum()))
        expected_a, expected_out, row, d = [], [], 0, 0
        for n in num_drafts.tolist():
            a = 0
            while a < n and sampled[row + a] == drafts[d + a]:
                a += 1
            expected_a.append(a)
            expected_out += sampled[row:row + a + 1].tolist()
            row, d = row + n + 1, d + n
        assert verify(sampled.tolist(), drafts.tolist(), num_drafts.tolist()) == (
            expected_a, expected_out)


def test_lengths_that_disagree_are_refused():
    with pytest.raises(ValueError, match="sampled rows"):
        verify([1, 2], [3], [2])
