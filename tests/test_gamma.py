"""Adaptive γ follows the cost model: longer drafts on slower links, shorter with poor acceptance."""
from edge_client.gamma import AdaptiveGamma, FixedGamma
from spec_core.costmodel import RoundCosts, best_gamma, expected_tokens_per_round


def feed(policy, rounds, gamma, accepted, rejected, rtt_s, draft_per_token_s=0.01, verify_s=0.02):
    for _ in range(rounds):
        policy.next_gamma()
        policy.observe(gamma=gamma, num_accepted=accepted, draft_s=draft_per_token_s * gamma,
                       round_s=rtt_s + verify_s, server_s=verify_s, model_s=verify_s,
                       rejected=rejected)


def test_expected_tokens_per_round_formula():
    assert expected_tokens_per_round(0.0, 5) == 1.0
    assert expected_tokens_per_round(1.0, 5) == 6.0
    assert abs(expected_tokens_per_round(0.8, 4) - (1 - 0.8 ** 5) / 0.2) < 1e-12


def test_slow_link_gets_longer_drafts():
    fast, slow = AdaptiveGamma(max_gamma=12), AdaptiveGamma(max_gamma=12)
    feed(fast, 30, 4, 3, True, rtt_s=0.001)
    feed(slow, 30, 4, 3, True, rtt_s=0.6)
    assert slow.next_gamma() > fast.next_gamma()


def test_alpha_counts_only_tested_drafts():
    p = AdaptiveGamma(decay=1.0)
    p.observe(gamma=8, num_accepted=3, draft_s=0.08, round_s=0.2, server_s=0.02, model_s=0.02, rejected=True)
    # prior 1/2 plus 3 accepted of 4 tested: (1 + 3) / (2 + 4); drafts 5..8 were never tested
    assert abs(p.alpha - 4 / 6) < 1e-12


def test_poor_acceptance_gets_shorter_drafts():
    good, poor = AdaptiveGamma(max_gamma=12), AdaptiveGamma(max_gamma=12)
    feed(good, 30, 6, 6, False, rtt_s=0.1)
    feed(poor, 30, 6, 0, True, rtt_s=0.1)
    assert poor.next_gamma() < good.next_gamma()


def test_best_gamma_grows_with_rtt():
    costs = lambda rtt: RoundCosts(t_draft_s=0.01, rtt_s=rtt, t_verify_base_s=0.02, t_verify_per_token_s=0.008)  # noqa
    assert best_gamma(0.8, costs(0.6), 16) > best_gamma(0.8, costs(0.005), 16)


def test_fixed_gamma():
    assert FixedGamma(3).next_gamma() == 3


# --- the edge's speculation options, and the verifier's limits on them ----------------------------

def test_gamma_is_parsed_in_one_place():
    import pytest

    from edge_client.options import OptionError, Speculation, parse_gamma
    assert parse_gamma("5") == 5 and parse_gamma(0) == 0 and parse_gamma("adaptive") == "adaptive"
    for bad in ("-1", "five", 2.5, None):
        with pytest.raises(OptionError) as e:
            parse_gamma(bad)
        assert e.value.option == "gamma"
    assert Speculation(gamma="7", plan="off").gamma == 7


def test_speculation_is_capped_by_the_verifier_limits():
    from edge_client.options import ServerLimits, Speculation
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
