"""The straightforward sampling maths as it was before the fast paths (spec_core at dd70c89).

Kept here, outside spec_core, as the reference the fast code is checked against
(tests/test_warping_fast.py) and timed against (bench/round_cost.py). Do not optimise it: its
value is that it is obviously what the docstrings say.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from spec_core.acceptance import RESIDUAL_EPS
from spec_core.qcodec import DEFAULT_SCALE_BITS, DEFAULT_TOP_K, EncodedQ
from spec_core.verify import RoundResult


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
    idx = min(idx, len(cdf) - 1)
    while probs[idx] <= 0.0:
        idx -= 1
    return idx


def encode_fixed(probs: np.ndarray, top_k: int = DEFAULT_TOP_K, scale_bits: int = DEFAULT_SCALE_BITS) -> EncodedQ:
    probs = np.asarray(probs, dtype=np.float64)  # [vocab]
    if 0 < top_k < len(probs):
        ids = np.argpartition(-probs, top_k - 1)[:top_k]
        ids = ids[np.argsort(-probs[ids], kind="stable")]
    else:
        ids = np.flatnonzero(probs > 0)
    kept = probs[ids] / probs[ids].sum()
    scale = 1 << scale_bits
    raw = kept * scale
    weights = np.floor(raw).astype(np.int64)
    short = scale - int(weights.sum())
    if short > 0:
        weights[np.argsort(-(raw - weights), kind="stable")[:short]] += 1
    nz = weights > 0
    return EncodedQ(ids[nz].astype(np.uint32), weights[nz], fixed=True)


def dense(q: EncodedQ, vocab: int) -> np.ndarray:
    out = np.zeros(vocab, dtype=np.float64)
    if q.token_ids is None:
        out[: len(q.weights)] = q.weights
    else:
        np.add.at(out, q.token_ids.astype(np.int64), q.weights.astype(np.float64))
    return out / out.sum()


def verify_round(target_probs: np.ndarray, draft_tokens: Sequence[int],
                 draft_probs: Sequence[EncodedQ | None] | None, rng: np.random.Generator) -> RoundResult:
    gamma = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        q_i = None if draft_probs is None else draft_probs[i]
        p_x = float(target_probs[i, x])
        q_x = 1.0 if q_i is None else q_i.prob_of(x)
        ratio = p_x / q_x
        if ratio >= 1.0 or (ratio > 0.0 and rng.random() < ratio):
            continue
        if q_i is None:
            residual = target_probs[i].copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(target_probs[i] - dense(q_i, target_probs.shape[1]), 0.0)
        if residual.sum() <= RESIDUAL_EPS:
            residual = target_probs[i]
        return RoundResult(i, sample(residual, rng))
    return RoundResult(gamma, sample(target_probs[gamma], rng))


def draft_step(draft_logits: np.ndarray, settings, qmode, rng: np.random.Generator):
    from spec_core.qcodec import encode_float
    if qmode.kind == "none" or settings.greedy:
        return int(np.argmax(draft_logits)), None
    probs = processed_probs(draft_logits, settings.temperature, settings.top_k, settings.top_p)
    if qmode.kind == "fixed":
        enc = encode_fixed(probs, qmode.top_k, qmode.scale_bits)
    else:
        enc = encode_float(probs, qmode.top_k)
    return enc.sample(rng), enc
