"""Jitter: a delay that wanders in time around its mean, never negative and never reordering.

The extra delay is a function of time, not an independent draw per chunk: independent values
are drawn every `interval_ms` (uniform in [0, 2·jitter_ms], or a normal with mean jitter_ms
clipped to that range) and the delay moves linearly from one to the next. Three reasons:

- Its mean is the stated mean whatever the traffic looks like. Per-chunk draws cannot keep
  the stream in order without holding a chunk behind the one in front of it, and that hold
  raised the mean: a gRPC message written as two or three chunks is delivered with the
  largest of their draws, so the round trip read above the profile's (figures on the docs'
  benchmarks page).
- A delay that changes by at most `2·jitter_ms` per `interval_ms` moves slower than time
  (the default interval is four times the spread, so by at most half a millisecond per
  millisecond); a later chunk therefore never overtakes an earlier one, with no hold at all.
- Real paths behave this way: queueing delay drifts, and packets sent close together see
  nearly the same delay.

Sampled at a random time, the extra delay has mean jitter_ms and stays in [0, 2·jitter_ms]; the
interpolation narrows its spread (the sd is sqrt(2/3) of the draws' at a uniformly random
phase). The extra delay is non-negative because queueing can add delay but cannot remove
propagation delay, so `Delay(d)` then `Jitter(j)` has mean one-way delay d + j.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar

from .base import Chunk, Effect, LinkContext

DISTRIBUTIONS = ("uniform", "normal")
INTERVAL_PER_SPREAD = 4.0   # default interval_ms = 4 · (2·jitter_ms): the delay changes at most 0.5 ms per ms


class _JitterWalk:
    """One connection's delay curve: the two draws around the current interval."""

    def __init__(self, settings: Jitter, ctx: LinkContext) -> None:
        self.settings = settings
        self.rng = ctx.rng
        self.epoch_s = ctx.epoch_s
        self.index: int | None = None   # the interval [index, index + 1) the two values span
        self.start_ms = 0.0             # extra delay at the interval's start (ms)
        self.end_ms = 0.0               # ... and at its end (ms)

    def extra_ms(self, t_s: float) -> float:
        interval_s = self.settings.interval_s()
        if interval_s <= 0.0:
            return 0.0
        position = (t_s - self.epoch_s) / interval_s
        index = math.floor(position)
        if index != self.index:
            if self.index is not None and index == self.index + 1:
                self.start_ms = self.end_ms
            else:
                # The values are independent, so after a gap fresh ones are as good as the skipped ones.
                self.start_ms = self.settings.extra_ms(self.rng)
            self.end_ms = self.settings.extra_ms(self.rng)
            self.index = index
        fraction = position - index
        return (1.0 - fraction) * self.start_ms + fraction * self.end_ms


@dataclass(frozen=True)
class Jitter(Effect):
    kind: ClassVar[str] = "jitter"

    jitter_ms: float               # mean extra delay (ms); the delay stays within [0, 2·jitter_ms]
    distribution: str = "uniform"  # of the draws: "uniform": U(0, 2·jitter_ms); "normal": N(jitter_ms, jitter_ms/2) clipped to [0, 2·jitter_ms]
    interval_ms: float | None = None   # time between independent draws (ms); None: 4 · 2·jitter_ms. At least 2·jitter_ms, so the stream stays in order

    def __post_init__(self) -> None:
        if self.jitter_ms < 0:
            raise ValueError(f"jitter_ms must be >= 0, got {self.jitter_ms}")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {self.distribution!r}")
        if self.interval_ms is not None and self.interval_ms < 2.0 * self.jitter_ms:
            raise ValueError(f"interval_ms must be >= 2·jitter_ms = {2.0 * self.jitter_ms:g} (a faster change "
                             f"would reorder the stream), got {self.interval_ms}")

    def interval_s(self) -> float:
        interval_ms = INTERVAL_PER_SPREAD * 2.0 * self.jitter_ms if self.interval_ms is None else self.interval_ms
        return interval_ms / 1000.0

    def new_state(self, ctx: LinkContext) -> _JitterWalk:
        return _JitterWalk(self, ctx)

    def extra_ms(self, rng: random.Random) -> float:
        """One independent draw (ms): a value the delay passes through."""
        spread_ms = 2.0 * self.jitter_ms
        if self.distribution == "uniform":
            return rng.uniform(0.0, spread_ms)
        # Clipping symmetrically about the mean keeps the mean at jitter_ms.
        return min(max(rng.gauss(self.jitter_ms, self.jitter_ms / 2.0), 0.0), spread_ms)

    def departure_s(self, chunk: Chunk, state: _JitterWalk) -> float:
        return chunk.arrival_s + state.extra_ms(chunk.arrival_s) / 1000.0

    def mean_delay_ms(self) -> float:
        return self.jitter_ms
