"""Trees: statistical exactness of whole sequences, literal cases, and the wire checks.

The same set-up as tests/test_exactness_stats.py: a synthetic target over V = 5 tokens (order-1,
exact probabilities), a blurred draft, N = 6000 sequences of L = 3 tokens per setting, compared
with the exact target probabilities of all 125 sequences by a chi-square test (cells with expected
count < 5 pooled); a setting fails if p < 1e-4. Seeds are fixed, so every test is deterministic.
Trees are grown by spec_core.tree.grow_tree (the edge's builder) with the budget/depth/branching
below, deterministic (point-mass children: the draft's most likely tokens) or sampled (children
drawn without replacement from the shipped q), and cut by commit_round at L (max tokens mid-path).
The negative controls (follow the first child whenever any child wins; test every sibling against
the untouched p) must be caught, which shows the test has power.
"""
import numpy as np
import pytest

from spec_core.qcodec import encode_fixed, encode_float
from spec_core.synthetic import synthetic_pair
from spec_core.tree import (ROOT, DraftTree, TreeError, TreeResult, TreeShape, grow_tree, prune_to_fit,
                            validate_tree, verify_tree, without_tokens)
from spec_core.verify import RoundResult, commit_round
from spec_core.warping import SamplingSettings, processed_probs, sample
from test_exactness_stats import L, N, P_MIN, V, chi_square_p, exact_sequence_probs, sequence_counts
from hybridspec.testing import warping_reference as ref

SHAPE = TreeShape(budget=8, depth=3, branching=3, width=2)


def encoder_for(kind: str):
    if kind == "deterministic":
        return None
    if kind == "sampled-fixed":
        return lambda probs: encode_fixed(probs, 3, 6)
    return lambda probs: encode_float(probs, 0)


def tree_target_probs(target, committed, tree: DraftTree, s: SamplingSettings) -> np.ndarray:
    ctxs = [list(committed)] + [list(committed) + [tree.tokens[j] for j in tree.path_to(i)] for i in range(len(tree))]
    return processed_probs(np.stack([target.logits(c) for c in ctxs]), s.temperature, s.top_k, s.top_p)


def speculative_tree_sequence(target, draft, prompt, s, shape, kind, rng, verify=verify_tree):
    committed = list(prompt)
    encode = encoder_for(kind)
    while len(committed) - len(prompt) < L:
        def next_probs(nodes, tokens, parents, base=list(committed)):
            tree = DraftTree(tuple(tokens), tuple(parents))
            paths = [[] if n == ROOT else [tokens[j] for j in tree.path_to(n)] for n in nodes]
            return np.stack([processed_probs(draft.logits(base + p), s.temperature, s.top_k, s.top_p) for p in paths])
        grown = grow_tree(next_probs, shape, rng, encode)
        p = tree_target_probs(target, committed, grown.tree, s)
        result = verify(p, grown.tree, grown.qs, rng)
        path_tokens = [grown.tree.tokens[i] for i in result.path]
        done = commit_round(path_tokens, RoundResult(len(path_tokens), result.next_token), frozenset(),
                            remaining=L - (len(committed) - len(prompt)), context_left=10_000)
        committed.extend(done.tokens)
    return tuple(committed[len(prompt):])


def run_tree_setting(temperature, top_k, top_p, kind, seed=0, n=N, verify=verify_tree, shape=SHAPE):
    return sequence_counts(lambda t, d, p, s, rng: speculative_tree_sequence(t, d, p, s, shape, kind, rng, verify),
                           temperature, top_k, top_p, seed, n)


@pytest.mark.parametrize("kind", ["deterministic", "sampled-fixed", "sampled-float"])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 0.9)], ids=["plain", "topk4-topp0.9"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
def test_tree_sequences_follow_the_target(temperature, top_k, top_p, kind):
    counts, probs = run_tree_setting(temperature, top_k, top_p, kind)
    p = chi_square_p(counts, probs, N)
    assert p > P_MIN, f"chi-square p = {p:.2e} for T={temperature} top_k={top_k} top_p={top_p} tree={kind}"


def test_wide_shallow_tree_follows_the_target():
    """Four sampled siblings per node (the support of top-k 3 runs out: fewer children)."""
    counts, probs = run_tree_setting(1.0, 0, 1.0, "sampled-fixed", shape=TreeShape(budget=12, depth=2,
                                                                                    branching=4, width=3))
    assert chi_square_p(counts, probs, N) > P_MIN


def test_greedy_tree_follows_the_target_argmax():
    target, draft = synthetic_pair(vocab=V, seed=3, noise=1.5)
    s = SamplingSettings(temperature=0.0)
    ctx = [0]
    for _ in range(L):
        ctx.append(int(np.argmax(target.logits(ctx))))
    rng = np.random.default_rng(0)
    for kind in ("deterministic", "sampled-float"):
        for _ in range(20):
            assert speculative_tree_sequence(target, draft, [0], s, SHAPE, kind, rng) == tuple(ctx[1:])


def follow_first_child(p, tree, qs, rng):
    """Biased: when any child of a node would win, move to its first child instead."""
    res = verify_tree(p, tree, qs, rng)
    children = tree.children()
    path, node = [], ROOT
    for _ in res.path:
        if not children[node]:
            break
        node = children[node][0]
        path.append(node)
    return TreeResult(path, res.next_token)


def no_residual_update(p, tree, qs, rng):
    """Biased: every sibling is tested against the node's own p, never against the residual."""
    children = tree.children()
    node, path = ROOT, []
    while True:
        for c in children[node]:
            q_c = None if qs is None else qs[c]
            x = tree.tokens[c]
            if rng.random() < p[node + 1, x] / (1.0 if q_c is None else q_c.prob_of(x)):
                node = c
                path.append(c)
                break
        else:
            return TreeResult(path, sample(p[node + 1], rng))


@pytest.mark.parametrize("control", [follow_first_child, no_residual_update])
@pytest.mark.parametrize("kind", ["deterministic", "sampled-float"])
def test_negative_controls_are_caught(control, kind):
    counts, probs = run_tree_setting(1.0, 0, 1.0, kind, verify=control)
    assert chi_square_p(counts, probs, N) < P_MIN


# --- literal cases ----------------------------------------------------------------------------

def one_hot_rows(*argmaxes, vocab=8):
    rows = np.zeros((len(argmaxes), vocab))
    rows[np.arange(len(argmaxes)), argmaxes] = 1.0
    return rows


def test_second_branch_wins():
    # root -> 3 (node 0) -> 4 (node 1); root -> 5 (node 2) -> 6 (node 3). Target greedy: 5, 6, then 7.
    tree = DraftTree((3, 4, 5, 6), (-1, 0, -1, 2))
    p = one_hot_rows(5, 0, 0, 6, 7)  # rows: root, after node 0, 1, 2, 3
    res = verify_tree(p, tree, None, np.random.default_rng(0))
    assert res == TreeResult([2, 3], 7)  # both nodes of the second branch, then the bonus


def test_corrected_token_at_depth_0():
    tree = DraftTree((3, 4, 5), (-1, -1, 0))
    p = one_hot_rows(6, 0, 0, 0)
    assert verify_tree(p, tree, None, np.random.default_rng(0)) == TreeResult([], 6)


def test_corrected_token_below_a_kept_node():
    tree = DraftTree((3, 4, 5), (-1, 0, 0))  # node 0 has children 4 and 5; the target wants 2
    p = one_hot_rows(3, 2, 0, 0)
    assert verify_tree(p, tree, None, np.random.default_rng(0)) == TreeResult([0], 2)


def test_sampled_siblings_second_wins_with_residual():
    """p = [0, .5, .5]; siblings drawn from q = [0, .8, .2], then from q without token 1 = [0, 0, 1]:
    the first is accepted with p/q = 0.625, else the residual is [0, 0, 1] and the second wins."""
    q1 = encode_float(np.array([0.0, 0.8, 0.2]))
    q2 = without_tokens(q1, [1])
    tree = DraftTree((1, 2), (-1, -1))
    p = np.array([[0.0, 0.5, 0.5], [1.0, 0, 0], [1.0, 0, 0]])
    outcomes = {tuple(verify_tree(p, tree, [q1, q2], np.random.default_rng(s)).path) for s in range(40)}
    assert outcomes == {(0,), (1,)}  # never a corrected token: one of the two always wins


def test_chain_tree_matches_the_reference_chain_round():
    """A chain given as a tree makes the decisions of the chain round (Leviathan et al.'s rule, as
    hybridspec.testing.warping_reference writes it) from the same random stream."""
    target, draft = synthetic_pair(vocab=V, seed=3, noise=1.5)
    s = SamplingSettings(temperature=1.0)
    for seed in range(50):
        rng = np.random.default_rng(seed)
        toks = [int(t) for t in rng.integers(0, V, 4)]
        qs = [encode_float(processed_probs(draft.logits([0] + toks[:i]), 1.0)) for i in range(4)]
        tree = DraftTree.chain(toks)
        p = tree_target_probs(target, [0], tree, s)
        a = ref.verify_round(p, toks, qs, np.random.default_rng(seed))
        b = verify_tree(p, tree, qs, np.random.default_rng(seed))
        assert (a.num_accepted, a.next_token) == (len(b.path), b.next_token)


def test_stop_token_inside_the_kept_path():
    tree = DraftTree((3, 1, 4, 5), (-1, 0, 1, -1))  # 3 -> 1 (stop) -> 4; and 5
    p = one_hot_rows(3, 1, 4, 6, 0)
    res = verify_tree(p, tree, None, np.random.default_rng(0))
    assert res == TreeResult([0, 1, 2], 6)
    tokens = [tree.tokens[i] for i in res.path]
    done = commit_round(tokens, RoundResult(3, res.next_token), frozenset({1}), remaining=10, context_left=100)
    assert done.tokens == [3, 1] and done.num_accepted == 2 and not done.has_next_token


def test_max_tokens_mid_path():
    tree = DraftTree((3, 4, 5, 7), (-1, 0, 1, -1))
    p = one_hot_rows(3, 4, 5, 6, 0)
    res = verify_tree(p, tree, None, np.random.default_rng(0))
    tokens = [tree.tokens[i] for i in res.path]
    done = commit_round(tokens, RoundResult(len(tokens), res.next_token), frozenset(), remaining=2, context_left=100)
    assert done.tokens == [3, 4] and done.num_accepted == 2


def test_tree_that_does_not_fit_the_context_is_cut():
    # depths: node0 1, node1 2, node2 3, node3 1, node4 2
    tree = DraftTree((3, 4, 5, 6, 7), (-1, 0, 1, -1, 3))
    assert prune_to_fit(tree, 2) == [0, 1]  # depth <= 2 leaves 0, 1, 3, 4; the first 2 fit
    assert prune_to_fit(tree, 4) == [0, 1, 2, 3]  # all depths fit; 4 cells
    assert prune_to_fit(tree, 0) == []
    sub = tree.subtree([0, 1, 3, 4])
    assert sub == DraftTree((3, 4, 6, 7), (-1, 0, -1, 2))


# --- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, parents, fragment", [
    ([1, 2], [-1], "has 1 entries"),
    ([1, 2], [1, -1], "not before node 0"),          # a parent after its child
    ([1, 2], [-1, 1], "not before node 1"),          # a self-loop (a cycle)
    ([1, 2, 3], [-1, 2, 1], "not before node 1"),    # a cycle through two nodes
    ([1, 2], [-1, -2], "use -1"),
    ([1, 99], [-1, 0], "outside the vocabulary"),
    ([1, 1], [-1, -1], "same token"),                # duplicate siblings
    (list(range(9)), [-1] * 9, "at most 8"),         # too many nodes
    ([1, 2, 3], [-1, -1, -1], "more than 2 children"),
    ([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3], "depth 5"),
])
def test_bad_trees_are_refused(tokens, parents, fragment):
    with pytest.raises(TreeError, match=fragment):
        validate_tree(tokens, parents, vocab=10, max_nodes=8, max_depth=4, max_branching=2 if len(tokens) == 3
                      and parents == [-1, -1, -1] else 8)


def test_grow_tree_respects_the_shape():
    rng = np.random.default_rng(0)
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    for encode in (None, lambda p: encode_fixed(p, 0, 8)):
        g = grow_tree(lambda nodes, *_: np.tile(probs, (len(nodes), 1)), TreeShape(budget=7, depth=3, branching=2,
                                                                               width=2), rng, encode)
        validate_tree(g.tree.tokens, g.tree.parents, 4, 7, 3, 2)
        assert len(g.tree) == 7 and max(g.tree.depths()) == 3
    g = grow_tree(lambda nodes, *_: np.tile(probs, (len(nodes), 1)), TreeShape(budget=6, depth=3, branching=2,
                                                                           width=2), rng, None)
    # Deterministic children: the two most likely tokens, best-first frontier.
    assert g.tree.tokens[:2] == (0, 1) and g.tree.parents[:2] == (-1, -1)


# --- the vLLM backend's rule: the same trees from per-node scores (no full rows) ---------------

def scores_verifier(keep_test=True):
    """verify_tree_from_scores fed like the vLLM backend: per node a sample y ~ p (its own random
    stream, as vLLM's sampler), p(y), and p on the tokens the rule needs; full rows on demand."""
    from spec_core.tree import NodeScore, tree_tokens_needed, verify_tree_from_scores
    sampler = np.random.default_rng(99)

    def verify(p, tree, qs, rng):
        scores = []
        for node in [ROOT] + list(range(len(tree))):
            row = p[node + 1]
            y = sample(row, sampler)
            need = tree_tokens_needed(tree, qs, node)
            tokens = range(len(row)) if need is None else need
            scores.append(NodeScore(y, float(row[y]), {int(t): float(row[t]) for t in tokens}))
        if not keep_test:  # biased: always keep vLLM's y as the corrected token
            res = verify_tree(p, tree, qs, np.random.default_rng(int(rng.integers(2**32))))
            return TreeResult(res.path, scores[(res.path[-1] if res.path else ROOT) + 1].sample)
        result, _ = verify_tree_from_scores(tree, qs, scores, lambda node: p[node + 1], rng)
        return result
    return verify


@pytest.mark.parametrize("kind", ["deterministic", "sampled-fixed", "sampled-float"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.5, 4, 0.9)], ids=["T1", "T0.5-topk-topp"])
def test_tree_from_scores_follows_the_target(temperature, top_k, top_p, kind):
    counts, probs = run_tree_setting(temperature, top_k, top_p, kind, verify=scores_verifier())
    p = chi_square_p(counts, probs, N)
    assert p > P_MIN, f"chi-square p = {p:.2e} for the scores rule, T={temperature} tree={kind}"


def test_tree_from_scores_negative_control_is_caught():
    counts, probs = run_tree_setting(1.0, 0, 1.0, "sampled-fixed", verify=scores_verifier(keep_test=False))
    assert chi_square_p(counts, probs, N) < P_MIN


def test_tree_from_scores_greedy_follows_the_argmax():
    from spec_core.tree import NodeScore, verify_tree_from_scores
    tree = DraftTree((3, 4, 5, 6), (-1, 0, -1, 2))
    p = one_hot_rows(5, 0, 0, 6, 7)
    scores = [NodeScore(int(np.argmax(r)), 1.0, {t: float(r[t]) for t in range(8)}) for r in p]
    result, used_full = verify_tree_from_scores(tree, None, scores, lambda n: p[n + 1], np.random.default_rng(0))
    assert result == TreeResult([2, 3], 7) and not used_full
