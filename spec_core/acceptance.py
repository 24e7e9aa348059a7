"""The acceptance rule, written once: the accept test, the residual, and their score-based forms.

Terms as in spec_core/verify.py (target_probs p, draft_probs q, accepted, corrected, bonus).
Every verifier calls these through spec_core.tree's one walk (a chain is the tree with one path)
or torch_accept's batched pass: every backend, the vLLM one included.

From full rows of p:
  accept     draft token x survives with probability min(1, p(x) / q(x)). No q (None) is a point
             mass on x: q(x) = 1, so x survives with p(x).
  residual   after x is rejected the next draw comes from norm(max(0, p - q)); for a point mass
             that is p with x removed. A residual whose mass is at most RESIDUAL_EPS is rounding
             noise (p and q agree): p itself is used instead.

From scores (the vLLM backend reads p only at a few tokens, plus a sample y ~ p drawn by the
target's own sampler, independently of our uniforms):
  keep the sample   the corrected token is a draw from R = norm(max(0, p - q)). Propose y and
             keep it with probability a(y) = max(0, 1 - q(y) / p(y)); otherwise draw from R built
             from the full row (one extra request). With r = sum_t max(0, p(t) - q(t)):
                 P(keep, y = t) = p(t) a(t) = max(0, p(t) - q(t)) = r R(t),  P(fall through) = 1 - r,
                 so P(out = t) = r R(t) + (1 - r) R(t) = R(t).
  sparse residual   for trees, p is known on a set T holding the children and the q supports of
             every child but the last (the last one's rejection only decides the corrected token,
             which keeps the sample above); a residual step changes only tokens of q's support and divides the rest by
             r = 1 - sum_{t in supp q} min(p(t), q(t)) (see spec_core.tree.verify_tree_from_scores).

Every coin draws a uniform only when its outcome is uncertain (0 < probability < 1): seeded runs
depend on that draw order, so it is kept here and nowhere else.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from spec_core.qcodec import EncodedQ

# Residual mass at or below this is rounding noise (p and q agree): keep p instead.
RESIDUAL_EPS = 1e-12


def coin(prob: float, rng: np.random.Generator) -> bool:
    """True with probability min(1, max(0, prob)); a uniform is drawn only when 0 < prob < 1."""
    return prob >= 1.0 or (prob > 0.0 and rng.random() < prob)


def draft_prob(draft_probs: EncodedQ | None, token: int) -> float:
    """q(token); a draft without q is a point mass on its token, q(token) = 1."""
    return 1.0 if draft_probs is None else draft_probs.prob_of(token)


def accepts(target_prob: float, draft_probs: EncodedQ | None, token: int, rng: np.random.Generator) -> bool:
    """The accept test of draft `token`: true with probability min(1, p(token) / q(token))."""
    return coin(target_prob / draft_prob(draft_probs, token), rng)


def residual(target_probs: np.ndarray, draft_probs: EncodedQ | None, token: int) -> np.ndarray:
    """max(0, p - q), not normalised; a point mass (draft_probs None): p with `token` removed.
    target_probs  # [vocab] -> [vocab]"""
    if draft_probs is None:
        out = target_probs.copy()
        out[token] = 0.0
        return out
    ids = draft_probs.token_ids
    if draft_probs.fixed and ids is not None and len(np.unique(ids)) == len(ids):
        # Integer weights sum exactly in any order, so these are q.dense()'s values on the support;
        # off it p - 0 = p. The same numbers without two passes over the vocabulary.
        ids = ids.astype(np.intp)
        out = target_probs.copy()
        q_support = draft_probs.weights.astype(np.float64) / float(np.sum(draft_probs.weights))
        out[ids] = np.maximum(target_probs[ids] - q_support, 0.0)
        return out
    return np.maximum(target_probs - draft_probs.dense(len(target_probs)), 0.0)


def corrected_probs(target_probs: np.ndarray, draft_probs: EncodedQ | None, token: int) -> np.ndarray:
    """What the corrected token is drawn from once `token` was rejected: the residual, or p when the
    residual is rounding noise. Not normalised (spec_core.warping.sample takes any positive sum).
    target_probs  # [vocab] -> [vocab]"""
    out = residual(target_probs, draft_probs, token)
    return target_probs if out.sum() <= RESIDUAL_EPS else out


def after_rejection(target_probs: np.ndarray, draft_probs: EncodedQ | None, token: int) -> np.ndarray:
    """norm(max(0, p - q)): the p a later sibling is tested against once `token` was rejected;
    p unchanged when the residual is rounding noise.  # [vocab] -> [vocab]"""
    out = residual(target_probs, draft_probs, token)
    total = out.sum()
    return out / total if total > RESIDUAL_EPS else target_probs


# --- the same rule from scores ------------------------------------------------------------------

def keeps_sample(sample: int, sample_prob: float, draft_probs: EncodedQ | None, token: int,
                 rng: np.random.Generator, current_prob: float | None = None, scale: float = 1.0) -> bool:
    """After `token` was rejected: whether the target's sample y ~ p (p(y) = sample_prob) is the
    corrected token. When false, the corrected token is a draw from corrected_probs(full row, ...).

    A chain (the rejected token was the first tested at its node): keep y with probability
    a(y) = max(0, 1 - q(y) / p(y)). After earlier siblings were rejected, p_k (what `token` was
    tested against) is known as `current_prob` = p_k(y) when y is among the tokens p was read at,
    and as p * scale off them (scale = 1 / prod of the earlier siblings' r, sparse_after_rejection):
    a(y) = max(0, p_k(y) - q(y)) / (p(y) scale) = p_{k+1}(y) prod r / p(y) <= 1, which only needs
    p_k at y, not on q's support (spec_core.tree.verify_tree_from_scores has the proof)."""
    if sample_prob >= 1.0:
        # p is a point mass on y (greedy, or all other mass rounded away): so is every residual.
        return True
    q_y = (1.0 if sample == token else 0.0) if draft_probs is None else draft_probs.prob_of(sample)
    base = sample_prob * scale
    if base <= 0.0:
        return False
    now = base if current_prob is None else current_prob
    return coin(now / base - q_y / base, rng)   # a chain: exactly 1 - q(y) / p(y)


def support(draft_probs: EncodedQ | None, token: int) -> dict[int, float]:
    """q as {token: probability} over its support (a point mass: {token: 1})."""
    if draft_probs is None:
        return {token: 1.0}
    total = float(np.sum(draft_probs.weights, dtype=np.float64))
    # A dense q's support is every token with weight.
    ids = draft_probs.token_ids if draft_probs.token_ids is not None else np.flatnonzero(draft_probs.weights)
    weights = draft_probs.weights if draft_probs.token_ids is not None else draft_probs.weights[ids]
    return dict(zip(np.asarray(ids, dtype=np.int64).tolist(),
                    (np.asarray(weights, dtype=np.float64) / total).tolist()))


def sparse_after_rejection(known: Mapping[int, float], draft_probs: EncodedQ | None,
                           token: int) -> tuple[dict[int, float], float]:
    """after_rejection on the tokens where p is known (they must include q's support).

    Returns (the new p on those tokens, r): off them the new p is the old one divided by r.
    When the residual is rounding noise, p is kept: (known, 1.0)."""
    supp = support(draft_probs, token)
    r = 1.0 - sum(min(known[t], w) for t, w in supp.items())
    if r <= RESIDUAL_EPS:
        return dict(known), 1.0
    out = dict(known)
    for t, w in supp.items():
        out[t] = max(0.0, out[t] - w)
    return {t: v / r for t, v in out.items()}, r
