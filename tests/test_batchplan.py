"""The fair-share planner (spec_core.batchplan) that the verifier's Batcher and the fleet simulator
both plan their passes with: readable literal cases."""
from __future__ import annotations

import pytest

from spec_core.batchplan import PassItem, fair_share


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
