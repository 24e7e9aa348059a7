"""The batched acceptance maths in torch (cloud_verifier/backends/torch_accept.py), on CPU torch.

Marked `vllm`: torch lives in the vLLM environment (.venv-vllm), so scripts/test_vllm.sh runs these;
the main environment has no torch and skips them.

Statistics: the set-up of tests/test_exactness_stats.py and tests/test_tree_exactness.py (a
synthetic target over V = 5 tokens, a blurred draft, N = 6000 sequences of L = 3 tokens, counts of
all 125 sequences against the exact target probabilities, chi-square with cells of expected count
< 5 pooled, a setting fails if p < 1e-4). Here the N sessions run in lockstep: every round of every
session at a step is verified by one `accept_pass` over one logits tensor, each session with its
own generator. The negative controls (the verifier told a wrong q) must fail, which shows the
test has power. Seeds are fixed, so each test is deterministic.

Agreement with spec_core's numpy kernels: the same uniforms fed to both (the numpy kernel through a
scripted generator, its coins made to draw always as the batched path does); a case counts only
when nudging every uniform by 1e-6 changes nothing in the numpy kernel (far from a boundary).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch", reason="torch is in the vLLM environment (scripts/test_vllm.sh)")

from cloud_verifier.backends.torch_accept import PassRound, accept_pass, round_uniforms, warp_rows  # noqa: E402
from spec_core import acceptance  # noqa: E402
from spec_core import tree as spec_tree  # noqa: E402
from spec_core.drafting import QMode, draft_step  # noqa: E402
from spec_core.qcodec import encode_fixed, encode_float  # noqa: E402
from spec_core.synthetic import synthetic_pair  # noqa: E402
from spec_core.tree import ROOT, DraftTree, TreeResult, TreeShape, grow_tree, verify_tree_on_logits  # noqa: E402
from spec_core.verify import RoundResult, commit_round  # noqa: E402
from spec_core.warping import SamplingSettings, processed_probs  # noqa: E402
from test_exactness_stats import L, N, P_MIN, V, chi_square_p, exact_sequence_probs  # noqa: E402
from test_tree_exactness import SHAPE, encoder_for  # noqa: E402

pytestmark = pytest.mark.vllm

QMODES = {"full": QMode("float", 0), "sparse-fixed": QMode("fixed", 3, 6), "none": QMode("none", 0, 0)}


def lockstep_sequences(s: SamplingSettings, draft_round, n: int = N, seed: int = 0, tell_q=lambda qs: qs):
    """n sequences of L tokens after [0], all sessions' rounds of a step in one accept_pass.
    draft_round(draft, committed, s, rng, room) -> (DraftTree, qs). tell_q: what the verifier is
    told about q (the controls lie). Returns (counts per sequence, exact target probabilities)."""
    target, draft = synthetic_pair(vocab=V, seed=3, noise=1.5)
    rngs = [np.random.default_rng([seed, i]) for i in range(n)]
    committed = [[0] for _ in range(n)]
    while True:
        live = [i for i in range(n) if len(committed[i]) - 1 < L]
        if not live:
            break
        rows, rounds = [], []
        for i in live:
            room = L - (len(committed[i]) - 1)
            tree, qs = draft_round(draft, committed[i], s, rngs[i], room)
            ctxs = [committed[i]] + [committed[i] + [tree.tokens[j] for j in tree.path_to(k)] for k in range(len(tree))]
            rounds.append(PassRound(len(rows), tree, tell_q(qs), s, round_uniforms(len(tree), rngs[i])))
            rows += [target.logits(c) for c in ctxs]
        results = accept_pass(torch.as_tensor(np.stack(rows), dtype=torch.float32), rounds)
        for i, rd, res in zip(live, rounds, results):
            path_tokens = [rd.tree.tokens[k] for k in res.path]
            done = commit_round(path_tokens, RoundResult(len(path_tokens), res.next_token), frozenset(),
                                remaining=L - (len(committed[i]) - 1), context_left=10_000)
            committed[i] += done.tokens
    counts: dict[tuple, int] = {}
    for c in committed:
        counts[tuple(c[1:])] = counts.get(tuple(c[1:]), 0) + 1
    return counts, exact_sequence_probs(target, [0], s)


def chain_drafter(gamma: int, qmode: QMode):
    def draft_round(draft, committed, s, rng, room):
        seq, tokens, qs = list(committed), [], []
        for _ in range(min(gamma, room - 1)):
            tok, q = draft_step(draft.logits(seq), s, qmode, rng)
            tokens.append(tok), qs.append(q), seq.append(tok)
        return DraftTree.chain(tokens), (None if not qs or any(q is None for q in qs) else qs)
    return draft_round


def tree_drafter(kind: str, shape: TreeShape = SHAPE):
    encode = encoder_for(kind)

    def draft_round(draft, committed, s, rng, room):
        def next_probs(nodes, tokens, parents):
            tree = DraftTree(tuple(tokens), tuple(parents))
            paths = [[] if k == ROOT else [tokens[j] for j in tree.path_to(k)] for k in nodes]
            return np.stack([processed_probs(draft.logits(committed + p), s.temperature, s.top_k, s.top_p)
                             for p in paths])
        grown = grow_tree(next_probs, shape, rng, encode)
        return grown.tree, grown.qs
    return draft_round


# --- exactness --------------------------------------------------------------------------------

@pytest.mark.parametrize("qname", list(QMODES))
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 4, 0.9), (1.5, 0, 0.8)],
                         ids=["plain", "T0.7-topk4-topp0.9", "T1.5-topp0.8"])
def test_chain_sequences_follow_the_target(temperature, top_k, top_p, qname):
    s = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    counts, probs = lockstep_sequences(s, chain_drafter(4, QMODES[qname]))
    p = chi_square_p(counts, probs, N)
    assert p > P_MIN, f"chi-square p = {p:.2e} (N = {N}) for {s} q={qname}"


@pytest.mark.parametrize("temperature, top_k, top_p, kind", [
    (1.0, 0, 1.0, "deterministic"), (1.0, 0, 1.0, "sampled-fixed"), (1.0, 0, 1.0, "sampled-float"),
    (0.7, 4, 0.9, "deterministic"), (0.7, 4, 0.9, "sampled-fixed")])
def test_tree_sequences_follow_the_target(temperature, top_k, top_p, kind):
    s = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    counts, probs = lockstep_sequences(s, tree_drafter(kind))
    p = chi_square_p(counts, probs, N)
    assert p > P_MIN, f"chi-square p = {p:.2e} (N = {N}) for {s} tree {kind}"


@pytest.mark.parametrize("drafter", [chain_drafter(4, QMODES["full"]), tree_drafter("sampled-float")],
                         ids=["chain", "tree"])
def test_negative_control_a_wrong_q_is_caught(drafter):
    """Drafts sampled from q but verified against another q (uniform: nearly every draft kept):
    the output leans towards the draft, and the test must see it. (Withholding q would not do: the
    point-mass rule is exact for a draft token drawn any way independent of the uniforms.)"""
    s = SamplingSettings(temperature=1.0)
    uniform = encode_float(np.full(V, 1.0 / V))
    counts, probs = lockstep_sequences(s, drafter, tell_q=lambda qs: qs and [uniform] * len(qs))
    assert chi_square_p(counts, probs, N) < P_MIN


def test_greedy_is_the_target_argmax_path():
    target, _ = synthetic_pair(vocab=V, seed=3, noise=1.5)
    ctx = [0]
    for _ in range(L):
        ctx.append(int(np.argmax(target.logits(ctx))))
    s = SamplingSettings(temperature=0.0)
    for drafter in (chain_drafter(4, QMODES["none"]), tree_drafter("deterministic")):
        counts, _ = lockstep_sequences(s, drafter, n=50)
        assert counts == {tuple(ctx[1:]): 50}


# --- literal cases ------------------------------------------------------------------------------

def greedy_logits(*argmaxes, vocab=8):
    rows = np.zeros((len(argmaxes), vocab), dtype=np.float32)
    rows[np.arange(len(argmaxes)), argmaxes] = 5.0
    return torch.as_tensor(rows)


def test_literal_greedy_rounds_in_one_pass():
    s = SamplingSettings(temperature=0.0)
    u = lambda n: np.full(n + 1, 0.5)  # noqa: E731
    rounds = [
        PassRound(0, DraftTree.chain([1, 2, 3]), None, s, u(3)),              # target 1, 5, 3, 4: mismatch at 1
        PassRound(4, DraftTree.chain([1, 2]), None, s, u(2)),                 # target 1, 2, 7: all kept, bonus 7
        PassRound(7, DraftTree((3, 4, 5, 6), (-1, 0, -1, 2)), None, s, u(4)),  # second branch, then bonus 7
        PassRound(12, DraftTree.chain([]), None, s, u(0)),                    # no drafts: the target's argmax
    ]
    logits = greedy_logits(1, 5, 3, 4, 1, 2, 7, 5, 0, 0, 6, 7, 2)
    assert accept_pass(logits, rounds) == [TreeResult([0], 5), TreeResult([0, 1], 7), TreeResult([2, 3], 7),
                                           TreeResult([], 2)]


def test_rows_not_owned_by_a_round_are_left_alone():
    """A pass may hold rows of other requests (a prefill's): rounds read only their own rows."""
    s = SamplingSettings(temperature=0.0)
    logits = greedy_logits(6, 1, 2, 6, 3)
    got = accept_pass(logits, [PassRound(1, DraftTree.chain([1]), None, s, np.full(2, 0.5)),
                               PassRound(4, DraftTree.chain([]), None, s, np.full(1, 0.5))])
    assert got == [TreeResult([0], 2), TreeResult([], 3)]


def test_warped_rows_match_spec_core_warping():
    """Kept sets equal and probabilities within float32 rounding, on rows with the settings mixed."""
    rng = np.random.default_rng(0)
    vocab = 20_000
    logits = np.concatenate([rng.standard_normal((4, vocab)) * 4, rng.standard_normal((4, vocab)) * 0.05])  # peaked, flat
    logits = logits.astype(np.float32)
    temperature = np.array([0.0, 1.0, 0.7, 0.7, 1.0, 0.7, 1.3, 0.5])
    top_k = np.array([0, 0, 50, 0, 0, 0, 300, 40])
    top_p = np.array([1.0, 1.0, 0.95, 0.95, 1.0, 0.95, 0.5, 1.0])
    warp = warp_rows(torch.as_tensor(logits), temperature, top_k, top_p)
    got = warp.rows_probs(torch.as_tensor(logits), torch.arange(8)).numpy()
    for r in range(8):
        want = processed_probs(logits[r], temperature[r], int(top_k[r]), top_p[r])
        assert np.array_equal(got[r] > 0, want > 0), r
        assert np.allclose(got[r], want, rtol=1e-5, atol=1e-12), r


# --- reproducible, and the same rule as spec_core's kernels -----------------------------------

def random_rounds(seed: int, n_rounds: int, vocab: int = 3000):
    """Mixed rounds over random logits: settings, chains and trees, q none / sparse / dense."""
    rng = np.random.default_rng(seed)
    settings = [SamplingSettings(temperature=0.0), SamplingSettings(temperature=1.0),
                SamplingSettings(temperature=0.7, top_k=50), SamplingSettings(temperature=0.7, top_p=0.95),
                SamplingSettings(temperature=0.9, top_k=50, top_p=0.9)]
    rows, rounds = [], []
    for _ in range(n_rounds):
        s = settings[rng.integers(len(settings))]
        tree = DraftTree.chain(rng.integers(0, 20, int(rng.integers(0, 5)))) if rng.random() < 0.6 else \
            DraftTree((1, 2, 3, 4, 5), (-1, 0, -1, 2, 0))
        block = (rng.standard_normal((len(tree) + 1, vocab)) * 2).astype(np.float32)
        block[:, :20] += 3.0   # the drafts' tokens are likely
        kind = rng.integers(3)
        qs = None
        if kind and not s.greedy:
            draft_p = [processed_probs(row + rng.standard_normal(vocab).astype(np.float32), 1.0) for row in block]
            parent_rows = [p + 1 for p in tree.parents]
            qs = [encode_fixed(draft_p[r], 16) if kind == 1 else encode_float(draft_p[r]) for r in parent_rows]
            # the draft token must be in its q's support: put it there
            qs = [encode_float(np.where(np.arange(vocab) == x, 0.05, 0.0) + 0.95 * q.dense(vocab))
                  if q.prob_of(x) == 0 else q for q, x in zip(qs, tree.tokens)]
        rounds.append(PassRound(len(rows), tree, qs, s, round_uniforms(len(tree), rng)))
        rows += list(block)
    return torch.as_tensor(np.stack(rows)), rounds


def test_seeded_runs_are_reproducible_and_independent_of_the_pass():
    logits, rounds = random_rounds(1, 24)
    together = accept_pass(logits, rounds)
    assert accept_pass(logits, rounds) == together
    # Each round alone, and the pass in reverse order: the same outcome per round.
    alone = [accept_pass(logits[rd.first_row:rd.first_row + len(rd.tree) + 1], [replace(rd, first_row=0)])[0]
             for rd in rounds]
    assert alone == together
    assert accept_pass(logits, rounds[::-1]) == together[::-1]
    # Other uniforms (another seed) change some outcomes: the uniforms are used.
    other = [replace(rd, uniforms=round_uniforms(len(rd.tree), np.random.default_rng(k))) for k, rd in enumerate(rounds)]
    assert accept_pass(logits, other) != together


class ScriptedRng:
    """A generator that hands out given uniforms in order."""

    def __init__(self, uniforms):
        self.uniforms = list(uniforms)

    def random(self):
        if not self.uniforms:
            raise OutOfUniforms
        return self.uniforms.pop(0)


class OutOfUniforms(Exception):
    """The numpy driver tested more nodes than the batched outcome did: it took another path."""


def numpy_outcome(logits_np, rd: PassRound, uniforms_in_order) -> TreeResult:
    """The numpy driver the host backends run (spec_core.tree.verify_tree_on_logits), fed these uniforms."""
    return verify_tree_on_logits(logits_np, rd.settings, rd.tree, rd.draft_probs, ScriptedRng(uniforms_in_order))


def nodes_tested(rd: PassRound, result: TreeResult) -> list[int]:
    """The nodes whose accept test ran, in order, for this outcome."""
    kids = rd.tree.children()
    order, node = [], ROOT
    for kept in result.path + [None]:
        for c in kids.get(node, []):
            order.append(c)
            if c == kept:
                break
        node = kept
    return order


def agreement(logits, rd: PassRound, res: TreeResult) -> bool | None:
    """Whether the numpy driver, fed the uniforms the batched outcome used, decides the same; None
    when a uniform lies within 1e-6 of a decision (float order may decide it: not compared)."""
    block = logits[rd.first_row:rd.first_row + len(rd.tree) + 1].numpy()
    used = np.array([rd.uniforms[c] for c in nodes_tested(rd, res)] + [rd.uniforms[-1]])
    def outcome(uniforms):
        try:
            o = numpy_outcome(block, rd, uniforms)
        except OutOfUniforms:
            return None   # another path than the batched one, deeper
        return tuple(o.path), o.next_token

    nudged = {outcome(np.clip(used + d, 0, 1 - 1e-12)) for d in (-1e-6, 1e-6)}
    exact = outcome(list(used))
    if len(nudged | {exact}) > 1:
        return None
    return exact == (tuple(res.path), res.next_token)


@pytest.fixture
def coin_draws_always(monkeypatch):
    # The batched path draws a uniform for every accept test; make the numpy coin do the same
    # (same outcome distribution: u < prob is certain for prob >= 1 and impossible for prob <= 0).
    monkeypatch.setattr(acceptance, "coin", lambda prob, rng: rng.random() < prob)


def test_same_ids_as_the_numpy_kernels_away_from_boundaries(coin_draws_always):
    logits, rounds = random_rounds(2, 200)
    verdicts = [agreement(logits, rd, res) for rd, res in zip(rounds, accept_pass(logits, rounds))]
    assert False not in verdicts, [(rd.settings, rd.tree) for rd, v in zip(rounds, verdicts) if v is False]
    assert verdicts.count(True) >= 190, verdicts.count(True)


SETTINGS_DRAWN = [SamplingSettings(temperature=0.0), SamplingSettings(temperature=1.0),
                  SamplingSettings(temperature=0.7, top_k=8), SamplingSettings(temperature=0.8, top_p=0.9),
                  SamplingSettings(temperature=1.3, top_k=12, top_p=0.8)]


@st.composite
def drawn_round(draw, vocab: int = 64):
    """One round: a random tree (siblings with distinct tokens, as the wire requires), settings, q
    (none, sparse fixed-point, dense float; the draft token in its q's support) and logits."""
    n = draw(st.integers(0, 7))
    parents, tokens, used = [], [], {}
    for i in range(n):
        parent = draw(st.integers(-1, i - 1))
        token = draw(st.integers(0, 15).filter(lambda t, taken=used.get(parent, set()): t not in taken))
        used.setdefault(parent, set()).add(token)
        parents.append(parent)
        tokens.append(token)
    tree = DraftTree(tuple(tokens), tuple(parents))
    s = draw(st.sampled_from(SETTINGS_DRAWN))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    block = (rng.standard_normal((n + 1, vocab)) * 2).astype(np.float32)
    block[:, :16] += 2.0   # the drafts' tokens are likely
    kind = draw(st.sampled_from(["none", "fixed", "float"]))
    qs = None
    if kind != "none":
        qs = []
        for parent, x in zip(parents, tokens):
            q_p = processed_probs(block[parent + 1] + rng.standard_normal(vocab).astype(np.float32), 1.0)
            q_p = 0.9 * q_p + 0.1 * (np.arange(vocab) == x)   # x in the support
            qs.append(encode_fixed(q_p, 16) if kind == "fixed" else encode_float(q_p))
        qs = [q if q.prob_of(x) > 0 else encode_float(0.9 * q.dense(vocab) + 0.1 * (np.arange(vocab) == x))
              for q, x in zip(qs, tokens)]
    return torch.as_tensor(block), PassRound(0, tree, qs, s, round_uniforms(n, rng))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn_round())
def test_accept_pass_agrees_with_the_numpy_driver_draw_for_draw(coin_draws_always, drawn):
    """Property: on the same uniforms, the batched torch pass and the numpy driver decide every round
    the same (trees, chains and the empty draft; every setting; q none, sparse, dense), except where
    a uniform lies within 1e-6 of a decision."""
    logits, rd = drawn
    res, = accept_pass(logits, [rd])
    assert agreement(logits, rd, res) is not False, (rd.settings, rd.tree, res)


def test_the_agreement_check_catches_a_driver_that_breaks_one_rule(coin_draws_always, monkeypatch):
    """Negative control: a numpy driver whose rejections leave p as it was (no residual: the rejected
    token can come out as the corrected one) must disagree with the batched pass."""
    monkeypatch.setattr(spec_tree, "after_rejection", lambda p, q, x: p)
    monkeypatch.setattr(spec_tree, "corrected_probs", lambda p, q, x: p)
    logits, rounds = random_rounds(2, 200)
    verdicts = [agreement(logits, rd, res) for rd, res in zip(rounds, accept_pass(logits, rounds))]
    assert verdicts.count(False) >= 10, verdicts.count(False)


def test_bfloat16_logits_give_the_outcomes_of_their_float32_values():
    """An engine's logits may be bf16: warping reads them as float32, so a pass over bf16 logits
    decides as the same pass over those values in float32 (ties, common in bf16, included)."""
    logits, rounds = random_rounds(3, 40)
    low = logits.to(torch.bfloat16)
    assert accept_pass(low, rounds) == accept_pass(low.float(), rounds)
