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

from spec_core.proto import verifier_pb2 as pb
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


# --- protobuf <-> EncodedQ -------------------------------------------------------------------

def to_proto(positions: list[EncodedQ] | None, scale_bits: int = DEFAULT_SCALE_BITS) -> pb.QPayload:
    if not positions:
        return pb.QPayload(format=pb.QPayload.NONE)
    fixed = positions[0].fixed
    payload = pb.QPayload(format=pb.QPayload.FIXED if fixed else pb.QPayload.FLOAT32,
                          scale_bits=scale_bits if fixed else 0)
    for q in positions:
        d = payload.positions.add()
        if q.token_ids is not None:
            d.token_ids.extend(q.token_ids.tolist())
        (d.weights if fixed else d.probs).extend(q.weights.tolist())
    return payload


class QError(ValueError):
    """A q payload that cannot be a probability distribution; the message says which field."""


def from_proto(payload: pb.QPayload, draft_tokens: list[int], vocab: int) -> list[EncodedQ] | None:
    """Validate and decode; None means point-mass drafts. Raises QError with a readable message."""
    gamma = len(draft_tokens)
    if payload.format == pb.QPayload.NONE:
        if payload.positions:
            raise QError("q.format is NONE but q.positions is not empty")
        return None
    if payload.format not in (pb.QPayload.FIXED, pb.QPayload.FLOAT32):
        raise QError(f"q.format {payload.format} is unknown")
    if len(payload.positions) != gamma:
        raise QError(f"q has {len(payload.positions)} positions but there are {gamma} draft tokens")
    fixed = payload.format == pb.QPayload.FIXED
    if fixed and not 1 <= payload.scale_bits <= 31:
        raise QError(f"q.scale_bits must be in 1..31, got {payload.scale_bits}")
    out = []
    for i, (d, token) in enumerate(zip(payload.positions, draft_tokens)):
        values = d.weights if fixed else d.probs
        other = d.probs if fixed else d.weights
        if len(other):
            raise QError(f"q.positions[{i}] mixes weights and probs; format says {'FIXED' if fixed else 'FLOAT32'}")
        # A sparse support is a few dozen entries: plain Python lists check it faster than numpy.
        if d.token_ids:
            id_list = list(d.token_ids)
            if len(id_list) != len(values):
                raise QError(f"q.positions[{i}] has {len(id_list)} token_ids but {len(values)} values")
            if max(id_list) >= vocab:
                raise QError(f"q.positions[{i}] names token id {max(id_list)}, outside the vocabulary (n_vocab={vocab})")
            if len(set(id_list)) != len(id_list):
                raise QError(f"q.positions[{i}] repeats a token id")
            ids = np.array(id_list, dtype=np.uint32)
            value_list = list(values)
            token_value = value_list[id_list.index(token)] if token in id_list else 0
        else:
            ids = None
            if len(values) != vocab:
                raise QError(f"q.positions[{i}] is dense with {len(values)} values; the vocabulary has {vocab}")
            value_list = values
            token_value = values[token] if token < len(values) else 0
        if fixed:
            w = np.array(value_list, dtype=np.int64) if ids is not None else \
                np.fromiter(values, dtype=np.int64, count=len(values))
            total = int(w.sum())
            if total <= 0 or total > (1 << payload.scale_bits):
                raise QError(f"q.positions[{i}] weights sum to {total}; must be in 1..2^{payload.scale_bits}")
        else:
            w = np.array(value_list, dtype=np.float32) if ids is not None else \
                np.fromiter(values, dtype=np.float32, count=len(values))
            if not np.all(np.isfinite(w)):
                raise QError(f"q.positions[{i}] has a NaN or infinite probability")
            if np.any(w < 0) or np.any(w > 1):
                raise QError(f"q.positions[{i}] has a probability outside [0, 1]")
            total = float(w.sum(dtype=np.float64))
            if total <= 0 or total > 1.0 + 1e-3:
                raise QError(f"q.positions[{i}] probabilities sum to {total:.6g}; must be in (0, 1]")
        # q(token) = weight / total with total > 0, so q(token) = 0 exactly when its weight is 0.
        if not token_value > 0:
            raise QError(f"draft token {token} at position {i} has q = 0, so it cannot have been sampled from q")
        out.append(EncodedQ(ids, w, fixed=fixed))
    return out
