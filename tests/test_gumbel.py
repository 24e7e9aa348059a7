"""The gumbel coupling's maths (spec_core.gumbel): the noise, the Gumbel-max sample, the acceptance
formula, Gumbel-top-k for tree children, and the verifier's walk.

Statistical tests state N and tolerance and carry a negative control:
- the target's Gumbel-max token follows p (chi-square, N = 6000 positions, p > 1e-4); control: noise
  keyed by round instead of position repeats the same token every round and fails;
- the acceptance formula against Monte Carlo (N = 20000 positions, |Δ| < 4.5 standard errors) on
  random, truncated and partly disjoint pairs; control: the draft with its own independent noise
  (acceptance sum p q) is far outside the same tolerance;
- Gumbel-top-2 children are two draws without replacement (chi-square N = 6000).
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from spec_core.gumbel import (GumbelNoise, PositionNoise, coupling_rate, daliri_bound, draft_choices, gumbel_argmax,
                              gumbel_from_uniforms, noise_bits, noise_high, rejection_rate, target_token,
                              total_variation, uniforms, uniforms_grid)
from spec_core.qcodec import encode_fixed, encode_float
from spec_core.tree import DraftTree, gumbel_walk, verify_tree_on_logits
from spec_core.warping import GUMBEL, SamplingError, SamplingSettings, processed_probs

P_MIN = 1e-4


def test_the_noise_bits_are_fixed_integers():
    # Integer arithmetic only: these are the same on every machine and in torch (the vLLM path's
    # equality checks against the same numbers); a change here changes every seeded gumbel text.
    assert noise_bits(0, 0, np.array([0, 1, 262143])).tolist() == [2435718686451675, 3552073620922552, 1813637671544036]
    assert noise_bits(2 ** 64 - 1, 2 ** 40, np.array([5])).tolist() == [1739900631684332]
    bits = noise_bits(11, 7, np.arange(4))
    assert bits.dtype == np.uint64 and bool(np.all(bits < 2 ** 52))
    assert (noise_high(11, 7, np.arange(4)).astype(np.uint64) == bits >> np.uint64(20)).all()
    assert noise_bits(11, 7, np.arange(4)).tolist() != noise_bits(11, 8, np.arange(4)).tolist()
    assert noise_bits(11, 7, np.arange(4)).tolist() != noise_bits(12, 7, np.arange(4)).tolist()


def test_the_noise_is_uniform_and_independent_across_tokens_and_positions():
    u = np.concatenate([uniforms(3, pos, np.arange(2000)) for pos in range(50)])   # N = 100000
    assert 0 < u.min() and u.max() < 1
    counts, _ = np.histogram(u, bins=50, range=(0, 1))
    assert chisquare(counts).pvalue > P_MIN
    # Pairs (token v at position i, token v at i + 1) and (v, v + 1) at one position: 10 x 10 cells.
    a = uniforms(3, 0, np.arange(20000))
    for b in (uniforms(3, 1, np.arange(20000)), uniforms(3, 0, np.arange(1, 20001))):
        cells = np.histogram2d(a, b, bins=10, range=((0, 1), (0, 1)))[0].ravel()
        assert chisquare(cells).pvalue > P_MIN


def _rows(rng, vocab: int, n: int):
    for k in range(n):
        scale = [0.3, 1.0, 3.0, 8.0][k % 4]
        yield np.exp(rng.standard_normal(vocab) * scale)


def test_the_pruned_argmax_is_the_plain_one_on_long_rows():
    rng = np.random.default_rng(0)
    for vocab in (300, 5000, 49152):
        for k, w in enumerate(_rows(rng, vocab, 12)):
            p = w / w.sum()
            if k % 3 == 0:
                p[rng.integers(0, vocab, vocab // 3)] = 0.0   # zeros: not in the support
                p /= p.sum()
            if k % 4 == 1:
                p[:100] = p[0]                               # ties
                p /= p.sum()
            noise = PositionNoise(5, k)
            ids = np.flatnonzero(p)
            plain = int(ids[np.argmax(np.log(p[ids]) + noise(ids))])
            assert gumbel_argmax(p, noise) == plain


def test_greedy_is_argmax_and_a_one_token_support_is_that_token():
    p = np.zeros(10)
    p[4] = 1.0
    assert all(target_token(p, 1, i) == 4 for i in range(20))
    s = SamplingSettings(temperature=0.0, seed=1, coupling=GUMBEL)
    logits = np.random.default_rng(0).standard_normal((3, 10))
    tree = DraftTree.chain([int(np.argmax(logits[0])), 9])
    out = verify_tree_on_logits(logits, s, tree, None, None, position=7)
    assert out.path[:1] == [0] and out.next_token == (int(np.argmax(logits[2])) if out.path == [0, 1] else
                                                     int(np.argmax(logits[1])))


def test_the_target_token_follows_p_and_round_keyed_noise_does_not():
    p = np.array([0.05, 0.4, 0.25, 0.2, 0.1])
    n = 6000
    tokens = np.argmax(np.log(p) + gumbel_from_uniforms(uniforms_grid(9, range(n), np.arange(5))), axis=1)
    assert [target_token(p, 9, i) for i in range(0, n, 600)] == tokens[::600].tolist()
    assert chisquare(np.bincount(tokens, minlength=5), n * p).pvalue > P_MIN
    # Control: noise keyed by the round (rounds of 4 positions share one key): tokens within a round
    # repeat (a constant row), so the pairs (token, next token) inside a round are far from p x p.
    pairs = np.zeros((5, 5))
    for t in tokens[: n // 4]:   # every position of round r reads key r: the same token
        pairs[t, t] += 1
    assert chisquare(pairs.ravel(), (n // 4) * np.outer(p, p).ravel()).pvalue < P_MIN


PAIRS = {
    "random": lambda rng: (rng.dirichlet(np.ones(12)), rng.dirichlet(np.ones(12))),
    "close": lambda rng: _close(rng),
    "truncated": lambda rng: _truncated(rng),
    "disjoint-part": lambda rng: (np.array([0.5, 0.3, 0.2, 0, 0]), np.array([0, 0.1, 0.3, 0.4, 0.2])),
}


def _close(rng):
    logits = rng.standard_normal(30) * 2
    return processed_probs(logits, 1.0), processed_probs(logits + rng.standard_normal(30) * 0.5, 1.0)


def _truncated(rng):
    logits = rng.standard_normal(40) * 2
    p = processed_probs(logits, 0.7, top_k=6)
    q = encode_fixed(processed_probs(logits + rng.standard_normal(40), 0.7), 8, 12)
    return p, q.dense(40).astype(np.float64)


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_the_acceptance_formula_against_monte_carlo(kind):
    rng = np.random.default_rng(1)
    p, q = PAIRS[kind](rng)
    n = 20000
    g = gumbel_from_uniforms(uniforms_grid(13, range(n), np.arange(len(p))))   # [n, V]: position i's noise
    with np.errstate(divide="ignore"):
        y = np.argmax(np.log(p) + g, axis=1)
        x = np.argmax(np.log(q) + g, axis=1)
    for i in range(0, n, 2500):   # the grid is gumbel_argmax's noise
        assert y[i] == gumbel_argmax(p, PositionNoise(13, i)) and x[i] == gumbel_argmax(q, PositionNoise(13, i))
    hits = int(np.sum(x == y))
    # control: the draft's own, independent draw
    own_draws = np.searchsorted(np.cumsum(q / q.sum()), np.random.default_rng(2).random(n), side="right")
    own = int(np.sum(np.minimum(own_draws, len(q) - 1) == y))
    rate = coupling_rate(p, q)
    se = np.sqrt(rate * (1 - rate) / n) + 1e-12
    assert abs(hits / n - rate) < 4.5 * se, (kind, hits / n, rate)
    independent = float(np.sum(p * q))
    if abs(independent - rate) > 12 * se:   # the control is distinguishable here: it must fail the test
        assert abs(own / n - rate) >= 4.5 * se
    tv = total_variation(p, q)
    assert daliri_bound(p, q) - 1e-12 <= rate <= rejection_rate(p, q) + 1e-12 == pytest.approx(1 - tv)


def test_the_formula_bounds_on_many_pairs():
    rng = np.random.default_rng(4)
    for _ in range(300):
        v = int(rng.integers(2, 40))
        p = rng.dirichlet(np.full(v, rng.uniform(0.1, 3)))
        q = rng.dirichlet(np.full(v, rng.uniform(0.1, 3)))
        if rng.random() < 0.3:
            p[rng.integers(0, v, v // 2)] = 0
            p = p / p.sum() if p.sum() else np.eye(v)[0]
        rate = coupling_rate(p, q)
        assert daliri_bound(p, q) - 1e-9 <= rate <= rejection_rate(p, q) + 1e-9
        # The O(V log V) form is the definition's double sum.
        both = np.flatnonzero((p > 0) & (q > 0))
        direct = sum(1.0 / np.sum(np.maximum(p / p[k], q / q[k])) for k in both)
        assert rate == pytest.approx(direct, rel=1e-9, abs=1e-12)
    assert coupling_rate(np.array([0.3, 0.7]), np.array([0.3, 0.7])) == pytest.approx(1.0)


def test_gumbel_top_two_children_are_draws_without_replacement():
    q = encode_float(np.array([0.4, 0.3, 0.2, 0.1]), 0)
    w = np.array([0.4, 0.3, 0.2, 0.1])
    n = 6000
    order = np.argsort(-(np.log(w) + gumbel_from_uniforms(uniforms_grid(21, range(n), np.arange(4)))), axis=1)
    assert [draft_choices(q, PositionNoise(21, i), 2) for i in range(0, n, 600)] == order[::600, :2].tolist()
    counts = np.zeros((4, 4))
    np.add.at(counts, (order[:, 0], order[:, 1]), 1)
    expected = np.array([[0 if a == b else w[a] * w[b] / (1 - w[a]) for b in range(4)] for a in range(4)]) * n
    off = ~np.eye(4, dtype=bool)
    assert chisquare(counts[off], expected[off]).pvalue > P_MIN


def test_a_tree_walk_follows_the_child_carrying_the_target_token():
    rng = np.random.default_rng(3)
    probs = processed_probs(rng.standard_normal((6, 8)) * 2, 1.0)
    tree = DraftTree((1, 2, 3, 4, 5), (-1, -1, 0, 0, 2))
    seed, position = 17, 40
    for pos in range(position, position + 200):
        out = gumbel_walk(probs.__getitem__, tree, seed, pos)
        node, expect = -1, []
        while True:
            y = target_token(probs[node + 1], seed, pos + len(expect))
            child = next((c for c in tree.children()[node] if tree.tokens[c] == y), None)
            if child is None:
                break
            expect.append(child)
            node = child
        assert out.path == expect and out.next_token == y


def test_settings_refuse_an_unknown_coupling_and_draw_a_session_seed():
    with pytest.raises(SamplingError, match="coupling must be one of rejection, gumbel"):
        SamplingSettings(coupling="minhash")
    s = SamplingSettings(coupling=GUMBEL).with_session_seed()
    assert s.seed is not None and s.with_session_seed() is s
    assert SamplingSettings().with_session_seed().seed is None   # rejection: no seed is invented
    with pytest.raises(ValueError, match="needs a seed"):
        GumbelNoise(None)
