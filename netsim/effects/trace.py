"""Trace replay in Mahimahi's format (mm-link(1)).

Each line of a trace is a time in milliseconds at which the link can deliver one packet of
1500 bytes. Accounting is per byte: a chunk uses what is left of the current opportunity and
then as many more as it needs, and leaves at the opportunity that carries its last byte.
Opportunities that pass with nothing queued are wasted, and the trace repeats with a period
equal to its last timestamp. Trace time 0 is the run's start (LinkContext.epoch_s), as in a
Mahimahi shell. The queue is unbounded, Mahimahi's default (`--uplink-queue=infinite`).
"""
from __future__ import annotations

import bisect
import functools
import importlib.resources
import math
import os
from pathlib import Path
from dataclasses import dataclass
from typing import ClassVar

from .base import Chunk, Effect, LinkContext

PACKET_BYTES = 1500   # bytes per delivery opportunity, fixed by the format


@functools.lru_cache(maxsize=16)
def load_trace(trace: str) -> tuple[int, ...]:
    """Opportunity times (ms) from a trace file path or the name of a bundled trace (cached by name)."""
    if os.path.exists(trace):
        text = Path(trace).read_text(encoding="ascii")
    else:
        bundled = importlib.resources.files("netsim").joinpath("traces").joinpath(trace)
        if not bundled.is_file():
            raise FileNotFoundError(f"no trace file {trace!r}, and no bundled trace of that name")
        text = bundled.read_text(encoding="ascii")
    times_ms = tuple(int(line) for line in text.split())
    if not times_ms:
        raise ValueError(f"trace {trace!r} is empty")
    if any(b < a for a, b in zip(times_ms, times_ms[1:])) or times_ms[0] < 0:
        raise ValueError(f"trace {trace!r}: timestamps must be non-negative and non-decreasing")
    if times_ms[-1] <= 0:
        raise ValueError(f"trace {trace!r}: the last timestamp (the period) must be > 0 ms")
    return times_ms


class _TraceState:
    def __init__(self, times_ms: tuple[int, ...], epoch_s: float) -> None:
        self.times_ms = times_ms
        self.period_ms = times_ms[-1]
        self.epoch_s = epoch_s
        self.index = -1          # absolute opportunity index last used (counts across repeats)
        self.bytes_left = 0      # bytes still free in that opportunity

    def time_ms(self, index: int) -> float:
        cycle, i = divmod(index, len(self.times_ms))
        return cycle * self.period_ms + self.times_ms[i]

    def first_index_at_or_after(self, t_ms: float) -> int:
        cycle = math.floor(t_ms / self.period_ms)
        i = bisect.bisect_left(self.times_ms, t_ms - cycle * self.period_ms)
        if i == len(self.times_ms):
            cycle, i = cycle + 1, 0
        return cycle * len(self.times_ms) + i


@dataclass(frozen=True)
class Trace(Effect):
    kind: ClassVar[str] = "trace"

    trace: str   # a Mahimahi trace file: a path, or the name of a bundled trace in netsim/traces/

    def __post_init__(self) -> None:
        load_trace(self.trace)   # fail when the profile is built, not on the first chunk

    def new_state(self, ctx: LinkContext) -> _TraceState:
        return _TraceState(load_trace(self.trace), ctx.epoch_s)

    def departure_s(self, chunk: Chunk, state: _TraceState) -> float:
        arrival_ms = (chunk.arrival_s - state.epoch_s) * 1000.0
        index, bytes_left = state.index, state.bytes_left
        if bytes_left == 0 or state.time_ms(index) < arrival_ms:
            # The chunk cannot use an opportunity that passed before it arrived.
            index = max(index + 1, state.first_index_at_or_after(arrival_ms))
            bytes_left = PACKET_BYTES
        remaining = max(chunk.size_bytes, 1)
        while remaining > bytes_left:
            remaining -= bytes_left
            index += 1
            bytes_left = PACKET_BYTES
        state.index, state.bytes_left = index, bytes_left - remaining
        return state.epoch_s + state.time_ms(index) / 1000.0

    def mean_rate_kbit_s(self) -> float:
        times_ms = load_trace(self.trace)
        return len(times_ms) * PACKET_BYTES * 8 / times_ms[-1]   # bits per ms = kbit/s
