"""What to draft while a round is in flight: the outcomes worth a continuation, and how many fit.

The session loop (edge_client.client) asks `ranked_outcomes` for the round's likely outcomes
(spec_core.continuations.chain_outcomes: the draft's own estimate), then drafts continuations in that
order while `ContinuationBudget.worth` says that one more pays: its chance of being the outcome
times the time a hit saves (the round trip hidden and the fresh draft avoided) against the delay
that drafting and uploading it adds to every hit. Measured inputs: the round trip and the verifier's
time (the tree planner's estimates), the draft time per continuation (measured as they are drafted)
and the uplink's time per byte (`UplinkFit`: least squares of round trip over request bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from spec_core.continuations import Outcome, chain_outcomes, worth_drafting
from spec_core.costmodel import expected_tokens_per_round
from spec_core.estimates import fit_line
from spec_core.qcodec import EncodedQ

CANDIDATES = 8  # corrected / bonus candidates considered per position


def top_candidates(q: EncodedQ | None, k: int, exclude: Sequence[int] = ()) -> list[tuple[int, float]]:
    """The k most probable tokens of q without `exclude`, renormalised: (token, prob)."""
    if q is None:
        return []
    ids = np.arange(len(q.weights)) if q.token_ids is None else q.token_ids.astype(np.int64)
    w = q.weights.astype(np.float64).copy()
    if len(exclude):
        w[np.isin(ids, np.asarray(list(exclude), dtype=np.int64))] = 0.0
    total = w.sum()
    if total <= 0:
        return []
    order = np.argsort(-w, kind="stable")[:k]
    return [(int(ids[i]), float(w[i] / total)) for i in order if w[i] > 0]


def ranked_outcomes(drafts: Sequence[int], alpha: float, position_q: Callable[[int], EncodedQ | None],
                    bonus_q: EncodedQ | None, limit: int, excluded: Callable[[int], Sequence[int]] = lambda j: ()
                    ) -> list[Outcome]:
    """The round's outcomes, most probable first. position_q(j): the draft's q at position j (the one
    shipped, or an estimate for point-mass drafts); excluded(j): tokens the verifier cannot emit
    there besides the draft (a tree's other children)."""
    corrected = [top_candidates(position_q(j), CANDIDATES, [drafts[j], *excluded(j)]) for j in range(len(drafts))]
    return chain_outcomes(drafts, alpha, corrected, top_candidates(bonus_q, CANDIDATES), limit)


@dataclass
class UplinkFit:
    """Uplink seconds per request byte: least squares of (round trip − server time) over request
    bytes for recent rounds; 0 until the points spread (then bytes cost nothing in the model)."""

    points: list[tuple[int, float]] = field(default_factory=list)
    keep: int = 32

    def observe(self, request_bytes: int, network_s: float) -> None:
        self.points = (self.points + [(request_bytes, max(0.0, network_s))])[-self.keep:]

    def seconds_per_byte(self) -> float:
        if len(self.points) < 4:
            return 0.0
        sizes = [p[0] for p in self.points]
        if max(sizes) - min(sizes) < 16:
            return 0.0
        return fit_line(self.points).slope


@dataclass
class ContinuationBudget:
    """When to stop drafting continuations, as times on spec_core.clock's clock.

    t_reply: when the reply to the round in flight is expected; rtt_s: the network round trip;
    fresh_draft_s: what drafting the next round after the reply would cost (saved by a hit)."""

    t_reply: float
    rtt_s: float
    fresh_draft_s: float
    s_per_byte: float
    check_first: bool = False   # the first continuation is drafted in any case (the reply is awaited anyway)
    round_s: float = 0.0        # a fresh round's predicted time: its drafting, round trip and verifier
    depth: int = 1              # rounds in flight once a continuation is sent (1: kept for when the reply comes)

    def hit_miss_s(self, g: int, t_row_s: float) -> tuple[float, float]:
        """The time the next round takes after this reply when a continuation hits, and when none
        does (a fresh round: drafted, sent, verified). A hit skips the drafting; sent ahead, it also
        shares the round trip with the other rounds in flight."""
        return max(0.0, self.round_s - self.fresh_draft_s) / max(self.depth, 1), self.round_s

    def saving_s(self, t_send: float) -> float:
        """What a hit saves against drafting afresh after the reply, if the round leaves at t_send."""
        return max(0.0, min(self.t_reply - t_send, self.rtt_s)) + self.fresh_draft_s

    def worth(self, prob: float, covered: float, now: float, draft_s: float, nbytes: int) -> bool:
        """Whether drafting one more continuation (probability `prob`, ~draft_s to draft, ~nbytes up)
        pays, given the probability `covered` of those drafted so far."""
        cost = draft_s + nbytes * self.s_per_byte
        if covered <= 0.0:
            return self.saving_s(now + cost) > 0.0
        after, before = self.saving_s(now + cost), self.saving_s(now)
        return worth_drafting(prob, covered, before, before - after) if before > 0 else False


@dataclass
class FusedBudget:
    """When drafting one more continuation before round r leaves pays (fused: verified in round r's
    own pass). Unlike continuations drafted during the round trip, this drafting delays round r
    itself, hit or miss: a continuation pays when its chance of being the outcome times what a hit
    saves (round r + 1's fresh draft, its round trip and its pass: `gain_s`) exceeds what it adds
    to round r: its drafting, its upload, and the verifier's time for its nodes (one node per
    draft row: `verify_per_draft` = the verifier's seconds per node / the draft's per row). The same
    `worth` signature as ContinuationBudget, so the session's drafting loop and `choose_length`
    take either."""

    gain_s: float
    s_per_byte: float
    verify_per_draft: float = 0.0
    check_first: bool = True   # the first continuation must pay too (ContinuationBudget drafts it anyway)

    def worth(self, prob: float, covered: float, now: float, draft_s: float, nbytes: int) -> bool:
        return prob * self.gain_s > draft_s * (1.0 + self.verify_per_draft) + nbytes * self.s_per_byte

    def hit_miss_s(self, g: int, t_row_s: float) -> tuple[float, float]:
        """A hit costs what a continuation of length g adds to round r (its drafting and its nodes in
        the pass); a miss, round r + 1 afresh (`gain_s`)."""
        return (g + 1) * t_row_s * (1.0 + self.verify_per_draft), self.gain_s


def choose_length(outcomes: Sequence[Outcome], alpha: float, max_gamma: int, t_row_s: float, bytes_per_token: float,
                  budget: "ContinuationBudget | FusedBudget", now: float) -> int:
    """The continuations' length g (at most the fresh round's γ, `max_gamma`): the one that maximises
    the next round's expected tokens per second. P(hit) sums the outcomes that `budget.worth` would
    let be drafted at length g (shorter continuations cover more outcomes); a hit commits E[tokens]
    of a g-round in the hit's time, a miss a fresh γ-round in a fresh round's time
    (`budget.hit_miss_s`). So a short continuation pays only where hits save enough time to make up
    for the tokens it gives away: a continuation kept for when the reply comes still costs its round
    trip, and there the fresh round's γ wins."""
    a = min(alpha, 0.999)
    fresh = expected_tokens_per_round(a, max_gamma)

    def covered(g: int) -> float:
        cost = (g + 1) * t_row_s   # the outcome's own token, then g drafts
        total, t = 0.0, now
        for i, o in enumerate(outcomes):
            if i and not budget.worth(o.prob, total, t, cost, int(g * bytes_per_token)):
                break
            total += o.prob
            t += cost
        return total

    def rate(g: int) -> float:
        p = min(covered(g), 1.0)
        hit_s, miss_s = budget.hit_miss_s(g, t_row_s)
        tokens = p * expected_tokens_per_round(a, g) + (1 - p) * fresh
        return tokens / max(p * hit_s + (1 - p) * miss_s, 1e-9)
    return max(range(1, max_gamma + 1), key=lambda g: (rate(g), g))
