"""Adaptive γ follows the cost model (edge_client.planner.plan_round): longer drafts on slower links,
shorter with poor acceptance."""
from edge_client.estimates import Estimates
from edge_client.options import Speculation
from edge_client.planner import RoundPlan
from spec_core.costmodel import RoundCosts, best_gamma, expected_tokens_by_position, expected_tokens_per_round
from spec_core.estimates import Acceptance

from plan_feed import plan, teach

CHAINS = Speculation(gamma="adaptive", plan="off")   # γ adaptive, chains, nothing in flight


def feed(est, rounds, gamma, accepted, rtt_s, draft_per_token_s=0.01, verify_s=0.02):
    for _ in range(rounds):
        teach(est, RoundPlan("chain", gamma), tokens=accepted + 1, rtt_s=rtt_s, model_s=verify_s,
              draft_s=draft_per_token_s * gamma)


def test_expected_tokens_per_round_formula():
    assert expected_tokens_per_round(0.0, 5) == 1.0
    assert expected_tokens_per_round(1.0, 5) == 6.0
    assert abs(expected_tokens_per_round(0.8, 4) - (1 - 0.8 ** 5) / 0.2) < 1e-12
    assert abs(expected_tokens_by_position([0.8] * 4) - expected_tokens_per_round(0.8, 4)) < 1e-12
    assert expected_tokens_by_position([0.9, 0.5]) == 1 + 0.9 + 0.45


def test_slow_link_gets_longer_drafts():
    fast, slow = Estimates(), Estimates()
    feed(fast, 30, 4, 3, rtt_s=0.001)
    feed(slow, 30, 4, 3, rtt_s=0.6)
    assert plan(slow, CHAINS).gamma > plan(fast, CHAINS).gamma


def test_alpha_counts_only_tested_drafts():
    est = Estimates(acceptance=Acceptance(1.0))
    teach(est, RoundPlan("chain", 8), tokens=4, rtt_s=0.18, model_s=0.02, draft_s=0.08)
    # prior 1/2 plus 3 accepted of 4 tested: (1 + 3) / (2 + 4); drafts 5..8 were never tested
    assert abs(est.alpha - 4 / 6) < 1e-12
    # By position: the first three accepted, the fourth rejected, the rest untested (they keep α).
    alphas = est.alphas(8)
    assert alphas[0] > est.alpha > alphas[3] and alphas[4:] == [est.alpha] * 4


def test_poor_acceptance_gets_shorter_drafts():
    good, poor = Estimates(), Estimates()
    feed(good, 30, 6, 6, rtt_s=0.1)
    feed(poor, 30, 6, 0, rtt_s=0.1)
    assert plan(poor, CHAINS).gamma < plan(good, CHAINS).gamma


def test_best_gamma_grows_with_rtt():
    costs = lambda rtt: RoundCosts(t_draft_s=0.01, rtt_s=rtt, t_verify_base_s=0.02, t_verify_per_token_s=0.008)  # noqa
    assert best_gamma(0.8, costs(0.6), 16) > best_gamma(0.8, costs(0.005), 16)


def test_fixed_gamma():
    est = Estimates()
    feed(est, 10, 3, 3, rtt_s=0.6)
    assert plan(est, Speculation(gamma=3, plan="off")).gamma == 3
    assert plan(est, Speculation(gamma=3, plan="off"), remaining=3).gamma == 2   # cut to the tokens left


# --- the edge's speculation options, and the verifier's limits on them ----------------------------

def test_gamma_is_parsed_in_one_place():
    import pytest

    from edge_client.options import OptionError, parse_gamma
    assert parse_gamma("5") == 5 and parse_gamma(0) == 0 and parse_gamma("adaptive") == "adaptive"
    for bad in ("-1", "five", 2.5, None):
        with pytest.raises(OptionError) as e:
            parse_gamma(bad)
        assert e.value.option == "gamma"
    assert Speculation(gamma="7", plan="off").gamma == 7


def test_speculation_is_capped_by_the_verifier_limits():
    from edge_client.options import ServerLimits
    from spec_core.tree import TreeShape
    limits = ServerLimits(max_gamma=8, max_tree_nodes=10, max_tree_branching=2)
    adaptive = Speculation(gamma="adaptive", max_gamma=12, plan="off").within(limits)
    assert adaptive.gamma == "adaptive" and adaptive.max_gamma == 8
    assert Speculation(gamma=10, plan="off").within(limits).gamma == 8
    assert Speculation(gamma=4, plan="off").within(limits) == Speculation(gamma=4, max_gamma=8, plan="off")
    tree = Speculation(gamma=4, tree="budget=16,depth=9,branching=3,width=4", plan="off").within(limits).tree
    assert tree == TreeShape(budget=10, depth=8, branching=2, width=4)
    assert Speculation(tree="auto", max_tree_nodes=64, plan="off").within(limits).max_tree_nodes == 10
    chains_only = ServerLimits(max_gamma=8, max_tree_nodes=0)
    assert Speculation(tree="auto", plan="off").within(chains_only).tree == "off"
    for unstated in (Speculation(gamma=20, max_gamma=30, plan="off"),
                     Speculation(tree="budget=99,depth=20,branching=5", plan="off")):
        assert unstated.within(ServerLimits()) == unstated  # a verifier that states no limits: nothing capped
