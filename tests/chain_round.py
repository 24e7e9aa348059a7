"""A chain round through the one driver: spec_core.tree.verify_tree on DraftTree.chain (a chain is
the tree with one path), answered as (accepted, next token) for the tests written with chains."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from spec_core.qcodec import EncodedQ
from spec_core.tree import DraftTree, verify_tree
from spec_core.verify import RoundResult


def chain_round(target_probs: np.ndarray, draft_tokens: Sequence[int], draft_probs: Sequence[EncodedQ | None] | None,
                rng: np.random.Generator) -> RoundResult:
    """target_probs  # [gamma + 1, vocab]; draft_tokens  # [gamma]; draft_probs  # [gamma] or None"""
    result = verify_tree(target_probs, DraftTree.chain(draft_tokens), draft_probs, rng)
    return RoundResult(len(result.path), result.next_token)
