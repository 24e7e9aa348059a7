"""The two places the virtual clock charges model work from the cost table: a drafter's calls on the
edge, and a batcher's passes on the verifier. Both wrap the shipped object and leave what it
computes alone: the tokens drafted, the logits of a pass, so acceptance stays real; only the time
is the table's.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from netsim.virtual.costs import CostTable
from spec_core import clock


class CostedDrafter:
    """A drafter whose calls charge drafting from the table: draft_base_s + draft_row_s · rows, rows
    being the positions a chain drafts or the rows a tree's growth evaluates (at the table's tree rate:
    a level's rows are one batch). The draft's own
    `seconds` become that charge (the planner learns the table's drafting time, as it would learn
    the device's). Everything else is the wrapped drafter's."""

    def __init__(self, inner, costs: CostTable):
        self.inner, self.costs = inner, costs
        self.calls = 0
        self.rows = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _charge(self, rows: int, tree: bool = False) -> float:
        seconds = self.costs.edge.draft_s(rows, tree)
        self.calls += 1
        self.rows += rows
        clock.charge(seconds)
        return seconds

    def propose(self, committed: Sequence[int], gamma: int, settings, qmode, rng):
        d = self.inner.propose(committed, gamma, settings, qmode, rng)
        if gamma <= 0:   # nothing drafted (cloud-stepwise): no call worth charging
            return dataclasses.replace(d, seconds=0.0)
        return dataclasses.replace(d, seconds=self._charge(max(len(d.tokens), 1)))

    def propose_tree(self, committed, shape, settings, qmode, rng):
        d = self.inner.propose_tree(committed, shape, settings, qmode, rng)
        return dataclasses.replace(d, seconds=self._charge(d.rows, tree=True))


class CostedPacker:
    """A batcher's packer whose passes charge the table's pass line: tokens are the pass's items, rows
    the items whose logits are read. Charged inside the batcher's pass (its `decode`), so the
    batcher's own timing of the pass, its cost line and the draft budget priced from it read the
    table's time."""

    def __init__(self, inner, costs: CostTable):
        self.inner, self.costs = inner, costs
        self.passes = 0
        self.tokens = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, items):
        out = self.inner.decode(items)
        rows = sum(1 for it in items if it.want_logits)
        self.passes += 1
        self.tokens += len(items)
        clock.charge(self.costs.verifier.pass_s(len(items), rows))
        return out
