"""Drafting across tokenizers (spec_core.crossvocab): the map, the wire blob, the draft view, and
chi-square exactness of TLI on the synthetic pair of tests/xvocab_pair.py.

Exactness: a target LM over the 9 target ids, a draft LM over the 8 draft ids (order 2, on the
draft's own tokenization of the committed text). N = 6000 generations of L = 3 target tokens
(729 sequences, cells with expected count < 5 pooled) through DraftView -> restrict_logits ->
draft_step -> to_target_q -> the chain round (spec_core.tree.verify_tree on a chain) -> commit_round; the counts must not
differ from the exact target probabilities at p < 1e-4. Negative controls (must fail, p < 1e-4):
drafting from the UNRESTRICTED q (a token outside the intersection shipped as the first target
token of its text) while shipping the restricted q, and shipping for a draft token a target token
with other bytes than the one its q names.
"""
import itertools

import numpy as np
import pytest

from spec_core.crossvocab import (DraftView, TargetPieces, TokenMap, Vocabulary, VocabularyError, intersection_map,
                                  pack_token_bytes, restrict_logits, restrict_probs, to_target_q,
                                  unpack_token_bytes)
from spec_core.drafting import QMode, draft_step
from spec_core.qcodec import EncodedQ, encode_float
from spec_core.synthetic import SyntheticLM
from spec_core.verify import commit_round
from spec_core.warping import SamplingSettings, processed_probs
from hybridspec.testing import exactness
from test_exactness_stats import chi_square_p
from xvocab_pair import DRAFT, TARGET, longest_match_tokenizer
from chain_round import chain_round

L, N = 3, 6000
P_MIN = 1e-4


# --- the map ------------------------------------------------------------------------------------

def test_intersection_map_of_the_synthetic_pair():
    m = intersection_map(DRAFT, TARGET)
    # draft: <d> a b c é ab ca bb  -> target ids of a b c é, bb; specials, 'ab', 'ca' unmapped
    assert m.draft_to_target.tolist() == [-1, 2, 3, 4, 5, -1, -1, 7]
    assert m.target_to_draft.tolist() == [-1, -1, 1, 2, 3, 4, -1, 7, -1]
    assert m.n_mapped == 5


def test_map_prefers_ordinary_tokens_to_byte_fallback_and_stays_one_to_one():
    target = Vocabulary((b"", b"\x41", b"A", b"x"), special_ids=frozenset({0}), byte_ids=frozenset({1}))
    draft = Vocabulary((b"A", b"A", b"x", b""), special_ids=frozenset())
    m = intersection_map(draft, target)
    assert m.draft_to_target.tolist() == [2, -1, 3, -1]   # 'A' -> the ordinary 'A'; the second 'A' unmapped


def test_special_tokens_are_never_mapped_even_with_the_same_text():
    target = Vocabulary((b"<eos>", b"a"), special_ids=frozenset({0}))
    draft = Vocabulary((b"<eos>", b"a"))
    assert intersection_map(draft, target).draft_to_target.tolist() == [-1, 1]


def test_restrict_and_translate_q():
    m = intersection_map(DRAFT, TARGET)
    logits = np.zeros(DRAFT.n_vocab)
    probs = processed_probs(restrict_logits(logits, m), 1.0)
    assert np.allclose(probs, restrict_probs(np.full(DRAFT.n_vocab, 1 / 8), m))
    assert probs[[0, 5, 6]].tolist() == [0, 0, 0] and np.isclose(probs.sum(), 1.0)
    q = EncodedQ(np.array([1, 4], dtype=np.uint32), np.array([3, 1]), True)
    t = to_target_q(q, m)
    assert t.token_ids.tolist() == [2, 5] and t.weights.tolist() == [3, 1]
    with pytest.raises(ValueError, match="outside the intersection"):
        to_target_q(EncodedQ(np.array([5], dtype=np.uint32), np.array([1]), True), m)
    dense = to_target_q(EncodedQ(None, np.array([0, 0.5, 0, 0, 0.5, 0, 0, 0], dtype=np.float32), False), m)
    assert dense.token_ids.tolist() == [2, 5]


# --- the wire blob --------------------------------------------------------------------------------

def test_token_bytes_round_trip():
    blob = pack_token_bytes(TARGET.token_bytes)
    assert unpack_token_bytes(blob, TARGET.n_vocab) == TARGET.token_bytes


@pytest.mark.parametrize("blob, n, why", [
    (b"not zlib", 9, "do not decompress"),
    (pack_token_bytes(TARGET.token_bytes)[:-3], 9, "truncated"),
    (pack_token_bytes(TARGET.token_bytes), 10, "do not add up"),
    (pack_token_bytes(TARGET.token_bytes), 0, "outside"),
    (__import__("zlib").compress(b"\0" * (80 << 20)), 4, "larger than"),   # a decompression bomb
])
def test_hostile_blobs_are_refused(blob, n, why):
    with pytest.raises(VocabularyError, match=why):
        unpack_token_bytes(blob, n)


# --- the draft view ----------------------------------------------------------------------------------

def _target_ids(text: bytes) -> list[int]:
    return longest_match_tokenizer(TARGET)(text)


def test_draft_view_equals_full_tokenization_at_every_step():
    tok = longest_match_tokenizer(DRAFT)
    view = DraftView(TARGET, DRAFT, tok, window=2)
    ids = _target_ids("abcaébbabcca".encode())
    for n in range(1, len(ids) + 1):
        got = view.sync(ids[:n])
        assert got.draft_ids == tok(TARGET.text_bytes(ids[:n])), n
    assert view.stats.syncs == len(ids) and view.stats.rolled_back > 0   # 'a' then 'ab' rolls 'a' back


def test_draft_view_anchor_and_incomplete_utf8():
    tok = longest_match_tokenizer(DRAFT)
    view = DraftView(TARGET, DRAFT, tok)
    view.anchor([0, 3], [0, 7])                     # target prompt <s> b  ==  draft prompt <d> bb
    assert view.sync([0, 3]).draft_ids == [0, 7]
    half = view.sync([0, 3, 8])                     # the first byte of 'é' alone: no complete char
    assert half.draft_ids == [0, 7]                 # no single-byte 0xc3 token in the draft: dropped
    assert view.sync([0, 3, 2, 5]).draft_ids == [0, 7, 1, 4]
    # Committed ids that do not start with the anchor: everything converted.
    assert view.sync([2, 3]).draft_ids == [5]


# --- exactness ---------------------------------------------------------------------------------------

PIECES = TargetPieces(TARGET)
TARGET_LM = SyntheticLM(TARGET.n_vocab, seed=11, order=1, scale=1.2)
DRAFT_LM = SyntheticLM(DRAFT.n_vocab, seed=12, order=2, scale=1.2)
PROMPT = [0, 2]


def exact_probs(s: SamplingSettings) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(TARGET.n_vocab), repeat=L):
        ctx, prob = list(PROMPT), 1.0
        for tok in seq:
            prob *= processed_probs(TARGET_LM.logits(ctx), s.temperature, s.top_k, s.top_p)[tok]
            ctx.append(tok)
        out[seq] = prob
    return out


def spelled_draft(view: DraftView, m: TokenMap, committed, gamma, s, qmode, rng, with_q=False):
    """Beyond TLI: the draft's own argmax spelled in target tokens, as point masses (the edge's
    CrossVocabDrafter._propose_spelled). with_q: the control, shipping the step's TLI q instead."""
    seq = view.sync(committed).draft_ids
    tokens, qs = [], []
    while len(tokens) < gamma:
        logits = DRAFT_LM.logits(seq)
        d = int(np.argmax(logits))
        t = int(m.draft_to_target[d])
        pieces = [t] if t >= 0 else PIECES.spell(DRAFT.token_bytes[d])
        if not pieces:
            break
        if with_q:
            _, q = draft_step(restrict_logits(logits, m), s, QMode("float", 0), rng)
            qs.extend([to_target_q(q, m)] * len(pieces))
        tokens.extend(pieces)
        seq.append(d)
    tokens, qs = tokens[:gamma], qs[:gamma]
    return tokens, (qs or None) if with_q else None


def tli_draft(view: DraftView, m: TokenMap, committed, gamma, s, qmode, rng, unrestricted=False, relabel=None,
              spelled=False, with_q=False):
    """The edge's side: TLI drafts as target ids with their shipped q."""
    if spelled:
        return spelled_draft(view, m, committed, gamma, s, qmode, rng, with_q)
    seq = view.sync(committed).draft_ids
    tokens, qs = [], []
    for _ in range(gamma):
        logits = DRAFT_LM.logits(seq)
        if unrestricted:
            # Control: draw from the draft's UNRESTRICTED q and ship the restricted one; a draft token
            # outside the intersection goes out as the first target token of its text ('ab' -> 'a').
            d, _ = draft_step(np.where(np.arange(DRAFT.n_vocab) == 0, -np.inf, logits), s, qmode, rng)  # not <d>
            _, q = draft_step(restrict_logits(logits, m), s, qmode, np.random.default_rng(0))
            t = int(m.draft_to_target[d]) if m.draft_to_target[d] >= 0 else _target_ids(DRAFT.token_bytes[d])[0]
            tokens.append(t)
            qs.append(None if q is None else to_target_q(q, m))
        else:
            d, q = draft_step(restrict_logits(logits, m), s, qmode, rng)
            t = int(m.draft_to_target[d])
            tokens.append(relabel.get(t, t) if relabel else t)   # control: relabel the token, not its q
            qs.append(None if q is None else to_target_q(q, m))
        seq.append(d)
    return tokens, (None if not qs or any(q is None for q in qs) else qs)


def generate(s, gamma, qmode, rng, m, **kw) -> tuple:
    view = DraftView(TARGET, DRAFT, longest_match_tokenizer(DRAFT), window=2)
    committed = list(PROMPT)
    while len(committed) - len(PROMPT) < L:
        left = L - (len(committed) - len(PROMPT))
        tokens, qs = tli_draft(view, m, committed, min(gamma, left - 1), s, qmode, rng, **kw)
        ctxs = [committed + tokens[:i] for i in range(len(tokens) + 1)]
        p = processed_probs(np.stack([TARGET_LM.logits(c) for c in ctxs]), s.temperature, s.top_k, s.top_p)
        done = commit_round(tokens, chain_round(p, tokens, qs, rng), frozenset(), remaining=left,
                            context_left=10_000)
        committed.extend(done.tokens)
    return tuple(committed[len(PROMPT):])


def run(temperature, top_k, top_p, gamma, qmode, m=None, seed=0, n=N, **kw) -> float:
    m = m or intersection_map(DRAFT, TARGET)
    s = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    exactness.note_seed("run", {"seed": seed, "n": n, "settings": [temperature, top_k, top_p], "gamma": gamma,
                                "qmode": str(qmode), **{k: str(v) for k, v in kw.items()}})
    rng = np.random.default_rng(seed)
    counts: dict[tuple, int] = {}
    for _ in range(n):
        seq = generate(s, gamma, qmode, rng, m, **kw)
        counts[seq] = counts.get(seq, 0) + 1
    return chi_square_p(counts, exact_probs(s), n)


# float-top6: a sparse float support wider than the restriction's 5 ids, so it keeps zero-weight ids
# outside the intersection (issue 24's crash; they must be neither drawn nor shipped).
QMODES = {"float": QMode("float", 0), "float-top6": QMode("float", 6), "fixed-top3": QMode("fixed", 3, 6),
          "none": QMode("none", 0, 0)}


@pytest.mark.parametrize("qname", list(QMODES))
@pytest.mark.parametrize("temperature, top_k, top_p, gamma", [(1.0, 0, 1.0, 3), (0.6, 4, 0.9, 2)],
                         ids=["T1-γ3", "T0.6-topk4-topp0.9-γ2"])
def test_tli_sequences_follow_the_target(temperature, top_k, top_p, gamma, qname):
    p = run(temperature, top_k, top_p, gamma, QMODES[qname])
    assert p > P_MIN, f"chi-square p = {p:.2e}"


def test_tli_greedy_is_the_target_argmax_path():
    ctx = list(PROMPT)
    for _ in range(L):
        ctx.append(int(np.argmax(TARGET_LM.logits(ctx))))
    m = intersection_map(DRAFT, TARGET)
    for gamma in (1, 2):
        assert generate(SamplingSettings(temperature=0.0), gamma, QMODES["float"], np.random.default_rng(0), m) \
            == tuple(ctx[len(PROMPT):])


def test_negative_control_unrestricted_q_is_caught():
    """Its bias is small: at N over 130 seeds, 9 passed (log10 p up to -2.1; this seed's -6.5), so a
    change in how the stream is drawn could turn it green. At 2N, 45 seeds: worst log10 p -13.5."""
    assert run(1.0, 0, 1.0, 3, QMODES["float"], unrestricted=True, n=2 * N) < P_MIN


def test_negative_control_mislabelled_tokens_are_caught():
    """Shipping, for draft 'a', the target token 'b' (other bytes) while q still names 'a' breaks
    the tie between the drawn token and its q: biased, and the test sees it."""
    assert run(1.0, 0, 1.0, 3, QMODES["float"], relabel={2: 3, 3: 2}) < P_MIN


# --- beyond TLI: point masses spelled in target tokens ----------------------------------------------

def test_target_pieces_spell_tokens_outside_the_intersection():
    assert PIECES.spell(b"ab") == [2, 3] and PIECES.spell(b"ca") == [4, 2] and PIECES.spell(b"abc") == [6]
    assert PIECES.spell("é".encode()) == [5] and PIECES.spell(b"\xc3") == [8] and PIECES.spell(b"z") == []


def test_spelled_point_masses_follow_the_target():
    """The draft's own argmax, spelled ('ab' -> 'a' 'b'), as point masses: exact at T = 1 (N = 6000)."""
    assert run(1.0, 0, 1.0, 3, QMODES["none"], spelled=True) > P_MIN


def test_spelled_greedy_is_the_target_argmax_path():
    ctx = list(PROMPT)
    for _ in range(L):
        ctx.append(int(np.argmax(TARGET_LM.logits(ctx))))
    m = intersection_map(DRAFT, TARGET)
    got = generate(SamplingSettings(temperature=0.0), 3, QMODES["none"], np.random.default_rng(0), m, spelled=True)
    assert got == tuple(ctx[len(PROMPT):])


def test_negative_control_spelled_drafts_with_a_q_are_caught():
    """The same spelled drafts shipped with the step's TLI q (not what they were drawn from): biased."""
    assert run(1.0, 0, 1.0, 3, QMODES["none"], spelled=True, with_q=True) < P_MIN


# --- regression: a sparse float q wider than the restricted support (issue 24) -----------------------

class _LinspaceDrafter:
    """A draft model whose logits are linspace(0, 1, n) after any context (the issue's reproduction)."""

    fingerprint = None
    supports_trees = False

    def __init__(self, n: int):
        self.logits = np.linspace(0.0, 1.0, n)

    def next_logits(self, seq):
        return self.logits

    def observe(self, committed, num_accepted):
        pass


def _abc_pair():
    """Target vocabulary 'a b c'; draft vocabulary 'a b c x0..x19' (the x's are outside the intersection)."""
    target_tokens = (b"a", b"b", b"c")
    draft_tokens = target_tokens + tuple(f"x{i}".encode() for i in range(20))
    target = Vocabulary(target_tokens, fingerprint=_fp_of(target_tokens, b"t"))
    draft = Vocabulary(draft_tokens, fingerprint=_fp_of(draft_tokens, b"d"))
    return target, draft


def _fp_of(tokens, tag):
    from spec_core.fingerprint import tokenizer_fingerprint
    return tokenizer_fingerprint([tag + t for t in tokens], 0, 1)


@pytest.mark.parametrize("settings", [SamplingSettings(temperature=0.7, top_k=2),
                                      SamplingSettings(temperature=0.7, top_p=0.5),
                                      SamplingSettings(temperature=1.0)], ids=["top-k2", "top-p0.5", "T1"])
def test_sparse_float_q_wider_than_the_restriction_ships_only_the_support(settings):
    """Issue 24's crash: float:16 over a restriction with 3 (or fewer) nonzero ids keeps 13+ zero-weight
    draft ids outside the intersection; they are never drawn, and now never shipped either."""
    from edge_client.drafters import CrossVocabDrafter
    target, draft = _abc_pair()
    drafter = CrossVocabDrafter(_LinspaceDrafter(draft.n_vocab), draft, target, longest_match_tokenizer(draft))
    rng = np.random.default_rng(0)
    for _ in range(50):
        d = drafter.propose([0], 2, settings, QMode("float", 16), rng)
        assert len(d.tokens) == 2 and all(0 <= t < 3 for t in d.tokens)
        for tok, q in zip(d.tokens, d.qs):
            assert q.token_ids is not None and set(q.token_ids.tolist()) <= {0, 1, 2}
            assert q.prob_of(tok) > 0
            # The shipped q is the distribution the token was drawn from, bit for bit: the float32
            # encoding of the restricted, processed draft distribution, less its zero entries.
            restricted = restrict_logits(drafter.inner.logits, drafter.token_map)
            enc = encode_float(processed_probs(restricted, settings.temperature, settings.top_k, settings.top_p), 16)
            keep = enc.weights > 0
            assert sorted(zip(q.token_ids.tolist(), q.weights.tolist())) == \
                sorted(zip(enc.token_ids[keep].tolist(), enc.weights[keep].tolist()))


def test_to_target_q_refuses_weight_outside_the_intersection():
    """A positive weight on an unmapped draft id is still a bug upstream (q was not restricted)."""
    target, draft = _abc_pair()
    m = intersection_map(draft, target)
    q = EncodedQ(np.array([0, 5], dtype=np.uint32), np.array([0.5, 0.5], dtype=np.float32), fixed=False)
    with pytest.raises(ValueError, match="outside the intersection"):
        to_target_q(q, m)
    zero = EncodedQ(np.array([0, 5, 1], dtype=np.uint32), np.array([0.75, 0.0, 0.25], dtype=np.float32), fixed=False)
    out = to_target_q(zero, m)
    assert out.token_ids.tolist() == [0, 1] and out.weights.tolist() == [0.75, 0.25]   # the zero is not shipped
