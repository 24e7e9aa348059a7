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


# --- what the planner spends on learning: no blind warm-up, no prompt in the verifier's line ----------

def observe_chain(trees: TreePolicy, gamma: int, accepted: int, model_s: float | None, rtt_s: float = 0.3):
    """One chain round of `gamma` drafts with `accepted` kept, fed to both policies as the loop does."""
    seconds = model_s or 0.05
    trees.gamma_policy.observe(gamma=gamma, num_accepted=accepted, draft_s=0.002 * gamma, round_s=rtt_s + seconds,
                               server_s=seconds, model_s=model_s, rejected=accepted < gamma)
    trees.observe(RoundPlan("chain", gamma), nodes=gamma, rows=gamma, tokens=accepted + 1, draft_s=0.002 * gamma,
                  round_s=rtt_s + seconds, server_s=seconds, model_s=model_s)


def test_the_round_that_opened_the_session_is_off_the_verifiers_line():
    """The opening round's pass held the prompt (model_s None): fitted, it would make the line look
    flat or steep at random. Control: the same round fed with its time moves the line."""
    clean, polluted = TreePolicy(AdaptiveGamma(), "auto"), TreePolicy(AdaptiveGamma(), "auto")
    observe_chain(clean, 4, 3, None)
    observe_chain(polluted, 4, 3, 2.0)              # control: a 2 s prefill on the line
    for p in (clean, polluted):
        for gamma in (4, 8, 4, 8):
            observe_chain(p, gamma, 3, 0.0202 + 0.00005 * gamma)
    assert [nodes for nodes, _ in clean.verify_points()] == [4, 8, 4, 8]
    assert clean.verify_line()[1] > 0 and polluted.verify_line()[1] == 0.0   # clamped flat by the outlier
    assert len(clean.gamma_policy._verify_points) == 4 and len(polluted.gamma_policy._verify_points) == 5


def test_adaptive_gamma_extrapolates_the_verifiers_line_at_most_twofold():
    """Measured only at γ = 4 (slope unknown, so flat), a 300 ms round trip would ask for the longest
    γ; the planner goes to 8 first. Control: once 12 was measured it may go there."""
    g = AdaptiveGamma(max_gamma=12)
    assert g.next_gamma() == g.start_gamma   # nothing measured
    g.observe(gamma=4, num_accepted=4, draft_s=0.008, round_s=0.32, server_s=0.02, model_s=0.02)
    assert g.next_gamma() == 8
    g.observe(gamma=12, num_accepted=12, draft_s=0.024, round_s=0.32, server_s=0.02, model_s=0.02)
    assert g.next_gamma() == 12


def test_trees_are_not_tried_where_even_their_best_case_loses_to_the_chain():
    """A loaded CPU verifier (30 ms per node): a tree's optimistic rate is below the chain's, so not
    one tree round is spent; on a flat verifier (control) each tree is tried once."""
    for per_node, tried in ((0.030, 0), (0.00005, 2)):
        trees = TreePolicy(AdaptiveGamma(), "auto")
        observe_chain(trees, 4, 2, None, rtt_s=0.05)
        sent = []
        for _ in range(12):
            plan = trees.plan(remaining=1000)
            sent.append(plan.arm)
            nodes = plan.gamma if plan.shape is None else plan.shape.budget
            model_s = 0.05 + per_node * nodes
            if plan.shape is None:
                observe_chain(trees, plan.gamma, min(2, plan.gamma), model_s, rtt_s=0.05)
            else:
                trees.observe(plan, nodes=nodes, rows=plan.gamma, tokens=1, draft_s=0.002 * plan.gamma,
                              round_s=0.05 + model_s, server_s=model_s, model_s=model_s)
        assert sum(arm != "chain" for arm in sent) == tried, (per_node, sent)


def test_a_continuations_plan_counts_no_round():
    """Drafting a continuation asks for the plan a fresh round would get (peek): γ's record of chosen
    lengths and the rounds between explorations stay as they were."""
    trees = TreePolicy(AdaptiveGamma(), "auto")
    observe_chain(trees, 4, 3, None)
    observe_chain(trees, 8, 5, 0.03)
    observe_chain(trees, 4, 3, 0.02)
    before = (list(trees.gamma_policy.chosen), trees.rounds)
    for _ in range(5):
        trees.plan(remaining=1000, peek=True)
    assert (trees.gamma_policy.chosen, trees.rounds) == before
    trees.plan(remaining=1000)   # control: a round sent counts
    assert len(trees.gamma_policy.chosen) == len(before[0]) + 1


def test_a_continuation_kept_for_the_reply_keeps_the_fresh_rounds_length():
    """choose_length maximises the next round's tokens per second over hit and miss. A continuation
    kept for when the reply comes (depth 1) still costs its round trip when it hits, so a shorter one
    only gives tokens away: it keeps the fresh round's γ. Sent ahead into a window of 4, a hit shares
    the round trip, and covering more outcomes with shorter continuations pays. The control: the
    old objective, P(hit) × E[tokens of a hit], shortened the kept one too (γ 2 here)."""
    from edge_client.continuations import ContinuationBudget, choose_length
    from spec_core.continuations import chain_outcomes
    from spec_core.costmodel import expected_tokens_per_round
    alpha, t_row, rtt, verify = 0.5, 0.025, 0.3, 0.08
    corrected = [[(21 + j, 0.6), (31 + j, 0.3), (41 + j, 0.1)] for j in range(4)]
    outcomes = chain_outcomes([11, 12, 13, 14], alpha, corrected, [(51, 0.8), (52, 0.2)], 8)

    def budget(depth):
        fresh = 5 * t_row
        return ContinuationBudget(t_reply=100 + rtt + verify, rtt_s=rtt, fresh_draft_s=fresh, s_per_byte=0.0,
                                  round_s=fresh + rtt + verify, depth=depth)
    assert choose_length(outcomes, alpha, 4, t_row, 10, budget(1), 100.0) == 4
    assert choose_length(outcomes, alpha, 4, t_row, 10, budget(4), 100.0) == 2

    def old_objective(g):   # the control
        cost, total, t, b = (g + 1) * t_row, 0.0, 100.0, budget(1)
        for i, o in enumerate(outcomes):
            if i and not b.worth(o.prob, total, t, cost, g * 10):
                break
            total, t = total + o.prob, t + cost
        return total * expected_tokens_per_round(alpha, g)
    assert max(range(1, 5), key=lambda g: (old_objective(g), g)) == 2
