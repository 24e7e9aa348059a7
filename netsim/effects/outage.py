"""Outages: windows in which the link carries nothing.

The windows are either listed (`windows_s`) or drawn as an on/off process with exponential
up and down times (Mahimahi's `mm-onoff`). Either way they are times on the network's clock,
counted from the run's start (LinkContext.epoch_s), and the on/off draws come from the run's
seed alone: both directions and every connection see the same outages, as they would on one
path.

In "stall" mode data that reaches a down link is held until the link is back (TCP keeps
retransmitting; delivery at the next retransmission after the outage is not modelled).
In "reset" mode, once an outage has lasted `reset_after_s` (think gRPC keepalive timeout
or TCP_USER_TIMEOUT) open connections are reset and new ones are refused until it ends;
shorter outages stall.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from typing import ClassVar

from .base import Chunk, Effect, LinkContext, LinkReset

MODES = ("stall", "reset")
# How far ahead reset_at_s looks through on/off windows before telling the caller to ask again.
_LOOKAHEAD_S = 3600.0


class _OutageSchedule:
    """Absolute (start, end) windows, generated lazily for the on/off process."""

    def __init__(self, settings: Outage, ctx: LinkContext) -> None:
        self.on_off = settings.mean_up_s is not None
        self.starts: list[float] = []
        self.ends: list[float] = []
        if self.on_off:
            # Keyed by the run's seed and the settings only, never by connection or direction.
            self._rng = random.Random(f"outage:{ctx.seed}:{settings.mean_up_s}:{settings.mean_down_s}")
            self._mean_up_s = settings.mean_up_s
            self._mean_down_s = settings.mean_down_s
            self._generated_to_s = ctx.epoch_s
        else:
            for start_s, duration_s in sorted(settings.windows_s):
                self.starts.append(ctx.epoch_s + start_s)
                self.ends.append(ctx.epoch_s + start_s + duration_s)

    def _generate_past(self, t_s: float) -> None:
        while self.on_off and self._generated_to_s <= t_s:
            start_s = self._generated_to_s + self._rng.expovariate(1.0 / self._mean_up_s)
            end_s = start_s + self._rng.expovariate(1.0 / self._mean_down_s)
            self.starts.append(start_s)
            self.ends.append(end_s)
            self._generated_to_s = end_s

    def window_at(self, t_s: float) -> tuple[float, float] | None:
        self._generate_past(t_s)
        i = bisect.bisect_right(self.starts, t_s) - 1
        if i >= 0 and t_s < self.ends[i]:
            return self.starts[i], self.ends[i]
        return None

    def windows_from(self, t_s: float, until_s: float):
        """Windows that end after t_s and start before until_s, in order."""
        self._generate_past(t_s)
        i = max(bisect.bisect_right(self.starts, t_s) - 1, 0)
        while True:
            if i >= len(self.starts):
                if not self.on_off:
                    return
                self._generate_past(self.ends[-1] if self.ends else t_s)
            if self.starts[i] >= until_s:
                return
            if self.ends[i] > t_s:
                yield self.starts[i], self.ends[i]
            i += 1


class _OutageState:
    def __init__(self, settings: Outage, ctx: LinkContext) -> None:
        self.schedule = _OutageSchedule(settings, ctx)
        self.record_stall = ctx.record_stall


@dataclass(frozen=True)
class Outage(Effect):
    kind: ClassVar[str] = "outage"

    windows_s: tuple[tuple[float, float], ...] = ()   # listed outages: (start, duration) in s after the run starts
    mean_up_s: float | None = None     # on/off process: mean time the link stays up (exponential, s)
    mean_down_s: float | None = None   # on/off process: mean outage length (exponential, s)
    mode: str = "stall"                # "stall": hold data until the link is back; "reset": see reset_after_s
    reset_after_s: float = 0.0         # reset mode: reset once an outage has lasted this long (s); shorter ones stall

    def __post_init__(self) -> None:
        # Lists arrive from JSON; keep the dataclass hashable and comparable.
        object.__setattr__(self, "windows_s", tuple((float(s), float(d)) for s, d in self.windows_s))
        on_off = (self.mean_up_s, self.mean_down_s)
        if (None in on_off) != (on_off == (None, None)):
            raise ValueError("give both mean_up_s and mean_down_s, or neither")
        if bool(self.windows_s) == (self.mean_up_s is not None):
            raise ValueError("give either windows_s or mean_up_s/mean_down_s")
        if self.mean_up_s is not None and (self.mean_up_s <= 0 or self.mean_down_s <= 0):
            raise ValueError("mean_up_s and mean_down_s must be > 0")
        if any(s < 0 or d <= 0 for s, d in self.windows_s):
            raise ValueError(f"windows need start >= 0 and duration > 0, got {self.windows_s}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.reset_after_s < 0:
            raise ValueError(f"reset_after_s must be >= 0, got {self.reset_after_s}")

    def new_state(self, ctx: LinkContext) -> _OutageState:
        return _OutageState(self, ctx)

    def _reset_point_s(self, window: tuple[float, float]) -> float | None:
        start_s, end_s = window
        if self.mode == "reset" and end_s - start_s > self.reset_after_s:
            return start_s + self.reset_after_s
        return None

    def departure_s(self, chunk: Chunk, state: _OutageState) -> float:
        t_s = chunk.arrival_s
        while (window := state.schedule.window_at(t_s)) is not None:
            reset_point_s = self._reset_point_s(window)
            if reset_point_s is not None and t_s >= reset_point_s:
                raise LinkReset(f"outage since {window[0]:.3f} s outlasted reset_after_s={self.reset_after_s}")
            # Windows may touch (on/off draws), hence the loop.
            t_s = window[1]
        if t_s > chunk.arrival_s:
            state.record_stall(t_s - chunk.arrival_s)
        return t_s

    def reset_at_s(self, now_s: float, state: _OutageState) -> float | None:
        """The next reset point; for on/off outages, at most an hour ahead (ask again then)."""
        if self.mode != "reset":
            return None
        until_s = now_s + _LOOKAHEAD_S
        for window in state.schedule.windows_from(now_s, until_s):
            reset_point_s = self._reset_point_s(window)
            if reset_point_s is not None:
                return max(now_s, reset_point_s)
        return until_s if state.schedule.on_off else None
