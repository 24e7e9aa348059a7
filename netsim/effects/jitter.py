"""Jitter: a random extra delay per chunk, never negative and never reordering.

The extra delay is drawn in [0, 2·jitter_ms] with mean jitter_ms, so `Delay(d)` followed by
`Jitter(j)` (uniform) is netem's `delay (d+j)ms (j)ms` without its reordering: the Link holds
a chunk behind the one in front of it (TCP would read reordering as loss). Because of that
hold, chunks that arrive closer together than the spread see a mean a little above jitter_ms.
The extra delay is kept non-negative because queueing can add delay but cannot remove
propagation delay.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from .base import Chunk, Effect, LinkContext

DISTRIBUTIONS = ("uniform", "normal")


@dataclass(frozen=True)
class Jitter(Effect):
    kind: ClassVar[str] = "jitter"

    jitter_ms: float              # mean extra delay per chunk (ms); the draw spans [0, 2·jitter_ms]
    distribution: str = "uniform"  # "uniform": U(0, 2·jitter_ms); "normal": N(jitter_ms, jitter_ms/2) clipped to [0, 2·jitter_ms]

    def __post_init__(self) -> None:
        if self.jitter_ms < 0:
            raise ValueError(f"jitter_ms must be >= 0, got {self.jitter_ms}")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {self.distribution!r}")

    def new_state(self, ctx: LinkContext) -> random.Random:
        return ctx.rng

    def extra_ms(self, rng: random.Random) -> float:
        spread_ms = 2.0 * self.jitter_ms
        if self.distribution == "uniform":
            return rng.uniform(0.0, spread_ms)
        # Clipping symmetrically about the mean keeps the mean at jitter_ms.
        return min(max(rng.gauss(self.jitter_ms, self.jitter_ms / 2.0), 0.0), spread_ms)

    def departure_s(self, chunk: Chunk, rng: random.Random) -> float:
        return chunk.arrival_s + self.extra_ms(rng) / 1000.0

    def mean_delay_ms(self) -> float:
        return self.jitter_ms
