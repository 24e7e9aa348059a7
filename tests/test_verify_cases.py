"""Literal cases of one round: readable lists in, accepted count and next token out."""
import numpy as np
import pytest

from spec_core.qcodec import EncodedQ
from spec_core.verify import FinishReason, RoundResult, commit_round
from chain_round import chain_round

V = 6


def one_hot_rows(argmaxes):
    """Greedy target: p is one-hot at each position's argmax  # [gamma + 1, V]"""
    p = np.zeros((len(argmaxes), V))
    p[np.arange(len(argmaxes)), argmaxes] = 1.0
    return p


def rng():
    return np.random.default_rng(0)


def test_greedy_all_accepted_plus_bonus():
    draft = [1, 2, 3]; target_argmax = [1, 2, 3, 4]  # all match: bonus is 4
    assert chain_round(one_hot_rows(target_argmax), draft, None, rng()) == RoundResult(3, 4)


def test_greedy_rejection_at_first_position():
    draft = [1, 2, 3]; target_argmax = [5, 2, 3, 4]  # mismatch at 0: corrected to 5
    assert chain_round(one_hot_rows(target_argmax), draft, None, rng()) == RoundResult(0, 5)


def test_greedy_rejection_in_the_middle():
    draft = [1, 2, 3]; target_argmax = [1, 5, 3, 4]  # mismatch at 1
    assert chain_round(one_hot_rows(target_argmax), draft, None, rng()) == RoundResult(1, 5)


def test_greedy_rejection_at_the_end():
    draft = [1, 2, 3]; target_argmax = [1, 2, 0, 4]  # mismatch at the last draft
    assert chain_round(one_hot_rows(target_argmax), draft, None, rng()) == RoundResult(2, 0)


def test_greedy_result_does_not_depend_on_the_seed():
    results = {chain_round(one_hot_rows([1, 5, 3, 4]), [1, 2, 3], None, np.random.default_rng(s)) for s in range(50)}
    assert results == {RoundResult(1, 5)}


def test_empty_draft_is_a_plain_sample():
    p = np.array([[0, 0, 1.0, 0, 0, 0]])
    assert chain_round(p, [], None, rng()) == RoundResult(0, 2)


def test_point_mass_draft_rejected_resamples_without_the_draft():
    # p(x=1) = 0 -> always rejected; the corrected token comes from p with token 1 removed.
    p = np.array([[0, 0, 0.5, 0.5, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=float)
    for seed in range(20):
        res = chain_round(p, [1], None, np.random.default_rng(seed))
        assert res.num_accepted == 0 and res.next_token in (2, 3)


def test_point_mass_draft_certain_accept():
    p = np.array([[0, 1.0, 0, 0, 0, 0], [0, 0, 0, 0, 1.0, 0]])
    assert chain_round(p, [1], None, rng()) == RoundResult(1, 4)


def test_q_residual_excludes_where_q_exceeds_p():
    # q puts all mass on 1 where p has 0.2: on rejection the residual is p without token 1.
    p = np.array([[0.0, 0.2, 0.8, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    q = EncodedQ(np.array([1], dtype=np.uint32), np.array([65536]), fixed=True)
    outs = {chain_round(p, [1], [q], np.random.default_rng(s)) for s in range(200)}
    assert outs == {RoundResult(1, 0), RoundResult(0, 2)}


def test_draft_with_zero_target_probability_always_rejected():
    p = np.array([[0.0, 0.0, 1.0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    q = EncodedQ(np.array([1, 2], dtype=np.uint32), np.array([60000, 5536]), fixed=True)
    for s in range(50):
        assert chain_round(p, [1], [q], np.random.default_rng(s)) == RoundResult(0, 2)


# --- commit: stop tokens and length limits cut the round exactly where target-alone would stop ---

EOS = frozenset({5})


def test_commit_stop_token_inside_accepted_prefix():
    draft = [1, 5, 3]; result = RoundResult(3, 4)  # eos (5) accepted at position 1
    c = commit_round(draft, result, EOS, remaining=100, context_left=100)
    assert (c.tokens, c.num_accepted, c.has_next_token, c.finish_reason) == ([1, 5], 2, False, FinishReason.STOP)


def test_commit_stop_as_corrected_token():
    c = commit_round([1, 2], RoundResult(1, 5), EOS, remaining=100, context_left=100)
    assert (c.tokens, c.has_next_token, c.finish_reason) == ([1, 5], True, FinishReason.STOP)


def test_commit_max_tokens_reached_mid_round():
    c = commit_round([1, 2, 3], RoundResult(3, 4), EOS, remaining=2, context_left=100)
    assert (c.tokens, c.num_accepted, c.has_next_token, c.finish_reason) == ([1, 2], 2, False, FinishReason.LENGTH)


def test_commit_max_tokens_exactly_at_next_token():
    c = commit_round([1, 2], RoundResult(2, 4), EOS, remaining=3, context_left=100)
    assert (c.tokens, c.finish_reason) == ([1, 2, 4], FinishReason.LENGTH)


def test_commit_context_full():
    c = commit_round([1, 2, 3], RoundResult(3, 4), EOS, remaining=100, context_left=2)
    assert (c.tokens, c.finish_reason) == ([1, 2], FinishReason.CONTEXT)


def test_commit_nothing_special():
    c = commit_round([1, 2, 3], RoundResult(1, 4), EOS, remaining=100, context_left=100)
    assert (c.tokens, c.num_accepted, c.has_next_token, c.finish_reason) == ([1, 4], 1, True, FinishReason.NOT_FINISHED)


def test_reusable_prefix_keeps_the_common_prefix_but_recomputes_the_rows_asked_for():
    from spec_core.kvreuse import reusable_prefix
    held = [1, 2, 3, 4, 5]
    assert reusable_prefix(held, [1, 2, 3, 4, 5, 6, 7], rows=3) == 4   # row after 4 must be computed: 5 redone
    assert reusable_prefix(held, [1, 2, 9, 4], rows=1) == 2             # diverges at position 2
    assert reusable_prefix(held, [1, 2, 3], rows=3) == 0                # every row asked for
    assert reusable_prefix([], [7], rows=1) == 0
    with pytest.raises(ValueError):
        reusable_prefix(held, [1, 2], rows=3)
