"""The fleet model's inputs for rounds in flight, read from the project's own measurements.

The regime map and the per-cell simulation charge a window of rounds in flight with what the edges
were measured to do, not with what a model of continuations would hope:

  guess          the chance that a continuation's guessed corrected or bonus token is right. Fitted
                 so that the model of which outcomes the continuations cover
                 (spec_core.continuations.chain_outcomes, as `regime.hit_probability` uses it) gives the
                 hits measured, pooled over every run of bench/continuations/summary.json (the
                 `netsim experiment` runs of docs/continuations.md: pipeline rounds, one continuation a
                 round, and continuations rounds, several), each run at its own α and continuations
                 per round.
  window         rounds in flight: docs/window.md's runs kept a mean of 2.00–2.29 rounds in flight
                 (`window_depth`) in every profile with a window of up to 4 allowed; the depth model
                 declines a third round when the uplink is the slowest stage. So 2, not 4.
  bytes per continuation   upload bytes a continuation adds to its round: the runs' extra bytes up
                 (continuations against the plain chain of the same pair and profile) over the
                 continuations they sent.
  drafting       every continuation is a chain of γ drafted tokens on the device: a round with c
                 continuations costs the edge (1 + c)·γ·draft_s (none is free).

A run is left out where its counters disagree with themselves (more hits than continuations sent).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spec_core.continuations import chain_outcomes

ROOT = Path(__file__).resolve().parents[2]
CONTINUATIONS_SUMMARY = ROOT / "bench" / "continuations" / "summary.json"
# docs/window.md, the `rounds in flight` column of its window-g4 rows (every profile, three runs).
WINDOW_DEPTH_MEASURED = (2.00, 2.29)
MEASURED_GAMMA = 4   # the runs' γ


@dataclass(frozen=True)
class HitRun:
    """One measured run with rounds in flight."""
    pair: str
    profile: str
    mode: str
    alpha: float
    rounds: int               # rounds sent with continuations
    continuations: float      # sent per round
    hits: int
    extra_up_bytes: float     # bytes up beyond the plain chain's, over the run


@dataclass(frozen=True)
class MeasuredInputs:
    guess: float
    window: int
    bytes_per_continuation: float
    runs: tuple[HitRun, ...]
    source: str

    def describe(self) -> str:
        hits = sum(r.hits for r in self.runs)
        rounds = sum(r.rounds for r in self.runs)
        return (f"guess {self.guess:.2f} (fitted to {hits} hits in {rounds} rounds of {len(self.runs)} runs, "
                f"{self.source}); window {self.window} (docs/window.md: {WINDOW_DEPTH_MEASURED[0]:.2f}–"
                f"{WINDOW_DEPTH_MEASURED[1]:.2f} rounds in flight); {self.bytes_per_continuation:.0f} B up per "
                f"continuation; drafting (1 + continuations)·γ tokens a round")


def hit_runs(summary: list[dict]) -> list[HitRun]:
    chains = {(r["pair"], r["profile"]): r for r in summary if r["mode"].startswith("hybrid")}
    runs = []
    for r in summary:
        if not r.get("continuation_rounds") or not r["mode"].startswith(("pipeline", "continuations")):
            continue
        if r["continuation_hits"] > r["continuations_sent"]:
            continue   # counters that disagree with themselves
        chain = chains.get((r["pair"], r["profile"]))
        extra = ((r["bytes_up_per_token"] - chain["bytes_up_per_token"]) * r["tokens"]) if chain else 0.0
        runs.append(HitRun(r["pair"], r["profile"], r["mode"], r["alpha"], r["continuation_rounds"],
                           r["continuations_sent"] / r["continuation_rounds"], r["continuation_hits"], max(extra, 0.0)))
    return runs


def fit_guess(runs: list[HitRun]) -> float:
    """The guess at which the model's hits, summed over the runs (each at its α, γ and continuations per
    round), equal the hits measured: bisection (the model's hits grow with the guess)."""
    measured = sum(r.hits for r in runs)

    def predicted(guess: float) -> float:
        return sum(r.rounds * hit_probability(r.alpha, MEASURED_GAMMA, guess, max(1, round(r.continuations)))
                   for r in runs)
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def hit_probability(alpha: float, gamma: int, guess: float, continuations: int) -> float:
    """The chance that one of the edge's `continuations` is what the round in flight commits: the most
    probable outcomes (spec_core.continuations.chain_outcomes), each corrected or bonus token guessed
    right with probability `guess` (its top candidate; the next ones each (1 − guess) as likely)."""
    if continuations <= 0:
        return 0.0
    candidates = [(1000 + i, guess * (1.0 - guess) ** i) for i in range(4)]
    outcomes = chain_outcomes(list(range(1, gamma + 1)), alpha, [candidates] * gamma, candidates, continuations)
    return min(1.0, sum(o.prob for o in outcomes))


def hit_probability_curve(curve, gamma: int, guess: float, continuations: int) -> float:
    """`hit_probability` with acceptance by position (netsim.fleet.acceptance.Curve): the round stops at
    draft j with probability reach(j) − reach(j + 1) and takes the bonus with reach(γ); the outcomes
    are ranked as spec_core.continuations.chain_outcomes ranks them, and the `continuations` most
    probable are covered. A flat curve gives hit_probability's figure."""
    if continuations <= 0:
        return 0.0
    cands = [guess * (1.0 - guess) ** i for i in range(4)]
    probs = []
    for j in range(gamma):
        stop = curve.at(j) - curve.at(j + 1)
        probs += [(stop * c, j + 1) for c in cands if c > 0]
    probs += [(curve.at(gamma) * c, gamma + 1) for c in cands if c > 0]
    probs.sort(key=lambda pc: (-pc[0], pc[1]))
    return min(1.0, sum(p for p, _ in probs[:continuations]))


def load_measured(path: Path = CONTINUATIONS_SUMMARY) -> MeasuredInputs:
    runs = hit_runs(json.loads(Path(path).read_text()))
    sent = sum(r.continuations * r.rounds for r in runs if r.mode.startswith("continuations"))
    extra = sum(r.extra_up_bytes for r in runs if r.mode.startswith("continuations"))
    return MeasuredInputs(guess=fit_guess(runs), window=round(WINDOW_DEPTH_MEASURED[0]),
                          bytes_per_continuation=extra / sent if sent else 0.0, runs=tuple(runs),
                          source=str(Path(path).resolve().relative_to(ROOT)) if Path(path).resolve().is_relative_to(ROOT)
                          else str(path))
