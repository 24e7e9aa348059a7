"""From logits to the processed distribution that sampling (and verification) uses.

The order is vLLM's and llama.cpp's: temperature, then top-k, then top-p, then softmax over what
is left. Temperature 0 means greedy: a point mass on the first argmax. Everything is float64 so
that the draft's q and the verifier's p are computed the same way on both ends.

The plain definition (kept in hybridspec/testing/warping_reference.py) partitions the whole vocabulary for
top-k and sorts it for top-p: 49,152 to 262,144 entries per row, of which a handful matter. The
code here finds the few that can matter and touches the rest only with cheap vectorised passes,
without changing a number:
  - Every exp, sum and division is the plain definition's, on the same values: a row's sum is
    taken over the whole row with zeros where tokens are dropped, so even its rounding is the same
    and p is bit-for-bit the plain p.
  - top-k needs the k-th largest value, which any exact selection gives; we select among the
    entries at or above the k-th largest of 4k block maxima (at least k entries clear it).
  - top-p keeps a token when the mass before it in the stable descending order is < top_p. No entry
    below (1 - top_p) / (4 n) can be kept, and sorting the upper set above that floor reproduces
    the head of the plain order exactly, so its cumulative sums are the plain ones. When that set is
    large (flat rows), a histogram of the values' float32 bits locates the boundary and only the
    boundary bucket is sorted; a token is decided there only when a bound on both sides' rounding
    says the plain code decides the same, and otherwise the whole row is sorted as it does.
"""
from __future__ import annotations

import math
import operator
import secrets
import threading
from dataclasses import dataclass, field, replace

import numpy as np


# How a round's drafts are checked (spec_core.gumbel): "rejection" (accept with min(1, p/q), random
# streams keyed by committed length; the default) or "gumbel" (drafter-invariant: the target's
# Gumbel-max token with noise keyed by seed and position; the text is a function of the seed).
REJECTION, GUMBEL = "rejection", "gumbel"
COUPLINGS = (REJECTION, GUMBEL)


def is_greedy(temperature: float) -> bool:
    """The one rule: temperature 0 means greedy (a point mass on the first argmax)."""
    return temperature <= 0.0


class SamplingError(ValueError):
    """A sampling setting out of range: `field` names the SamplingSettings field, `problem` says
    what is wrong with its value."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


def _integer(name: str, value, low: int, high: int | None = None) -> int:
    try:
        v = operator.index(value)  # any integer type (numpy's too); a float is refused
    except TypeError:
        raise SamplingError(name, f"must be an integer, got {value!r}") from None
    if v < low or (high is not None and v > high):
        raise SamplingError(name, f"must be in [{low}, {high}], got {v}" if high is not None
                            else f"must be >= {low}, got {v}")
    return v


def _real(name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SamplingError(name, f"must be a number, got {value!r}") from None


@dataclass(frozen=True)
class SamplingSettings:
    """How the target samples, and so how the draft drafts. Checked on construction (the one rule
    for a valid setting, both ends use it): SamplingError names the field and what to change."""

    temperature: float = 1.0  # >= 0; 0 = greedy
    top_k: int = 0            # >= 0; 0 = off
    top_p: float = 1.0        # in [0, 1]; 1 (and 0, the wire's "unset") = off, kept as 1.0
    max_new_tokens: int = 128  # >= 1
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None   # None = fresh entropy; else in [0, 2**64 - 1] (the wire's uint64)
    coupling: str = REJECTION  # COUPLINGS: how drafts are checked, and so how the target samples (spec_core.gumbel)

    def __post_init__(self):
        temperature = _real("temperature", self.temperature)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise SamplingError("temperature", f"must be finite and >= 0 (0 = greedy), got {temperature}")
        top_p = _real("top_p", self.top_p)
        if not 0.0 <= top_p <= 1.0:  # NaN fails too
            raise SamplingError("top_p", f"must be in [0, 1] (1 = off), got {top_p}")
        checked = dict(
            temperature=temperature, top_k=_integer("top_k", self.top_k, 0),
            top_p=top_p if 0.0 < top_p < 1.0 else 1.0,  # the one place "off" is spelled
            max_new_tokens=_integer("max_new_tokens", self.max_new_tokens, 1),
            stop_token_ids=tuple(_integer("stop_token_ids", t, 0) for t in self.stop_token_ids),
            ignore_eos=bool(self.ignore_eos),
            seed=None if self.seed is None else _integer("seed", self.seed, 0, 2 ** 64 - 1),
            coupling=self.coupling)
        if self.coupling not in COUPLINGS:
            raise SamplingError("coupling", f"must be one of {', '.join(COUPLINGS)}, got {self.coupling!r}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def gumbel(self) -> bool:
        """Drafter-invariant verification: the text is the target's Gumbel-max sampling at the seed."""
        return self.coupling == GUMBEL

    def with_session_seed(self) -> "SamplingSettings":
        """With the gumbel coupling both ends must read the same noise: a seed drawn now when none
        was given (kept for the session's replays); unchanged otherwise."""
        if not self.gumbel or self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(63))


# Rows shorter than this take the plain path: sorting a few thousand entries is already cheap.
_SHORT_ROW = 2048
# Unit roundoff of float64.
_U = 2.0 ** -53


def processed_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """p for each row of `logits`  # [..., vocab] -> [..., vocab], float64, rows sum to 1."""
    logits = np.asarray(logits)
    if logits.ndim != 2:
        flat = processed_probs(logits.reshape(-1, logits.shape[-1]), temperature, top_k, top_p)
        return flat.reshape(logits.shape)
    if logits.dtype != np.float32:
        logits = logits.astype(np.float64, copy=False)
    rows, vocab = logits.shape
    if is_greedy(temperature):
        out = np.zeros((rows, vocab), dtype=np.float64)
        out[np.arange(rows), np.argmax(logits, axis=-1)] = 1.0  # float32 -> float64 keeps the order
        return out
    truncate_p = 0.0 < top_p < 1.0
    if 0 < top_k < vocab:
        # Only the support is computed; the rest of each row stays zero (as exp(-inf) makes it).
        out = np.zeros((rows, vocab), dtype=np.float64)
        for r in range(rows):
            ids, scaled = _top_k_support(logits[r], temperature, top_k)
            exps = np.exp(scaled - scaled.max())
            total = _row_sum(vocab, ids, exps)
            if truncate_p:
                kept = _top_p_kept(exps / total, top_p)
                ids, exps = ids[kept], exps[kept]
                total = _row_sum(vocab, ids, exps)
            out[r, ids] = exps / total
        return out
    # Every token counts: the plain operations, in place. float32 -> float64 is exact.
    out = logits.astype(np.float64)  # [rows, vocab], a copy
    out /= temperature
    out -= out.max(axis=-1, keepdims=True)
    np.exp(out, out=out)
    totals = out.sum(axis=-1, keepdims=True)
    if not truncate_p:
        out /= totals
        return out
    probs = _scratch(vocab, 1)
    for r in range(rows):
        row = out[r]
        kept = _top_p_kept(np.divide(row, totals[r], out=probs), top_p)
        kept_exps = row[kept]
        row.fill(0.0)
        row[kept] = kept_exps
        row[kept] = kept_exps / row.sum()
    return out


_thread_scratch = threading.local()


def _scratch(n: int, which: int) -> np.ndarray:
    """This thread's scratch row `which` of length n  # [n]. Row 0 is kept all zeros between uses."""
    rows = getattr(_thread_scratch, "rows", None)
    if rows is None or len(rows[0]) != n:
        rows = _thread_scratch.rows = (np.zeros(n), np.empty(n))
    return rows[which]


def _row_sum(n: int, ids: np.ndarray, values: np.ndarray) -> float:
    """The sum of a length-n row holding `values` at `ids` and zeros elsewhere, rounded exactly as
    numpy's pairwise sum of that whole row rounds it (the plain definition's sum)."""
    row = _scratch(n, 0)
    row[ids] = values
    total = row.sum()
    row[ids] = 0.0
    return total


def _top_k_support(logits: np.ndarray, temperature: float, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Ascending ids of the tokens the plain top-k keeps (scaled logit >= the k-th largest; ties
    kept) and their scaled logits  # logits: [n] float32 or float64, 0 < k < n."""
    candidates = top_candidates(logits, k)
    if candidates is not None:
        raw = logits[candidates]
        scaled = raw.astype(np.float64) / temperature
        kth = np.partition(scaled, len(scaled) - k)[len(scaled) - k]
        # Tokens outside the candidates have raw logits below raw.min(); scaling is monotone but
        # may round two float64 neighbours together, so check that none of them can reach kth.
        below = np.nextafter(raw.min(), -np.inf)
        if np.float64(below) / temperature < kth:
            keep = scaled >= kth
            return candidates[keep], scaled[keep]
    scaled = logits.astype(np.float64) / temperature
    kth = np.partition(scaled, len(scaled) - k)[len(scaled) - k]
    ids = np.flatnonzero(scaled >= kth)
    return ids, scaled[ids]


def top_candidates(x: np.ndarray, k: int, nonnegative: bool = False) -> np.ndarray | None:
    """Ascending indices of an upper set of x (every entry >= some value) with at least k entries,
    about 1.2k on unordered data  # x: [n]. None when x is too short for this to pay.

    The value is the k-th largest of 4k block maxima: k blocks have a maximum at or above it. For
    probabilities (`nonnegative`) a zero value would take every zero; then the positive entries
    are the upper set, and there may be fewer than k.
    """
    blocks = 4 * k
    width = len(x) // blocks
    if width < 8:
        return None
    maxima = x[: blocks * width].reshape(blocks, width).max(axis=1)
    if blocks * width < len(x):
        maxima = np.append(maxima, x[blocks * width:].max())
    t = np.partition(maxima, len(maxima) - k)[len(maxima) - k]
    if nonnegative and t <= 0:
        return np.flatnonzero(x > 0)
    return np.flatnonzero(x >= t)


def _top_p_kept(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the entries the plain top-p keeps: mass strictly before them in the stable
    descending order (ties: lower index first) is < top_p  # probs: [n] >= 0, zeros elsewhere."""
    n = len(probs)
    if n > _SHORT_ROW:
        candidates = None
        if top_p < 1.0 - 1e-6:
            # An entry below this floor is not kept: it and the entries after it in the order weigh
            # less than n * floor = (1 - top_p) / 4 together, so the mass before it exceeds top_p
            # by far more than any rounding. On peaked rows a handful of entries clear it.
            candidates = np.flatnonzero(probs >= (1.0 - top_p) / (4 * n))
            if len(candidates) <= _SHORT_ROW:
                kept, mass = _kept_in_upper_set(probs, candidates, top_p)
                # Past the upper set the plain mass before a token is >= its total minus one
                # rounding (ulp(2) = 4.4e-16), so with this margin no later token is kept.
                if mass >= top_p + 1e-14:
                    return kept
                candidates = None
            elif 2 * len(candidates) > n:
                candidates = None  # gathering most of the row would cost more than it saves
        kept = _top_p_kept_by_buckets(probs if candidates is None else probs[candidates], top_p, n)
        if kept is not None:
            return kept if candidates is None else candidates[kept]
    return _kept_in_upper_set(probs, np.arange(n), top_p)[0]


def _kept_in_upper_set(probs: np.ndarray, candidates: np.ndarray, top_p: float) -> tuple[np.ndarray, float]:
    """The plain top-p decision over an upper set (ascending indices of every entry >= some value):
    sorted as the plain definition sorts the whole row, it is that order's head, so the cumulative
    sums, and the decisions, are bit-for-bit the plain ones. Returns (kept, the set's total mass)."""
    values = probs[candidates]
    order = np.argsort(-values, kind="stable")
    sorted_values = values[order]
    cumulative = np.cumsum(sorted_values)
    keep = cumulative - sorted_values < top_p
    return candidates[order[keep]], float(cumulative[-1])


def _top_p_kept_by_buckets(probs: np.ndarray, top_p: float, n: int) -> np.ndarray | None:
    """top-p over an upper set of a row of n entries with a flat head, or None when the boundary
    is too close to call (then the caller sorts the row).

    Rounding to float32 keeps the order, and non-negative float32 values order as their bits, so
    the top bits (exponent and 5 mantissa bits) bucket the entries by value: every bucket is a
    value interval. The bucket masses locate the boundary; buckets above it are kept, buckets
    below it are dropped, and only the boundary buckets are sorted. Our masses and the plain
    cumulative sums each differ from the exact ones by at most n + buckets roundings, hence `tol`:
    a token is decided only when its mass before is farther than tol from top_p.
    """
    keys = probs.astype(np.float32).view(np.int32) >> 18  # larger key = larger value
    top = int(keys.max())
    cumulative = np.cumsum(np.bincount(keys, weights=probs, minlength=top + 1)[::-1])  # [top + 1]: from key top down
    tol = 4.0 * (2 * n + len(cumulative) + 8) * _U
    first = int(np.searchsorted(cumulative, top_p - tol, side="left"))
    last = int(np.searchsorted(cumulative, top_p + tol, side="right"))
    if last >= len(cumulative):
        return None
    head_mass = float(cumulative[first - 1]) if first else 0.0
    band = np.flatnonzero((keys <= top - first) & (keys >= top - last))
    values = probs[band]
    order = np.argsort(-values, kind="stable")
    mass_before = np.cumsum(np.concatenate(([head_mass], values[order])))  # [len(band) + 1]
    keep = mass_before[:-1] < top_p - tol
    certain = head_mass < top_p - tol and mass_before[-1] >= top_p + tol \
        and bool(np.all(keep | (mass_before[:-1] >= top_p + tol)))
    if not certain:
        return None
    return np.concatenate((np.flatnonzero(keys > top - first), band[order[keep]]))


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from `probs`  # [vocab], non-negative, any positive sum."""
    nonzero = np.flatnonzero(probs)
    if 0 < 2 * len(nonzero) < len(probs):
        # Zeros add nothing to a running sum, so these are the whole row's cumulative sums at its
        # nonzero entries, and the first entry whose sum passes u is one of them.
        cdf = np.cumsum(probs[nonzero])
        u = rng.random() * cdf[-1]
        return int(nonzero[min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)])
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
