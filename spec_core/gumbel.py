"""Drafter-invariant verification (`--coupling gumbel`): Gumbel-max sampling with noise keyed by the
seed and the absolute position, shared by the draft and the target.

Terms as in spec_core/verify.py (target_probs p, draft_probs q, accepted, corrected, bonus).

The rule. At absolute position i (the index, in the whole sequence prompt included, of the token
being sampled) both ends read the same noise g_i(v) ~ Gumbel(0, 1), independent over tokens v and
positions i, computed from (seed, i, v) alone (`GumbelNoise`). The target's token is
    y_i = argmax_v (log p_i(v) + g_i(v))        over p_i's support (p processed: temperature, top-k, top-p)
and the draft proposes x_i = argmax_v (log q_i(v) + g_i(v)) over q_i's support. The verifier keeps
a draft token iff it equals y_i; at the first one that does not, it commits y_i (the corrected
token) and stops; after every draft was kept it commits y at the next position (the bonus). A tree:
at each node compute y and move to the child carrying y; none does, y is the corrected token (at a
leaf, the bonus). Greedy p is one-hot, so y is the argmax (T = 0 is argmax, as always).

Why the text is the target's own Gumbel-max sampling, token for token. By induction over
positions: if the committed prefix equals the target's own sample up to i - 1, then p_i is the
target's row after that prefix, and whatever the draft proposed at i the verifier commits y_i: a
kept draft token equals y_i by the rule, a corrected token is y_i. So the committed sequence is
(y_1, y_2, ...), which depends on the seed, the prompt and the target only: not on the draft, its
q, the tree's shape, how rounds were cut, a replay (the noise is keyed by position, not by round or
committed length), a retry, a replica move or a batch (as long as the target's rows are the same
numbers). Cloud-only sampling with the same rule (`sample_next` in this mode) gives the same ids.

Why that is exact. Gumbel-max: for independent g(v) ~ Gumbel, P(argmax_v (log p(v) + g(v)) = t) =
p(t) (the exponential race: with E(v) = exp(-g(v)) ~ Exp(1), argmax = argmin E(v)/p(v), and
min_v E(v)/p(v) ~ Exp(sum p) picks t with probability p(t)). The noise of position i is
independent of everything before it (the prefix is a function of the noise at earlier positions
only), so y_i given the prefix is distributed as p_i: the sequence follows the target.

Acceptance. x = y = k requires E(j) > E(k) max(p(j)/p(k), q(j)/q(k)) for every j != k; given
E(k) = e that has probability exp(-e sum_{j != k} m_j), and integrating over e ~ Exp(1):
    P(x = y) = sum_k 1 / sum_j max(p(j)/p(k), q(j)/q(k))     (k over supp p ∩ supp q; `coupling_rate`)
which is at least (1 - TV)/(1 + TV) with TV = total variation distance (Daliri, Musco, Suresh 2024,
"Coupling without communication and drafter-invariant speculative decoding"), and at most
1 - TV (rejection sampling's rate, the best any coupling reaches). The draft token at position i
uses the noise of position i only, which the earlier positions' rule never read, so a chain's
acceptance at a tested position given everything before is that formula at the position's p and q.

What the draft samples from. x uses the q the draft would have shipped (`--q`: top-k fixed-point,
float, or none: the draft's argmax, a point mass that ignores the noise); the verifier never reads
q, so in this mode no q travels. Quantizing or truncating q changes acceptance only. Across
vocabularies (token-level intersection, spec_core.crossvocab) q lives on the intersection's draft
ids; each maps to one target id, and the draft reads the noise of that target id, so x is the
target id argmax(log q_t + g) with q_t = to_target_q(q): the same formula on target ids.

The noise. g_i(v) = -log(-log u) with u = (n + 1/2) / 2^52 and n a 52-bit integer from a keyed
32-bit mixing function (two rounds of Wellons' lowbias32 per 32-bit lane, the lane keys from
BLAKE2b of (seed, i)): integer arithmetic only, so n is the same bits in numpy and in torch (CPU or
GPU) on every machine; u is exact in float64. The two logarithms are the one place where a library
may round differently in the last bit; an argmax can differ only when two scores tie to the last
bit. Only what is needed is computed: the noise at the ids of p's support (top-k / top-p rows are
short), and for a row with a long support the ids that can still win (`gumbel_argmax`).
"""
from __future__ import annotations

import hashlib
import struct

import numpy as np

from spec_core.warping import COUPLINGS, GUMBEL, REJECTION, top_candidates

__all__ = ["COUPLINGS", "GUMBEL", "REJECTION", "GumbelNoise", "PositionNoise", "coupling_rate", "daliri_bound",
           "draft_choices", "draft_noise", "gumbel_argmax", "ranked_by_noise", "rejection_rate", "target_token",
           "total_variation"]

_C1, _C2 = np.uint32(0x7FEB352D), np.uint32(0x846CA68B)
_S16, _S15 = np.uint32(16), np.uint32(15)
_BITS = 52
_SCALE = 2.0 ** -_BITS
# The largest noise there is: u <= 1 - 2^-53, g = -log(-log u) <= 36.7; with a margin.
G_MAX = float(-np.log(-np.log1p(-(2.0 ** -53)))) + 1e-6
# Rows with at most this many candidate tokens are scored whole; longer ones are pruned first.
_SHORT = 256
_HEAD = 64


def position_keys(seed: int, position: int) -> tuple[int, int, int, int]:
    """The four 32-bit lane keys of (seed, position): BLAKE2b, so nearby seeds and positions get
    unrelated keys."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed, position), digest_size=16, person=b"hybridspec-gmbl").digest()
    return struct.unpack("<4I", digest)


def _mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32 (C. Wellons) on uint32 lanes (products wrap mod 2^32), in place  # [n] -> [n]."""
    x ^= x >> _S16
    x *= _C1
    x ^= x >> _S15
    x *= _C2
    x ^= x >> _S16
    return x


def _lane(v: np.ndarray, ka: int, kb: int) -> np.ndarray:
    """One 32-bit lane: two keyed rounds  # v: [n] uint32 -> [n] uint32."""
    return _mix32(_mix32(v ^ np.uint32(ka)) ^ np.uint32(kb))


def _ids32(ids) -> np.ndarray:
    return np.asarray(ids).astype(np.uint32)


def noise_high(seed: int, position: int, ids) -> np.ndarray:
    """The high 32 of the noise's 52 bits  # [n] -> [n] uint32 (a cheap upper bound of u: u < (hi + 1) / 2^32)."""
    k0, k1, _, _ = position_keys(seed, position)
    return _lane(_ids32(ids), k0, k1)


def noise_bits(seed: int, position: int, ids) -> np.ndarray:
    """The 52-bit integers behind the noise at `ids`: hi << 20 | lo >> 12 of two independent lanes
    # [n] int -> [n] uint64 (< 2^52)."""
    k0, k1, k2, k3 = position_keys(seed, position)
    v = _ids32(ids)
    hi = _lane(v, k0, k1).astype(np.uint64)
    lo = _lane(v, k2, k3).astype(np.uint64)
    return (hi << np.uint64(20)) | (lo >> np.uint64(12))


def uniforms(seed: int, position: int, ids) -> np.ndarray:
    """u in (0, 1), exact in float64  # [n] -> [n]."""
    return (noise_bits(seed, position, ids).astype(np.float64) + 0.5) * _SCALE


def uniforms_grid(seed: int, positions, ids) -> np.ndarray:
    """uniforms at every (position, id)  # [P], [n] -> [P, n]: the same numbers as `uniforms` row by
    row, in one vectorised pass (benchmarks and statistical tests over many positions)."""
    keys = np.array([position_keys(seed, int(pos)) for pos in positions], dtype=np.uint32).reshape(-1, 4)
    v = _ids32(ids)[None, :]
    hi = _mix32(_mix32(v ^ keys[:, 0:1]) ^ keys[:, 1:2]).astype(np.uint64)
    lo = _mix32(_mix32(v ^ keys[:, 2:3]) ^ keys[:, 3:4]).astype(np.uint64)
    return (((hi << np.uint64(20)) | (lo >> np.uint64(12))).astype(np.float64) + 0.5) * _SCALE


def gumbel_from_uniforms(u: np.ndarray) -> np.ndarray:
    return -np.log(-np.log(u))


class GumbelNoise:
    """The noise of one seed: g(position, token)."""

    def __init__(self, seed: int):
        if seed is None:
            raise ValueError("the gumbel coupling needs a seed (both ends must read the same noise)")
        self.seed = int(seed)

    def at(self, position: int, ids: np.ndarray) -> np.ndarray:
        """g_position at `ids`  # [n] -> [n] float64."""
        return gumbel_from_uniforms(uniforms(self.seed, position, ids))

    def bound(self, position: int, id_map: np.ndarray | None = None) -> "PositionNoise":
        """ids -> g at `position`; `id_map` translates the caller's ids first (draft ids -> target ids)."""
        return PositionNoise(self.seed, position, id_map)


def gumbel_argmax(probs: np.ndarray, noise: "PositionNoise") -> int:
    """argmax_v (log p(v) + g(v)) over p's support, ties to the lowest id  # probs: [vocab] float64.

    For a long support only the tokens that can still win are scored: the best score s among the
    _HEAD most probable tokens is a lower bound of the maximum, and any other token v has
    p(v) <= p_h (the smallest of the head), so it can reach s only if g(v) >= s - log p_h, i.e.
    u(v) >= exp(-exp(-(s - log p_h))). That is checked on the high 32 bits of u's integer alone
    (u < (hi + 1) / 2^32: one lane of the hash, no logarithm), with the threshold lowered by a
    margin far above the rounding of exp and log, so every token that could win (ties included) is
    scored, with the same elementwise formula as the plain argmax: the result is the plain one.
    Before any hashing, tokens with p(v) < exp(s - G_MAX) are dropped: no noise reaches G_MAX."""
    ids = np.flatnonzero(probs)
    if len(ids) == 1:
        return int(ids[0])
    if len(ids) <= _SHORT:
        scores = np.log(probs[ids]) + noise(ids)
        return int(ids[int(np.argmax(scores))])
    sub = probs[ids]
    head = top_candidates(sub, _HEAD, nonnegative=True)   # an upper set: every other p is below its least
    if head is None or 4 * len(head) > len(sub):
        scores = np.log(sub) + noise(ids)
        return int(ids[int(np.argmax(scores))])
    head_ids = ids[head]
    head_scores = np.log(sub[head]) + noise(head_ids)
    best = float(head_scores.max())
    t = best - float(np.log(sub[head].min()))
    # u >= exp(-exp(-t)); 1e-9 relative below it is far beyond exp/log rounding (~1e-16).
    threshold = np.exp(-np.exp(-t)) * (1.0 - 1e-9) - 1e-12
    rest = np.ones(len(ids), dtype=bool)
    rest[head] = False
    # No noise exceeds G_MAX: a token with log p(v) + G_MAX < best can never win, whatever its noise.
    rest &= sub >= np.exp(best - G_MAX)
    rest_ids = ids[rest]
    # u < (hi + 1) / 2^32, so u >= threshold needs hi >= threshold * 2^32 - 1.
    cand = rest_ids[noise.high(rest_ids) >= np.floor(threshold * 2.0 ** 32) - 1.0]
    all_ids = np.concatenate((head_ids, cand))
    scores = np.concatenate((head_scores, np.log(probs[cand]) + noise(cand)))
    top = scores.max()
    return int(all_ids[scores == top].min())


class PositionNoise:
    """g at one position (optionally through an id map, draft ids -> target ids): callable
    ids -> g, and `high` (the bits gumbel_argmax prunes with)."""

    __slots__ = ("seed", "position", "id_map")

    def __init__(self, seed: int, position: int, id_map: np.ndarray | None = None):
        self.seed, self.position, self.id_map = int(seed), int(position), id_map

    def _ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        return ids if self.id_map is None else self.id_map[ids]

    def uniforms(self, ids) -> np.ndarray:
        return uniforms(self.seed, self.position, self._ids(ids))

    def high(self, ids) -> np.ndarray:
        return noise_high(self.seed, self.position, self._ids(ids))

    def __call__(self, ids) -> np.ndarray:
        return gumbel_from_uniforms(self.uniforms(ids))


def target_token(probs: np.ndarray, seed: int, position: int) -> int:
    """The target's token at `position`: argmax(log p + g_position)  # probs: [vocab], processed."""
    return gumbel_argmax(probs, PositionNoise(seed, position))


def ranked_by_noise(ids: np.ndarray, weights: np.ndarray, noise: "PositionNoise") -> np.ndarray:
    """ids of a draft distribution's support ordered by log w + g, best first (ties: lower id
    first)  # ids, weights: [n] (weights > 0, any positive scale). The first is the draft's token x
    (argmax(log q + g)); the first k are k draws from q without replacement (Gumbel-top-k), the
    children of a tree node."""
    ids = np.asarray(ids, dtype=np.int64)
    scores = np.log(np.asarray(weights, dtype=np.float64)) + noise(ids)
    order = np.lexsort((ids, -scores))
    return ids[order]


def draft_choices(q, noise: "PositionNoise", k: int = 1) -> list[int]:
    """The draft's tokens under the coupling: the first k of q's support ranked by log w + g, w the
    weights as shipped (q = w / sum w; the normaliser does not change the order)  # q: EncodedQ.
    k = 1 is the draft token x = argmax(log q + g); k > 1, a tree node's children."""
    if q.token_ids is None:   # dense: weights by id
        if k == 1:
            return [gumbel_argmax(np.asarray(q.weights, dtype=np.float64), noise)]
        ids = np.flatnonzero(q.weights)
        w = q.weights[ids]
    else:
        keep = np.asarray(q.weights) > 0
        ids, w = np.asarray(q.token_ids)[keep], np.asarray(q.weights)[keep]
    return [int(t) for t in ranked_by_noise(ids, w, noise)[:k]]


def draft_noise(settings, position: int, id_map: np.ndarray | None = None) -> "PositionNoise | None":
    """The noise a draft step at absolute `position` samples with (None: rejection sampling, the
    step draws from its generator). `id_map`: the drafter's ids -> the target's (across vocabularies
    the noise lives on target ids)."""
    if not settings.gumbel:
        return None
    if settings.seed is None:
        raise ValueError("the gumbel coupling needs a seed on the edge too (SamplingSettings.with_session_seed)")
    return PositionNoise(settings.seed, position, id_map)


# --- what a coupling accepts -----------------------------------------------------------------------

def coupling_rate(target_probs: np.ndarray, draft_probs: np.ndarray) -> float:
    """P(argmax(log p + g) = argmax(log q + g)) for Gumbel noise g, exactly:
    sum_k 1 / sum_j max(p_j / p_k, q_j / q_k) over k with p_k q_k > 0  # [vocab] each, each sums to 1.

    With r_j = p_j / q_j (inf where q_j = 0), max(p_j/p_k, q_j/q_k) is p_j/p_k when r_j >= r_k and
    q_j/q_k otherwise, so the inner sum is P(r >= r_k)/p_k + Q(r < r_k)/q_k: one sort, O(V log V)."""
    target = np.asarray(target_probs, dtype=np.float64)
    draft = np.asarray(draft_probs, dtype=np.float64)
    union = np.flatnonzero((target > 0) | (draft > 0))
    t_u, d_u = target[union], draft[union]
    with np.errstate(divide="ignore"):
        ratio = np.where(d_u > 0, t_u / np.where(d_u > 0, d_u, 1.0), np.inf)
    order = np.argsort(ratio, kind="stable")
    ratio, t_u, d_u = ratio[order], t_u[order], d_u[order]
    t_cum = np.concatenate(([0.0], np.cumsum(t_u)))
    d_cum = np.concatenate(([0.0], np.cumsum(d_u)))
    both = (t_u > 0) & (d_u > 0)
    below = np.searchsorted(ratio, ratio[both], side="left")   # how many have r_j < r_k
    inner = (t_cum[-1] - t_cum[below]) / t_u[both] + d_cum[below] / d_u[both]
    return float(np.sum(1.0 / inner))


def total_variation(target_probs: np.ndarray, draft_probs: np.ndarray) -> float:
    """TV(p, q) = sum |p - q| / 2  # [vocab] each."""
    return 0.5 * float(np.abs(np.asarray(target_probs, dtype=np.float64)
                              - np.asarray(draft_probs, dtype=np.float64)).sum())


def rejection_rate(target_probs: np.ndarray, draft_probs: np.ndarray) -> float:
    """Rejection sampling's acceptance at one position: sum_v min(p, q) = 1 - TV."""
    return 1.0 - total_variation(target_probs, draft_probs)


def daliri_bound(target_probs: np.ndarray, draft_probs: np.ndarray) -> float:
    """(1 - TV) / (1 + TV): the Gumbel coupling accepts at least this (Daliri, Musco, Suresh 2024)."""
    tv = total_variation(target_probs, draft_probs)
    return (1.0 - tv) / (1.0 + tv)
