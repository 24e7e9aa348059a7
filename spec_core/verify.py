"""One speculative round: which drafts the target keeps, and the one token it adds.

Glossary (used everywhere in this project):
  target_probs  p, the target's processed distribution (spec_core.warping) at each position.
  draft_probs   q, the distribution each draft token was sampled from (spec_core.qcodec);
                None at a position means a point mass on the draft token (no q was sent).
  accepted      leading draft tokens kept: token x at position i survives with min(1, p_i(x)/q_i(x)).
  corrected     at the first rejection i, a token drawn from norm(max(0, p_i - q_i)).
  bonus         after all gamma drafts are accepted, a token drawn from p_gamma.

Why it is exact (Leviathan et al. 2023, Chen et al. 2023): P(out = y) = q(y) min(1, p(y)/q(y))
+ (1 - sum_x min(p(x), q(x))) * max(0, p(y) - q(y)) / sum_x max(0, p(x) - q(x)) = p(y).
A point mass q = 1[x] gives accept with p(x), else draw from p with x removed (vLLM's n-gram rule).
Greedy p is one-hot, so the same code accepts iff x is the argmax and corrects to the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from spec_core.proto import verifier_pb2 as pb
from spec_core.qcodec import EncodedQ
from spec_core.warping import SamplingSettings, processed_probs, sample

# Residual mass below this is rounding noise (p and q agree); draw from p instead.
_RESIDUAL_EPS = 1e-12


@dataclass(frozen=True)
class RoundResult:
    num_accepted: int  # 0..gamma
    next_token: int    # corrected (num_accepted < gamma) or bonus (num_accepted == gamma)


def verify_round(target_probs: np.ndarray, draft_tokens: Sequence[int],
                 draft_probs: Sequence[EncodedQ | None] | None, rng: np.random.Generator) -> RoundResult:
    """target_probs  # [gamma + 1, vocab] float64; draft_tokens  # [gamma]; draft_probs  # [gamma] or None"""
    assert target_probs.shape[0] == len(draft_tokens) + 1, (target_probs.shape, len(draft_tokens))
    return _verify(target_probs.__getitem__, draft_tokens, draft_probs, rng)


def verify_round_on_logits(target_logits: np.ndarray, settings: SamplingSettings, draft_tokens: Sequence[int],
                           draft_probs: Sequence[EncodedQ | None] | None, rng: np.random.Generator) -> RoundResult:
    """verify_round(processed_probs(target_logits, ...), ...), warping only the rows the round
    reaches: the rows after the first rejection are never looked at. Each row's p is the same
    whether it is warped alone or with the others, and the draws happen in the same order, so the
    result (and the generator's state) is the same.  # target_logits: [gamma + 1, vocab]"""
    assert target_logits.shape[0] == len(draft_tokens) + 1, (target_logits.shape, len(draft_tokens))

    def row(i: int) -> np.ndarray:  # [vocab]
        return processed_probs(target_logits[i], settings.temperature, settings.top_k, settings.top_p)

    return _verify(row, draft_tokens, draft_probs, rng)


def _verify(target_row: Callable[[int], np.ndarray], draft_tokens: Sequence[int],
            draft_probs: Sequence[EncodedQ | None] | None, rng: np.random.Generator) -> RoundResult:
    """The round, given p one row at a time  # target_row(i): [vocab] float64"""
    gamma = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        q_i = None if draft_probs is None else draft_probs[i]
        p_i = target_row(i)
        p_x = float(p_i[x])
        q_x = 1.0 if q_i is None else q_i.prob_of(x)
        ratio = p_x / q_x
        # Draw u only when the outcome is uncertain (0 < ratio < 1).
        if ratio >= 1.0 or (ratio > 0.0 and rng.random() < ratio):
            continue
        if q_i is None:
            residual = p_i.copy()
            residual[x] = 0.0
        else:
            residual = _residual(p_i, q_i)
        if residual.sum() <= _RESIDUAL_EPS:
            residual = p_i
        return RoundResult(i, sample(residual, rng))
    return RoundResult(gamma, sample(target_row(gamma), rng))


def _residual(target_probs: np.ndarray, draft_probs: EncodedQ) -> np.ndarray:
    """max(0, p - q)  # [vocab]"""
    ids = draft_probs.token_ids
    if draft_probs.fixed and ids is not None and len(np.unique(ids)) == len(ids):
        # Integer weights sum exactly in any order, so these are q.dense()'s values on the support;
        # off it p - 0 = p. The same numbers without two passes over the vocabulary.
        ids = ids.astype(np.intp)
        residual = target_probs.copy()
        q_support = draft_probs.weights.astype(np.float64) / float(np.sum(draft_probs.weights))
        residual[ids] = np.maximum(target_probs[ids] - q_support, 0.0)
        return residual
    return np.maximum(target_probs - draft_probs.dense(len(target_probs)), 0.0)


@dataclass(frozen=True)
class Commit:
    tokens: list[int]       # appended to the committed sequence this round, in order
    num_accepted: int       # how many of them are draft tokens
    has_next_token: bool    # whether the corrected/bonus token is among them
    finish_reason: int      # pb.FinishReason


def commit_round(draft_tokens: Sequence[int], result: RoundResult, stop_ids: frozenset[int],
                 remaining: int, context_left: int) -> Commit:
    """Cut the round's tokens at the first stop token, at max_new_tokens, or at the context end.

    Target-alone sampling would stop at exactly the same token, so the cut keeps exactness.
    remaining: tokens still allowed by max_new_tokens (>= 1); context_left: free context slots (>= 1).
    """
    tokens = list(draft_tokens[: result.num_accepted]) + [result.next_token]
    for i, tok in enumerate(tokens):
        reason = pb.NOT_FINISHED
        if tok in stop_ids:
            reason = pb.STOP
        elif i + 1 >= remaining:
            reason = pb.LENGTH
        elif i + 1 >= context_left:
            reason = pb.CONTEXT
        if reason != pb.NOT_FINISHED:
            kept = tokens[: i + 1]
            return Commit(kept, min(len(kept), result.num_accepted), len(kept) > result.num_accepted, reason)
    return Commit(tokens, result.num_accepted, True, pb.NOT_FINISHED)
