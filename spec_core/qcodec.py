"""The draft distribution q on the wire, and sampling from exactly what is shipped.

Exactness needs q to be bit-for-bit the distribution the draft token was drawn from. So the edge
first encodes q (keep the top-k support, quantize to integer weights), then samples the draft
token from the encoded q, then ships that encoding; the verifier decodes the same numbers.

Encodings (`QPayload.Format` in the .proto):
  NONE     no q: each draft token is a point mass (greedy draft, prompt lookup).
  FIXED    integer weights in units of 2^-scale_bits over a sparse support (top-k) or dense.
  FLOAT32  float32 probabilities, sparse or dense; q = probs / sum(probs) on both ends.

In every encoding the distribution is weights / sum(weights), so a sum slightly under the scale
(rounding) changes nothing: both ends normalise the same integers or floats the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spec_core.warping import top_candidates

DEFAULT_SCALE_BITS = 16
DEFAULT_TOP_K = 16


@dataclass(frozen=True)
class EncodedQ:
    """One position's shipped q. token_ids is None for a dense encoding."""

    token_ids: np.ndarray | None  # [support] uint32, or None = dense over the vocabulary
    weights: np.ndarray           # [support] int64 (FIXED) or float32 (FLOAT32)
    fixed: bool

    def prob_of(self, token: int) -> float:
        if self.token_ids is None:
            w = self.weights[token] if token < len(self.weights) else 0
        else:
            hit = np.flatnonzero(self.token_ids == token)
            w = self.weights[hit[0]] if len(hit) else 0
        return float(w) / float(np.sum(self.weights, dtype=np.float64))

    def dense(self, vocab: int) -> np.ndarray:
        """q as float64 over the vocabulary  # [vocab]"""
        out = np.zeros(vocab, dtype=np.float64)
        if self.token_ids is None:
            out[: len(self.weights)] = self.weights
        else:
            np.add.at(out, self.token_ids.astype(np.int64), self.weights.astype(np.float64))
        return out / out.sum()

    def sample(self, rng: np.random.Generator) -> int:
        """Draw a token from exactly this encoding (integer arithmetic for FIXED)."""
        if self.fixed:
            cdf = np.cumsum(self.weights, dtype=np.int64)
            u = int(rng.integers(0, int(cdf[-1])))
            idx = int(np.searchsorted(cdf, u, side="right"))
        else:
            w = self.weights.astype(np.float64)
            cdf = np.cumsum(w)
            idx = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(w) - 1)
            while w[idx] <= 0.0:
                idx -= 1
        return int(idx if self.token_ids is None else self.token_ids[idx])


def encode_fixed(probs: np.ndarray, top_k: int = DEFAULT_TOP_K, scale_bits: int = DEFAULT_SCALE_BITS) -> EncodedQ:
    """Keep the top_k most likely tokens (0 = all) and quantize to integers summing to 2^scale_bits.

    Largest-remainder rounding; tokens that round to zero drop out of the support, so every
    shipped token has positive weight.
    """
    probs = np.asarray(probs, dtype=np.float64)  # [vocab]
    if 0 < top_k < len(probs):
        ids = _top_ids_fast(probs, top_k)
        if ids is not None:
            kept = np.zeros(top_k)  # the support's zeros sit at the end, as in the argpartition order
            kept[: len(ids)] = probs[ids]
            weights = _quantize(kept / kept.sum(), scale_bits)
            if not weights[len(ids):].any():
                nz = weights[: len(ids)] > 0
                return EncodedQ(ids[nz].astype(np.uint32), weights[: len(ids)][nz], fixed=True)
        # Ties (or a zero-probability token rounded up): the order argpartition leaves decides
        # which tied token comes first, so take exactly that path.
        ids = np.argpartition(-probs, top_k - 1)[:top_k]
        ids = ids[np.argsort(-probs[ids], kind="stable")]
    else:
        ids = np.flatnonzero(probs > 0)
    weights = _quantize(probs[ids] / probs[ids].sum(), scale_bits)
    nz = weights > 0
    return EncodedQ(ids[nz].astype(np.uint32), weights[nz], fixed=True)


def _quantize(kept: np.ndarray, scale_bits: int) -> np.ndarray:
    """Largest-remainder rounding of a distribution to integers summing to 2^scale_bits."""
    scale = 1 << scale_bits
    raw = kept * scale
    weights = np.floor(raw).astype(np.int64)
    short = scale - int(weights.sum())
    if short > 0:
        weights[np.argsort(-(raw - weights), kind="stable")[:short]] += 1
    return weights


def _top_ids_fast(probs: np.ndarray, k: int) -> np.ndarray | None:
    """The positive entries among the k largest, most likely first, in a few vectorised passes
    over the vocabulary; None when ties make the order argpartition leaves matter."""
    candidates = top_candidates(probs, k, nonnegative=True)
    if candidates is None:
        return None
    values = probs[candidates]
    if len(values) > k:
        kth = np.partition(values, len(values) - k)[len(values) - k]
        chosen = values >= kth
        if np.count_nonzero(chosen) > k:
            return None  # a tie at the k-th value: argpartition picks which tied tokens stay
        candidates, values = candidates[chosen], values[chosen]
    if len(np.unique(values)) < len(values):
        return None  # tied tokens inside: their order is argpartition's
    return candidates[np.argsort(-values, kind="stable")]


def encode_float(probs: np.ndarray, top_k: int = 0) -> EncodedQ:
    """float32 q, dense (top_k = 0) or over the top_k support."""
    probs = np.asarray(probs, dtype=np.float64)
    if 0 < top_k < len(probs):
        ids = np.argpartition(-probs, top_k - 1)[:top_k]
        kept = probs[ids]
        return EncodedQ(ids.astype(np.uint32), (kept / kept.sum()).astype(np.float32), fixed=False)
    return EncodedQ(None, probs.astype(np.float32), fixed=False)


class QError(ValueError):
    """A q payload that cannot be a probability distribution; the message says which field."""
