"""The planner (`auto`) against the held-out best fixed mode on a fixed subset of the virtual grid
(netsim.virtual.heldout; the whole grid: bench/planner_grid.py, docs/window.md).

Each cell runs `auto` and the fixed modes that were best there on the whole grid (chosen from
bench/results/planner-grid.json: a mode that never wins in a cell cannot set its bar), on two
prompts of CELL_TOKENS tokens; the best is chosen on one prompt and scored on the other, both ways.
The virtual clock makes every figure the cost model's: the same on every run and machine load, so
the rule cannot flake. Cells the grid found at ≥ 0.95× are held to 0.95×, the others (among them
the grid's worst) to the floor, 0.85×; one cell below the floor at these short replies is a strict
xfail (MISSED).
"""
from __future__ import annotations

import dataclasses

import pytest

from netsim.virtual.heldout import held_out, labels, meets
from netsim.virtual.sweep import Cell

CELL_TOKENS = 48
PROMPTS = 2
FLOOR, BAR = 0.85, 0.95

# (cell, the fixed modes that were the held-out best there on the whole grid, the bar it is held to:
# 0.95, or the floor 0.85 for the cells where the grid found auto under 0.95, the grid's 5 % allowance)
CASES = [
    (Cell(80, 30, 5, 0.0, 0.9), ("hybrid", "fused", "window"), BAR),   # fusing with costly drafting
    (Cell(400, 8, 150, 1.0, 0.9), ("continuations", "pipeline"), BAR),  # a CPU-like verifier far away
    (Cell(600, 30, 40, 1.0, 0.4), ("continuations", "window"), FLOOR),
    (Cell(1, 8, 150, 0.0, 0.9), ("fused",), FLOOR),                    # a flat, costly verifier next door
    (Cell(400, 8, 40, 1.0, 0.4), ("proactive", "continuations"), FLOOR),
    (Cell(20, 1, 40, 1.0, 0.9), ("continuations",), BAR),
    (Cell(200, 8, 5, 0.0, 0.9), ("fused", "tree"), BAR),
    (Cell(1, 30, 5, 1.0, 0.9), ("per-token", "hybrid"), FLOOR),        # drafting ahead outlasts the reply
    # the grid's worst cell with 128-token replies (under the floor there); above it at 48 tokens
    (Cell(200, 30, 40, 1.0, 0.9), ("pipeline",), FLOOR),
]
# Below the floor with the test's 48-token replies (0.90× on the grid's 128): low α, a long round
# trip, costly drafting and a flat pass, where the fixed 16-node tree (or a pipelined chain) wins and
# auto, judging its trees from the few rounds it tries them, stays with short chains while it learns.
# Held as a strict xfail: it fails the suite once fixed.
MISSED = [(Cell(600, 30, 150, 0.0, 0.4), ("pipeline", "tree"), FLOOR)]


def ratio(cell: Cell, fixed: tuple[str, ...]) -> float:
    from netsim.virtual.heldout import grid_case
    runs = grid_case(dataclasses.replace(cell, tokens=CELL_TOKENS), PROMPTS, (*fixed, "auto"))["runs"]
    return round(held_out(runs, fixed=labels(fixed))["ratio"], 3)


def test_held_out_chooses_on_one_half_and_scores_on_the_other():
    # mode "a" is best on prompt 1 only by luck; "b" is steadily good: auto is measured against the
    # choice made on the other prompt, never against the larger of the two noisy values
    runs = {1: {"a": 12.0, "b": 10.0, "auto": 10.0}, 2: {"a": 6.0, "b": 10.0, "auto": 10.0}}
    h = held_out(runs, fixed=("a", "b"))
    assert h["chosen"] == ["a", "b"]
    assert h["folds"] == [10.0 / 6.0, 1.0]
    assert h["ratio_in_sample"] == 1.0   # b's mean, 10, is the in-sample best (a's is 9)
    with pytest.raises(ValueError):
        held_out({1: runs[1]}, fixed=("a", "b"))


def test_the_rule_fails_a_planner_that_trails():
    # negative control for the rule the grid is held to
    assert meets([1.0] * 19 + [0.96])
    assert not meets([1.0] * 19 + [0.84])          # one cell below the floor
    assert not meets([1.0] * 18 + [0.9, 0.9])      # 90 % of the cells at the bar


def test_auto_holds_the_held_out_best_on_a_subset_of_the_grid():
    ratios = {cell.label(): (ratio(cell, fixed), bar) for cell, fixed, bar in CASES}
    assert all(r >= bar for r, bar in ratios.values()), ratios


@pytest.mark.xfail(strict=True, reason="below the floor at 48-token replies (MISSED)")
@pytest.mark.parametrize("cell,fixed,bar", MISSED)
def test_a_cell_below_the_floor_at_short_replies(cell, fixed, bar):
    assert ratio(cell, fixed) >= bar
