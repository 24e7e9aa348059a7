"""Statistical exactness: whole generated sequences follow the target's distribution.

A synthetic target over V = 5 tokens (order-1 context, exact probabilities) and a blurred draft.
For each setting we generate N = 6000 sequences of L = 3 tokens speculatively (the same
draft_step / verify_tree / commit_round the edge and verifier use) and compare the counts of
the 125 possible sequences with the exact target probabilities by a chi-square test (cells with
expected count < 5 pooled). Seeds are fixed, so each test is deterministic; a setting fails if
p < 1e-4. The negative controls show the test has the power to catch a biased verifier.
"""
import itertools

import numpy as np
import pytest

from hybridspec.testing import exactness
from hybridspec.testing.exactness import sequence_p
from spec_core.drafting import QMode, draft_step
from spec_core.synthetic import synthetic_pair
from spec_core.verify import commit_round
from spec_core.warping import SamplingSettings, processed_probs
from chain_round import chain_round

V, L, N = 5, 3, 6000
P_MIN = 1e-4


def exact_sequence_probs(target, prompt, s: SamplingSettings) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        ctx, prob = list(prompt), 1.0
        for tok in seq:
            prob *= processed_probs(target.logits(ctx), s.temperature, s.top_k, s.top_p)[tok]
            ctx.append(tok)
        out[seq] = prob
    return out


def speculative_sequence(target, draft, prompt, s, gamma, qmode, rng, verify=chain_round):
    committed = list(prompt)
    while len(committed) - len(prompt) < L:
        seq, tokens, qs = list(committed), [], []
        g = min(gamma, L - (len(committed) - len(prompt)) - 1)
        for _ in range(g):
            tok, q = draft_step(draft.logits(seq), s, qmode, rng)
            tokens.append(tok); qs.append(q); seq.append(tok)
        qs = None if not qs or any(q is None for q in qs) else qs
        ctxs = [committed + tokens[:i] for i in range(g + 1)]
        p = processed_probs(np.stack([target.logits(c) for c in ctxs]), s.temperature, s.top_k, s.top_p)
        result = verify(p, tokens, qs, rng)
        done = commit_round(tokens, result, frozenset(), remaining=L - (len(committed) - len(prompt)),
                            context_left=10_000)
        committed.extend(done.tokens)
    return tuple(committed[len(prompt):])


def chi_square_p(counts: dict, expected_probs: dict, n: int) -> float:
    """Chi-square p of sequence counts (n of them) against their exact probabilities, sparse cells
    pooled (hybridspec.testing.exactness.sequence_p); noted in the test's replay record."""
    return exactness.noted_p(sequence_p(counts, expected_probs))


def sequence_counts(generate, temperature, top_k, top_p, seed=0, n=N):
    """n sequences from generate(target, draft, prompt, settings, rng) on the synthetic pair:
    (counts per sequence, exact target probabilities)."""
    target, draft = synthetic_pair(vocab=V, seed=3, noise=1.5)
    s = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    exactness.note_seed("sequence_counts", {"seed": seed, "n": n, "pair": "synthetic_pair(5, 3, 1.5)",
                                            "settings": [temperature, top_k, top_p]})
    rng = np.random.default_rng(seed)
    counts: dict[tuple, int] = {}
    for _ in range(n):
        seq = generate(target, draft, [0], s, rng)
        counts[seq] = counts.get(seq, 0) + 1
    return counts, exact_sequence_probs(target, [0], s)


def run_setting(temperature, top_k, top_p, gamma, qmode, seed=0, n=N, verify=chain_round):
    return sequence_counts(lambda t, d, p, s, rng: speculative_sequence(t, d, p, s, gamma, qmode, rng, verify),
                           temperature, top_k, top_p, seed, n)


QMODES = {"full": QMode("float", 0), "sparse-fixed": QMode("fixed", 3, 6), "none": QMode("none", 0, 0)}


@pytest.mark.parametrize("qname", list(QMODES))
@pytest.mark.parametrize("gamma", [1, 4, 8])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 0.9)], ids=["plain", "topk4-topp0.9"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
def test_sequences_follow_the_target(temperature, top_k, top_p, gamma, qname):
    counts, probs = run_setting(temperature, top_k, top_p, gamma, QMODES[qname])
    p = chi_square_p(counts, probs, N)
    assert p > P_MIN, f"chi-square p = {p:.2e} for T={temperature} top_k={top_k} top_p={top_p} γ={gamma} q={qname}"


def test_greedy_sequences_are_the_target_argmax_path():
    target, draft = synthetic_pair(vocab=V, seed=3, noise=1.5)
    s = SamplingSettings(temperature=0.0)
    ctx = [0]
    for _ in range(L):
        ctx.append(int(np.argmax(target.logits(ctx))))
    rng = np.random.default_rng(0)
    for gamma in (1, 4, 8):
        for qname, qm in QMODES.items():
            assert speculative_sequence(target, draft, [0], s, gamma, qm, rng) == tuple(ctx[1:]), (gamma, qname)


def test_negative_control_accepting_every_draft_is_caught():
    """A verifier that keeps every draft outputs the draft's distribution: the test must see it."""
    def accept_all(p, tokens, qs, rng):
        from spec_core.verify import RoundResult
        from spec_core.warping import sample
        return RoundResult(len(tokens), sample(p[len(tokens)], rng))
    counts, probs = run_setting(1.0, 0, 1.0, 4, QMODES["full"], verify=accept_all)
    assert chi_square_p(counts, probs, N) < P_MIN


def test_negative_control_sampling_from_unquantized_q_is_caught():
    """Drafting from q but shipping a coarser quantized q (sample-then-quantize) is biased."""
    coarse = QMode("fixed", 2, 2)

    def verify_with_coarse_q(p, tokens, qs, rng):
        from spec_core.qcodec import encode_fixed
        if qs is not None:
            qs = [encode_fixed(q.dense(V), coarse.top_k, coarse.scale_bits) for q in qs]
            if any(q.prob_of(t) == 0 for q, t in zip(qs, tokens)):
                qs = None  # the wire would refuse it; fall back to point masses (still the wrong q)
        return chain_round(p, tokens, qs, rng)
    counts, probs = run_setting(1.0, 0, 1.0, 4, QMODES["full"], verify=verify_with_coarse_q)
    assert chi_square_p(counts, probs, N) < P_MIN
