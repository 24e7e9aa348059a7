"""How much of a KV cache a request can keep: the one rule every target runtime shares
(llama.cpp per-session contexts, the shared batched cache, the synthetic target)."""
from __future__ import annotations

from typing import Sequence


def reusable_prefix(held: Sequence[int], tokens: Sequence[int], rows: int) -> int:
    """Leading positions of `held` (what the cache holds) that a request for `tokens` keeps, when
    the logits of its last `rows` positions must be computed now: the common prefix, cut so that
    those rows are decoded afresh. Everything from the returned index on is rolled back."""
    if not 1 <= rows <= len(tokens):
        raise ValueError(f"rows must be in 1..{len(tokens)}, got {rows}")
    keep = 0
    for a, b in zip(held, tokens):
        if a != b:
            break
        keep += 1
    return min(keep, len(tokens) - rows)
