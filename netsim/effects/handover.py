"""LEO satellite handovers: a path that changes on a fixed, globally synchronised beat.

Starlink reallocates users to satellites every 15 s, network-wide; measurements show loss
bursts and latency steps at those boundaries (APNIC blog 2022-11-28 (UCLouvain et al.):
bursts "up to 50% of packets"; Mohan et al. arXiv 2310.09242; IMC 2022 browser-side view).
Here each interval of `period_s` (counted from the run's start) gets its own extra one-way
delay, drawn from the run's seed so that every connection sees the same step, and for
`burst_ms` after each boundary segments are lost with probability `burst_loss`; a loss
becomes a retransmission stall as in `loss.py`. The burst length and the step size are our
assumptions, not published figures.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar

from .base import Chunk, Effect, LinkContext
from .loss import _check_probability, stalled_departure_s


class _HandoverState:
    def __init__(self, settings: Handover, ctx: LinkContext) -> None:
        self.settings = settings
        self.rng = ctx.rng
        self.epoch_s = ctx.epoch_s
        self.seed = ctx.seed
        self.rtt_s = ctx.rtt_s if settings.rtt_ms is None else settings.rtt_ms / 1000.0
        self.record_stall = ctx.record_stall
        self._step_interval = -1
        self._step_ms = 0.0

    def step_ms(self, interval: int) -> float:
        if interval != self._step_interval:
            # One generator per interval, keyed by the run's seed: the same step on every connection.
            draw = random.Random(f"handover:{self.seed}:{interval}").random()
            self._step_interval, self._step_ms = interval, draw * self.settings.delay_step_ms
        return self._step_ms

    def in_burst(self, t_s: float) -> bool:
        since_boundary_s = (t_s - self.epoch_s) % self.settings.period_s
        return since_boundary_s < self.settings.burst_ms / 1000.0

    def lost_at(self, t_s: float) -> bool:
        return self.in_burst(t_s) and self.rng.random() < self.settings.burst_loss


@dataclass(frozen=True)
class Handover(Effect):
    kind: ClassVar[str] = "handover"

    period_s: float = 15.0          # time between reconfigurations (s); Starlink's is 15 s
    burst_ms: float = 100.0         # how long after each boundary the loss burst lasts (ms; assumption)
    burst_loss: float = 0.5         # per-segment loss probability during the burst
    delay_step_ms: float = 0.0      # each interval adds an extra one-way delay drawn U(0, delay_step_ms) (ms)
    rtt_ms: float | None = None     # RTT the sender's timers assume (ms); None = the path's (LinkContext.rtt_s)

    def __post_init__(self) -> None:
        _check_probability("burst_loss", self.burst_loss)
        if self.period_s <= 0 or self.burst_ms < 0 or self.delay_step_ms < 0:
            raise ValueError("period_s must be > 0; burst_ms and delay_step_ms >= 0")

    def new_state(self, ctx: LinkContext) -> _HandoverState:
        return _HandoverState(self, ctx)

    def departure_s(self, chunk: Chunk, state: _HandoverState) -> float:
        arrival_s = chunk.arrival_s
        interval = math.floor((arrival_s - state.epoch_s) / self.period_s)
        stepped_s = arrival_s + state.step_ms(interval) / 1000.0
        if not state.in_burst(arrival_s):
            return stepped_s
        return stalled_departure_s(
            Chunk(chunk.size_bytes, stepped_s),
            lambda: state.lost_at(arrival_s),
            state.rtt_s,
            lambda elapsed_s: state.lost_at(arrival_s + elapsed_s),
            state.record_stall,
        )

    def mean_delay_ms(self) -> float:
        return self.delay_step_ms / 2.0

    def mean_loss_rate(self) -> float:
        return self.burst_loss * min(self.burst_ms / 1000.0 / self.period_s, 1.0)
