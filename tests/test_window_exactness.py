"""The window's rule, statistically: round r + 2 runs only when rounds r and r + 1 committed exactly
the tokens its key assumes (both rounds' outcomes), with a negative control aimed at that rule.

As tests/test_continuations.py (whose helpers it uses): the synthetic pair over V = 5 tokens, here of
order 2 (the next token depends on the last two, so a round run after a wrong earlier token is
visible in the output), N = 6000 sequences of L = 3 tokens from the prompt [0], compared with the
exact probabilities of all 125 sequences by one chi-square (cells with expected count < 5 pooled);
a setting passes if p > 1e-4. Each sequence is a window of three rounds, all drafted before round r
is verified: round r (no drafts: it commits one token, so round r + 2 always has a token to
commit); for K = 6 of its outcomes (with V = 5: all) a round r + 1 (no drafts either) after it; for
K of the outcomes of round r + 1's most likely alternative, a round r + 2 (a chain of one draft, q
as float) after it, keyed by the tokens of both outcomes from the committed prefix the edge knew
(edge_client.window). Then round r is verified; round r + 1 is the alternative whose key is what r
committed (spec_core.continuations.pick_continuation), else a fresh draft; round r + 2 is the one
whose whole key is what r and r + 1 committed, else a fresh draft; plain rounds to L.

Negative control: round r + 2 keyed by round r + 1's outcome only (round r's tokens matched by
length, as a key that does not span every unanswered round would be), its target rows computed
after its key (a pass that attends to the assumed tokens, as a fused verification does) while its
tokens are committed after what rounds r and r + 1 really committed. It must fail: the test has the
power to see a window round run after a prefix it was not drafted from.
"""
from __future__ import annotations

import numpy as np
import pytest

from spec_core.continuations import pick_continuation
from spec_core.drafting import QMode, draft_step
from spec_core.synthetic import synthetic_pair
from spec_core.tree import DraftTree
from spec_core.verify import RoundResult, commit_round
from spec_core.warping import SamplingSettings
from test_continuations import _Draft, _outcomes, _verify
from hybridspec.testing import exactness
from test_exactness_stats import L, N, P_MIN, V, chi_square_p, exact_sequence_probs

FLOAT = QMode("float", 0)


def _one_draft(draft, base, s, rng, gamma: int = 1) -> _Draft:
    """A chain of `gamma` (0 or 1) drafts after `base`, with the q its token was sampled from."""
    if gamma == 0:
        return _Draft(base, DraftTree.chain([]), [])
    tok, q = draft_step(draft.logits(list(base)), s, FLOAT, rng)
    return _Draft(base, DraftTree.chain([tok]), [q])


def window_sequence(target, draft, s, rng, control: bool = False, used: list | None = None) -> tuple[int, ...]:
    prompt = [0]
    committed = list(prompt)

    def left() -> int:
        return L - (len(committed) - len(prompt))

    def commit(tokens):
        done = commit_round(tokens[:-1], RoundResult(len(tokens) - 1, tokens[-1]), frozenset(),
                            remaining=left(), context_left=10_000)
        committed.extend(done.tokens)

    known = list(committed)   # what the edge knew when it sent the window: keys count from here
    round_r = _one_draft(draft, known, s, rng, gamma=0)
    keys1 = _outcomes(draft, round_r, s, rng)
    conts1 = [_one_draft(draft, known + list(k), s, rng, gamma=0) for k in keys1]
    primary = conts1[0]                              # round r + 1's most likely alternative
    tails2 = _outcomes(draft, primary, s, rng)       # its outcomes
    conts2 = [_one_draft(draft, primary.base + list(k), s, rng) for k in tails2]
    keys2 = [tuple(keys1[0]) + tuple(k) for k in tails2]   # the window's keys: both rounds' outcomes

    commit(_verify(target, round_r, s, rng))
    if left() > 0:   # round r + 1
        i = pick_continuation(committed, len(known), keys1)
        nxt = conts1[i] if i is not None else _one_draft(draft, list(committed), s, rng, gamma=0)
        assert nxt.base == committed
        commit(_verify(target, nxt, s, rng))
    if left() > 0:   # round r + 2
        rows_after = None
        if control:   # the bug: keyed by round r + 1's outcome only, rows after the key
            start = len(known) + len(keys1[0])
            j = next((j for j, k in enumerate(tails2) if start + len(k) == len(committed)
                      and tuple(committed[start:]) == tuple(k)), None)
            rows_after = conts2[j].base if j is not None else None
        else:
            j = pick_continuation(committed, len(known), keys2)
        if used is not None:
            used.append(j is not None)
        nxt = conts2[j] if j is not None else _one_draft(draft, list(committed), s, rng)
        if rows_after is None:
            assert nxt.base == committed   # what makes it exact: drafted after exactly this prefix
        commit(_verify(target, nxt, s, rng, rows_after=rows_after))
    while left() > 0:
        commit(_verify(target, _one_draft(draft, list(committed), s, rng), s, rng))
    return tuple(committed[len(prompt):])


def _run(temperature: float, control: bool = False):
    target, draft = synthetic_pair(vocab=V, seed=3, noise=1.0, order=2)
    s = SamplingSettings(temperature=temperature)
    rng = np.random.default_rng(11)
    exactness.note_seed("window_sequence", {"seed": 11, "n": N, "temperature": temperature, "control": control})
    counts: dict[tuple, int] = {}
    used: list[bool] = []
    for _ in range(N):
        seq = window_sequence(target, draft, s, rng, control, used)
        counts[seq] = counts.get(seq, 0) + 1
    return chi_square_p(counts, exact_sequence_probs(target, [0], s), N), used


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rounds_two_deep_in_a_window_follow_the_target(temperature):
    p, used = _run(temperature)
    assert sum(used) > 0.1 * len(used), f"round r + 2's key came true in {sum(used)} of {len(used)}: too few to test"
    assert p > P_MIN, f"chi-square p = {p:.2e} (T = {temperature})"


def test_a_window_key_that_skips_an_unanswered_round_is_caught():
    p, used = _run(1.0, control=True)
    assert sum(used) > 0.1 * len(used)
    assert p < P_MIN, f"the control passed (p = {p:.2e}): the test has no power"
