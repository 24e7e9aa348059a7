"""A link: one direction of the path, a sequence of effects applied in order.

`Link` is settings only; `Link.open` gives the per-connection `LinkState`, which runs each
chunk through the effects. The state also keeps the stream in order: a chunk never leaves an
effect before the chunk in front of it did, because the bytes are one TCP stream and
reordering them is not possible (a loss stall or a jitter draw therefore delays what follows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .effects import Chunk, Effect, LinkContext, effect_from_dict


@dataclass(frozen=True)
class Link:
    effects: tuple[Effect, ...] = ()   # applied in this order to every chunk

    def __post_init__(self) -> None:
        object.__setattr__(self, "effects", tuple(self.effects))

    def open(self, ctx: LinkContext) -> LinkState:
        return LinkState(self.effects, ctx)

    def mean_delay_ms(self) -> float:
        """Mean one-way delay without queueing (ms): the sum of the effects' means."""
        return sum(effect.mean_delay_ms() for effect in self.effects)

    def expected_delay_ms(self, size_bytes: int, rtt_ms: float) -> float:
        """Mean one-way delay of a lone message of `size_bytes` (ms): delays, transmission and loss stalls.

        `rtt_ms` is the path's round trip, which the loss effects' recovery timers use.
        """
        rate_kbit_s = self.rate_kbit_s()
        transmission_ms = 0.0 if rate_kbit_s is None else size_bytes * 8.0 / rate_kbit_s
        stall_ms = sum(effect.mean_stall_ms(size_bytes, rtt_ms) for effect in self.effects)
        return self.mean_delay_ms() + transmission_ms + stall_ms

    def without(self, *kinds: str) -> Link:
        """The same link with the effects of the named kinds left out (e.g. "loss", "jitter")."""
        return Link(tuple(effect for effect in self.effects if effect.kind not in kinds))

    def mean_loss_rate(self) -> float:
        """Chance that a segment meets at least one loss effect's loss (mean rates)."""
        return 1.0 - math.prod(1.0 - effect.mean_loss_rate() for effect in self.effects)

    def rate_kbit_s(self) -> float | None:
        """The bottleneck rate (kbit/s; a trace's mean), or None if no effect limits it."""
        rates = [r for effect in self.effects if (r := effect.mean_rate_kbit_s()) is not None]
        return min(rates) if rates else None

    def find(self, kind: type[Effect]) -> list[Effect]:
        return [effect for effect in self.effects if isinstance(effect, kind)]

    def to_list(self) -> list[dict[str, Any]]:
        return [effect.to_dict() for effect in self.effects]

    @classmethod
    def from_list(cls, specs: list[dict[str, Any]]) -> Link:
        return cls(tuple(effect_from_dict(spec) for spec in specs))


class LinkState:
    """One connection's run through a link, in one direction."""

    def __init__(self, effects: tuple[Effect, ...], ctx: LinkContext) -> None:
        self.ctx = ctx
        self._effects = effects
        self._states = [effect.new_state(ctx) for effect in effects]
        self._last_departure_s = [-math.inf] * len(effects)

    def departure_s(self, size_bytes: int, arrival_s: float) -> float:
        """When a chunk of `size_bytes` that arrived at `arrival_s` leaves the link.

        Raises LinkReset when an effect resets the connection.
        """
        t_s = arrival_s
        for i, (effect, state) in enumerate(zip(self._effects, self._states)):
            t_s = max(effect.departure_s(Chunk(size_bytes, t_s), state), self._last_departure_s[i])
            self._last_departure_s[i] = t_s
        return t_s

    def reset_at_s(self, now_s: float) -> float | None:
        """The earliest time >= now_s at which an effect resets the connection, or None.

        An effect may answer a time before its reset, at which to ask again (see Outage), so
        callers reset only when the answer is the time they asked at.
        """
        times = [t for effect, state in zip(self._effects, self._states)
                 if (t := effect.reset_at_s(now_s, state)) is not None]
        return min(times) if times else None
