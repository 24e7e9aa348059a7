"""Fast sweeps on the virtual clock: the synthetic pair over a grid of links and costs, every mode.

A cell is one link and one set of costs: the round trip (a pure delay, half each way), drafting per
row, the verifier's pass (its base, and a per-token slope as a share of the base), and the draft's
acceptance α (the synthetic draft's noise, chosen so that the expected acceptance Σ min(p, q) at the
workload's sampling is α). Every mode of the experiment runs the same prompt for `tokens` tokens on
the shipped edge loop and engine (netsim.virtual.experiment's machinery); a cell returns tokens/s
per mode. Cells are independent and deterministic, so a grid runs them in worker processes.

    from netsim.virtual.sweep import Cell, run_cell, run_grid, default_grid
    run_cell(Cell(rtt_ms=300, draft_ms=10, pass_ms=40, slope=0.0, alpha=0.65))   # {"per-token": 4.1, ...}
    run_grid(default_grid(), workers=2)                                             # [CellResult, ...]

`netsim sweep` runs a grid and writes sweep.json, sweep.md and the plots (netsim.virtual.sweep_report).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from netsim.experiment import ALL_MODES, ExperimentConfig, Runner, delay_profile, expand_modes, make_row
from netsim.virtual import loop as vloop
from netsim.virtual.channel import InProcessChannel
from netsim.virtual.costs import synthetic_table
from netsim.virtual.experiment import costed_client

SWEEP_MODES = tuple(m for m in ALL_MODES if m != "edge-only")   # edge-only is the draft alone: no quality
WORKLOAD = "chat"          # the sampling of every cell (T 0.7, top-p 0.95)
VOCAB = 64


@dataclass(frozen=True)
class Cell:
    rtt_ms: float          # link round trip (pure delay, half each way)
    draft_ms: float        # drafting per row
    pass_ms: float         # the verifier's pass: its base
    slope: float = 0.0     # per token of the pass, as a share of its base (0: flat, GPU-like; 1: CPU-like)
    alpha: float = 0.65    # the draft's expected per-token acceptance at the workload's sampling
    tokens: int = 256
    seed: int = 1

    def label(self) -> str:
        return (f"rtt {self.rtt_ms:g} ms, draft {self.draft_ms:g} ms/row, pass {self.pass_ms:g} ms "
                f"+ {self.slope:.0%}/token, α {self.alpha:g}")


@dataclass
class CellResult:
    cell: Cell
    noise: float                                  # the synthetic draft's noise that gives the cell's α
    tokens_per_s: dict[str, float]                # per mode
    measured_alpha: dict[str, float | None] = field(default_factory=dict)   # per mode: accepted / (accepted + rejected)
    round_trips_per_token: dict[str, float] = field(default_factory=dict)

    @property
    def best(self) -> str:
        return max(self.tokens_per_s, key=lambda m: (self.tokens_per_s[m], m))

    def to_dict(self) -> dict:
        return {**asdict(self), "best": self.best}


@functools.lru_cache(maxsize=None)
def expected_alpha(noise: float, temperature: float = 0.7, top_p: float = 0.95) -> float:
    """Σ min(p, q) averaged over the synthetic pair's contexts (order 1: every context is one token)."""
    from spec_core.synthetic import synthetic_pair
    from spec_core.warping import processed_probs
    target, draft = synthetic_pair(VOCAB, 0, noise)
    return float(np.mean([np.minimum(processed_probs(target.logits([c]), temperature, 0, top_p),
                                     processed_probs(draft.logits([c]), temperature, 0, top_p)).sum()
                          for c in range(VOCAB)]))


@functools.lru_cache(maxsize=None)
def noise_for_alpha(alpha: float) -> float:
    """The draft noise whose expected acceptance is `alpha` (bisection; rounded to 0.001 so that every
    machine picks the same draft)."""
    if not 0.05 < alpha < 0.99:
        raise ValueError(f"alpha must be in (0.05, 0.99), got {alpha}")
    lo, hi = 0.0, 8.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_alpha(mid) > alpha else (lo, mid)
    return round((lo + hi) / 2, 3)


def _config(cell: Cell, noise: float, modes: Iterable[str]) -> ExperimentConfig:
    return ExperimentConfig(profiles=[], modes=list(modes), out=Path("."), workloads=[WORKLOAD],
                            max_tokens=cell.tokens, seed=cell.seed, synthetic=True, synthetic_alpha_noise=noise,
                            synthetic_draft_ms=0.0, crossover=False)


def run_cell(cell: Cell, modes: Iterable[str] = SWEEP_MODES, gamma: int = 4,
             make_verifier: Callable | None = None, prompt: str = "sweep") -> CellResult:
    """Every mode on one cell (module docstring); deterministic for the cell."""
    noise = noise_for_alpha(cell.alpha)
    costs = synthetic_table(cell.draft_ms / 1e3, cell.pass_ms / 1e3, cell.slope * cell.pass_ms / 1e3,
                            name=f"synthetic cell: {cell.label()}")
    rows = run_modes(costs, delay_profile(cell.rtt_ms), noise, modes, cell.tokens, cell.seed, gamma=gamma,
                     make_verifier=make_verifier, prompt=prompt)
    return CellResult(cell, noise, {r.mode: r.tokens_per_s for r in rows}, {r.mode: r.alpha for r in rows},
                      {r.mode: r.round_trips_per_token for r in rows})


def run_modes(costs, profile, noise: float, modes: Iterable[str], tokens: int, seed: int, gamma: int = 4,
              make_verifier: Callable | None = None, prompt: str = "sweep", why: dict | None = None) -> list:
    """The synthetic pair (draft noise `noise`) on one cost table and link profile: one run of `tokens`
    tokens per mode, each on a new connection of the profile's network; the experiment's rows (and in
    `why`, per mode, the planner's reasons for its last round and the shapes it sent)."""
    if make_verifier is None:
        from hybridspec.virtual import make_verifier
    cell = Cell(0, 0, 0, tokens=tokens, seed=seed)
    cfg = _config(cell, noise, modes)

    async def main():
        runner = Runner(cfg)
        verifier = make_verifier(runner.verifier_args(), costs)
        client = costed_client(costs)
        ids = runner.prompt_ids(prompt)
        rows = []
        try:
            for mode, g in expand_modes(cfg.modes, [gamma]):
                # a mode's connection number is its place among every mode: its link draws are the same
                # whichever modes run beside it
                number = SWEEP_MODES.index(mode) if mode in SWEEP_MODES else len(SWEEP_MODES)
                channel = InProcessChannel(verifier.server, profile, costs, seed=seed, first_connection=number)
                st, cross = await runner.run_on(channel, "in-process", mode, g, ids,
                                                runner.settings(WORKLOAD, tokens), None, client_class=client)
                rows.append(make_row(profile, mode, g, WORKLOAD, 0, st, channel.counts.bytes_up,
                                     channel.counts.bytes_down, cross))
                if why is not None:
                    why[rows[-1].mode] = {"why": getattr(st, "plan_reasons", ""), "shapes": rows[-1].shapes}
        finally:
            verifier.close()
        return rows
    random.seed(seed)
    return vloop.run(main)


def default_grid(tokens: int = 256) -> list[Cell]:
    """216 cells: RTT 1-600 ms (6) x drafting 1-30 ms/row (3) x pass 5-150 ms (3) x slope 0 or 100 %
    of the base (2) x α 0.4 or 0.9 (2)."""
    return [Cell(rtt, draft, pass_, slope, alpha, tokens)
            for rtt, draft, pass_, slope, alpha in itertools.product(
                (1, 20, 80, 200, 400, 600), (1, 8, 30), (5, 40, 150), (0.0, 1.0), (0.4, 0.9))]


def run_grid(cells: list[Cell], workers: int = 2, modes: Iterable[str] = SWEEP_MODES, progress=None) -> list[CellResult]:
    """run_cell over `cells` in `workers` processes (1: in this one); results in the cells' order."""
    modes = tuple(modes)
    if workers <= 1:
        out = []
        for cell in cells:
            out.append(run_cell(cell, modes))
            if progress:
                progress(cell)
        return out
    import multiprocessing
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_cell, cell, modes) for cell in cells]
        out = []
        for cell, fut in zip(cells, futures):
            out.append(fut.result())
            if progress:
                progress(cell)
        return out


def grid_result(results: list[CellResult], modes: Iterable[str]) -> dict:
    """What `netsim sweep` writes: the cells, their tokens/s per mode and best mode; virtual clock."""
    return {"clock": "virtual", "cost_table": "per cell: the synthetic pair with the cell's chosen costs "
                                              "(netsim.virtual.costs.synthetic_table), pure-delay links",
            "pair": "synthetic", "workload": WORKLOAD, "modes": list(modes),
            "cells": [r.to_dict() for r in results]}


def cell_from_dict(d: dict) -> Cell:
    return Cell(**{f.name: d[f.name] for f in dataclasses.fields(Cell)})
