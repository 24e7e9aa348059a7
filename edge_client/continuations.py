"""Which outcomes of a round in flight are worth a continuation: `ranked_outcomes`, the round's likely
outcomes by the draft's own estimate (spec_core.continuations.chain_outcomes). The session's drafting
(edge_client.drafts) drafts continuations in that order while the planner's cost model says one
more pays (edge_client.planner.ContinuationBudget).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from spec_core.continuations import Outcome, chain_outcomes
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
