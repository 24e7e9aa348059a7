"""How a continuously batched verifier fills one target pass: the planners (fair share, least
slack first, both with chunked prefill), and the record a pass is made of.

Glossary:
  *pass*     one forward pass of the target over at most `budget` tokens (the backend's n_ubatch);
  *pending*  the tokens a request still has to evaluate (a round's draft, a prefill's prompt);
  *take*     how many of a request's pending tokens go into the next pass;
  *prefill*  a request with more than a chunk of pending tokens evaluated for the cache, not for
             rows (a prompt, a replay); *round*: any other (a draft to verify, a stream's token).

Both the verifier's batcher (cloud_verifier.backends.batcher) and the fleet simulator
(netsim.fleet.policies.plan_pass) plan their passes with these functions, prefill flags
included, so what the simulator charges a pass is what the shipped batcher packs. They live here
because they are pure arithmetic on token counts and both may import spec_core, while netsim
must never import cloud_verifier. `PassItem` is here for the
same reason: the batcher packs it and llama_runtime (which the edge imports too) decodes it.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence


class PassItem(NamedTuple):
    """One token of a pass."""
    seq: int | tuple   # the sequence id; a token several sequences share (a tree node) carries a tuple,
                       # whose meaning is the packer's own
    pos: int           # its position in the sequence
    token: int
    want_logits: bool  # whether the pass returns this token's row of logits


def fair_share(pending: Sequence[int], budget: int, prefill: Sequence[bool] | None = None,
               prefill_chunk: int | None = None) -> list[int]:
    """Takes for the next pass, one per request, in the order given (arrival order).

    Each request gets up to a fair share (budget // requests, at least 1) while the budget lasts;
    what is left of the budget then goes to the requests in order, each taking what it still has.

        fair_share([5, 300, 5], 32)  == [5, 22, 5]    # shares of 10; the prefill gets the rest
        fair_share([40, 40], 32)     == [16, 16]
        fair_share([1] * 40, 32)     == [1] * 32 + [0] * 8   # the budget runs out

    With `prefill` flags and a `prefill_chunk` the pass is a chunked prefill (see
    `chunk_prefills`): the plan above is made with each prefill holding at most a chunk, rounds
    ahead of prefills, and only what it leaves goes to the prefills' remainders (a fair share of
    it each, then in order):

        fair_share([1500, 5], 32, [True, False], 8)     == [27, 5]
        fair_share([1500, 40], 32, [True, False], 8)    == [8, 24]    # without flags: [16, 16]
        fair_share([1500, 1500], 32, [True, True], 8)   == [16, 16]
    """
    if prefill is None or prefill_chunk is None:
        return _fair_in_order(pending, budget, range(len(pending)))
    _check(pending, prefill)
    rounds_first = [i for i, p in enumerate(prefill) if not p] + [i for i, p in enumerate(prefill) if p]
    first = _fair_in_order(chunk_prefills(pending, prefill, prefill_chunk), budget, rounds_first)
    rest = [n - t if p else 0 for n, t, p in zip(pending, first, prefill)]
    extra = _fair_in_order(rest, budget - sum(first), range(len(pending)))
    return [a + b for a, b in zip(first, extra)]


def least_slack_first(pending: Sequence[int], slack_s: Sequence[float], budget: int,
                      prefill_chunk: int, prefill: Sequence[bool] | None = None) -> list[int]:
    """Takes for the next pass, one per request (in the order given), SLO-aware.

    Requests go in order of slack (seconds left before their deadline; least first, ties in the
    order given) and take all their pending tokens while the budget lasts, a prefill (`prefill[i]`;
    default: more than `prefill_chunk` tokens pending) at most a chunk (`chunk_prefills`), late or
    not: a late prompt goes first, but never holds decoding rounds back for a whole pass. The
    budget is always used when there is work for it: the prefills' remainders take the leftovers
    after everyone else, in order of slack.

        least_slack_first([5, 5, 5], [0.3, -0.1, 0.2], 12, 16)  == [2, 5, 5]   # the late one first
        least_slack_first([5, 300], [0.1, 1.5], 32, 8)           == [5, 27]     # 8, then the leftovers
        least_slack_first([5, 300], [0.1, -0.5], 32, 8)          == [5, 27]     # late: 8 first
    """
    if prefill is None:
        prefill = [n > prefill_chunk for n in pending]
    if len(pending) != len(slack_s):
        raise ValueError("one slack per request")
    _check(pending, prefill)
    order = sorted(range(len(pending)), key=lambda i: (slack_s[i], i))
    first = chunk_prefills(pending, prefill, prefill_chunk)
    takes = [0] * len(pending)
    for i in order:
        if budget <= 0:
            break
        takes[i] = min(first[i], budget)
        budget -= takes[i]
    # work-conserving: the prefills' remainder fills what is left
    return _fill_leftovers(takes, pending, budget, order)


def chunk_prefills(pending: Sequence[int], prefill: Sequence[bool], prefill_chunk: int) -> list[int]:
    """What each request may take of a pass before every other request has had its turn: a
    prefill (a prompt or a replay: tokens evaluated for the cache, not for rows) a chunk, a round
    all it has. The rule of both schedules (chunked prefill, as Sarathi-Serve and vLLM do it): a
    pass holds more than `prefill_chunk` tokens of one prefill only when every round in it got
    all it had pending, so a long prompt never holds other sessions' rounds back."""
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    return [min(n, prefill_chunk) if p else n for n, p in zip(pending, prefill)]


def _check(pending: Sequence[int], prefill: Sequence[bool]) -> None:
    if len(pending) != len(prefill):
        raise ValueError("one prefill flag per request")


def _fair_in_order(pending: Sequence[int], budget: int, order: Sequence[int]) -> list[int]:
    """A fair share each (budget // requests, at least 1), then the leftovers, both in `order`."""
    takes = [0] * len(pending)
    if not pending:
        return takes
    share = max(1, budget // len(pending))
    for i in order:
        takes[i] = min(pending[i], share, max(budget, 0))
        budget -= takes[i]
    return _fill_leftovers(takes, pending, budget, order)


def _fill_leftovers(takes: list[int], pending: Sequence[int], budget: int, order: Sequence[int]) -> list[int]:
    """Give what is left of the pass's budget to what requests still have pending, in `order`."""
    for i in order:
        if budget <= 0:
            break
        extra = min(pending[i] - takes[i], budget)
        takes[i] += extra
        budget -= extra
    return takes
