"""Parking idle sessions' KV caches in host memory: when it pays, and whose.

Glossary:
- *busy*: a session's round is in the verifier, from its arrival at the backend to the end of
  the pass that computed it; its KV cache must be in the target's cache.
- *idle gap*: from the end of a session's round to the arrival of its next round (the link's
  round trip and the edge's drafting). Its KV cache sits unused through it.
- *park*: copy a session's KV cells to host memory and free its place in the target's cache;
  *restore*: copy them back into a free place when its next round arrives.

The rule (pure, so the verifier and the fleet model share it):
- park only when the cache is short, i.e. something needs a place and none is free;
- a session is a candidate when it is expected to stay away longer than parking and restoring
  it takes: with a forecast (its mean idle gap so far), when its next round is due later than
  that; without one (no full gap yet), once it has been idle that long (the ski-rental rule:
  idle time already spent pays for the move, which bounds the loss against an oracle by 2x
  whatever the gaps are); a session overdue by more than `OVERDUE` mean gaps (its edge may be
  gone) always;
- among candidates, park the one whose next round is expected last (Belady's rule with the
  forecast). Sessions with no forecast or overdue are expected never and go first, least
  recently used first. Plain least-recently-used is `order="lru"` (with the ski-rental rule
  for every session); on rounds that recur every round trip it parks exactly the session about
  to come back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from spec_core.estimates import ewma

OVERDUE = 2.0          # idle longer than this many mean gaps: expected never


@dataclass(frozen=True)
class ParkCandidate:
    key: int                    # the caller's handle
    idle_since: float           # when its last round's pass ended (s, monotonic)
    nbytes: int                 # host bytes it takes parked
    mean_gap_s: float | None    # its mean idle gap so far; None before its first full gap


@dataclass(frozen=True)
class ParkCost:
    """Seconds to park and restore a session's cells: per byte each way, plus a fixed part.
    The priors (1 GB/s each way) are replaced by measurements as they come (`observed`)."""
    park_s_per_byte: float = 1e-9
    restore_s_per_byte: float = 1e-9
    fixed_s: float = 2e-4

    def seconds(self, nbytes: int) -> float:
        """Expected park + restore time of `nbytes`."""
        return self.fixed_s + nbytes * (self.park_s_per_byte + self.restore_s_per_byte)

    def observed(self, nbytes: int, park_s: float | None = None, restore_s: float | None = None) -> "ParkCost":
        if nbytes <= 0:
            return self
        cost = self
        if park_s is not None:
            cost = replace(cost, park_s_per_byte=ewma(cost.park_s_per_byte, park_s / nbytes))
        if restore_s is not None:
            cost = replace(cost, restore_s_per_byte=ewma(cost.restore_s_per_byte, restore_s / nbytes))
        return cost


def next_use(c: ParkCandidate, now: float) -> float:
    """When the candidate's next round is expected (inf: not expected)."""
    if c.mean_gap_s is None or now - c.idle_since > OVERDUE * c.mean_gap_s:
        return math.inf
    return c.idle_since + c.mean_gap_s


def worth_moving(c: ParkCandidate, now: float, cost: ParkCost, forecast: bool = True) -> bool:
    """Whether the candidate is expected to stay away longer than its move takes."""
    move_s = cost.seconds(c.nbytes)
    if not forecast or c.mean_gap_s is None:
        return now - c.idle_since >= move_s
    due = next_use(c, now)
    return due == math.inf or due - now >= move_s


def choose_victim(candidates: Sequence[ParkCandidate], now: float, cost: ParkCost, bytes_free: int,
                  order: str = "next-use") -> int | None:
    """The key of the session to park now, or None: no candidate is worth moving (see the module
    docstring), or none fits the host bytes left."""
    if order not in ("next-use", "lru"):
        raise ValueError(f"order must be 'next-use' or 'lru', got {order!r}")
    ok = [c for c in candidates if c.nbytes <= bytes_free and worth_moving(c, now, cost, order == "next-use")]
    if not ok:
        return None
    if order == "lru":
        return min(ok, key=lambda c: c.idle_since).key
    # Latest expected next round first; among the never-expected, least recently used first.
    return max(ok, key=lambda c: (next_use(c, now), -c.idle_since)).key


def idle_share(busy_s: float, idle_s: float) -> float | None:
    """Share of a session's time between rounds that its KV cache sat idle."""
    total = busy_s + idle_s
    return idle_s / total if total > 0 else None


def parked_capacity(park_bytes: int, bytes_per_token: int, n_ctx: int) -> int:
    """Sessions that host memory of `park_bytes` holds parked, each at its full context: what
    parking adds to the sessions a cache holds, with no session ever refused a place to park."""
    if park_bytes <= 0 or bytes_per_token <= 0 or n_ctx <= 0:
        return 0
    return park_bytes // (bytes_per_token * n_ctx)
