"""A synthetic model pair with exact, cheap distributions, for statistical tests and fast sweeps.

The target's logits at a position depend on the last `order` tokens through a seeded table, so
whole-sequence probabilities can be computed exactly. A draft is the target's logits plus seeded
noise: `noise` = 0 gives a perfect draft (α = 1), larger noise lowers α.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from spec_core.fingerprint import tokenizer_fingerprint


class SyntheticLM:
    def __init__(self, vocab: int, seed: int, order: int = 1, scale: float = 2.0,
                 base: "SyntheticLM | None" = None, noise: float = 0.0):
        self.vocab, self.seed, self.order, self.scale = vocab, seed, order, scale
        self.base, self.noise = base, noise
        self._cache: dict[tuple[int, ...], np.ndarray] = {}

    def logits(self, context: Sequence[int]) -> np.ndarray:
        """Raw logits for the next token  # [vocab] float64"""
        key = tuple(int(t) for t in context[-self.order:])
        hit = self._cache.get(key)
        if hit is None:
            digest = hashlib.blake2b(repr((self.seed, key)).encode(), digest_size=8).digest()
            rng = np.random.default_rng(int.from_bytes(digest, "little"))
            if self.base is None:
                hit = rng.standard_normal(self.vocab) * self.scale
            else:
                hit = self.base.logits(context) + rng.standard_normal(self.vocab) * self.noise
            self._cache[key] = hit
        return hit


def synthetic_pair(vocab: int = 64, seed: int = 0, noise: float = 1.0, order: int = 1) -> tuple[SyntheticLM, SyntheticLM]:
    """(target, draft) sharing a vocabulary; the draft is the target blurred by `noise`."""
    target = SyntheticLM(vocab, seed, order=order)
    return target, SyntheticLM(vocab, seed + 1, order=order, base=target, noise=noise)


def synthetic_fingerprint(vocab: int) -> str:
    """The synthetic vocabulary is '<tok0>', '<tok1>', ...; BOS 0, EOS 1."""
    return tokenizer_fingerprint((f"<tok{i}>".encode() for i in range(vocab)), 0, 1)
