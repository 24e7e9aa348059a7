"""How a continuously batched verifier fills one target pass: the fair-share planner, and the
record a pass is made of.

Glossary:
  *pass*     one forward pass of the target over at most `budget` tokens (the backend's n_ubatch);
  *pending*  the tokens a request still has to evaluate (a round's draft, a prefill's prompt);
  *take*     how many of a request's pending tokens go into the next pass.

Both the verifier's batcher (cloud_verifier.backends.batcher) and the fleet simulator
(netsim.fleet) plan their passes with `fair_share`, so what the simulator charges a pass is what
the shipped batcher packs. It lives here because it is pure arithmetic on token counts and both
may import spec_core, while netsim must never import cloud_verifier. `PassItem` is here for the
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


def fair_share(pending: Sequence[int], budget: int) -> list[int]:
    """Takes for the next pass, one per request, in the order given (arrival order).

    Each request gets up to a fair share (budget // requests, at least 1) while the budget lasts;
    what is left of the budget then goes to the requests in order, each taking what it still has.
    A long prefill is so spread over several passes and never holds up short rounds.

        fair_share([5, 300, 5], 32)  == [5, 22, 5]    # shares of 10; the prefill gets the rest
        fair_share([40, 40], 32)     == [16, 16]
        fair_share([1] * 40, 32)     == [1] * 32 + [0] * 8   # the budget runs out
    """
    if not pending:
        return []
    share = max(1, budget // len(pending))
    takes = []
    for tokens in pending:
        take = min(tokens, share, budget)
        takes.append(take)
        budget -= take
    for i, tokens in enumerate(pending):
        if budget <= 0:
            break
        extra = min(tokens - takes[i], budget)
        takes[i] += extra
        budget -= extra
    return takes


def least_slack_first(pending: Sequence[int], slack_s: Sequence[float], budget: int,
                      prefill_chunk: int, prefill: Sequence[bool] | None = None) -> list[int]:
    """Takes for the next pass, one per request (in the order given), SLO-aware.

    Requests go in order of slack (seconds left before their deadline; least first, ties in the
    order given) and take all their pending tokens while the budget lasts. A prefill (`prefill[i]`:
    a prompt or a replay, tokens evaluated for the cache rather than for rows; default: more than
    `prefill_chunk` tokens pending) takes at most `prefill_chunk` a pass while its slack is positive, so that a long prompt never holds decoding rounds back for a
    whole pass; once late it is served like any other. The budget is always used when there is
    work for it (a capped prefill takes the leftovers after everyone else).

        least_slack_first([5, 5, 5], [0.3, -0.1, 0.2], 12, 16)  == [2, 5, 5]   # the late one first
        least_slack_first([5, 300], [0.1, 1.5], 32, 8)           == [5, 27]     # 8, then the leftovers
    """
    if prefill is None:
        prefill = [n > prefill_chunk for n in pending]
    if not len(pending) == len(slack_s) == len(prefill):
        raise ValueError("one slack and one prefill flag per request")
    order = sorted(range(len(pending)), key=lambda i: (slack_s[i], i))
    takes = [0] * len(pending)
    capped = [i for i in order if prefill[i] and pending[i] > prefill_chunk and slack_s[i] > 0]
    for i in order:
        if budget <= 0:
            break
        limit = prefill_chunk if i in capped else pending[i]
        takes[i] = min(limit, budget)
        budget -= takes[i]
    for i in capped:   # work-conserving: the prefills' remainder fills what is left
        if budget <= 0:
            break
        extra = min(pending[i] - takes[i], budget)
        takes[i] += extra
        budget -= extra
    return takes
