"""Propagation delay: every chunk leaves a fixed time after it arrived."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Chunk, Effect


@dataclass(frozen=True)
class Delay(Effect):
    kind: ClassVar[str] = "delay"

    delay_ms: float   # one-way delay added to every chunk (ms)

    def __post_init__(self) -> None:
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")

    def departure_s(self, chunk: Chunk, state: None) -> float:
        return chunk.arrival_s + self.delay_ms / 1000.0

    def mean_delay_ms(self) -> float:
        return self.delay_ms
