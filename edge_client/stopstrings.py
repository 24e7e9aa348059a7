"""Stop strings on streamed text: found across piece (token) boundaries, never emitted.

Text arrives in pieces as rounds commit tokens. `StopStrings.feed` releases what can no longer
be part of a stop string and holds back the longest tail that is the start of one, so a stop
string split over two pieces is still found and none of it is ever sent. When several stop
strings occur, the one that is complete first in the text wins (as if checked after every
token, as vLLM does), and the text is cut where it starts.
"""
from __future__ import annotations

import codecs
from typing import Callable, Iterable, Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.released = 0               # characters released so far
        self.stopped = False
        self.end = 0                    # once stopped: offset just past the stop string in the full text

    def feed(self, piece: str) -> str:
        """The part of the text so far that is safe to release."""
        if self.stopped:
            return ""
        text = self._pending + piece
        hit = self._first_complete(text)
        if hit is not None:
            start, end = hit
            self.stopped, self._pending = True, ""
            self.end = self.released + end
            return self._release(text[:start])
        keep = self._held_tail(text)
        self._pending = text[len(text) - keep:] if keep else ""
        return self._release(text[: len(text) - keep])

    def flush(self) -> str:
        """At the end of generation: the held tail was not a stop string after all."""
        out, self._pending = self._pending, ""
        return self._release(out)

    def _release(self, s: str) -> str:
        self.released += len(s)
        return s

    def _first_complete(self, text: str) -> tuple[int, int] | None:
        best = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < (best[1], best[0])):
                best = (i, i + len(s))
        return best

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        return keep


def tokens_covering(token_ids: Iterable[int], token_bytes: Callable[[int], bytes], hidden: frozenset[int],
                    n_chars: int) -> int:
    """How many of `token_ids` it takes for their text to reach `n_chars` characters: the tokens
    generated up to the end of a stop string, which usage counts (later tokens of the same round
    were committed by the verifier but are not part of the answer)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    length = 0
    ids = list(token_ids)
    for k, t in enumerate(ids, 1):
        if t not in hidden:
            length += len(decoder.decode(token_bytes(t)))
        if length >= n_chars:
            return k
    return len(ids)
