"""Rules both ends (and the simulators) share, written once: the cost line fit, the acceptance
estimate (spec_core.estimates), the SLO's due rule and verdicts (spec_core.slo), wire constants
(spec_core.wire)."""
from __future__ import annotations

import pytest

from spec_core.estimates import Acceptance, Line, fit_line, x_varies
from spec_core.slo import Slo, meets_slo, run_meets_slo, window_tpot


# --- the cost line ------------------------------------------------------------------------------

def test_fit_line_recovers_a_line_and_clamps_costs_at_zero():
    assert tuple(fit_line([(1, 3.0), (2, 5.0), (4, 9.0)])) == pytest.approx((1.0, 2.0))
    # Falling cost with size: slope 0 (a cost never shrinks with more work), base the mean.
    assert tuple(fit_line([(1, 5.0), (3, 1.0)])) == pytest.approx((3.0, 0.0))
    # A steep line whose base would be negative: the base floors at 0, the slope stays.
    assert tuple(fit_line([(10, 1.0), (20, 3.0)])) == pytest.approx((0.0, 0.2))
    # max_slope caps the slope; the base then goes through the means.
    assert tuple(fit_line([(1, 3.0), (2, 5.0)], max_slope=1.0)) == pytest.approx((2.5, 1.0))
    # Nothing to fit a slope to: every point at one size, or none at all.
    assert tuple(fit_line([(4, 1.0), (4, 3.0)])) == pytest.approx((2.0, 0.0))
    assert fit_line([]) == Line(0.0, 0.0)
    assert not x_varies([(512, 1.0), (512 + 1e-9, 1.0)]) and x_varies([(1, 0.0), (2, 0.0)])


def test_the_edge_and_the_verifier_fit_their_lines_with_it():
    from edge_client.estimates import Estimates, UplinkFit
    from edge_client.planner import RoundPlan
    from plan_feed import teach
    from spec_core.steering import PassCostLine
    from spec_core.tree import TreeShape
    line = PassCostLine(min_passes=2)
    uplink = UplinkFit()
    est = Estimates()
    for size in (8, 16, 32, 64):
        seconds = 0.002 + 0.001 * size
        line.observe(size, seconds)
        uplink.observe(size * 100, seconds)
        teach(est, RoundPlan("chain", size), tokens=1, rtt_s=0.0, model_s=seconds, draft_s=0.0)
    assert line.line() == pytest.approx((0.002, 0.001))
    assert uplink.seconds_per_byte() == pytest.approx(0.001 / 100)
    assert tuple(est.verify_line()) == pytest.approx((0.002, 0.001))
    # The planner's predicted round: 8 nodes on that line (no drafting, no round trip, bytes free).
    tree8 = RoundPlan("tree8", 2, TreeShape(8, 2, 2, 1))
    assert est.round_s(tree8.nodes, tree8.rows) == pytest.approx(0.002 + 0.008)


def test_the_edge_and_the_verifier_estimate_alpha_alike():
    from edge_client.estimates import Estimates
    from edge_client.planner import RoundPlan
    from plan_feed import teach
    edge, verifier = Estimates(), Acceptance(decay=0.9)
    for drafted, accepted in ((4, 4), (4, 1), (0, 0), (6, 2), (3, 3)):
        rejected = accepted < drafted
        teach(edge, RoundPlan("chain", drafted), tokens=accepted + 1, rtt_s=0.1, model_s=0.01, draft_s=0.01)
        verifier.observe(drafted, accepted, rejected)
        assert edge.alpha == verifier.alpha
    # Never forgotten (decay 1): the Beta(1, 1) posterior mean, (accepted + 1) / (tested + 2).
    total = Acceptance(decay=1.0)
    total.observe(4, 4, False)
    total.observe(4, 1, True)
    assert total.alpha == pytest.approx((5 + 1) / (6 + 2))


# --- the SLO --------------------------------------------------------------------------------------

def test_the_slo_verdicts():
    assert meets_slo(0.1, 1.0, 0.15, 2.0) is True
    assert meets_slo(0.2, 1.0, 0.15, 2.0) is False          # too slow per token
    assert meets_slo(0.1, 3.0, 0.15, 2.0) is False          # too slow to start
    assert meets_slo(0.1, 3.0, 0.15) is True                # no TTFT target
    assert meets_slo(None, 1.0, 0.15, 2.0) is True          # TTFT only (too few commits for a TPOT)
    assert meets_slo(None, None, 0.15, 2.0) is None         # nothing to judge
    assert run_meets_slo(0.1, None, 0.15, 2.0) is True      # no request arrived in the window: TPOT only
    assert run_meets_slo(None, 1.0, 0.15, 2.0) is False     # a run without a measured TPOT fails
    assert run_meets_slo(0.1, 2.5, 0.15, 2.0) is False


def test_window_tpot_counts_the_commits_inside_the_window():
    times = [(1.0, 1), (2.0, 3), (3.0, 7), (9.0, 8)]
    assert window_tpot(times, 0.0, 10.0) == pytest.approx(8.0 / 7)
    assert window_tpot(times, 1.5, 3.5) == pytest.approx(1.0 / 4)
    assert window_tpot(times, 2.5, 3.5) is None                          # one commit inside
    assert window_tpot([(1.0, 2), (2.0, 2)], 0.0, 3.0) is None          # no tokens between them


def test_slo_due_follows_the_tpot_schedule_from_the_first_token():
    slo = Slo(tpot_s=0.1, ttft_s=2.0)
    assert slo.due(5.0, None, 10) == pytest.approx(7.0)                  # before the first token: TTFT
    # First token at t = 6 with 11 tokens; at 14 tokens the next is due at 6 + 0.1 × 4 ...
    assert slo.due(6.35, (6.0, 11), 14) == pytest.approx(6.4)
    # ... but never later than one TPOT after it arrives (a session ahead banks no more than that).
    assert slo.due(6.1, (6.0, 11), 14) == pytest.approx(6.2)
    assert Slo().due(5.0, None, 10) is None and Slo(ttft_s=1.0).due(5.0, (4.0, 1), 3) is None


# --- the wire --------------------------------------------------------------------------------------

def test_the_verifier_takes_its_wire_constants_from_spec_core():
    from cloud_verifier import admission, server
    from spec_core import wire
    assert admission.RETRY_AFTER_KEY is wire.RETRY_AFTER_KEY == "retry-after-ms"
    assert server.MESSAGE_SIZE_OPTIONS is wire.MESSAGE_SIZE_OPTIONS
    assert dict(wire.MESSAGE_SIZE_OPTIONS)["grpc.max_receive_message_length"] == wire.MAX_MESSAGE_BYTES == 64 << 20


def test_the_edge_takes_its_wire_constants_from_spec_core():
    from edge_client import crossvocab, remote, transport
    from spec_core import wire
    assert transport.RETRY_AFTER_KEY is wire.RETRY_AFTER_KEY
    assert set(wire.MESSAGE_SIZE_OPTIONS) <= set(transport.CHANNEL_OPTIONS)
    assert remote.OPEN_KEY_BYTES is wire.OPEN_KEY_BYTES and crossvocab.VOCABULARY_MAX_BYTES == wire.MAX_MESSAGE_BYTES
