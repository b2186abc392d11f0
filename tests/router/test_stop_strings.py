"""StopStringMatcher: the streamed text equals "cut at the first stop string" for any split."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.stop_strings import StopResult, StopStringMatcher


def reference(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """The shortest prefix of ``text`` that ends with a stop string, cut before it (or after it
    with ``include``); among stop strings ending there, the longest. Naive on purpose."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stop if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return (text[:end] if include else text[:end - len(s)]), s
    return text, None


def longest_held_suffix(seen: str, stop: list[str]) -> str:
    """Naive: the longest suffix of ``seen`` that is a proper prefix of some stop string."""
    for i in range(len(seen)):
        if any(len(seen) - i < len(s) and s.startswith(seen[i:]) for s in stop):
            return seen[i:]
    return ""


def run(deltas: list[str], stop: list[str], include: bool = False) -> tuple[list[str], StopResult]:
    m = StopStringMatcher(stop, include)
    emitted, res = [], StopResult("")
    for d in deltas:
        res = m.feed(d)
        emitted.append(res.text_to_emit)
        if res.stopped:
            break
    else:
        emitted.append(m.flush())
    return emitted, res


ALPHABET = "ab \n"
texts = st.text(ALPHABET, max_size=40)
stops = st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


@settings(max_examples=400, deadline=None)
@given(texts, stops, st.lists(st.integers(0, 100), max_size=12), st.booleans())
def test_streamed_text_matches_reference(text, stop, cuts, include):
    deltas = split(text, cuts)
    expected, expected_stop = reference(text, stop, include)
    m = StopStringMatcher(stop, include)
    out, seen = "", ""
    for d in deltas:
        res = m.feed(d)
        out += res.text_to_emit
        seen += d
        assert expected.startswith(out)  # every emitted prefix is a prefix of the answer
        if res.stopped:
            assert res.stop_str == expected_stop
            break
        # held back exactly what could still start a stop string, nothing more
        assert m.pending == longest_held_suffix(seen, stop)
        assert out + m.pending == seen
    else:
        assert expected_stop is None
        out += m.flush()
    assert out == expected


@settings(max_examples=200, deadline=None)
@given(texts, stops, st.booleans())
def test_char_by_char_equals_whole_text(text, stop, include):
    one, r1 = run(list(text), stop, include)
    whole, r2 = run([text], stop, include)
    assert "".join(one) == "".join(whole)
    assert (r1.stopped, r1.stop_str) == (r2.stopped, r2.stop_str)


@pytest.mark.parametrize("deltas, stop, include, text, stop_str", [
    (["Hello", " wor", "ld! END", " more"], ["END"], False, "Hello world! ", "END"),
    (["Hello", " E", "N", "D"], ["END"], True, "Hello END", "END"),
    (["abc"], ["abcd", "bc"], False, "a", "bc"),  # "bc" completes first
    (["abc"], ["bc", "abc"], False, "", "abc"),  # same end: the longest wins
    (["a", "x", "b"], ["ab"], False, "axb", None),  # released once it cannot match
    (["🙂 ok", "<|e", "nd|>", "x"], ["<|end|>"], False, "🙂 ok", "<|end|>"),
])
def test_examples(deltas, stop, include, text, stop_str):
    emitted, res = run(deltas, stop, include)
    assert "".join(emitted) == text
    assert res.stop_str == stop_str


def test_partial_stop_string_is_held_then_released():
    m = StopStringMatcher(["\n\nUser:"], False)
    assert m.feed("Sure.\n").text_to_emit == "Sure."
    assert m.feed("\nUs").text_to_emit == ""
    assert m.feed("ually").text_to_emit == "\n\nUsually"
    assert m.flush() == ""


def test_after_stop_everything_is_dropped():
    m = StopStringMatcher(["x"], False)
    assert m.feed("abxcd") == StopResult("ab", True, "x")
    assert m.feed("more") == StopResult("", True, "x")
    assert m.flush() == ""


def test_no_stop_strings_passes_text_through():
    m = StopStringMatcher([], False)
    assert m.feed("abc").text_to_emit == "abc" and m.flush() == ""


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""], False)


def test_work_per_delta_does_not_grow_with_the_output():
    # 16 stop strings of 256 characters that share their first 255 with the text: the worst
    # case for holding back. 20k one-character deltas must stay far from quadratic.
    stop = ["a" * 255 + chr(ord("b") + i) for i in range(16)]
    m = StopStringMatcher(stop, False)
    start = time.perf_counter()
    emitted = sum(len(m.feed("a").text_to_emit) for _ in range(20_000))
    elapsed = time.perf_counter() - start
    assert emitted == 20_000 - 255 and m.pending == "a" * 255
    assert elapsed < 5.0, f"{elapsed:.2f} s for 20k deltas"
