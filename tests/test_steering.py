"""The verifier steers speculation (spec_core.steering): the draft budget rule, the pass cost line
and commit rate it is priced with, the least-slack planner and the batcher that uses it, the edge
drafting min(its adaptive choice, the budget), and bad input in the new fields."""
from __future__ import annotations

import math
import threading

import grpc
import pytest

from cloud_verifier.backends.batcher import Batcher
from cloud_verifier.backends.synthetic import SyntheticBackend
from cloud_verifier.sessions import Slo
from edge_client import EdgeClient
from edge_client.drafters import SyntheticDrafter
from edge_client.options import OptionError, Speculation
from edge_client.text import SyntheticTokenizer
from helpers import HeldPasses, edge_options, running_server, stub_for
from spec_core.batchplan import least_slack_first
from spec_core.proto import verifier_pb2 as pb
from spec_core.steering import (Acceptance, CommitRate, PassCostLine, draft_budget, gamma_budget,
                                tree_node_budget)
from spec_core.warping import SamplingSettings
from test_batching import RecordingPacker
from test_faults import VOCAB, synthetic_greedy

# --- the budget rule (pure) ---------------------------------------------------------------------


@pytest.mark.parametrize("alpha, price, max_gamma, gamma", [
    (0.5, 0.25, 16, 2),     # α² = θ exactly: the second token pays, the third (0.125) does not
    (0.5, 0.26, 16, 1),
    (0.5, 0.0, 16, 16),     # idle, or a pass flat in tokens: as long as the server allows
    (0.9, 0.01, 8, 8),      # ⌊ln 0.01 / ln 0.9⌋ = 43, bounded by the server's max_gamma
    (0.7, 0.75, 16, 0),     # saturated: one verified token is worth more than any draft token
    (0.7, 1.0, 16, 0),
    (1.0, 0.9, 6, 6),       # drafts that are always accepted always pay
    (0.0, 0.1, 6, 0),
])
def test_gamma_budget_cases(alpha, price, max_gamma, gamma):
    assert gamma_budget(alpha, price, max_gamma) == gamma


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.7, 0.9, 0.99])
def test_the_budget_shrinks_as_the_load_grows_and_stays_within_the_server_limits(alpha):
    prices = [i / 50 for i in range(0, 51)]
    budgets = [draft_budget(alpha, p, 12, 40, 3) for p in prices]
    gammas = [b.max_gamma for b in budgets]
    nodes = [b.max_tree_nodes for b in budgets]
    assert all(a >= b for a, b in zip(gammas, gammas[1:])), gammas
    assert all(a >= b for a, b in zip(nodes, nodes[1:])), nodes
    assert gammas[0] == 12 and nodes[0] == 40 and gammas[-1] == 0
    assert all(0 <= g <= 12 and g <= n <= 40 for g, n in zip(gammas, nodes))
    # Every token inside the budget is worth its price, the next one is not.
    for p, g in zip(prices[1:-1], gammas[1:-1]):
        assert g == 12 or alpha ** (g + 1) < p
        assert g == 0 or alpha ** g >= p - 1e-12


def test_tree_nodes_count_the_nodes_worth_their_price():
    # α = 0.5: depth 1 ranks 0, 1 are worth 0.5, 0.25; depth 2 (ranks 0+0) 0.25. At θ = 0.25 three nodes.
    assert tree_node_budget(0.5, 0.25, 4, 2, 64) == 3
    # One child per node: the tree is the chain.
    assert tree_node_budget(0.6, 0.2, 8, 1, 64) == gamma_budget(0.6, 0.2, 8)
    assert tree_node_budget(0.5, 0.0, 4, 2, 10) == 10
    assert tree_node_budget(0.5, 0.01, 3, 2, 1000) == 2 + 4 + 8   # every node of depth ≤ 3 pays


def test_the_saturated_fixed_point_is_the_throughput_optimum():
    """S sessions all in every pass, no round trip, pass cost = b x tokens: the price a verifier
    with γ measures is b·R = E(γ) / (γ + 1); the budget it gives back is 0 for any α < 1, which is
    where E(γ) / (γ + 1) (committed per verified token) is largest."""
    from spec_core.costmodel import expected_tokens_per_round
    for alpha in (0.3, 0.6, 0.8, 0.95):
        for gamma in range(0, 8):
            price = expected_tokens_per_round(alpha, gamma) / (gamma + 1)
            # The average of α^0..α^γ is above α^γ: the budget asks for a shorter draft, down to 0.
            assert gamma_budget(alpha, price, 16) == max(gamma - 1, 0) or gamma_budget(alpha, price, 16) < gamma
            assert gamma_budget(alpha, price, 16) < max(gamma, 1)


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.9])
@pytest.mark.parametrize("sessions, rtt_s", [(1, 0.001), (16, 0.001), (16, 0.6), (64, 0.1), (4, 2.0)])
def test_the_budget_is_a_fixed_point_exactly_at_the_verifiers_best_gamma(alpha, sessions, rtt_s):
    """The symmetric model: S sessions with the same γ ride every pass; a round takes
    L(γ) = rtt + base + per_token·S·(γ + 1), the verifier commits R(γ) = S·E(γ)/L(γ). A γ the budget
    gives back to itself (budget at price per_token·R(γ) == γ) is where R is largest, and no other."""
    from spec_core.costmodel import expected_tokens_per_round
    base, per_token, top = 0.02, 0.017, 16

    def rate(g):
        return sessions * expected_tokens_per_round(alpha, g) / (rtt_s + base + per_token * sessions * (g + 1))
    best = max(rate(g) for g in range(top + 1))
    fixed = [g for g in range(top + 1) if gamma_budget(alpha, per_token * rate(g), top) == g]
    assert fixed, "no fixed point"
    assert all(rate(g) == pytest.approx(best, rel=1e-9) for g in fixed), (fixed, [rate(g) for g in range(top + 1)])


def test_the_pass_cost_line_and_the_commit_rate():
    line = PassCostLine()
    assert line.line() == (0.0, 0.0)
    line.observe(1, 0.02)
    assert line.line() == (0.0, 0.0)          # one pass says nothing yet: priced as idle
    line = PassCostLine()
    for n in (1, 5, 10, 20, 32, 7):
        line.observe(n, 0.010 + 0.002 * n)
    base, per_token = line.line()
    assert base == pytest.approx(0.010) and per_token == pytest.approx(0.002)
    same = PassCostLine()
    for _ in range(5):
        same.observe(10, 0.05)
    assert same.line() == (0.0, pytest.approx(0.005))   # unidentified: through the origin (errs short)
    rate = CommitRate(window_s=2.0)
    assert rate.rate(0.0) == 0.0
    for t in range(10):
        rate.observe(t * 0.5, 4)
    assert rate.rate(4.5) == pytest.approx(5 * 4 / 2.0)   # the events at 2.5 .. 4.5 s
    assert rate.rate(100.0) == 0.0


def test_acceptance_counts_tested_drafts():
    acc = Acceptance(decay=1.0)
    acc.observe(drafted=4, accepted=4, rejected=False)   # 4 of 4, bonus: nothing rejected
    acc.observe(drafted=4, accepted=1, rejected=True)    # 1 accepted, the second rejected
    assert acc.alpha == pytest.approx((1 + 5) / (2 + 6))
    acc.observe(drafted=0, accepted=0, rejected=False)
    assert acc.alpha == pytest.approx(6 / 8)


# --- least slack first ----------------------------------------------------------------------------


@pytest.mark.parametrize("pending, slack, budget, chunk, takes", [
    ([5, 5, 5], [0.3, -0.1, 0.2], 12, 16, [2, 5, 5]),          # the late one first, then by slack
    ([5, 300, 5], [0.1, 1.5, 0.2], 32, 8, [5, 22, 5]),         # the prefill: 8, then the leftovers
    ([5, 300, 5, 5, 5, 5], [0.1, 1.5, 0.2, 0.2, 0.2, 0.2], 32, 8, [5, 7, 5, 5, 5, 5]),  # rounds first
    ([5, 300, 5], [0.1, -0.5, 0.2], 32, 8, [5, 22, 5]),        # a late prefill goes first, a chunk a pass
    ([5, 5], [0.1, 0.1], 5, 8, [5, 0]),                        # ties in the order given
])
def test_least_slack_first_cases(pending, slack, budget, chunk, takes):
    assert least_slack_first(pending, slack, budget, chunk) == takes


@pytest.mark.parametrize("pending, budget", [([1, 5, 18, 40, 300, 2], 32), ([7] * 9, 512), ([3, 1000], 1)])
def test_least_slack_first_uses_the_budget_and_never_more(pending, budget):
    slack = [0.1 * (i % 3) - 0.1 for i in range(len(pending))]
    takes = least_slack_first(pending, slack, budget, 8)
    assert sum(takes) == min(budget, sum(pending))
    assert all(0 <= t <= n for t, n in zip(takes, pending))


def test_slo_deadlines():
    slo = Slo(tpot_s=0.1, ttft_s=2.0)
    assert slo.due(10.0, None, 50) == 12.0                  # before the first token: arrival + TTFT
    assert slo.due(10.0, (9.0, 50), 52) == pytest.approx(9.3)   # behind its schedule: due already
    assert slo.due(10.0, (9.9, 50), 51) == pytest.approx(10.1)  # ahead: no later than arrival + TPOT
    assert Slo().due(10.0, None, 1) is None


def test_the_batcher_serves_least_slack_first_and_caps_prefills():
    """A pass of 16 tokens; after a first pass holding seq 9 alone, four 5-token rounds and a
    200-token prefill wait together (HeldPasses). By slack: round 3 (late), round 1, the prefill
    (capped at 4 tokens a pass), then round 2 gets the 2 tokens left and round 4 none, whatever
    order they arrived in."""
    import time
    packer = RecordingPacker(n_ubatch=16)
    batcher = Batcher(packer, schedule="slack", prefill_chunk=4)
    held = HeldPasses(batcher, lambda i: 5 if i == 1 else 0)
    now = time.perf_counter()
    for seq, slack in {1: 0.2, 2: 0.5, 3: -0.3, 4: 0.9, 0: 0.3}.items():
        batcher.set_deadline(seq, now + 60 + slack)   # 60 s ahead: slack stays positive but for seq 3
    batcher.set_deadline(3, now - 1.0)
    out = {}

    def call(seq, n, rows):
        out[seq] = batcher.submit(seq, list(range(n)), rows)

    first = threading.Thread(target=call, args=(9, 1, 1))
    first.start()
    assert held.entered.wait(30)
    threads = [threading.Thread(target=call, args=(0, 200, 1))] + \
              [threading.Thread(target=call, args=(k, 5, 5)) for k in (4, 2, 1, 3)]
    for t in threads:
        t.start()
    for t in threads + [first]:
        t.join(timeout=30)
    batcher.close()
    assert held.timed_out == 0
    second = [it.seq for it in packer.passes[1]]
    assert {s: second.count(s) for s in set(second)} == {3: 5, 1: 5, 0: 4, 2: 2}, second
    assert all(out[k][0].shape == (5, 4) for k in (1, 2, 3, 4)) and out[0][0].shape == (1, 4)
    assert sum(1 for p in packer.passes for it in p if it.seq == 0) == 200


def test_a_fair_batcher_ignores_deadlines():
    packer = RecordingPacker(n_ubatch=12)
    with pytest.raises(ValueError, match="schedule"):
        Batcher(packer, schedule="fastest")


# --- the edge honours min(own, budget) ------------------------------------------------------------


class _FixedBudget:
    """Replaces the engine's budget with a fixed one (the rule itself is tested above)."""

    def __init__(self, engine, max_gamma, max_tree_nodes=64):
        self.budget = pb.DraftBudget(max_gamma=max_gamma, max_tree_nodes=max_tree_nodes, price=0.5)
        engine._budget = lambda session, now: self.budget


@pytest.mark.parametrize("cap", [0, 2])
async def test_an_adaptive_edge_drafts_at_most_the_budget_and_stays_exact(cap):
    """Greedy on the synthetic target: the first round drafts the adaptive start (4; no budget yet),
    every later one at most the verifier's budget, and the text is the target's own."""
    n = 40
    async with running_server(SyntheticBackend(vocab=VOCAB, batching=True)) as server:
        _FixedBudget(server.engine, cap)
        events = []
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma="adaptive"),
                              SyntheticDrafter(VOCAB, noise=0.3), SyntheticTokenizer(VOCAB),
                              on_round=events.append) as c:
            gen = c.generate("5 6 7", SamplingSettings(temperature=0.0, max_new_tokens=n, ignore_eos=True))
            await gen.text()
        fixed = []
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=4),
                              SyntheticDrafter(VOCAB, noise=0.3), SyntheticTokenizer(VOCAB),
                              on_round=fixed.append) as c:
            gen_fixed = c.generate("5 6 7", SamplingSettings(temperature=0.0, max_new_tokens=n, ignore_eos=True))
            await gen_fixed.text()
    assert events[0].gamma == 4
    assert all(e.gamma <= cap for e in events[1:]), [e.gamma for e in events]
    assert gen.stats.token_ids == synthetic_greedy([0, 5, 6, 7], n)
    # A fixed γ is what the user asked for (and keeps seeded outputs independent of the load).
    assert all(e.gamma == 4 for e in fixed[:-1]) and gen_fixed.stats.token_ids == gen.stats.token_ids


async def test_a_steering_verifier_sends_a_budget_within_its_limits_and_says_so():
    backend = SyntheticBackend(vocab=VOCAB, batching=True, step_ms=1.0, per_token_ms=1.0)
    async with running_server(backend, max_gamma=6) as server:
        async with stub_for(server) as stub:
            info = await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=10)
            assert info.draft_budgets and not info.HasField("slo")
            reply = None
            for round_ in range(1, 6):
                req = pb.VerifyRequest(session_id=reply.session_id if reply else "", round=round_,
                                       committed_length=reply.committed_length if reply else 2,
                                       draft_token_ids=[3, 4, 5])
                if reply is None:
                    req.open.CopyFrom(pb.OpenSession(prompt_token_ids=[0, 5], sampling=pb.SamplingParams(
                        temperature=0.0, max_new_tokens=100, ignore_eos=True)))
                reply = await stub.Verify(req, timeout=10)
                assert reply.HasField("budget")
                assert 0 <= reply.budget.max_gamma <= 6 and reply.budget.price >= 0
                assert reply.budget.max_gamma <= reply.budget.max_tree_nodes <= 64
    backend.close()
    serial = SyntheticBackend(vocab=VOCAB)    # a serial verifier has no batch to price: no budget
    async with running_server(serial, slo_tpot_ms=100) as server:
        async with stub_for(server) as stub:
            info = await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=10)
            assert not info.draft_budgets and info.slo.tpot_ms == 100
            reply = await stub.Verify(pb.VerifyRequest(round=1, committed_length=2, open=pb.OpenSession(
                prompt_token_ids=[0, 5], sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=8))), timeout=10)
            assert not reply.HasField("budget")


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("slo", [pb.SessionSlo(tpot_ms=math.nan), pb.SessionSlo(tpot_ms=-1.0),
                                 pb.SessionSlo(ttft_ms=math.inf), pb.SessionSlo(ttft_ms=4e6)])
async def test_a_bad_session_slo_is_invalid_argument_and_the_server_carries_on(slo):
    async with running_server(SyntheticBackend(vocab=VOCAB, batching=True)) as server:
        async with stub_for(server) as stub:
            def first_round(s):
                return pb.VerifyRequest(round=1, committed_length=2, open=pb.OpenSession(
                    prompt_token_ids=[0, 5], sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=8), slo=s))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(first_round(slo), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "open.slo." in e.value.details() and "milliseconds" in e.value.details()
            ok = await stub.Verify(first_round(pb.SessionSlo(tpot_ms=80, ttft_ms=500)), timeout=10)
            assert ok.committed_length == 3


@pytest.mark.parametrize("field, value", [("slo_tpot_ms", -5), ("slo_ttft_ms", float("nan")), ("slo_tpot_ms", "fast")])
def test_bad_edge_slo_options_name_the_option(field, value):
    with pytest.raises(OptionError) as e:
        Speculation(**{field: value})
    assert e.value.option == field


def test_a_long_round_is_not_taken_for_a_prefill():
    # A 17-token round (γ 16) and a 300-token prompt: only the prompt is capped at the chunk of 8.
    assert least_slack_first([17, 300], [0.1, 0.05], 32, 8, prefill=[False, True]) == [17, 15]
    with pytest.raises(ValueError):
        least_slack_first([1, 2], [0.1], 32, 8)


@pytest.mark.parametrize("argv, flag", [(["--slo-tpot-ms", "-1"], "--slo-tpot-ms"),
                                        (["--slo-ttft-ms", "4e6"], "--slo-ttft-ms"),
                                        (["--prefill-chunk", "0"], "--prefill-chunk"),
                                        (["--pipeline-wait", "-1"], "--pipeline-wait"),
                                        (["--pipeline-wait", "nan"], "--pipeline-wait")])
def test_bad_server_flags_exit_with_the_flag_named_before_a_model_loads(argv, flag):
    from cloud_verifier.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "--backend", "synthetic"] + argv)
    assert flag in str(e.value)


def test_the_edge_command_line_carries_the_steering_options():
    import argparse
    from edge_client.options import add_edge_options, options_from_args
    p = argparse.ArgumentParser()
    add_edge_options(p)
    spec = options_from_args(p.parse_args(["--gamma", "adaptive", "--no-steer", "--slo-tpot-ms", "120"])).speculation
    assert (spec.steer, spec.slo_tpot_ms, spec.slo_ttft_ms) == (False, 120.0, 0.0)
    with pytest.raises(OptionError, match="--slo-ttft-ms"):
        options_from_args(p.parse_args(["--slo-ttft-ms", "-3"]))
