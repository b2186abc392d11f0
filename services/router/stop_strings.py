"""Stop-string matching on streamed text: hold back what could still become a stop string.

The output ends at the first point where the text so far contains a complete stop string, i.e.
at the shortest prefix of the full output that ends with one (the "first occurrence": the stop
string that completes first; when several complete at the same character, the longest).
Without ``include_stop_str_in_output`` the text is cut right before that stop string, with it
right after.

Streaming without ever showing part of a stop string::

    seen text:   ... emitted ... | pending |  <- delta arrives
                                  \\_______/
          longest suffix of the seen text that is a proper prefix of some stop string

Any stop string that completes later must start inside ``pending`` (an earlier start would
make a longer suffix a prefix of it), so each delta only searches ``pending + delta``: work is
O(len(delta) + longest stop string) per stop string (amortized: each character is released
once), never the whole output.

NOTE: vLLM (``check_stop_strings``) takes the first stop string *in list order* found in the
new text and holds back a fixed ``max(len(stop)) - 1`` characters; here the match does not
depend on how the text was split into deltas, and held text is released as soon as it can no
longer start a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopResult:
    """What one ``feed`` produced.

    Attributes:
        text_to_emit: text that can be sent to the client now (may be empty).
        stopped: a stop string matched; the request is over and its output text is final.
        stop_str: the stop string that matched, or None.
    """

    text_to_emit: str
    stopped: bool = False
    stop_str: str | None = None


class StopStringMatcher:
    """Matches stop strings across text deltas of one request.

    Args:
        stop: the stop strings (non-empty strings; duplicates are harmless).
        include_stop_str_in_output: keep the matched stop string at the end of the output.

    Raises:
        ValueError: a stop string is empty.
    """

    def __init__(self, stop: list[str] | tuple[str, ...], include_stop_str_in_output: bool = False):
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        # Longest first, so that among matches ending at the same character the longest wins.
        self._stop = sorted(set(stop), key=len, reverse=True)
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stop), default=0)
        self._first_chars = frozenset(s[0] for s in self._stop)
        self._pending = ""  # held-back text: a proper prefix of some stop string
        self._stop_str: str | None = None

    @property
    def has_stops(self) -> bool:
        """True when there is any stop string to match."""
        return bool(self._stop)

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; later deltas are ignored."""
        return self._stop_str is not None

    @property
    def pending(self) -> str:
        """Text held back because it could still start a stop string."""
        return self._pending

    def feed(self, delta: str) -> StopResult:
        """Add ``delta`` (new output text) and return what may be emitted now.

        After a match, returns ``StopResult("", True, stop_str)`` for every later call.
        """
        if self._stop_str is not None:
            return StopResult("", True, self._stop_str)
        if not self._stop:
            return StopResult(delta)
        buf = self._pending + delta
        match = self._first_match(buf)
        if match is not None:
            start, stop_str = match
            self._stop_str, self._pending = stop_str, ""
            end = start + len(stop_str) if self._include else start
            return StopResult(buf[:end], True, stop_str)
        keep = self._held_suffix_len(buf)
        self._pending = buf[len(buf) - keep:]
        return StopResult(buf[:len(buf) - keep])

    def flush(self) -> str:
        """Release the held-back text at the end of the request ("" after a match)."""
        text, self._pending = self._pending, ""
        return "" if self._stop_str is not None else text

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first in ``buf`` (ties: longest)."""
        best: tuple[int, str] | None = None
        best_end = len(buf) + 1
        for s in self._stop:  # longest first: a strict ``<`` keeps the longest on a tie
            i = buf.find(s, 0, best_end - 1 if best is not None else len(buf))
            if i != -1 and i + len(s) < best_end:
                best, best_end = (i, s), i + len(s)
        return best

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for i in range(max(0, len(buf) - self._max_len + 1), len(buf)):
            if buf[i] in self._first_chars:
                tail = buf[i:]
                if any(s.startswith(tail) for s in self._stop):
                    return len(buf) - i
        return 0
