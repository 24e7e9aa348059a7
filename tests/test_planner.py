"""The planner's choices from measured inputs (edge_client.planner), without a server: which options
it owns, when it fuses a round, how deep the window goes, and what the verifier's budget does."""
from __future__ import annotations

import pytest

from edge_client import window as window_mod
from edge_client.gamma import AdaptiveGamma, RoundPlan, TreePolicy
from edge_client.options import OptionError, Speculation
from edge_client.planner import ShapePlanner


def planner(spec: Speculation, verify_points, rtt_s: float | None = 0.3) -> ShapePlanner:
    trees = TreePolicy(AdaptiveGamma(), spec.tree)
    for nodes, model_s in verify_points:
        trees.observe(RoundPlan("chain", nodes), nodes=nodes, rows=nodes, tokens=3, draft_s=0.002 * nodes,
                      round_s=(rtt_s or 0.0) + model_s, server_s=model_s, model_s=model_s)
    if rtt_s is None:
        trees.rtt_s = None
    return ShapePlanner(spec, trees, window_mod.Window())


FLAT = [(4, 0.0202), (8, 0.0204), (16, 0.0208), (4, 0.0202)]     # 20 ms + 0.05 ms per node (GPU-like)
STEEP = [(4, 0.0756), (8, 0.1012), (16, 0.1524), (4, 0.0756)]    # 50 ms + 6.4 ms per node (this CPU)


def test_unset_options_are_the_planners_and_set_ones_are_pinned():
    assert Speculation().planned == ("gamma", "tree", "window", "proactive", "pipeline", "fuse")
    pinned = Speculation(gamma=4, window=1)
    assert pinned.planned == ("tree", "proactive", "pipeline", "fuse") and pinned.gamma == 4
    assert not pinned.pipeline   # a window of one round sends nothing ahead
    off = Speculation(plan="off")
    assert (off.planned, off.gamma, off.tree, off.window, off.pipeline, off.fuse) == ((), 5, "off", 1, False, False)
    with pytest.raises(OptionError, match="plan"):
        Speculation(plan="sometimes")
    with pytest.raises(OptionError, match="plan_inputs"):
        Speculation(plan_inputs="rtt=5")


def test_the_planner_fuses_where_a_pass_barely_grows_with_its_nodes():
    spec = Speculation()
    assert planner(spec, FLAT).fuse(nodes=4, tried=0, hits=0)
    assert not planner(spec, STEEP).fuse(nodes=4, tried=0, hits=0)            # control: a CPU's curve
    assert not planner(spec, [(4, 0.02)] * 4).fuse(nodes=4, tried=0, hits=0)   # nothing to fit a slope to
    assert not planner(spec, FLAT, rtt_s=None).fuse(nodes=4, tried=0, hits=0)  # no round trip measured
    assert not planner(spec, FLAT).fuse(nodes=4, tried=8, hits=1)              # fused rounds that rarely hit
    assert planner(Speculation(fuse=True, plan="off"), STEEP).fuse(nodes=4, tried=8, hits=0)   # pinned: asked for


def test_a_starved_budget_keeps_one_round_unfused():
    p = planner(Speculation(), FLAT)
    assert p.depth(0.0) >= 1 and p.fuse(nodes=4, tried=0, hits=0)
    p.trees.steer(max_gamma=1, max_tree_nodes=0)
    assert p.depth(0.0) == 1 and not p.fuse(nodes=4, tried=0, hits=0)


def test_shapes_are_counted_by_how_they_travelled():
    p = planner(Speculation(), FLAT)
    p.record(RoundPlan("chain", 4), "fused")
    p.record(RoundPlan("chain", 4), "fused")
    p.record(RoundPlan("tree2x", 3), "pipelined")
    assert p.describe() == {"chain g4 fused": 2, "tree2x g3 pipelined": 1}


def test_a_planned_tree_is_a_chain_for_a_drafter_without_trees():
    from edge_client.drafters import PromptLookupDrafter, SyntheticDrafter
    from edge_client.options import OptionConflict, refuse_drafter_conflicts
    assert refuse_drafter_conflicts(Speculation(), PromptLookupDrafter()).tree == "off"
    assert refuse_drafter_conflicts(Speculation(), SyntheticDrafter(8)).tree == "auto"
    with pytest.raises(OptionConflict):   # a tree asked for still conflicts with it
        refuse_drafter_conflicts(Speculation(tree="auto"), PromptLookupDrafter())
