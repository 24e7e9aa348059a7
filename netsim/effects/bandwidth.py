"""Bandwidth: a serialising link that is busy for size/rate per chunk.

departure = max(arrival, link free) + size·8/rate. This is a link, not a token bucket: there
is no burst allowance, so a small message pays its own transmission time and waits behind
the bytes queued in front of it (the TBF flaw that netem's `rate` was written to avoid).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .base import Chunk, Effect, LinkContext


class _LinkBusy:
    def __init__(self) -> None:
        self.free_at_s = -math.inf   # when the link finishes sending what it already holds


@dataclass(frozen=True)
class Bandwidth(Effect):
    kind: ClassVar[str] = "bandwidth"

    rate_kbit_s: float   # link rate in kbit/s (1 kbit = 1000 bits), counting payload bytes only

    def __post_init__(self) -> None:
        if self.rate_kbit_s <= 0:
            raise ValueError(f"rate must be > 0 kbit/s, got {self.rate_kbit_s}")

    def new_state(self, ctx: LinkContext) -> _LinkBusy:
        return _LinkBusy()

    def departure_s(self, chunk: Chunk, state: _LinkBusy) -> float:
        start_s = max(chunk.arrival_s, state.free_at_s)
        state.free_at_s = start_s + chunk.size_bytes * 8.0 / (self.rate_kbit_s * 1000.0)
        return state.free_at_s

    def mean_rate_kbit_s(self) -> float:
        return self.rate_kbit_s
