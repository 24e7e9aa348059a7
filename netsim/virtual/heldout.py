"""The planner (`auto`) against the best fixed mode on held-out prompts, on the virtual clock.

Each case (a synthetic grid cell, or a named cost table on a named link) runs every mode on several
prompts, each with its own sampling seed. The best fixed mode is chosen on one half of the prompts
(its mean tokens/s there) and scored on the other half, and the halves swap (two folds): so the bar
is a choice made without seeing the prompts it is scored on, not the maximum of noisy values. A
case's ratio is auto's tokens/s over the chosen mode's on the scoring half, the mean of the folds.

The fixed modes are the edge's speculative shapes that `auto` chooses among (FIXED_MODES); cloud-only
is not a shape of a round (the planner cannot pick it): it is run and reported beside, not in the
bar. `auto-unsteered` is the planner with the verifier's draft budget ignored (steer False): its
ratio says what steering costs a lone session.

    from netsim.virtual.heldout import grid_case, table_case, held_out
    runs = grid_case(Cell(400, 8, 40, 0.0, 0.9, tokens=128), prompts=2)["runs"]   # {seed: {mode: tok/s}}
    held_out(runs)                                                    # {"ratio": 1.02, "chosen": [...], ...}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from netsim.experiment import delay_profile, mode_label
from netsim.profiles import get_profile
from netsim.virtual.costs import load_table, synthetic_table
from netsim.virtual.sweep import Cell, noise_for_alpha, run_modes

FIXED_MODES = ("per-token", "hybrid", "tree", "proactive", "pipeline", "continuations", "window", "fused")
BESIDE = ("cloud-only",)                     # run and shown, not in the bar
UNSTEERED = "auto-unsteered"                  # auto without the verifier's draft budget: what steering costs
GAMMA = 4
# named cases: the shipped tables of the bundled pair's CPU verifier and of GPU verifiers, on named links
TABLES = ("smollm2", "gemma-smollm2", "flat-gpu", "h100-8b-bf16", "h100-70b-fp8")
LINKS = ("lan", "lte", "3g", "geo-sat")
TABLE_ALPHA = 0.65                            # the synthetic draft's acceptance on the named tables


def labels(modes: Iterable[str]) -> list[str]:
    return [mode_label(m, GAMMA) for m in modes]


FIXED = labels(FIXED_MODES)


@dataclass(frozen=True)
class TableCase:
    table: str
    link: str
    alpha: float = TABLE_ALPHA
    tokens: int = 256

    def label(self) -> str:
        return f"{self.table} on {self.link}, α {self.alpha:g}"


def prompt_seeds(prompts: int) -> list[int]:
    return list(range(1, prompts + 1))


def _runs(costs, profile, noise: float, tokens: int, prompts: int, modes: Iterable[str]) -> dict:
    """{"runs": {seed: {mode label: tokens/s}}, "why": {seed: {mode label: {why, shapes}}}}"""
    out, whys = {}, {}
    for seed in prompt_seeds(prompts):
        whys[seed] = {}
        rows = run_modes(costs, profile, noise, tuple(modes), tokens, seed, gamma=GAMMA, prompt=f"prompt {seed}",
                         why=whys[seed])
        out[seed] = {r.mode: r.tokens_per_s for r in rows}
    return {"runs": out, "why": whys}


def grid_case(cell: Cell, prompts: int = 2, modes: Iterable[str] = (*FIXED_MODES, "auto", *BESIDE)) -> dict:
    """_runs for one grid cell (its seed is ignored: each prompt has its own)."""
    costs = synthetic_table(cell.draft_ms / 1e3, cell.pass_ms / 1e3, cell.slope * cell.pass_ms / 1e3,
                            name=f"synthetic cell: {cell.label()}")
    return _runs(costs, delay_profile(cell.rtt_ms), noise_for_alpha(cell.alpha), cell.tokens, prompts, modes)


def table_case(case: TableCase, prompts: int = 2, modes: Iterable[str] = (*FIXED_MODES, "auto", *BESIDE)) -> dict:
    """_runs for a named cost table on a named link."""
    return _runs(load_table(case.table), get_profile(case.link), noise_for_alpha(case.alpha), case.tokens,
                 prompts, modes)


def held_out(runs: dict, auto: str = "auto", fixed: Iterable[str] = FIXED) -> dict:
    """auto over the best fixed mode chosen on the other half of the prompts (module docstring)."""
    seeds = sorted(runs)
    if len(seeds) < 2:
        raise ValueError("held-out needs at least two prompts")
    halves = (seeds[::2], seeds[1::2])
    fixed = [m for m in fixed if all(m in runs[s] for s in seeds)]

    def mean(mode: str, half: list[int]) -> float:
        return sum(runs[s][mode] for s in half) / len(half)
    ratios, chosen = [], []
    for pick, score in (halves, halves[::-1]):
        best = max(fixed, key=lambda m: (mean(m, pick), m))
        chosen.append(best)
        ratios.append(mean(auto, score) / max(mean(best, score), 1e-12))
    every = {m: mean(m, seeds) for m in runs[seeds[0]]}
    in_sample = max(every[m] for m in fixed)
    unsteered = None
    if all(UNSTEERED in runs[s] for s in seeds):
        unsteered = sum(mean(UNSTEERED, score) / max(mean(best, score), 1e-12)
                        for (pick, score), best in zip((halves, halves[::-1]), chosen)) / 2
    return {"ratio": sum(ratios) / len(ratios), "folds": ratios, "chosen": chosen, "ratio_unsteered": unsteered,
            "auto": every[auto], "in_sample_best": in_sample, "ratio_in_sample": every[auto] / max(in_sample, 1e-12),
            "means": every}


def meets(ratios: list[float], share: float = 0.95, floor: float = 0.85, bar: float = 0.95) -> bool:
    """The goal: at least `share` of the ratios ≥ `bar`, none below `floor`."""
    return bool(ratios) and min(ratios) >= floor and sum(r >= bar for r in ratios) >= share * len(ratios)
