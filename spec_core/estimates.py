"""Estimates both ends keep as rounds go, written once: a cost line and the acceptance rate.

Glossary:
  *cost line*   y = base + slope · x by least squares over recent (x, y) points: seconds of a pass or
                round (y) against its size (x: tokens, nodes, bytes). Costs are never negative, so the
                slope is clamped to ≥ 0 (and at most `max_slope`) and the base, taken through the means
                with that slope, floored at 0;
  *acceptance*  α, the per-token acceptance of a session's drafts: accepted / tested drafts, where the
                first rejected draft counts as tested and the drafts after it do not (the geometric
                model's maximum-likelihood estimate), with a Beta(1, 1) prior (1 accepted of 2 tested,
                α = 0.5 before any round), forgotten at `decay` per round (1.0: never forgotten);
  *running mean* an exponentially weighted moving average: the first value as is, then each new one
                weighted `weight` against the mean so far (`ewma`).

Who uses them: the verifier's pass cost (spec_core.steering.PassCostLine) and each session's α for its
draft budget (Acceptance, in cloud_verifier); the edge's adaptive γ and tree planner (verifier time
over γ or nodes, α), its continuations (uplink seconds per byte); the fleet simulator runs the
verifier's own, through spec_core.steering.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence


class Line(NamedTuple):
    base: float    # y at x = 0
    slope: float   # y per unit of x


def x_varies(points: Sequence[tuple[float, float]]) -> bool:
    """Whether the points' x spread enough to fit a slope (relative to their size, so rounding of
    equal sizes does not count as spread)."""
    if len(points) < 2:
        return False
    mx = sum(x for x, _ in points) / len(points)
    return sum((x - mx) ** 2 for x, _ in points) >= 1e-9 * max(1.0, mx * mx)


def fit_line(points: Sequence[tuple[float, float]], max_slope: float = math.inf) -> Line:
    """The cost line through `points` (see the glossary). No points: Line(0, 0); x that does not
    vary: slope 0 and base the mean y (nothing to fit a slope to)."""
    if not points:
        return Line(0.0, 0.0)
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = 0.0
    if x_varies(points):
        var = sum((x - mx) ** 2 for x, _ in points)
        slope = min(max(sum((x - mx) * (y - my) for x, y in points) / var, 0.0), max_slope)
    return Line(max(0.0, my - slope * mx), slope)


EWMA_WEIGHT = 0.2      # the weight of a new observation in a running mean, unless the caller says


def ewma(mean: float | None, value: float, weight: float = EWMA_WEIGHT) -> float:
    """The running mean after `value` (see the glossary); `mean` None: no value before."""
    return value if mean is None else (1 - weight) * mean + weight * value


class Acceptance:
    """Per-token acceptance α of one session's drafts (see the glossary)."""

    def __init__(self, decay: float = 0.9):
        self.decay, self.accepted, self.tested = decay, 1.0, 2.0

    def observe(self, drafted: int, accepted: int, rejected: bool) -> None:
        """One round: `drafted` drafts sent, the first `accepted` accepted, `rejected` whether the
        one after them was rejected (False when all were accepted). A round with no drafts says nothing."""
        if drafted > 0:
            self.accepted = self.decay * self.accepted + accepted
            self.tested = self.decay * self.tested + accepted + (1 if rejected else 0)

    @property
    def alpha(self) -> float:
        return self.accepted / self.tested

