"""From logits to the processed distribution that sampling (and verification) uses.

The order is vLLM's and llama.cpp's: temperature, then top-k, then top-p, then softmax over what
is left. Temperature 0 means greedy: a point mass on the first argmax. Everything is float64 so
that the draft's q and the verifier's p are computed the same way on both ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # >= 1 or <= 0 = off
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def processed_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """p for each row of `logits`  # [..., vocab] -> [..., vocab], float64, rows sum to 1."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim == 1:
        return processed_probs(logits[None, :], temperature, top_k, top_p)[0]
    vocab = logits.shape[-1]
    if temperature <= 0.0:
        out = np.zeros_like(logits)
        out[np.arange(logits.shape[0]), np.argmax(logits, axis=-1)] = 1.0
        return out
    scaled = logits / temperature
    if 0 < top_k < vocab:
        # Ties at the k-th value are kept, so the kept set does not depend on sort stability.
        kth = -np.partition(-scaled, top_k - 1, axis=-1)[:, top_k - 1:top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = _softmax(scaled)
    if 0.0 < top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        # Keep a token if the mass strictly before it is < top_p: the smallest set reaching top_p.
        mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = _softmax(np.where(keep, scaled, -np.inf))
    return probs


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=-1, keepdims=True)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from `probs`  # [vocab], non-negative, any positive sum."""
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    idx = int(np.searchsorted(cdf, u, side="right"))
    # u < cdf[-1] always, but guard against landing on a trailing zero-probability token.
    idx = min(idx, len(cdf) - 1)
    while probs[idx] <= 0.0:
        idx -= 1
    return idx


# Independent random streams from one user seed. The edge (drafting) and the verifier (accept
# tests, corrected and bonus tokens) must never share a stream: identical uniforms on both ends
# correlate the draft token with its acceptance test and bias the output.
EDGE_STREAM, VERIFIER_STREAM, GENERATE_STREAM = 0, 1, 2


def seeded_rng(seed: int | None, *stream: int) -> np.random.Generator:
    """A generator for one role (and, e.g., one committed length); seed None = fresh entropy."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=tuple(stream)))
