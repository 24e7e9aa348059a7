"""The planners (spec_core.batchplan) that the verifier's Batcher (and the fleet simulator) plan
their passes with: readable literal cases, and the chunked-prefill rule on drawn plans."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_core.batchplan import PassItem, chunk_prefills, fair_share, least_slack_first


@pytest.mark.parametrize("pending, budget, takes", [
    # Everything fits: each request takes all it has.
    ([5, 5, 5], 32, [5, 5, 5]),
    # A fair share each (32 // 2 = 16), nothing left over.
    ([40, 40], 32, [16, 16]),
    # Fair share 10; the short rounds take 5 each, the prefill its 10 and then the 12 left over.
    ([5, 300, 5], 32, [5, 22, 5]),
    # Leftovers go in arrival order: shares of 8 (one request has nothing), then the first takes the 8 left.
    ([100, 100, 8, 0], 32, [16, 8, 8, 0]),
    # Shares of 10: the first has only 8, so the next in arrival order takes the 4 left, not the last.
    ([8, 100, 100], 32, [8, 14, 10]),
])
def test_fair_share_then_leftovers_in_arrival_order(pending, budget, takes):
    assert fair_share(pending, budget) == takes


def test_the_budget_runs_out_before_every_request_gets_a_token():
    # 40 one-token requests, 32 tokens a pass: the share is at least 1, so the first 32 arrivals go.
    assert fair_share([1] * 40, 32) == [1] * 32 + [0] * 8
    # A share of 1 each (32 // 20), then the 12 left in arrival order until the budget is spent.
    assert fair_share([5] * 20, 32) == [5, 5, 5] + [1] * 17


@pytest.mark.parametrize("pending", [[], [0], [0, 0, 3]])
def test_nothing_pending_takes_nothing(pending):
    assert fair_share(pending, 32) == [min(n, 32) for n in pending]


@pytest.mark.parametrize("pending, budget", [([1, 5, 18, 40, 300, 2], 32), ([7] * 9, 512), ([3, 1000], 1)])
def test_a_plan_never_exceeds_the_budget_nor_what_a_request_has(pending, budget):
    takes = fair_share(pending, budget)
    assert sum(takes) == min(budget, sum(pending))
    assert all(0 <= take <= n for take, n in zip(takes, pending))


def test_a_pass_item_has_named_fields_and_stays_a_tuple():
    item = PassItem(seq=3, pos=17, token=42, want_logits=True)
    assert (item.seq, item.pos, item.token, item.want_logits) == (3, 17, 42, True)
    assert item == (3, 17, 42, True)


# --- chunked prefill: both schedules ---------------------------------------------------------------

@pytest.mark.parametrize("pending, prefill, takes", [
    # One 1,500-token prompt and a 5-token round: the round all it has, the prompt the rest.
    ([1500, 5], [True, False], [27, 5]),
    # A 40-token round: the prompt its chunk of 8, the round the 24 left (unflagged: 16 and 16).
    ([1500, 40], [True, False], [8, 24]),
    # Two prompts and nothing else: a chunk each, then the rest shared fairly between them.
    ([1500, 1500], [True, True], [16, 16]),
    # 40 prompts, one round that arrived last: the round's share comes first, not after 32 prompts.
    ([900] * 40 + [5], [True] * 40 + [False], [1] * 31 + [0] * 9 + [1]),
])
def test_fair_share_gives_a_prefill_a_chunk_while_rounds_wait(pending, prefill, takes):
    assert fair_share(pending, 32, prefill, 8) == takes


def test_without_flags_the_plan_is_the_plain_fair_share():
    assert fair_share([1500, 40], 32) == [16, 16]
    assert fair_share([1500, 40], 32, [False, False], 8) == [16, 16]


def test_a_late_prefill_goes_first_but_takes_a_chunk():
    # Late (negative slack): its chunk first, then the rounds, then the leftovers.
    assert least_slack_first([5, 300, 5], [0.1, -0.5, 0.2], 32, 8) == [5, 22, 5]
    assert least_slack_first([20, 300], [0.1, -0.5], 24, 8, prefill=[False, True]) == [16, 8]
    with pytest.raises(ValueError):
        chunk_prefills([5], [True], 0)


_plans = st.lists(st.tuples(st.integers(0, 600), st.booleans(), st.floats(-1, 1)), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(_plans, st.integers(1, 64), st.integers(1, 16))
def test_no_pass_holds_more_than_a_chunk_of_a_prefill_while_a_round_waits(plan, budget, chunk):
    """Drawn plans, both schedules: the budget is used whenever there is work, never exceeded; a
    prefill takes more than `chunk` only when every round got all it had pending. Negative
    control: the plain fair share breaks the rule on some of the same plans (counted below)."""
    pending = [n for n, _, _ in plan]
    prefill = [p and n > chunk for n, p, _ in plan]
    for takes in (fair_share(pending, budget, prefill, chunk),
                  least_slack_first(pending, [s for _, _, s in plan], budget, chunk, prefill)):
        assert sum(takes) == min(budget, sum(pending))
        assert all(0 <= t <= n for t, n in zip(takes, pending))
        assert _chunk_rule_holds(pending, prefill, takes, chunk)


def _chunk_rule_holds(pending, prefill, takes, chunk) -> bool:
    rounds_served = all(t == n for t, n, p in zip(takes, pending, prefill) if not p)
    return rounds_served or all(t <= chunk for t, p in zip(takes, prefill) if p)


def test_the_rule_fails_for_the_plain_fair_share():
    """The negative control of the drawn test: unflagged, a prompt takes its fair share (16)
    while a 40-token round waits for more than the pass has left."""
    pending, prefill = [1500, 40], [True, False]
    assert not _chunk_rule_holds(pending, prefill, fair_share(pending, 32), 8)
    assert _chunk_rule_holds(pending, prefill, fair_share(pending, 32, prefill, 8), 8)
