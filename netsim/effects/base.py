"""The contract every link effect keeps, and the values that pass through it.

An effect is configuration only: a frozen dataclass whose fields carry their units. What
changes while a connection runs (a busy-until time, a loss chain's state, a trace position)
lives in the state object that `new_state` returns, one per connection and direction, so one
settings object can serve any number of connections (the toxiproxy split of toxic and stub).

Times are seconds on the link's clock (the event loop's `loop.time()` in the proxy; any
float in the unit tests). Each chunk carries the time it reached the effect, and the effect
answers with the time it leaves; the next effect in the link takes that as its arrival, so
effects compose: two 100 ms delays in series make 200 ms.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar


@dataclass(frozen=True)
class Chunk:
    size_bytes: int    # payload bytes in this piece of the stream
    arrival_s: float   # when the chunk reached the current effect, on the link's clock (s)


def _ignore_stall(stall_s: float) -> None:
    pass


@dataclass
class LinkContext:
    """What an effect may know about the connection and network it serves."""

    rng: random.Random      # this connection's, this direction's generator, seeded by the caller
    epoch_s: float = 0.0    # clock time at which the emulated network started: schedules count from here
    rtt_s: float = 0.0      # the path's mean round trip without queueing; the senders' loss-recovery timers use it
    seed: int = 0           # the run's seed; schedules that every connection and both directions share derive from it
    record_stall: Callable[[float], None] = field(default=_ignore_stall)  # told each stall's length (s), for counters


class LinkReset(Exception):
    """The link resets the connection (an outage in reset mode, or TCP giving up)."""


class Effect:
    """Base of the effect dataclasses: the interface plus harmless defaults.

    Subclasses set `kind` (their name in the registry) and override `departure_s`; an effect
    that keeps per-connection state overrides `new_state`. The Link, not the effect, keeps a
    chunk from leaving before the chunk in front of it, so an effect may compute each
    departure on its own.
    """

    kind: ClassVar[str] = ""

    def new_state(self, ctx: LinkContext) -> Any:
        return None

    def departure_s(self, chunk: Chunk, state: Any) -> float:
        """When `chunk` leaves this effect (s, >= chunk.arrival_s); raises LinkReset to reset."""
        raise NotImplementedError

    def reset_at_s(self, now_s: float, state: Any) -> float | None:
        """The earliest time >= now_s at which this effect resets the connection, or None.

        An answer may also be an earlier time at which to ask again; callers reset only when
        the answer is now_s itself.
        """
        return None

    # Summaries for profile tables and the netem backend; they do not affect emulation.
    def mean_delay_ms(self) -> float:
        return 0.0

    def mean_loss_rate(self) -> float:
        return 0.0

    def mean_rate_kbit_s(self) -> float | None:
        return None

    def mean_stall_ms(self, size_bytes: int, rtt_ms: float) -> float:
        """Expected recovery stall of a lone message of `size_bytes` (ms); loss effects override."""
        return 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}
