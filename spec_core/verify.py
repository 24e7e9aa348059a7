"""One speculative round: the glossary and what a round commits (commit_round). The round's one
driver is spec_core.tree's walk, on target rows (verify_tree / verify_tree_on_logits) and on scores
(verify_tree_from_scores, the vLLM backend's rows-off paths): a chain is the tree with one path.

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
The accept test and the residual are spec_core.acceptance's, shared by every driver.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RoundResult:
    num_accepted: int  # 0..gamma
    next_token: int    # corrected (num_accepted < gamma) or bonus (num_accepted == gamma)


class FinishReason(enum.Enum):
    """Why generation ended after a round (the verifier maps it to the wire's enum in one place)."""

    NOT_FINISHED = "not_finished"
    STOP = "stop"          # a stop token (EOS or one the request named) was committed
    LENGTH = "length"      # max_new_tokens reached
    CONTEXT = "context"    # the context window is full


@dataclass(frozen=True)
class Commit:
    tokens: list[int]       # appended to the committed sequence this round, in order
    num_accepted: int       # how many of them are draft tokens
    has_next_token: bool    # whether the corrected/bonus token is among them
    finish_reason: FinishReason


def commit_round(draft_tokens: Sequence[int], result: RoundResult, stop_ids: frozenset[int],
                 remaining: int, context_left: int) -> Commit:
    """Cut the round's tokens at the first stop token, at max_new_tokens, or at the context end.

    Target-alone sampling would stop at exactly the same token, so the cut keeps exactness.
    remaining: tokens still allowed by max_new_tokens (>= 1); context_left: free context slots (>= 1).
    """
    tokens = list(draft_tokens[: result.num_accepted]) + [result.next_token]
    for i, tok in enumerate(tokens):
        reason = FinishReason.NOT_FINISHED
        if tok in stop_ids:
            reason = FinishReason.STOP
        elif i + 1 >= remaining:
            reason = FinishReason.LENGTH
        elif i + 1 >= context_left:
            reason = FinishReason.CONTEXT
        if reason is not FinishReason.NOT_FINISHED:
            kept = tokens[: i + 1]
            return Commit(kept, min(len(kept), result.num_accepted), len(kept) > result.num_accepted, reason)
    return Commit(tokens, result.num_accepted, True, FinishReason.NOT_FINISHED)
