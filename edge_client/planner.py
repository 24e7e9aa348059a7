"""The planner: before each round, the round's shape from what the session has measured.

A round's shape is: chain or tree and its size (γ, the tree's budget), how many rounds are in flight
(the window's depth), and whether continuations for its outcomes travel ahead (drafted during the
round trip, sent as a pipelined round or kept for when the reply matches) or fused (sent with the
round, verified in its own pass). Each choice reuses the cost model that already made it for its
option, fed the same measurements (round trip, uplink per byte, drafting per row, the verifier's
time per node, acceptance):

- γ: edge_client.gamma.AdaptiveGamma (spec_core.costmodel.best_gamma);
- chain or tree, and its size: edge_client.gamma.TreePolicy;
- depth: edge_client.window.window_depth (a round more in flight pays while the rounds in flight do
  not cover the round trip and the chance it runs times what it hides beats what a miss costs);
- continuations: edge_client.continuations (how many outcomes pay, ahead or fused: FusedBudget);
  fused only when the window's depth is 1 (a deeper window already sends the next round ahead, and
  the verifier fuses a waiting round into its predecessor's pass by itself).

An option that is set pins its choice (Speculation.planned lists those left to the planner); the
verifier's draft budget (VerifyReply.budget) binds γ and tree size (TreePolicy.steer), and a budget
of one draft or none keeps a single round in flight, unfused.

`pinned_choices`: with the inputs pinned (Speculation.plan_inputs), the planner chooses once, from
those inputs, with the same models, and keeps that shape: a seeded run then repeats.
"""
from __future__ import annotations

from collections import Counter

from edge_client import window as window_mod
from edge_client.continuations import FusedBudget
from edge_client.gamma import RoundPlan, TreePolicy
from spec_core.costmodel import RoundCosts, best_gamma, expected_tokens_per_round
from spec_core.estimates import x_varies

BYTES_PER_DRAFT = 80   # a draft token with its q (fixed:16:16) on the wire, for pinned uplink costs
FLAT_SHARE = 0.1       # fuse where one continuation's nodes add at most this share to a pass
MIN_TRIED, MIN_HITS = 4, 0.25   # stop fusing when under a quarter of 4 or more fused rounds hit


class ShapePlanner:
    """One session's shape choices beyond γ and the tree (which TreePolicy makes), and their counts."""

    def __init__(self, spec, trees: TreePolicy, window: window_mod.Window):
        """spec: the session's edge_client.options.Speculation."""
        self.spec, self.trees, self.window = spec, trees, window
        self.chosen: Counter[str] = Counter()

    def _starved(self) -> bool:
        """The verifier's budget allows one draft or none: nothing pays ahead."""
        budget = self.trees.budget_gamma
        return budget is not None and budget <= 1 and bool({"window", "fuse"} & set(self.spec.planned))

    def depth(self, s_per_byte: float) -> int:
        """Rounds to keep in flight: 1 without pipelining; 2 with pipelined rounds; with a window,
        what the cost model says pays (edge_client.window.window_depth)."""
        spec = self.spec
        if not spec.pipeline or self._starved():
            return 1
        if spec.window <= 1:
            return 2
        if self.trees.rtt_s is None:
            return min(2, spec.window)   # nothing measured yet: one pipelined round
        return window_mod.window_depth(self.window.costs(self.trees.rtt_s, s_per_byte), spec.window)

    def fuse(self, nodes: int, tried: int, hits: int) -> bool:
        """Whether this round (of `nodes` draft nodes) may carry fused continuations; FusedBudget then
        says how many pay. The planner fuses where the verifier's pass barely grows with its nodes:
        one continuation's nodes (about this round's, plus its key token) cost at most FLAT_SHARE of
        a pass, by the verifier's fitted line (over rounds of more than one size: unfitted, none).
        `tried` / `hits`: its fused rounds so far and those whose continuation ran; under MIN_HITS
        of them hitting after MIN_TRIED, it stops (the round's outcomes are too hard to guess). A
        round that carries none has the window behind it instead."""
        if self.spec.fuse:
            return True
        if "fuse" not in self.spec.planned or self._starved() or self.trees.rtt_s is None:
            return False
        if tried >= MIN_TRIED and hits < MIN_HITS * tried:
            return False
        points = self.trees.verify_points()
        if not x_varies(points):
            return False
        base, per_node = self.trees.verify_line()
        return per_node * (nodes + 1) <= FLAT_SHARE * base

    def record(self, plan: RoundPlan, how: str) -> None:
        """A round sent: its chain or tree and how it travelled (alone, ahead, pipelined, fused)."""
        self.chosen[f"{plan.arm} g{plan.gamma} {how}"] += 1

    def describe(self) -> dict[str, int]:
        return dict(sorted(self.chosen.items(), key=lambda kv: -kv[1]))


def pinned_choices(spec) -> dict:
    """The planner's choice for each option it plans, from the pinned inputs (spec.plan_inputs), by
    the same cost models; chains (a tree's gain is measured per session, and unmeasured the geometric
    model ranks no tree above the chain of its depth). spec: a Speculation whose planned options
    hold the planner's range (its window: the most rounds in flight)."""
    x = spec.plan_inputs
    rtt, row, base, node = x.rtt_ms / 1e3, x.draft_ms / 1e3, x.verify_ms / 1e3, x.node_ms / 1e3
    up_per_byte = x.up_ms_per_kb / 1e3 / 1024
    gamma = spec.gamma if "gamma" not in spec.planned else best_gamma(
        x.alpha, RoundCosts(row, rtt, base, node, BYTES_PER_DRAFT, 1 / up_per_byte if up_per_byte else float("inf")),
        spec.max_gamma)
    gamma = gamma if isinstance(gamma, int) else 5
    costs = window_mod.WindowCosts(rtt_s=rtt, verify_s=base + gamma * node, draft_s=(gamma + 1) * row,
                                   up_s=gamma * BYTES_PER_DRAFT * up_per_byte, hit=x.alpha ** gamma)
    window = spec.window if "window" not in spec.planned else window_mod.window_depth(costs, spec.window)
    round_s = gamma * row + rtt + base + gamma * node
    fused = FusedBudget(round_s, up_per_byte, node / row if row else 0.0).worth(
        x.alpha ** gamma, 0.0, 0.0, (gamma + 1) * row, gamma * BYTES_PER_DRAFT)
    flat = node * (gamma + 1) <= FLAT_SHARE * base
    choice = {"gamma": gamma, "tree": "off", "window": window, "proactive": True, "pipeline": window > 1,
              "fuse": window == 1 and flat and fused and expected_tokens_per_round(x.alpha, gamma) > 1}
    return {k: v for k, v in choice.items() if k in spec.planned}
