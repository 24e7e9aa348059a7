"""spec_core.acceptance: the accept test, the residual, and the score-based rule the vLLM backend runs.

Literal cases with a scripted generator (each uniform is listed, so a test also pins which coins
draw one), then exact checks that the score-based rule gives the probability rule's distribution:
the target's own sample, kept with a(y) = max(0, 1 - q(y)/p(y)), else a draw from the residual,
is distributed as the residual. No vLLM is needed here.
"""
from __future__ import annotations

import numpy as np
import pytest

from spec_core.acceptance import (RESIDUAL_EPS, accepts, after_rejection, coin, corrected_probs, keeps_sample,
                                  residual, sparse_after_rejection, support)
from spec_core.qcodec import EncodedQ, encode_fixed, encode_float
from spec_core.tree import DraftTree, NodeScore, TreeResult, verify_tree, verify_tree_from_scores
from chain_round import chain_round


class Scripted:
    """A generator whose uniforms are listed in the test; drawing one too many fails."""

    def __init__(self, *uniforms: float):
        self.uniforms = list(uniforms)

    def random(self) -> float:
        assert self.uniforms, "drew a uniform the test did not expect"
        return self.uniforms.pop(0)


def float_q(probs) -> EncodedQ:
    return encode_float(np.asarray(probs, dtype=np.float64), 0)


# --- the accept test ----------------------------------------------------------------------------

def test_coin_draws_only_when_uncertain():
    assert coin(1.0, Scripted()) and coin(2.5, Scripted())           # certain: no uniform
    assert not coin(0.0, Scripted()) and not coin(-0.1, Scripted())
    assert coin(0.5, Scripted(0.49)) and not coin(0.5, Scripted(0.5))


def test_accepts_with_min_one_p_over_q():
    q = float_q([0.6, 0.4, 0.0])   # q(0) = 0.6
    assert accepts(0.3, q, 0, Scripted(0.49))          # ratio 0.5: u = 0.49 accepts
    assert not accepts(0.3, q, 0, Scripted(0.51))      # u = 0.51 rejects
    assert accepts(0.7, q, 0, Scripted())              # p >= q: always, no uniform drawn
    assert not accepts(0.0, q, 0, Scripted())          # p = 0: never, no uniform drawn


def test_point_mass_accepts_with_p_of_the_draft():
    assert accepts(0.25, None, 7, Scripted(0.2))
    assert not accepts(0.25, None, 7, Scripted(0.3))
    assert accepts(1.0, None, 7, Scripted())


# --- the residual -------------------------------------------------------------------------------

def test_residual_is_max_zero_p_minus_q():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = float_q([0.2, 0.5, 0.3, 0.0])
    assert residual(p, q, 1) == pytest.approx([0.3, 0.0, 0.0, 0.0])
    assert corrected_probs(p, q, 1) == pytest.approx([0.3, 0.0, 0.0, 0.0])   # not normalised
    assert after_rejection(p, q, 1) == pytest.approx([1.0, 0.0, 0.0, 0.0])   # normalised


def test_point_mass_residual_removes_the_draft_token():
    p = np.array([0.5, 0.3, 0.2])
    assert list(residual(p, None, 0)) == [0.0, 0.3, 0.2]
    assert after_rejection(p, None, 0) == pytest.approx([0.0, 0.6, 0.4])
    assert list(p) == [0.5, 0.3, 0.2]  # p itself is untouched


def test_rounding_noise_keeps_p():
    p = np.array([0.5, 0.5, 0.0])
    q = float_q([0.5, 0.5, 0.0])                       # p == q: nothing left to correct toward
    assert residual(p, q, 0).sum() <= RESIDUAL_EPS
    assert corrected_probs(p, q, 0) is p and after_rejection(p, q, 0) is p


def test_sparse_fixed_q_residual_is_the_dense_one_bit_for_bit():
    rng = np.random.default_rng(3)
    for _ in range(200):
        p = rng.dirichlet(np.full(40, 0.3))
        q = encode_fixed(rng.dirichlet(np.full(40, 0.3)), top_k=int(rng.integers(1, 12)), scale_bits=8)
        dense = np.maximum(p - q.dense(40), 0.0)
        assert np.array_equal(residual(p, q, int(q.token_ids[0])), dense)


# --- the rule from scores -----------------------------------------------------------------------

def test_keeps_sample_literal_cases():
    q = float_q([0.5, 0.1, 0.4, 0.0])
    assert keeps_sample(3, 0.2, q, 0, Scripted())              # q(y) = 0: a(y) = 1, no uniform
    assert not keeps_sample(0, 0.4, q, 0, Scripted())          # q(y) > p(y): a(y) = 0, no uniform
    assert keeps_sample(1, 0.4, q, 0, Scripted(0.74))          # a(y) = 1 - 0.1/0.4 = 0.75
    assert not keeps_sample(1, 0.4, q, 0, Scripted(0.76))
    assert keeps_sample(2, 1.0, q, 0, Scripted())              # p is a point mass on y (greedy)
    assert not keeps_sample(5, 0.3, None, 5, Scripted())       # point mass: y is the rejected draft
    assert keeps_sample(4, 0.3, None, 5, Scripted())           # any other y is kept


def keep_probability(y: int, p: np.ndarray, q: EncodedQ | None, x: int) -> float:
    """The probability with which keeps_sample keeps y, read off its coin: it keeps for u below
    it and not above it (u is uniform, so that threshold is the probability)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if keeps_sample(y, float(p[y]), q, x, Scripted(mid, mid)) else (lo, mid)
    return lo


@pytest.mark.parametrize("q_kind", ["float", "fixed-sparse", "none"])
def test_keeping_the_sample_gives_the_residual_distribution(q_kind):
    """P(out = t) = p(t) a(t) + (1 - sum_y p(y) a(y)) R(t) must equal R(t) = norm(max(0, p - q))."""
    rng = np.random.default_rng(11)
    for _ in range(20):
        p = rng.dirichlet(np.full(8, 0.7))
        q_probs = rng.dirichlet(np.full(8, 0.7))
        q = {"float": float_q(q_probs), "fixed-sparse": encode_fixed(q_probs, 4, 8), "none": None}[q_kind]
        x = int(np.argmax(q_probs)) if q is None else int(q.token_ids[0] if q.token_ids is not None else 0)
        target_r = corrected_probs(p, q, x)
        target_r = target_r / target_r.sum()
        kept = np.array([p[y] * keep_probability(y, p, q, x) for y in range(8)])
        out = kept + (1.0 - kept.sum()) * target_r
        assert out == pytest.approx(target_r, abs=1e-12)


def chain_scores(drafts, samples, sample_probs, draft_probs):
    """A chain's per-position scores as verify_tree_from_scores reads them: position i is the node
    before draft i (the root first), p read at the draft token; the last position holds the bonus."""
    return [NodeScore(y, py, {} if px is None else {x: px})
            for x, y, py, px in zip(list(drafts) + [None], samples, sample_probs, draft_probs)]


def test_chain_from_scores_literal_round():
    drafts = [3, 5, 2]
    chain = DraftTree.chain(drafts)
    qs = [float_q([0, 0, 0, 1.0, 0, 0]),              # q(3) = 1
          float_q([0, 0.2, 0, 0, 0, 0.8]),            # q(5) = 0.8
          None]
    p1 = np.array([0.0, 0.5, 0.1, 0.0, 0.0, 0.4])    # the target at position 1 (after node 0)
    # p(3) = 1: accepted without a uniform; ratio 0.4 / 0.8 = 0.5, and y = 5 is the draft: a = 0
    scores = chain_scores(drafts, [3, 5, 2, 0], [1.0, 0.4, 0.3, 0.5], [1.0, 0.4, 0.3, None])
    # u = 0.7 rejects 5; a(5) = 0 draws nothing; the fallback draws from max(0, p1 - q1) = [0, .3, .1, 0, 0, 0]
    # with u = 0.5: 0.5 * 0.4 = 0.2 < 0.3, so token 1.
    result, used_full_row = verify_tree_from_scores(chain, qs, scores, lambda node: {0: p1}[node], Scripted(0.7, 0.5))
    assert (result, used_full_row) == (TreeResult([0], 1), True)
    # The same round when every draft is accepted: the bonus is the target's sample at position 3.
    scores = chain_scores(drafts, [3, 5, 2, 0], [1.0, 0.9, 0.8, 0.5], [1.0, 0.9, 1.0, None])
    result, used_full_row = verify_tree_from_scores(chain, qs, scores, None, Scripted())
    assert (result, used_full_row) == (TreeResult([0, 1, 2], 0), False)


def test_chain_from_scores_matches_the_row_walk_when_the_sample_is_not_kept():
    """With the target's sample never kept (y = the rejected draft, a(y) = 0), the score rule and the
    row rule draw the same uniforms for the same things, so they give the same round."""
    rng = np.random.default_rng(5)
    for seed in range(200):
        gamma = 3
        p = rng.dirichlet(np.full(10, 0.5), size=gamma + 1)
        qs = [encode_fixed(rng.dirichlet(np.full(10, 0.5)), 5, 8) for _ in range(gamma)]
        drafts = [int(q.token_ids[0]) for q in qs]
        at_draft = [float(p[i][drafts[i]]) for i in range(gamma)]
        scores = chain_scores(drafts, drafts + [0], at_draft + [0.5], at_draft + [None])
        by_rows = chain_round(p, drafts, qs, np.random.default_rng(seed))
        by_scores, _ = verify_tree_from_scores(DraftTree.chain(drafts), qs, scores, lambda node: p[node + 1],
                                               np.random.default_rng(seed))
        if by_rows.num_accepted < gamma:
            assert (by_scores.num_accepted, by_scores.next_token) == (by_rows.num_accepted, by_rows.next_token)


def test_sparse_residual_agrees_with_the_full_row():
    rng = np.random.default_rng(8)
    for _ in range(100):
        p = rng.dirichlet(np.full(12, 0.6))
        q = encode_fixed(rng.dirichlet(np.full(12, 0.6)), 4, 8)
        x = int(q.token_ids[0])
        known = {t: float(p[t]) for t in sorted(set(support(q, x)) | {0, 1})}
        sparse, r = sparse_after_rejection(known, q, x)
        full = after_rejection(p, q, x)
        for t in range(12):
            expect = sparse[t] if t in sparse else p[t] / r
            assert full[t] == pytest.approx(expect, abs=1e-12)


def keep_threshold(y, p_y, q, x, current, scale) -> float:
    """keeps_sample's keep probability after siblings, read off its coin (as keep_probability)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if keeps_sample(y, p_y, q, x, Scripted(mid, mid), current, scale) else (lo, mid)
    return lo


def test_keeps_sample_after_rejected_siblings_needs_p_only_at_the_sample():
    """The last of three rejected siblings: a(y) from p_k at y alone (current_prob on the tokens read,
    p * scale off them) equals p_{k+1}(y) r_1 r_2 r_3 / p(y) computed on full rows, for every y; and
    the kept mass plus the fall-through gives p_{k+1} exactly. 100 random cases, abs 1e-12.
    Control: ignoring the earlier siblings' scale must disagree."""
    rng = np.random.default_rng(21)
    wrong = 0
    for _ in range(100):
        p = rng.dirichlet(np.full(12, 0.6))
        qs = [encode_fixed(rng.dirichlet(np.full(12, 0.6)), 4, 8) for _ in range(3)]
        xs = [int(q.token_ids[0]) for q in qs]
        rows, rs = [p], []
        for q, x in zip(qs, xs):
            rs.append(float(residual(rows[-1], q, x).sum()))
            rows.append(after_rejection(rows[-1], q, x))
        known = {t: float(p[t]) for t in sorted(set(xs) | set(support(qs[0], xs[0])) | set(support(qs[1], xs[1])))}
        cur, scale = dict(known), 1.0
        for q, x in zip(qs[:2], xs[:2]):   # the last sibling's support is not read
            cur, r = sparse_after_rejection(cur, q, x)
            scale /= r
        kept = np.zeros(12)
        for y in range(12):
            a = keep_threshold(y, float(p[y]), qs[2], xs[2], cur.get(y), scale)
            assert a == pytest.approx(rows[3][y] * np.prod(rs) / p[y], abs=1e-12)
            kept[y] = p[y] * a
            wrong += abs(keep_threshold(y, float(p[y]), qs[2], xs[2], cur.get(y), 1.0) - a) > 1e-3
        assert kept + (1.0 - kept.sum()) * rows[3] == pytest.approx(rows[3], abs=1e-12)
    assert wrong > 0, "the control: without the siblings' scale the keep probability must differ somewhere"


def test_verify_tree_from_scores_literal_tree():
    # Root children 3 and 4 (point masses); node 0 (token 3) has child 5.
    tree = DraftTree((3, 4, 5), (-1, -1, 0))
    p_root = np.array([0.1, 0.0, 0.0, 0.3, 0.6, 0.0])
    scores = [NodeScore(4, 0.6, {3: 0.3, 4: 0.6}), NodeScore(5, 0.5, {5: 0.5}), NodeScore(0, 1.0, {}),
              NodeScore(0, 1.0, {})]
    # u = 0.5 rejects 3 (p = 0.3); then p(4) = 0.6 / 0.7 > 0.6: u = 0.9 rejects 4; the sample y = 4
    # is a rejected child (a = 0), so the full row: residual [0.1, 0, 0, 0, 0, 0] -> token 0.
    result, used = verify_tree_from_scores(tree, None, scores, lambda node: p_root, Scripted(0.5, 0.9, 0.3))
    assert (result, used) == (TreeResult([], 0), True)
    # u = 0.2 accepts 3, then u = 0.4 accepts 5 (p = 0.5); node 2 is a leaf: its sample is the bonus.
    result, used = verify_tree_from_scores(tree, None, scores, None, Scripted(0.2, 0.4))
    assert (result, used) == (TreeResult([0, 2], 0), False)
    rows = np.stack([p_root, np.array([0, 0, 0, 0, 0.5, 0.5]), np.eye(6)[0], np.eye(6)[0]])
    assert verify_tree(rows, tree, None, Scripted(0.2, 0.4, 0.0)) == TreeResult([0, 2], 0)
