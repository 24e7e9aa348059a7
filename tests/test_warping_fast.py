"""The fast sampling maths gives the plain definition's numbers (hybridspec/testing/warping_reference.py).

What must not change: the kept set of every row (which tokens have p > 0) and p itself; the fast
code is built to give p bit-for-bit (the same exps, the same sums over whole rows), so the checks
assert the kept set, |p - p_ref| <= 1e-9 (the contract) and bitwise equality (what keeps every
seeded generation's tokens). Inputs: logits recorded from the bundled SmolLM2 target (slow) and
the tiny GGUF models, random logits at SmolLM2's and Gemma's vocabulary sizes, and adversarial
rows: ties and near-ties at the top-k and top-p boundaries, flat rows, -inf, underflow.
The q codec, sample() and the chain round are checked the same way, and seeded generations must
give the reference code's token ids, computed in the same run (never ids recorded on one CPU).
"""
from __future__ import annotations

import copy
from typing import Callable, NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from chain_round import chain_round
from hybridspec.testing import warping_reference as ref
from spec_core import qcodec
from spec_core.drafting import QMode, draft_step
from spec_core.synthetic import synthetic_pair
from spec_core.tree import DraftTree, verify_tree_on_logits
from spec_core.verify import RoundResult, commit_round
from spec_core.warping import (EDGE_STREAM, GENERATE_STREAM, VERIFIER_STREAM, SamplingSettings, processed_probs,
                               sample, seeded_rng)

SETTINGS = [(t, k, p) for t in (0.0, 0.7, 1.0) for k in (0, 1, 50) for p in (1.0, 0.95, 0.5)]


def check_same_probs(logits, temperature, top_k, top_p):
    want = ref.processed_probs(logits, temperature, top_k, top_p)
    got = processed_probs(logits, temperature, top_k, top_p)
    where = f"T={temperature} top_k={top_k} top_p={top_p!r}"
    assert got.shape == want.shape and got.dtype == np.float64
    np.testing.assert_array_equal(got > 0, want > 0, err_msg=f"kept set differs at {where}")
    assert np.max(np.abs(got - want)) <= 1e-9, where
    np.testing.assert_array_equal(got, want, err_msg=f"not bit-for-bit at {where}")
    return got, want


def check_same_codec_and_sampling(got, want, seed=0):
    """encode_fixed and sample on the same rows give the same encodings and the same draws."""
    for r, (row, row_ref) in enumerate(zip(np.atleast_2d(got), np.atleast_2d(want))):
        for top_k, bits in ((16, 16), (3, 8), (64, 12)):
            q, q_ref = qcodec.encode_fixed(row, top_k, bits), ref.encode_fixed(row_ref, top_k, bits)
            np.testing.assert_array_equal(q.token_ids, q_ref.token_ids)
            np.testing.assert_array_equal(q.weights, q_ref.weights)
        a, b = np.random.default_rng(seed + r), np.random.default_rng(seed + r)
        assert [sample(row, a) for _ in range(5)] == [ref.sample(row_ref, b) for _ in range(5)]


# --- recorded logits ----------------------------------------------------------------------------

def record_logits(path: str, text: str, n_rows: int) -> np.ndarray:
    """Raw logits of a GGUF model along its own greedy continuation of `text`  # [n_rows, vocab]"""
    from llama_runtime import GGUFModel
    model = GGUFModel(path, n_threads=1)
    ctx = model.new_context(256)
    try:
        tokens = model.tokenize(text)
        rows = []
        for _ in range(n_rows):
            row = ctx.logits(tokens, 1)[0]
            rows.append(row)
            tokens.append(int(np.argmax(row)))
        return np.stack(rows)
    finally:
        ctx.close()
        model.close()


@pytest.fixture(scope="module")
def smollm2_logits(tmp_path_factory) -> np.ndarray:
    from llama_runtime import bundled_model_path
    path = tmp_path_factory.mktemp("recorded") / "smollm2_logits.npy"
    np.save(path, record_logits(str(bundled_model_path()), "Write a short poem about the sea.\n", 12))
    return np.load(path)


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS + [(0.7, 16, 0.9), (1.5, 0, 0.99), (0.3, 0, 0.8)])
def test_recorded_smollm2_logits(smollm2_logits, temperature, top_k, top_p):
    got, want = check_same_probs(smollm2_logits, temperature, top_k, top_p)
    check_same_codec_and_sampling(got[:3], want[:3])


def test_recorded_tiny_gguf_logits(tiny_models, tmp_path):
    path = tmp_path / "tiny_logits.npy"
    np.save(path, np.concatenate([record_logits(str(tiny_models[m]), "hello world", 6) for m in ("target", "draft")]))
    logits = np.load(path)
    for temperature, top_k, top_p in SETTINGS:
        got, want = check_same_probs(logits, temperature, top_k, top_p)
        check_same_codec_and_sampling(got[:2], want[:2])


# --- random and adversarial logits --------------------------------------------------------------

@pytest.mark.parametrize("vocab", [5, 3000, 49152])
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_random_logits(vocab, scale):
    logits = (np.random.default_rng(vocab).standard_normal((4, vocab)) * scale).astype(np.float32)
    for temperature, top_k, top_p in SETTINGS:
        got, want = check_same_probs(logits, temperature, top_k, top_p)
        check_same_codec_and_sampling(got[:1], want[:1])


def test_random_logits_at_gemma_vocabulary():
    logits = np.random.default_rng(1).standard_normal((2, 262_144)) * 3.0  # float64 input too
    for temperature, top_k, top_p in [(0.7, 0, 1.0), (0.7, 0, 0.95), (1.0, 50, 0.95), (0.0, 0, 1.0)]:
        check_same_probs(logits, temperature, top_k, top_p)


def _logits_from_probs(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64))


def adversarial_rows(vocab: int = 8192) -> list[tuple[str, np.ndarray, float, int, float]]:
    """(name, logits [rows, vocab], temperature, top_k, top_p) built to sit on a boundary."""
    rng = np.random.default_rng(5)
    cases = []
    # A tie group straddles the top-p boundary: 20 tokens of 1/40 each after a 0.6 head; the
    # stable order keeps the lowest-index ones, and the group sits among random low tokens.
    probs = np.full(vocab, 1e-9)
    head = rng.choice(vocab, 1, replace=False)
    group = np.sort(rng.choice(np.setdiff1d(np.arange(vocab), head), 20, replace=False))
    probs[head], probs[group] = 0.6, 0.02
    cases.append(("tie group at top-p", _logits_from_probs(probs)[None], 1.0, 0, 0.75))
    # Dyadic masses: the mass before a token equals top_p exactly (not kept), and one ulp either side.
    dyadic = np.full(vocab, 2.0 ** -40)
    dyadic[[7, 3000, 11, 4095]] = [0.5, 0.25, 0.125, 0.0625]
    for top_p in (0.875, np.nextafter(0.875, 0), np.nextafter(0.875, 1), 0.75, np.nextafter(0.75, 1)):
        cases.append((f"exact mass {float(top_p)!r}", _logits_from_probs(dyadic)[None], 1.0, 0, float(top_p)))
    # Near-ties: neighbouring float32 logits around the top-p boundary of a flat row.
    flat = rng.standard_normal(vocab).astype(np.float32)
    flat[rng.choice(vocab, 200)] = np.float32(0.5)
    flat[rng.choice(vocab, 200)] = np.nextafter(np.float32(0.5), np.float32(1))
    for top_p in (0.3, 0.5, 0.9, 0.99, 0.999999):
        cases.append((f"flat near-ties {top_p}", flat[None], 0.7, 0, top_p))
    # top_p equal to the plain code's own mass-before at a token of a flat row (and one ulp either
    # side): any other summation order rounds differently, so only the exact decision agrees.
    flatter = rng.standard_normal((1, vocab)) * 0.3
    plain = np.sort(ref.processed_probs(flatter, 1.0)[0])[::-1]
    mass_before = np.cumsum(plain) - plain
    for at in (0.3, 0.6, 0.9):
        j = int(np.searchsorted(mass_before, at))
        for top_p in (mass_before[j], np.nextafter(mass_before[j], 0), np.nextafter(mass_before[j], 1)):
            cases.append((f"top_p = plain mass before, {at} {float(top_p)!r}", flatter, 1.0, 0, float(top_p)))
    # Every logit equal: one tie group of the whole vocabulary.
    cases.append(("all equal", np.zeros((1, vocab)), 1.0, 0, 0.5))
    cases.append(("all equal, top-k", np.zeros((1, vocab)), 1.0, 50, 1.0))
    # Ties at the k-th value: 10 tokens share it; all are kept.
    tied = rng.standard_normal(vocab)
    tied[rng.choice(vocab, 10, replace=False)] = tied.max() - 0.1
    cases.append(("ties at k-th", tied[None], 1.0, 45, 1.0))
    cases.append(("ties at k-th + top-p", tied[None], 0.7, 45, 0.9))
    # Quantized logits (many exact ties everywhere).
    coarse = np.round(rng.standard_normal((3, vocab)) * 4) / 4
    for top_k, top_p in ((0, 0.9), (50, 1.0), (50, 0.8), (1, 1.0)):
        cases.append((f"quantized k={top_k} p={top_p}", coarse, 1.0, top_k, top_p))
    # -inf logits (masked tokens), underflow to zero, extreme temperatures, extreme top_p.
    masked = rng.standard_normal((2, vocab)) * 3
    masked[:, rng.choice(vocab, vocab - 30, replace=False)] = -np.inf
    for top_k, top_p in ((0, 0.9), (50, 1.0), (50, 0.9), (0, 1.0)):
        cases.append((f"-inf k={top_k} p={top_p}", masked, 1.0, top_k, top_p))
    wide = rng.standard_normal((2, vocab)) * 400
    cases.append(("underflow", wide, 1.0, 0, 0.95))
    cases.append(("tiny temperature", rng.standard_normal((2, vocab)), 1e-3, 0, 0.95))
    cases.append(("huge temperature", rng.standard_normal((2, vocab)), 1e3, 50, 0.95))
    cases.append(("top_p tiny", rng.standard_normal((2, vocab)), 1.0, 0, 1e-300))
    cases.append(("top_p next to 1", rng.standard_normal((2, vocab)), 1.0, 0, float(np.nextafter(1.0, 0))))
    cases.append(("top_k = vocab - 1", rng.standard_normal((1, vocab)), 1.0, vocab - 1, 0.95))
    return cases


@pytest.mark.parametrize("name, logits, temperature, top_k, top_p", adversarial_rows(),
                         ids=[c[0] for c in adversarial_rows()])
def test_adversarial_logits(name, logits, temperature, top_k, top_p):
    got, want = check_same_probs(logits, temperature, top_k, top_p)
    check_same_codec_and_sampling(got, want)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([2049, 3000, 9000]), scale=st.floats(0.01, 40.0),
       step=st.sampled_from([0.0, 0.25, 1.0]), temperature=st.floats(0.05, 3.0),
       top_k=st.sampled_from([0, 1, 2, 16, 50, 1000]), top_p=st.floats(0.0, 1.0))
def test_property_same_as_the_plain_code(seed, vocab, scale, step, temperature, top_k, top_p):
    """Rows long enough for the fast paths, with ties wherever `step` quantizes the logits."""
    logits = np.random.default_rng(seed).standard_normal((2, vocab)) * scale
    if step:
        logits = np.round(logits / step) * step
    got, want = check_same_probs(logits.astype(np.float32), temperature, top_k, top_p)
    check_same_codec_and_sampling(got[:1], want[:1], seed)


def test_the_tie_group_case_really_straddles_the_boundary():
    """The adversarial case above is only adversarial if part of the tie group is kept."""
    _, logits, t, k, p = adversarial_rows()[0]
    kept = np.flatnonzero(processed_probs(logits, t, k, p)[0])
    assert 1 < len(kept) < 21


def test_encode_fixed_with_ties_inside_and_at_the_kth():
    rng = np.random.default_rng(2)
    for trial in range(20):
        probs = rng.random(6000) ** 8
        top = rng.choice(6000, 30, replace=False)
        probs[top[:3]] = probs[top[3:6]] = 0.01 * (trial + 1)  # tied pairs inside the top 16
        probs[top[10:14]] = probs.max() / 7                     # a tie group near the 16th
        probs /= probs.sum()
        for top_k in (4, 16, 20):
            q, q_ref = qcodec.encode_fixed(probs, top_k), ref.encode_fixed(probs, top_k)
            np.testing.assert_array_equal(q.token_ids, q_ref.token_ids)
            np.testing.assert_array_equal(q.weights, q_ref.weights)


# --- one round and one draft step ---------------------------------------------------------------

@pytest.mark.parametrize("qkind", ["fixed", "fixed:0", "float", "float:64", "none"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (0.7, 0, 0.95), (1.0, 50, 0.9), (0.0, 0, 1.0)])
def test_draft_step_and_verify_round_match_the_reference(qkind, temperature, top_k, top_p):
    """Same tokens, same q, same accept/reject decisions and the same RNG state afterwards; the
    verifier's driver on logits (rows warped as the walk reaches them) too."""
    vocab, gamma = 6000, 5
    rng = np.random.default_rng(11)
    draft_logits = (rng.standard_normal((gamma, vocab)) * 3).astype(np.float32)
    target_logits = draft_logits[:, :] + rng.standard_normal((gamma, vocab)).astype(np.float32)
    target_logits = np.vstack([target_logits, rng.standard_normal((1, vocab)).astype(np.float32)])
    s, qmode = SamplingSettings(temperature, top_k, top_p), QMode.parse(qkind)
    for seed in range(6):
        new_rng, ref_rng = np.random.default_rng(seed), np.random.default_rng(seed)
        drafts, qs, qs_ref = [], [], []
        for row in draft_logits:
            tok, q = draft_step(row, s, qmode, new_rng)
            tok_ref, q_ref = ref.draft_step(row, s, qmode, ref_rng)
            assert tok == tok_ref
            if q is not None:
                np.testing.assert_array_equal(q.weights, q_ref.weights)
                np.testing.assert_array_equal(q.token_ids if q.token_ids is not None else -1,
                                              q_ref.token_ids if q_ref.token_ids is not None else -1)
            drafts.append(tok); qs.append(q); qs_ref.append(q_ref)
        qs = None if any(q is None for q in qs) else qs
        qs_ref = None if any(q is None for q in qs_ref) else qs_ref
        p = processed_probs(target_logits, temperature, top_k, top_p)
        p_ref = ref.processed_probs(target_logits, temperature, top_k, top_p)
        lazy_rng = copy.deepcopy(new_rng)
        result = ref.verify_round(p_ref, drafts, qs_ref, ref_rng)
        assert chain_round(p, drafts, qs, new_rng) == result
        on_logits = verify_tree_on_logits(target_logits, s, DraftTree.chain(drafts), qs, lazy_rng)
        assert RoundResult(len(on_logits.path), on_logits.next_token) == result
        assert new_rng.random() == ref_rng.random() == lazy_rng.random()


# --- seeded generations: the fast code against the reference, at run time ------------------------
#
# The token ids are compared with the reference code's on the same machine, in the same run: numpy
# runs other SIMD kernels on other CPUs (AVX-512, AVX2, NEON), so the last bits of float32 logits and
# with them a draw near a boundary may differ between machines; ids recorded on one CPU do not
# travel. What must hold everywhere is that the fast code makes the same draws as the definition.

class Impl(NamedTuple):
    """The sampling maths a seeded generation runs: spec_core's or the reference's."""
    draft_step: Callable
    processed_probs: Callable
    verify_round: Callable
    sample: Callable


FAST = Impl(draft_step, processed_probs, chain_round, sample)
REFERENCE = Impl(ref.draft_step, ref.processed_probs, ref.verify_round, ref.sample)


def seeded_hybrid_tokens(impl: Impl, vocab: int, seed: int, s: SamplingSettings, qmode: QMode, gamma: int,
                         n_tokens: int):
    """Edge drafting and verifier rounds, with the streams the edge and the verifier use
    (EDGE_STREAM; VERIFIER_STREAM keyed by the committed length)."""
    target, draft = synthetic_pair(vocab=vocab, seed=seed, noise=1.0)
    edge_rng, verifier_rng = seeded_rng(seed, EDGE_STREAM), seeded_rng(seed, VERIFIER_STREAM, 1)
    committed = [0]
    while len(committed) - 1 < n_tokens:
        seq, tokens, qs = list(committed), [], []
        g = min(gamma, n_tokens - (len(committed) - 1) - 1)
        for _ in range(g):
            tok, q = impl.draft_step(draft.logits(seq), s, qmode, edge_rng)
            tokens.append(tok); qs.append(q); seq.append(tok)
        qs = None if not qs or any(q is None for q in qs) else qs
        rows = np.stack([target.logits(committed + tokens[:i]) for i in range(g + 1)])
        p = impl.processed_probs(rows, s.temperature, s.top_k, s.top_p)
        result = impl.verify_round(p, tokens, qs, verifier_rng)
        done = commit_round(tokens, result, frozenset(), remaining=n_tokens - (len(committed) - 1),
                            context_left=10**6)
        committed.extend(done.tokens)
    return committed[1:]


def seeded_target_tokens(impl: Impl, vocab: int, seed: int, s: SamplingSettings, n_tokens: int):
    """The cloud-only stream: sample from the target's processed p, GENERATE_STREAM."""
    target, _ = synthetic_pair(vocab=vocab, seed=seed)
    rng = seeded_rng(seed, GENERATE_STREAM, 1)
    ctx = [0]
    for _ in range(n_tokens):
        ctx.append(impl.sample(impl.processed_probs(target.logits(ctx), s.temperature, s.top_k, s.top_p), rng))
    return ctx[1:]


SEEDED_PAIRS = [(8192, 5), (49152, 7)]   # (vocab, seed); 49152 is SmolLM2's size (slow)
SEEDED_GAMMA, SEEDED_TOKENS = 5, 24


def _seeded_params():
    for vocab, seed in SEEDED_PAIRS:
        for t in (0.0, 0.7, 1.0):
            for k in (0, 50):
                for p in (1.0, 0.95):
                    for q in ("target", "none", "fixed", "float", "float:64"):
                        yield pytest.param(vocab, seed, t, k, p, q, marks=[pytest.mark.slow] if vocab > 10_000 else [],
                                           id=f"V{vocab}-T{t}-k{k}-p{p}-{q}")


@pytest.mark.parametrize("vocab, seed, temperature, top_k, top_p, q", list(_seeded_params()))
def test_seeded_generation_gives_the_reference_codes_tokens(vocab, seed, temperature, top_k, top_p, q):
    s = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    if q == "target":
        got, want = (seeded_target_tokens(impl, vocab, seed, s, SEEDED_TOKENS) for impl in (FAST, REFERENCE))
    else:
        got, want = (seeded_hybrid_tokens(impl, vocab, seed, s, QMode.parse(q), SEEDED_GAMMA, SEEDED_TOKENS)
                     for impl in (FAST, REFERENCE))
    assert len(got) == SEEDED_TOKENS
    assert got == want


def test_seeded_generation_check_can_fail():
    """Negative control: a reference whose sampler draws once more per token gives other ids, so
    the comparison above is not vacuous."""
    def skewed_sample(probs, rng):
        rng.random()
        return ref.sample(probs, rng)
    skewed = REFERENCE._replace(sample=skewed_sample)
    s = SamplingSettings(temperature=1.0)
    assert seeded_target_tokens(FAST, 8192, 5, s, SEEDED_TOKENS) != seeded_target_tokens(skewed, 8192, 5, s, SEEDED_TOKENS)


def test_seeded_generation_on_tiny_gguf_logits_matches_the_reference(tiny_models, monkeypatch):
    """Real-model logits: one seeded hybrid generation with the fast code and with the reference
    code swapped in gives the same token ids."""
    from llama_runtime import GGUFModel
    target, draft = GGUFModel(str(tiny_models["target"]), n_threads=1), GGUFModel(str(tiny_models["draft"]), n_threads=1)
    t_ctx, d_ctx = target.new_context(256), draft.new_context(256)

    def generate(s: SamplingSettings, qmode: QMode, step, warp, verify) -> list[int]:
        edge_rng, verifier_rng = seeded_rng(3, EDGE_STREAM), seeded_rng(3, VERIFIER_STREAM, 1)
        committed = target.tokenize("once upon a time")
        start = len(committed)
        while len(committed) - start < 24:
            seq, tokens, qs = list(committed), [], []
            for _ in range(4):
                tok, q = step(d_ctx.logits(seq, 1)[0], s, qmode, edge_rng)
                tokens.append(tok); qs.append(q); seq.append(tok)
            qs = None if any(q is None for q in qs) else qs
            p = warp(t_ctx.logits(committed + tokens, len(tokens) + 1), s.temperature, s.top_k, s.top_p)
            result = verify(p, tokens, qs, verifier_rng)
            committed.extend(tokens[: result.num_accepted] + [result.next_token])
        return committed[start:]

    try:
        for s in (SamplingSettings(0.7), SamplingSettings(1.0, top_k=20, top_p=0.9), SamplingSettings(0.7, top_p=0.95)):
            for qkind in ("fixed", "none", "float"):
                new = generate(s, QMode.parse(qkind), draft_step, processed_probs, chain_round)
                old = generate(s, QMode.parse(qkind), ref.draft_step, ref.processed_probs, ref.verify_round)
                assert new == old, (s, qkind)
    finally:
        t_ctx.close(); d_ctx.close(); target.close(); draft.close()
