"""The planner's choices from measured inputs (edge_client.planner.plan_round), without a server:
which options it owns, when it fuses a round, how deep the window goes, what the verifier's budget
does, and that it reads nothing but its arguments."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from edge_client.estimates import Estimates
from edge_client.options import OptionError, Speculation
from edge_client.planner import (TUNING, Budget, RoundPlan, Tuning, fuses, plan_conflicts, plan_round,
                                 rounds_in_flight)
from plan_feed import chain_round, plan, teach


def measured(verify_points, rtt_s: float | None = 0.3) -> Estimates:
    """Estimates after chain rounds of the given (nodes, model seconds), one session opened before them."""
    est = Estimates()
    for nodes, model_s in verify_points:
        chain_round(est, nodes, 2, model_s, rtt_s=rtt_s or 0.0)
    if rtt_s is None:
        est.rtt_s = None
    return est


FLAT = [(4, 0.0202), (8, 0.0204), (16, 0.0208), (4, 0.0202)]     # 20 ms + 0.05 ms per node (GPU-like)
STEEP = [(4, 0.0756), (8, 0.1012), (16, 0.1524), (4, 0.0756)]    # 50 ms + 6.4 ms per node (this CPU)
CHAIN4 = RoundPlan("chain", 4)


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
    spec, b = Speculation(), Budget(1000)
    assert fuses(measured(FLAT), spec, b, CHAIN4)
    assert not fuses(measured(STEEP), spec, b, CHAIN4)                # control: a CPU's curve
    assert not fuses(measured([(4, 0.02)] * 4), spec, b, CHAIN4)      # nothing to fit a slope to
    assert not fuses(measured(FLAT, rtt_s=None), spec, b, CHAIN4)     # no round trip measured
    rarely = measured(FLAT)
    rarely.fused_tried, rarely.fused_hits = 8, 1
    assert not fuses(rarely, spec, b, CHAIN4)                         # fused rounds that rarely hit
    assert fuses(measured(STEEP), Speculation(fuse=True, plan="off"), b, CHAIN4)   # pinned: asked for


def test_a_starved_budget_keeps_one_round_unfused():
    est, spec = measured(FLAT), Speculation()
    assert rounds_in_flight(est, spec, Budget(1000), CHAIN4)[0] >= 1 and fuses(est, spec, Budget(1000), CHAIN4)
    starved = Budget(1000, max_gamma=1, max_tree_nodes=0)
    assert rounds_in_flight(est, spec, starved, CHAIN4)[0] == 1 and not fuses(est, spec, starved, CHAIN4)
    p = plan_round(est, spec, starved)
    assert (p.gamma, p.shape, p.depth, p.fuse) == (1, None, 1, False)


def test_shapes_are_counted_by_how_they_travelled():
    from edge_client.stats import GenerationStats
    st = GenerationStats()
    for label in (CHAIN4.label("fused"), CHAIN4.label("fused"), RoundPlan("tree2x", 3).label("pipelined")):
        st.shapes[label] = st.shapes.get(label, 0) + 1
    st.complete(1.0, "", [], Speculation(), 1.0)
    assert st.shapes == {"chain g4 fused": 2, "tree2x g3 pipelined": 1}
    assert st.plans == "chain×2, tree2x×1"


def test_a_planned_tree_is_a_chain_for_a_drafter_without_trees():
    from edge_client.drafters import PromptLookupDrafter, SyntheticDrafter
    from edge_client.options import OptionConflict, refuse_drafter_conflicts
    assert refuse_drafter_conflicts(Speculation(), PromptLookupDrafter()).tree == "off"
    assert refuse_drafter_conflicts(Speculation(), SyntheticDrafter(8)).tree == "auto"
    with pytest.raises(OptionConflict):   # a tree asked for still conflicts with it
        refuse_drafter_conflicts(Speculation(tree="auto"), PromptLookupDrafter())


# --- what the planner spends on learning: no blind warm-up, no prompt in the verifier's line ----------

def test_the_round_that_opened_the_session_is_off_the_verifiers_line():
    """The opening round's pass held the prompt (model_s None): fitted, it would make the line look
    flat or steep at random. Control: the same round fed with its time moves the line."""
    clean, polluted = Estimates(), Estimates()
    chain_round(clean, 4, 3, None)
    chain_round(polluted, 4, 3, 2.0)              # control: a 2 s prefill on the line
    for est in (clean, polluted):
        for gamma in (4, 8, 4, 8):
            chain_round(est, gamma, 3, 0.0202 + 0.00005 * gamma)
    assert [nodes for nodes, _ in clean.verify_points] == [4, 8, 4, 8]
    assert clean.verify_line().slope > 0 and polluted.verify_line().slope == 0.0   # clamped flat by the outlier


def test_adaptive_gamma_extrapolates_the_verifiers_line_at_most_twofold():
    """Measured only at γ = 4 (slope unknown, so flat), a 300 ms round trip would ask for the longest
    γ; the planner goes to 8 first. Control: once 12 was measured it may go there."""
    est, spec = Estimates(), Speculation(gamma="adaptive", plan="off")
    assert plan(est, spec).gamma == TUNING.start_gamma   # nothing measured
    teach(est, RoundPlan("chain", 4), tokens=5, rtt_s=0.3, model_s=0.02, draft_s=0.008)
    assert plan(est, spec).gamma == 8
    teach(est, RoundPlan("chain", 12), tokens=13, rtt_s=0.3, model_s=0.02, draft_s=0.024)
    assert plan(est, spec).gamma == 12


def test_trees_are_not_tried_where_even_their_best_case_loses_to_the_chain():
    """A loaded CPU verifier (30 ms per node): a tree's optimistic rate is below the chain's, so not
    one tree round is spent; on a flat verifier (control) each tree is tried once."""
    spec = Speculation(gamma="adaptive", tree="auto", plan="off")
    for per_node, tried in ((0.030, 0), (0.00005, 2)):
        est = Estimates()
        chain_round(est, 4, 2, None, rtt_s=0.05)
        sent = []
        for _ in range(12):
            p = plan(est, spec, remaining=1000)
            sent.append(p.arm)
            model_s = 0.05 + per_node * p.nodes
            if p.shape is None:
                chain_round(est, p.gamma, min(2, p.gamma), model_s, rtt_s=0.05)
            else:
                teach(est, p, tokens=1, rtt_s=0.05, model_s=model_s, draft_s=0.002 * p.gamma, rows=p.gamma)
        assert sum(arm != "chain" for arm in sent) == tried, (per_node, sent)


def test_plan_round_reads_only_its_arguments():
    """No clock, no counters: the same estimates give the same plan, and planning changes nothing (a
    continuation's plan is the one a fresh round would get, and counts no round)."""
    est, spec = measured(FLAT), Speculation()
    before = pickle.dumps(est)
    plans = {plan_round(est, spec, Budget(1000)) for _ in range(5)}
    assert len(plans) == 1 and pickle.dumps(est) == before


def test_every_plan_keeps_to_the_options_that_are_set():
    """plan_round's plans against the options' rules; the check itself catches a plan that breaks one
    (the control)."""
    from spec_core.tree import TreeShape
    specs = [Speculation(), Speculation(gamma=3), Speculation(window=1), Speculation(fuse=True),
             Speculation(tree="off", window=3), Speculation(tree=TreeShape(8, 3), plan="off", pipeline=True),
             Speculation(plan="off"), Speculation(proactive=True, plan="off", gamma="adaptive")]
    for est in (Estimates(), measured(FLAT), measured(STEEP, rtt_s=0.6)):
        for spec in specs:
            for budget in (Budget(1000), Budget(3), Budget(1000, max_gamma=1, max_tree_nodes=0)):
                assert plan_conflicts(plan_round(est, spec, budget), spec) == []
    off = Speculation(plan="off")
    bad = dataclasses.replace(plan_round(Estimates(), off, Budget(1000)), depth=3, fuse=True)
    assert len(plan_conflicts(bad, off)) == 2


def test_pinned_inputs_give_one_plan_every_round():
    """--plan-inputs: the estimates learn nothing, so every round gets the plan of the first (and a
    seed pins the output); a reply changes nothing. Control: live estimates move with what they see."""
    from edge_client.planner import pinned_estimates
    spec = Speculation(plan_inputs="rtt_ms=600,draft_ms=2,verify_ms=20,node_ms=0.05,alpha=0.8")
    est = pinned_estimates(spec.plan_inputs)
    first = plan_round(est, spec, Budget(1000))
    chain_round(est, first.gamma, 0, 0.5, rtt_s=0.001)
    assert plan_round(est, spec, Budget(1000)) == first
    live = Estimates()
    chain_round(live, 4, 4, 0.02, rtt_s=0.6)
    g = plan_round(live, Speculation(), Budget(1000)).gamma
    chain_round(live, g, 0, 0.5, rtt_s=0.001)
    assert plan_round(live, Speculation(), Budget(1000)).gamma != g


def test_a_continuation_kept_for_the_reply_keeps_the_fresh_rounds_length():
    """choose_length maximises the next round's tokens per second over hit and miss. A continuation
    kept for when the reply comes (depth 1) still costs its round trip when it hits, so a shorter one
    only gives tokens away: it keeps the fresh round's γ. Sent ahead into a window of 4, a hit shares
    the round trip, and covering more outcomes with shorter continuations pays. The control: the
    old objective, P(hit) × E[tokens of a hit], shortened the kept one too (γ 2 here)."""
    from edge_client.planner import ContinuationBudget, continuation_length as choose_length
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


def test_a_reply_is_learned_once():
    """One reply, one update of each estimate: a fused hit (two rounds in one pass) adds one point to
    the verifier's line and one round trip, teaches both rounds' arms and acceptance, and counts one
    fused round that hit; a base_mismatch counts a pipelined round that did not run and nothing else;
    a lost call only that miss. Pinned estimates learn nothing (the control: same replies, no change)."""
    from edge_client.estimates import ReplyTaught, RoundTaught, pinned
    est = measured(FLAT)
    points, rounds = len(est.verify_points), est.rounds
    r1 = RoundTaught("chain", True, 4, 4, False, 5, 4, 0.008)
    r2 = RoundTaught("chain", True, 4, 1, True, 2, 4, 0.008)
    est.observe(ReplyTaught((r1, r2), 0.43, 0.03, 0.021, 0.001, 14, 900, 9, fused=True))
    assert len(est.verify_points) == points + 1 and est.verify_points[-1] == (14, 0.021)
    assert est.rtt_s == pytest.approx(0.8 * 0.3 + 0.2 * 0.4)   # timed once, sent on its own
    assert est.rounds == rounds + 2 and (est.fused_tried, est.fused_hits) == (1, 1)
    rtt = est.rtt_s
    est.observe(ReplyTaught((), 0.31, 0.001, request_bytes=400, request_nodes=4, pipelined=False))
    assert (est.pipelined_sent, est.pipelined_ran, len(est.verify_points)) == (1, 0, points + 1)
    assert est.rtt_s == rtt
    est.observe(ReplyTaught((), pipelined=False, answered=False))
    assert (est.pipelined_sent, est.rtt_s) == (2, est.rtt_s)
    frozen = pinned(300, 2, 20, 0.05, 0, 0.7)
    before = pickle.dumps(frozen)
    frozen.observe(ReplyTaught((r1, r2), 0.33, 0.03, 0.021, 0.001, 14, 900, 9, fused=True))
    assert pickle.dumps(frozen) == before


def test_a_tuning_run_scores_other_constants_through_the_same_function():
    """Tuning carries the planner's constants: a grid can try other values on the same estimates
    without patching the module (here: the γ before anything is measured, and trees never judged)."""
    est = Estimates()
    assert plan_round(est, Speculation(), Budget(1000), Tuning(start_gamma=6)).gamma == 6
    flat = measured(FLAT)
    assert plan_round(flat, Speculation(tree="auto"), Budget(1000), Tuning(tree_sizes=())).shape is None


def test_pinned_estimates_take_acceptance_by_position():
    """A falling acceptance curve (as published for EAGLE) asks for shorter chains than a flat α of
    the same first position: flat α overstates long drafts."""
    from edge_client.estimates import pinned
    flat = pinned(300, 2, 20, 0.05, 0, 0.8)
    falling = pinned(300, 2, 20, 0.05, 0, 0.8, by_position=[0.8, 0.6, 0.4, 0.3, 0.2, 0.1])
    spec = Speculation(gamma="adaptive", plan="off")
    assert flat.alphas(3) == pytest.approx([0.8] * 3) and falling.alphas(2) == pytest.approx([0.8, 0.6])
    assert plan_round(falling, spec, Budget(1000)).gamma < plan_round(flat, spec, Budget(1000)).gamma
