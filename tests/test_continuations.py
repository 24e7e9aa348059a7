"""Continuations (spec_core.continuations): statistical exactness, literal cases, the wire checks.

Statistics, as in tests/test_exactness_stats.py: the synthetic target over V = 5 tokens (order 1,
exact probabilities) and its blurred draft; N = 6000 sequences of L = 3 tokens per setting from
the prompt [0], compared with the exact probabilities of all 125 sequences by a chi-square test
(cells with expected count < 5 pooled); a setting passes if p > 1e-4. Seeds are fixed, so every
test is deterministic. Each sequence is: round r (a chain of 2 drafts, or a tree of 4 nodes)
drafted with the edge's sampling; before it is verified, continuations (a chain of 2 drafts, or
a tree) are drafted after up to K = 6 of its outcomes (chains: spec_core.continuations.chain_outcomes,
the edge's ranking; trees: outcomes drawn at random by the edge, any edge-side rule must do);
round r is verified; the continuation whose key is what it committed (pick_continuation) is
round r + 1, else a fresh draft is; then plain rounds to L. Negative control: a key matched by
length only, its rows computed after the key (a fused pass attending to the assumed tokens)
while its tokens are committed after what round r really committed: it must fail, which shows the
test has the power to catch a continuation used against a prefix it was not drafted from.

End to end (one session, and many sessions in shared batches): see the tests at the bottom.
"""
from __future__ import annotations

import numpy as np
import pytest

from spec_core.continuations import chain_outcomes, pick_continuation, worth_drafting
from spec_core.drafting import QMode, draft_step
from spec_core.qcodec import encode_fixed, encode_float
from spec_core.synthetic import synthetic_pair
from spec_core.tree import ROOT, DraftTree, TreeShape, grow_tree, verify_tree
from spec_core.verify import RoundResult, commit_round
from spec_core.warping import SamplingSettings, processed_probs
from test_exactness_stats import L, N, P_MIN, V, chi_square_p, exact_sequence_probs
from chain_round import chain_round

K = 6
TREE = TreeShape(budget=4, depth=2, branching=2, width=2)


class _Draft:
    """A chain or a tree drafted after `base`, with the q its tokens were sampled from."""

    def __init__(self, base, tree: DraftTree, qs):
        self.base, self.tree, self.qs = list(base), tree, qs


def _draft(draft, base, s, shape, rng, qmode: QMode) -> _Draft:
    if shape == "chain":
        seq, tokens, qs = list(base), [], []
        for _ in range(2):
            tok, q = draft_step(draft.logits(seq), s, qmode, rng)
            tokens.append(tok); qs.append(q); seq.append(tok)
        return _Draft(base, DraftTree.chain(tokens), None if any(q is None for q in qs) else qs)
    encode = (lambda p: encode_fixed(p, qmode.top_k, qmode.scale_bits)) if qmode.kind == "fixed" else \
        (lambda p: encode_float(p, 0))

    def next_probs(nodes, tokens, parents):
        tree = DraftTree(tuple(tokens), tuple(parents))
        paths = [[] if n == ROOT else [tokens[j] for j in tree.path_to(n)] for n in nodes]
        return np.stack([processed_probs(draft.logits(list(base) + p), s.temperature, s.top_k, s.top_p)
                         for p in paths])
    grown = grow_tree(next_probs, TREE, rng, encode)
    return _Draft(base, grown.tree, grown.qs)


def _verify(target, d: _Draft, s, rng, rows_after=None) -> list[int]:
    """What the round commits (kept drafts + one token). rows_after: the context the target rows are
    computed after (default: the draft's own base)."""
    ctx0 = d.base if rows_after is None else rows_after
    tree = d.tree
    ctxs = [list(ctx0)] + [list(ctx0) + [tree.tokens[j] for j in tree.path_to(i)] for i in range(len(tree))]
    p = processed_probs(np.stack([target.logits(c) for c in ctxs]), s.temperature, s.top_k, s.top_p)
    if tree.is_chain:
        r = chain_round(p, list(tree.tokens), d.qs, rng)
        return list(tree.tokens[: r.num_accepted]) + [r.next_token]
    res = verify_tree(p, tree, d.qs, rng)
    return [tree.tokens[i] for i in res.path] + [res.next_token]


def _outcomes(draft, d: _Draft, s, rng) -> list[tuple[int, ...]]:
    """Up to K outcomes of round r to draft continuations for (edge-side information only)."""
    if d.tree.is_chain and d.qs is not None:
        tokens = list(d.tree.tokens)
        corrected = [[(t, float(p)) for t, p in enumerate(d.qs[j].dense(V)) if t != tokens[j]]
                     for j in range(len(tokens))]
        bonus = processed_probs(draft.logits(d.base + tokens), s.temperature, s.top_k, s.top_p)
        return [o.tokens for o in chain_outcomes(tokens, 0.6, corrected, list(enumerate(bonus)), K)]
    every = [tuple(d.tree.tokens[j] for j in d.tree.path_to(n)) + (y,)
             for n in [ROOT, *range(len(d.tree))] for y in range(V)]
    every = list(dict.fromkeys(every))
    return [every[i] for i in rng.choice(len(every), size=min(K, len(every)), replace=False)]


def sequence_with_continuations(target, draft, prompt, s, first: str, then: str, qmode: QMode, rng,
                                control: bool = False, hits: list | None = None) -> tuple[int, ...]:
    committed = list(prompt)

    def commit(tokens):
        done = commit_round(tokens[:-1], RoundResult(len(tokens) - 1, tokens[-1]), frozenset(),
                            remaining=L - (len(committed) - len(prompt)), context_left=10_000)
        committed.extend(done.tokens)

    round_r = _draft(draft, committed, s, first, rng, qmode)
    keys = _outcomes(draft, round_r, s, rng)
    continuations = [_draft(draft, committed + list(k), s, then, rng, qmode) for k in keys]
    base_length = len(committed)
    commit(_verify(target, round_r, s, rng))
    if len(committed) - len(prompt) < L:
        if control:  # the bug: a key of the same length, its rows after the key, committed after the truth
            i = next((j for j, k in enumerate(keys) if len(k) == len(committed) - base_length), None)
            rows_after = None if i is None else continuations[i].base
        else:
            i = pick_continuation(committed, base_length, keys)
            rows_after = None
        if hits is not None:
            hits.append(i is not None)
        nxt = continuations[i] if i is not None else _draft(draft, committed, s, then, rng, qmode)
        if i is not None and rows_after is None:
            assert nxt.base == committed  # what makes it exact: drafted after exactly this prefix
        nxt.base = list(committed) if rows_after is None else nxt.base
        commit(_verify(target, nxt, s, rng, rows_after=rows_after))
    while len(committed) - len(prompt) < L:
        commit(_verify(target, _draft(draft, committed, s, "chain", rng, qmode), s, rng))
    return tuple(committed[len(prompt):])


def _run(first, then, temperature, qmode, control=False, n=N):
    target, draft = synthetic_pair(vocab=V, seed=3, noise=1.5)
    s = SamplingSettings(temperature=temperature)
    rng = np.random.default_rng(7)
    exactness.note_seed("sequences", 7)
    counts: dict[tuple, int] = {}
    hits: list[bool] = []
    for _ in range(n):
        seq = sequence_with_continuations(target, draft, [0], s, first, then, qmode, rng, control, hits)
        counts[seq] = counts.get(seq, 0) + 1
    return chi_square_p(counts, exact_sequence_probs(target, [0], s), n), hits


FLOAT, FIXED = QMode("float", 0), QMode("fixed", 3, 6)


@pytest.mark.parametrize("first, then, temperature, qmode", [
    ("chain", "chain", 1.0, FLOAT), ("chain", "chain", 0.7, FIXED), ("chain", "tree", 1.0, FIXED),
    ("tree", "chain", 1.0, FLOAT), ("tree", "tree", 0.7, FIXED)])
def test_sequences_with_continuations_follow_the_target(first, then, temperature, qmode):
    p, hits = _run(first, then, temperature, qmode)
    assert p > P_MIN, f"chi-square p = {p:.2e} ({first} round, {then} continuations, T={temperature})"
    assert sum(hits) > 0.2 * len(hits), f"continuations hit in {sum(hits)} of {len(hits)} sequences: too few to test"


@pytest.mark.parametrize("first, then", [("chain", "chain"), ("tree", "tree")])
def test_a_continuation_used_against_another_prefix_is_caught(first, then):
    p, _ = _run(first, then, 1.0, FLOAT, control=True)
    assert p < P_MIN, f"the control passed (p = {p:.2e}): the test has no power"


# --- literal cases ----------------------------------------------------------------------------

def test_pick_continuation_needs_the_exact_tokens():
    committed = [9, 9, 4, 7]            # base [9, 9], then round r committed [4, 7]
    keys = [[4, 7, 1], [4, 8], [4, 7]]  # all accepted + bonus 1; a different corrected token; the hit
    assert pick_continuation(committed, 2, keys) == 2
    assert pick_continuation(committed, 2, [[4, 8], [4]]) is None      # same length is not enough
    assert pick_continuation(committed, 3, [[7]]) == 0


def test_chain_outcomes_rank_by_the_drafts_estimate():
    drafts = [3, 4]  # alpha 0.5: reject at 0 (0.5), at 1 (0.25), all accepted (0.25)
    corrected = [[(5, 0.8), (3, 0.2)], [(6, 1.0)]]   # the draft token itself is never a corrected one
    out = chain_outcomes(drafts, 0.5, corrected, [(7, 0.6), (8, 0.4)], limit=4)
    assert [o.tokens for o in out] == [(5,), (3, 6), (3, 4, 7), (3, 4, 8)]
    assert [round(o.prob, 3) for o in out] == [0.4, 0.25, 0.15, 0.1]


def test_one_more_continuation_pays_only_when_likely_enough():
    # 0.3 of hits so far; a hit saves 300 ms; one more costs 30 ms for everything covered.
    assert worth_drafting(0.2, 0.3, 0.3, 0.03)          # 0.2 x 300 > 0.5 x 30
    assert not worth_drafting(0.02, 0.3, 0.3, 0.03)     # 0.02 x 300 < 0.32 x 30


# --- end to end: the edge and the verifier over gRPC, one session and many ----------------------
# The transition test: the synthetic target is order 1, so each generated token given the one
# before follows p(. | that token). Counts of (previous, next) pairs over all generated tokens
# (T = 1, V = 5) against n_prev x p(. | prev): one chi-square over the 25 cells (cells with an
# expected count < 5 pooled within their row; V - 1 degrees of freedom less, as row totals are
# observed); passes if p > 1e-4. Negative control: a verifier that accepts every draft fails it at
# the same sample size (the test has power); the wrong-prefix control is the simulation's above.

from hybridspec.testing import exactness  # noqa: E402
from hybridspec.testing.exactness import transition_counts, transition_fit  # noqa: E402

from cloud_verifier.backends.synthetic import SyntheticBackend  # noqa: E402
from edge_client import EdgeClient  # noqa: E402
from edge_client.drafters import SyntheticDrafter  # noqa: E402
from edge_client.text import SyntheticTokenizer  # noqa: E402
from helpers import HeldPasses, edge_options, generate_many, running_server  # noqa: E402
from test_batching import AcceptEverything  # noqa: E402

E2E_T = SamplingSettings(temperature=1.0)


def transition_p(sequences: list[list[int]]) -> float:
    target, _ = synthetic_pair(V, 0, 1.0, 1)
    probs = np.stack([processed_probs(target.logits([a]), 1.0, 0, 1.0) for a in range(V)])
    return exactness.noted_p(transition_fit(transition_counts(sequences, V), probs).p)


async def _generate(backend, sessions: int, tokens: int, concurrency: int, **kw):
    """`sessions` generations of `tokens` tokens from [0] with continuations; their sequences and stats."""
    settings = SamplingSettings(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
    async with running_server(backend, max_sessions=concurrency + 8) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=2, qmode="float:0", pipeline=True,
                                           max_continuations=8, **kw),
                              SyntheticDrafter(V, seed=0, noise=1.0), SyntheticTokenizer(V)) as c:
            stats = await generate_many(c, sessions, settings, concurrency)
    return [[0] + st.token_ids for st in stats], stats


@pytest.mark.parametrize("tree", ["off", "budget=4,depth=2,branching=2,width=2"])
async def test_one_session_with_continuations_follows_the_target(tree):
    """One session of 3000 tokens (a 5 ms verifier pass, so continuations leave before the reply)."""
    seqs, stats = await _generate(SyntheticBackend(vocab=V, seed=0, step_ms=5.0), 1, 3000, 1, tree=tree)
    st = stats[0]
    assert st.tokens == 3000 and st.continuation_hits > 0 and st.continuations_sent > st.continuation_rounds, st
    p = transition_p(seqs)
    bad, _ = await _generate(AcceptEverything(vocab=V, seed=0, step_ms=5.0), 1, 3000, 1, tree="off")
    p_control = transition_p(bad)
    print(f"hits {st.continuation_hits} of {st.continuation_rounds}; chi-square p = {p:.3g}, control p = {p_control:.3g}")
    assert p > P_MIN
    assert p_control < P_MIN


async def test_many_sessions_in_shared_batches_with_continuations_follow_the_target():
    """48 sessions of 64 tokens, 16 at a time on a batching target whose passes wait for 8 rounds."""
    backend = SyntheticBackend(vocab=V, seed=0, step_ms=2.0, batching=True)
    held = HeldPasses(backend.batcher, lambda _: 8, max_wait_s=0.02)
    seqs, stats = await _generate(backend, 48, 64, 16)
    backend.close()
    assert sum(s.tokens for s in stats) == 48 * 64
    assert sum(s.continuation_hits for s in stats) > 0
    assert any(k > 1 for k in held.sessions_per_pass), "no pass held rounds of two sessions"
    assert transition_p(seqs) > P_MIN
