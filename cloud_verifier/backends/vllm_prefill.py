"""vLLM's prefill rate, measured on its own requests, for honest admission (cloud_verifier.first_token).

vLLM schedules prompts itself (its chunked prefill, beside the running requests), so the rate at
which it gives a new session's prompt tokens is read off what it did lately: for each prefill of
at least MIN_TOKENS uncached tokens (a session's first chunk, its context; an ordinary request's
prompt), the engine's own timestamps (`RequestOutput.metrics`: first scheduled, first token) give
the interval the prefill took. Prefills that overlapped shared the engine's steps, so the rate is

    rate = (uncached tokens of the last `window` prefills) / (length of the union of their intervals)

the engine's prefill throughput while it was prefilling, however many prompts shared it. Shorter
prefills (a round's chunk, a prompt the prefix cache held) are one step's fixed cost, not a rate,
and are left out. A prefill that took more than OUTLIER times what the window's median seconds per
token say (a one-off stall: a compile, a preemption) counts for that much, so one stall does not
refuse sessions for the next 32 prefills. No vLLM import: outputs are read by attribute.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

MIN_TOKENS = 16
OUTLIER = 4.0


class Prefill(NamedTuple):
    tokens: int        # uncached prompt tokens it evaluated
    start_s: float     # engine clock: first scheduled
    end_s: float       # ... first token


class PrefillMeter:
    def __init__(self, window: int = 32):
        self._done: deque[Prefill] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe_output(self, out, prompt_tokens: int) -> None:
        """A request's first output (`out`, a vLLM RequestOutput) after a prompt of `prompt_tokens`."""
        stats = getattr(out, "metrics", None)
        start, end = getattr(stats, "scheduled_ts", 0.0) or 0.0, getattr(stats, "first_token_ts", 0.0) or 0.0
        self.observe(prompt_tokens - int(getattr(out, "num_cached_tokens", 0) or 0), start, end)

    def observe(self, tokens: int, start_s: float, end_s: float) -> None:
        if tokens >= MIN_TOKENS and 0.0 < start_s < end_s:
            with self._lock:
                self._done.append(Prefill(tokens, start_s, end_s))

    def rate(self) -> float | None:
        """Prefill tokens a second (None before the first prefill is measured)."""
        with self._lock:
            done = sorted(self._done, key=lambda p: p.start_s)
        if not done:
            return None
        per_token = sorted((p.end_s - p.start_s) / p.tokens for p in done)[len(done) // 2]
        busy, reach = 0.0, float("-inf")
        for p in done:   # the union of the intervals, in start order, each at most OUTLIER x the median's
            end = min(p.end_s, p.start_s + OUTLIER * per_token * p.tokens)
            busy += max(0.0, end - max(p.start_s, reach))
            reach = max(reach, end)
        return sum(p.tokens for p in done) / busy
