"""The exactness checks' statistics and their replay record, shared by tests/ and bench/.

Statistics. Every exactness check compares counts with the target's exact probabilities by
Pearson's chi-square. Its p-value is only as good as the chi-square approximation, which fails
for sparse cells: with expected counts under about 5 the tail is heavier than the chi-square's,
so small p-values come far more often than they claim (a 12-token bigram checked row by row, with
no pooling and Bonferroni over rows at 1e-3, rejects 0.7-3 % of samples drawn from the target
itself, not 0.1 %: bench/exactness_hunt.py measures it). Here cells with an expected count under
`MIN_EXPECTED` are pooled into one cell, and a pool still under it joins the smallest other cell;
a count where the target gives probability 0 fails outright (p = 0).

- `sequence_p`: whole sequences (a dict of counts) against their exact probabilities.
- `transition_fit`: token transitions of a bigram target, row by row (a row: the previous
  token), the rows' statistics summed into one (its degrees of freedom: each row's cells - 1),
  with each row's own p as well.
- `unpooled_bonferroni_p`: the per-row test without pooling, to measure how far it misses its level.
- `uniformity_p`: a Kolmogorov-Smirnov test of p-values against the uniform distribution; over
  repeated runs it sees a bias too small for any single run.
- `markov_counts`: transitions sampled directly from the target (the calibration's positive
  control: the test's false-positive rate on samples that are exact by construction).

Replay record (`ReplayRecord`). A statistical check keeps what it needs to be run again: its
configuration, its seeds, for each generation the rounds as the planner chose them (the round,
the committed length it started from, the plan: chain or tree and its depth, what it kept) and
the faults injected, and for batched runs the composition of each target pass. A failing check
writes it (`ReplayRecord.write`, into pytest's tmp dir for the suite: the path is in the failure
message) and `check_p` does both. What a replay pins is said where it runs
(hybridspec.testing.hunt.replay).
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
from scipy.stats import chi2, kstest

MIN_EXPECTED = 5.0


def pooled(observed: Sequence[float], expected: Sequence[float],
           min_expected: float = MIN_EXPECTED) -> tuple[np.ndarray, np.ndarray] | None:
    """Cells with an expected count under `min_expected` pooled into one (joined to the smallest
    other cell when the pool is still under it). None: a count where the target gives 0."""
    obs, exp = np.asarray(observed, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if (obs[exp <= 0] > 0).any():
        return None
    big = exp >= min_expected
    o, e = list(obs[big]), list(exp[big])
    small_o, small_e = float(obs[~big].sum()), float(exp[~big].sum())
    if small_e > 0:
        if small_e >= min_expected or not o:
            o.append(small_o)
            e.append(small_e)
        else:
            i = int(np.argmin(e))
            o[i] += small_o
            e[i] += small_e
    return np.array(o), np.array(e)


def _pearson(obs: np.ndarray, exp: np.ndarray) -> float:
    return float(((obs - exp) ** 2 / exp).sum())


def sequence_p(counts: Mapping[tuple, int], probs: Mapping[tuple, float]) -> float:
    """Chi-square p of sequence counts against their exact probabilities (sparse cells pooled)."""
    n = sum(counts.values())
    keys = list(probs)
    if set(counts) - set(keys):
        return 0.0   # a sequence the target cannot produce
    exp = np.array([probs[k] for k in keys])
    cells = pooled([counts.get(k, 0) for k in keys], exp / exp.sum() * n)
    if cells is None:
        return 0.0
    obs, exp = cells
    if len(obs) < 2:
        return 1.0
    return float(chi2.sf(_pearson(obs, exp), len(obs) - 1))


@dataclass(frozen=True)
class TransitionFit:
    """A transition test's result (`transition_fit`)."""

    p: float                 # all rows together: the summed statistic on the summed degrees of freedom
    statistic: float
    dof: int
    transitions: int
    row_p: list[float]       # each row's own p (NaN: a row with fewer than two cells after pooling)
    bonferroni_p: float      # min(row p) x rows tested, capped at 1

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def transition_fit(counts: np.ndarray, probs: np.ndarray) -> TransitionFit:
    """counts  # [V, V]: transitions a -> b seen; probs  # [V, V]: the target's p(b | a).
    Each row's cells under MIN_EXPECTED pooled; rows with no transitions are skipped."""
    counts = np.asarray(counts, dtype=np.float64)
    stat, dof, row_p, impossible = 0.0, 0, [], False
    for a in range(counts.shape[0]):
        n = counts[a].sum()
        if not n:
            continue
        cells = pooled(counts[a], n * probs[a])
        if cells is None:
            impossible = True
            row_p.append(0.0)
            continue
        obs, exp = cells
        if len(obs) < 2:
            row_p.append(float("nan"))
            continue
        s = _pearson(obs, exp)
        stat += s
        dof += len(obs) - 1
        row_p.append(float(chi2.sf(s, len(obs) - 1)))
    tested = [p for p in row_p if p == p]
    bonferroni = min(1.0, min(tested) * len(tested)) if tested else 1.0
    p = 0.0 if impossible else (float(chi2.sf(stat, dof)) if dof else 1.0)
    return TransitionFit(p, stat, dof, int(counts.sum()), row_p, bonferroni)


def unpooled_bonferroni_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """A per-row Pearson chi-square over every cell with a nonzero probability (no pooling), the
    smallest row p times the rows tested: a test that does NOT hold its level on sparse rows, kept
    to measure how far it misses (an external harness used it; bench/exactness_hunt.py)."""
    ps = []
    for c, p in zip(np.asarray(counts, dtype=np.float64), probs):
        n = c.sum()
        if n:
            keep = p > 0
            e = n * p[keep]
            ps.append(float(chi2.sf((((c[keep] - e) ** 2) / e).sum(), keep.sum() - 1)))
    return min(1.0, min(ps) * len(ps)) if ps else 1.0


def transition_counts(sequences: Iterable[Sequence[int]], vocab: int) -> np.ndarray:
    """counts  # [vocab, vocab] of the transitions in `sequences` (each starts with the token it follows)."""
    out = np.zeros((vocab, vocab), dtype=np.int64)
    for seq in sequences:
        s = np.asarray(seq, dtype=np.int64)
        if len(s) > 1:
            np.add.at(out, (s[:-1], s[1:]), 1)
    return out


def uniformity_p(ps: Sequence[float]) -> float:
    """Kolmogorov-Smirnov p of `ps` against Uniform(0, 1): small when the p-values of repeated runs
    lean anywhere (toward 0: a bias too small for one run to show)."""
    return float(kstest(np.asarray(ps, dtype=np.float64), "uniform").pvalue) if len(ps) else float("nan")


def markov_counts(probs: np.ndarray, starts: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    """Transitions of chains drawn directly from the target (the exactness checks' positive
    control): starts  # [samples, chains], the token each chain follows; each draws `length`
    tokens. counts  # [samples, V, V], one transition table per sample."""
    v = probs.shape[0]
    cum = np.cumsum(probs, axis=1)
    cum[:, -1] = 1.0
    starts = np.asarray(starts, dtype=np.int64)
    samples = starts.shape[0]
    x = starts.reshape(-1).copy()
    which = np.repeat(np.arange(samples), starts.shape[1])
    out = np.zeros((samples, v, v), dtype=np.int64)
    for _ in range(length):
        y = np.minimum((rng.random(len(x))[:, None] >= cum[x]).sum(axis=1), v - 1)
        np.add.at(out, (which, x, y), 1)
        x = y
    return out


# --- the replay record -------------------------------------------------------------------------------

def replay_dir() -> Path:
    """Where records go outside pytest: $HYBRIDSPEC_REPLAY_DIR, else <tmp>/hybridspec-replay."""
    return Path(os.environ.get("HYBRIDSPEC_REPLAY_DIR") or Path(tempfile.gettempdir()) / "hybridspec-replay")


@dataclass
class ReplayRecord:
    """What a statistical check needs to be run again (module docstring)."""

    test: str
    config: dict = field(default_factory=dict)
    seeds: dict = field(default_factory=dict)
    generations: list[dict] = field(default_factory=list)   # per generation: seed, prompt, rounds, faults, ids
    rounds: list[list] = field(default_factory=list)   # edge rounds not tied to a generation (RoundLog)
    passes: list[list[list]] = field(default_factory=list)   # per target pass: [sequence (KV slot), tokens] per sequence
    results: dict = field(default_factory=dict)   # the p-values (and what else the check measured)
    directory: Path | None = None   # where `write` puts it (None: replay_dir())

    def write(self, directory: Path | str | None = None) -> Path:
        d = Path(directory or self.directory or replay_dir())
        d.mkdir(parents=True, exist_ok=True)
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.test)[-120:]
        path = d / f"replay-{name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.json"
        doc = {k: v for k, v in dataclasses.asdict(self).items() if k != "directory"}
        path.write_text(json.dumps(doc, default=_jsonable) + "\n")
        return path

    @classmethod
    def read(cls, path: Path | str) -> "ReplayRecord":
        return cls(**json.loads(Path(path).read_text()))


def _jsonable(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)


def check_p(p: float, record: ReplayRecord, *, above: float | None = None, below: float | None = None,
            what: str = "chi-square") -> None:
    """Assert p > `above` (an exactness check) or p < `below` (a negative control); on failure the
    record is written and its path is in the message."""
    record.results.setdefault("p", []).append(p)
    ok = (above is None or p > above) and (below is None or p < below)
    if ok:
        return
    path = record.write()
    bound = f"> {above:g}" if above is not None else f"< {below:g} (a negative control: the test has no power)"
    raise AssertionError(f"{what}: p = {p:.3g}, expected {bound}; replay record: {path}")


# --- the record of the test that runs now (tests/conftest.py opens one per test) ------------------------

_current: ReplayRecord | None = None


def begin(test: str, directory: Path | None = None) -> ReplayRecord:
    global _current
    _current = ReplayRecord(test=test, directory=directory)
    return _current


def end() -> ReplayRecord | None:
    global _current
    record, _current = _current, None
    return record


def current() -> ReplayRecord | None:
    return _current


def note_seed(name: str, value) -> None:
    """Record a seed (or any input a replay needs) of the check that runs now."""
    if _current is not None:
        _current.seeds.setdefault(name, []).append(value)


def note_config(**config) -> None:
    if _current is not None:
        _current.config.update(config)


def noted_p(p: float, name: str = "p") -> float:
    """Record a p-value of the check that runs now; returns it."""
    if _current is not None:
        _current.results.setdefault(name, []).append(p)
    return p


class RoundLog:
    """An EdgeClient's `on_round` that records every committed round's plan in the record of the
    check that runs now: [client, round, base, accepted, tokens, plan (arm, γ[, tree shape])]."""

    def __init__(self, client: int, then=None):
        self.client, self.then = client, then

    def __call__(self, ev) -> None:
        if _current is not None:
            plan = ev.plan
            shape = [] if plan is None or plan.shape is None else list(dataclasses.astuple(plan.shape))
            _current.rounds.append([self.client, ev.round, ev.base, ev.accepted, ev.tokens,
                                    [plan.arm, plan.gamma, *shape] if plan is not None else []])
        if self.then is not None:
            self.then(ev)


class PassLog:
    """Wraps a batcher's packer to record each target pass (cloud_verifier.backends.batcher): per
    sequence in it (a session's KV slot), the tokens it had in the pass, into `passes` and the
    record of the check that runs now."""

    def __init__(self, batcher):
        self.passes: list[list[list[int]]] = []
        self.inner = batcher.packer
        batcher.packer = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, items):
        by_seq: dict = {}
        for it in items:   # spec_core.batchplan.PassItem: a tree node shared by sequences has a tuple
            by_seq[it.seq] = by_seq.get(it.seq, 0) + 1
        composition = [[k if isinstance(k, int) else list(k), v] for k, v in by_seq.items()]
        self.passes.append(composition)
        if _current is not None:
            _current.passes.append(composition)
        return self.inner.decode(items)
