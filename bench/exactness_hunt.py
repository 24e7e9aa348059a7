"""Issue 42's hunt: is the output exactly the target's under the planner, faults and batching?

Each configuration (hybridspec.testing.hunt.HuntConfig) generates with a synthetic bigram pair
through the real EdgeClient -> gRPC -> verifier, with replies lost and sessions evicted on a seeded
schedule, and tests every token transition against the target (pooled chi-square,
hybridspec.testing.exactness.transition_fit). A run's generations are cut into `--blocks`
independent blocks (different generations and seeds: exact or not, independently), each block
tested on its own, so one run gives the p of all its transitions and the distribution of p over
the blocks (a KS test against uniform). Each configuration's negative controls (deliberately
biased variants: see hybridspec.testing.hunt) run the same way and must fail.

Also measured, and cheap:
- calibration: the tests' own false-positive rate on samples drawn directly from the target
  (the positive control), for this bench's test and for the tests of issue 42's three failures
  (the external harness's per-row chi-square without pooling, Bonferroni over rows at 1e-3;
  tests/test_batching.py's sequence test; the option matrix's transition test);
- candidate (b) of the issue, directly: for every eviction, whether the redo of the evicted round
  had another shape than the lost attempt, against whether the lost attempt kept all its drafts
  (a 2 x 2 table, Fisher's exact test: a redo whose shape depends on the lost outcome reuses the
  seeded stream with a draft that depends on it, and biases the output).

Usage (each run appends a line to --jsonl, so a long hunt can be stopped and resumed; `--report`
writes bench/results/exactness-hunt.json from the lines):

    nice -n 10 .venv/bin/python bench/exactness_hunt.py --configs planner-seeded-f3 --runs 1 \
        --transitions 200000 --jsonl /tmp/hunt.jsonl
    .venv/bin/python bench/exactness_hunt.py --calibration --jsonl /tmp/hunt.jsonl
    .venv/bin/python bench/exactness_hunt.py --report --jsonl /tmp/hunt.jsonl
    .venv/bin/python bench/exactness_hunt.py --replay /tmp/hybridspec-replay/replay-....json --jsonl /tmp/r.jsonl

A run whose p is under 1e-3 (or a block's under 1e-4) writes its replay record (hybridspec.testing.
exactness.ReplayRecord: config, seeds, every generation's planned rounds, faults and tokens, the
passes) and names it in its line; --replay runs a seeded record again (hybridspec.testing.hunt.replay
says what it pins) and prints the share of generations whose tokens came out the same.

p-values do not depend on the machine's load: the result file may be recorded on a busy machine.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import chi2, fisher_exact

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridspec.figures import Figure, Table, write_result  # noqa: E402
from hybridspec.testing.exactness import (markov_counts, transition_counts, transition_fit,  # noqa: E402
                                          unpooled_bonferroni_p, uniformity_p)
from hybridspec.testing.hunt import HuntConfig, redo_table, run  # noqa: E402

TREE = "budget=4,depth=2,branching=2,width=2"
F3, F15 = dict(lost=0.03, evicted=0.03), dict(lost=0.15, evicted=0.15)
# The external harness of issue 42: a 12-token bigram target, its own bigram draft, T = 1, fixed q,
# the planner on by default (γ up to 12), seeded, 3 % of replies lost and 3 % lost with the session evicted.
CONFIGS = {c.name: c for c in [
    HuntConfig("planner-seeded-f3", **F3),
    HuntConfig("planner-seeded-f15", **F15),
    HuntConfig("planner-unseeded-f3", seeded=False, **F3),
    HuntConfig("planner-unseeded-f15", seeded=False, **F15),
    HuntConfig("fixed-seeded-f3", plan="off", **F3),
    HuntConfig("fixed-seeded-f15", plan="off", **F15),
    HuntConfig("fixed-unseeded-f3", plan="off", seeded=False, **F3),
    HuntConfig("fixed-unseeded-f15", plan="off", seeded=False, **F15),
    # tests/test_batching.py's failure: V = 5, γ 2, trees of 4 nodes, float q, T = 1, unseeded, batched.
    HuntConfig("batched-tree-fair", vocab=5, plan="off", gamma=2, tree=TREE, qmode="float:0", seeded=False,
               batching=True, schedule="fair", tokens=40, concurrency=32),
    HuntConfig("batched-tree-slack", vocab=5, plan="off", gamma=2, tree=TREE, qmode="float:0", seeded=False,
               batching=True, schedule="slack", tokens=40, concurrency=32),
    # The option matrix's failure: same/chain/proactive/fixed/top-k/batched/synthetic (V 16, γ 3, T 0.8, top-k 5).
    HuntConfig("proactive-batched-topk", vocab=16, plan="off", gamma=3, tree="off", proactive=True,
               max_continuations=1, temperature=0.8, top_k=5, seeded=False, batching=True, tokens=100),
]}


def controls_for(config: HuntConfig, rate: float = 1.0) -> list[HuntConfig]:
    """The deliberately biased variants of `config` that its test must catch (`rate`: the share of
    rejections the resampling verifier gets wrong, and of rounds without a kept draft that the
    outcome-dependent faults hit)."""
    out = [dataclasses.replace(config, name=config.name + "+resample", control="resample", control_rate=rate)]
    if config.evicted:
        kind = "redo-shape" if config.seeded else "outcome-faults"
        out.append(dataclasses.replace(config, name=f"{config.name}+{kind}", control=kind, control_rate=rate))
    return out


def block_ps(record, vocab: int, probs: np.ndarray, blocks: int) -> list[float]:
    gens = [g for g in record.generations if g]
    out = []
    for part in np.array_split(np.arange(len(gens)), blocks):
        seqs = [gens[i]["prompt"][-1:] + gens[i]["ids"] for i in part]
        out.append(transition_fit(transition_counts(seqs, vocab), probs).p)
    return out


def one_run(config: HuntConfig, seed: int, transitions: int, blocks: int) -> dict:
    t0 = time.time()
    result = asyncio.run(run(config, seed, transitions))
    rec = result.record
    ps = block_ps(rec, config.vocab, config.target_probs(), blocks) if blocks > 1 else []
    table = redo_table(rec) if config.evicted else None
    line = {"config": config.name, "control": config.control, "control_rate": config.control_rate,
            **result.summary(), "block_p": ps,
            "block_ks_p": uniformity_p(ps) if ps else None, "redo_table": table,
            "redo_fisher_p": float(fisher_exact(table).pvalue) if table and min(map(sum, table)) else None,
            "plans": result.plans, "started": time.strftime("%H:%M:%S", time.gmtime(t0)),
            "cpu_s": time.process_time()}
    bad = result.fit.p < 1e-3 or (ps and min(ps) < 1e-4)
    if bad and not config.control:
        line["replay_record"] = str(rec.write())
    return line


def invariance(config: HuntConfig, seed: int, transitions: int) -> dict:
    """A seeded configuration with its faults and without: the share of generations (same seeds,
    same prompts) whose tokens are identical. Where it is 1, the faults cannot bias anything (the
    output is the fault-free output), whatever a chi-square says."""
    faulty = asyncio.run(run(config, seed, transitions))
    clean = asyncio.run(run(dataclasses.replace(config, lost=0.0, evicted=0.0), seed, transitions))
    pairs = list(zip(faulty.record.generations, clean.record.generations))
    same = sum(1 for a, b in pairs if a and b and a["ids"] == b["ids"])
    return {"invariance": config.name, "seed": seed, "generations": len(pairs), "identical": same,
            "share": same / max(1, len(pairs)), "evicted": faulty.evicted, "lost": faulty.lost,
            "replays": faulty.replays}


# --- calibration: the tests on samples drawn from the target itself ------------------------------------

def calibration(reps: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    # 1. The external harness (12-token bigram, T = 1): generations of 200 tokens, 24,000 and 36,000 transitions.
    for tseed in (0, 1, 2, 3):
        probs = HuntConfig("x", target_seed=tseed).target_probs()
        for n in (24_000, 36_000):
            counts = markov_counts(probs, rng.integers(2, 12, (reps, n // 200)), 200, rng)
            naive = np.array([unpooled_bonferroni_p(c, probs) for c in counts])
            ours = np.array([transition_fit(c, probs).p for c in counts])
            out[f"harness-v12-s{tseed}-n{n}"] = {
                "reps": reps, "min_p_in_target": float(probs.min()),
                "naive_fpr_1e-3": float(np.mean(naive < 1e-3)), "naive_fpr_1e-4": float(np.mean(naive < 1e-4)),
                "naive_fpr_3.6e-5": float(np.mean(naive < 3.6e-5)),
                "pooled_fpr_1e-3": float(np.mean(ours < 1e-3)), "pooled_fpr_1e-4": float(np.mean(ours < 1e-4)),
                "pooled_ks_p": uniformity_p(ours)}
    # 2. tests/test_batching.py's sequence test: V 5, L 3, N 3000 sequences (a multinomial over the
    # 125). Which cells pool depends only on the expected counts: vectorised over the samples.
    import itertools
    from spec_core.synthetic import synthetic_pair
    from spec_core.warping import processed_probs
    target, _ = synthetic_pair(5, 0, 1.0, 1)
    ps = []
    for seq in itertools.product(range(5), repeat=3):
        ctx, pr = [0], 1.0
        for t in seq:
            pr *= processed_probs(target.logits(ctx), 1.0)[t]
            ctx.append(t)
        ps.append(pr)
    ps = np.array(ps) / sum(ps)
    n, exp = 3000, np.array(ps) * 3000
    seq_reps = reps * 500
    old_hits, new_hits = np.zeros(3), np.zeros(3)
    levels = np.array([1e-3, 1e-4, 2e-5])
    big = exp >= 5
    # the old pooling: one pool however small; the new: a pool under 5 joins the smallest other cell
    new_groups = np.arange(len(exp))
    small_idx = np.flatnonzero(~big)
    j = int(np.flatnonzero(big)[np.argmin(exp[big])])
    for _ in range(seq_reps // 20_000):
        d = rng.multinomial(n, ps, size=20_000).astype(np.float64)
        o_old = np.concatenate([d[:, big], d[:, ~big].sum(1, keepdims=True)], axis=1)
        e_old = np.concatenate([exp[big], [exp[~big].sum()]])
        x_old = ((o_old - e_old) ** 2 / e_old).sum(1)
        old_hits += (chi2.sf(x_old, len(e_old) - 1)[:, None] < levels).sum(0)
        if exp[~big].sum() >= 5:
            o_new, e_new = o_old, e_old
        else:
            o_new = d[:, big].copy()
            e_new = exp[big].copy()
            k = int(np.flatnonzero(np.flatnonzero(big) == j)[0])
            o_new[:, k] += d[:, ~big].sum(1)
            e_new[k] += exp[~big].sum()
        x_new = ((o_new - e_new) ** 2 / e_new).sum(1)
        new_hits += (chi2.sf(x_new, len(e_new) - 1)[:, None] < levels).sum(0)
    done = seq_reps // 20_000 * 20_000
    out["batching-v5-l3-n3000"] = {"reps": done, "pooled_expected": float(exp[~big].sum()),
                                   **{f"old_fpr_{lv:g}": float(h / done) for lv, h in zip(levels, old_hits)},
                                   **{f"new_fpr_{lv:g}": float(h / done) for lv, h in zip(levels, new_hits)}}
    # 3. The option matrix's transition test: one 800-token chain of V 16 at T 0.8, top-k 5.
    probs = CONFIGS["proactive-batched-topk"].target_probs()
    big_reps = reps * 20
    om = [transition_fit(c, probs).p for c in markov_counts(probs, rng.integers(2, 16, (big_reps, 1)), 800, rng)]
    om = np.array(om)
    out["matrix-v16-topk5-n800"] = {"reps": big_reps, "fpr_1e-4": float(np.mean(om < 1e-4)),
                                    "fpr_1e-5": float(np.mean(om < 1e-5)), "ks_p": uniformity_p(om)}
    return out


# --- the result file -------------------------------------------------------------------------------

CAUGHT = 1e-4   # a control is caught when the check aimed at it gives p below this


def control_p(line: dict) -> float:
    """The p of the check a control is aimed at: the chi-square for a verifier's or a fault's bias;
    for "redo-shape" also the redo table (Fisher), which sees the shape change itself where the
    chi-square cannot see its effect (at 3 % evictions a redo-shape bias moves a few tokens in a
    thousand: below any chi-square's power at these sizes)."""
    ps = [line["p"]]
    if line.get("control") == "redo-shape" and line.get("redo_fisher_p") is not None:
        ps.append(line["redo_fisher_p"])
    return min(ps)


def _control_cell(x: dict) -> str:
    kind = x["config"].split("+")[1]
    cell = f"{kind} {x.get('control_rate', 0.5):g} ({x['transitions'] // 1000}k, seed {x['seed']}): χ² {x['p']:.2g}"
    if kind == "redo-shape" and x.get("redo_fisher_p") is not None:
        cell += f", redo table {x['redo_fisher_p']:.2g}"
    return cell


def _caught(controls: list[dict]) -> str:
    return f"{sum(control_p(x) < CAUGHT for x in controls)} of {len(controls)}" if controls else ""


def _different_drafts(line: dict) -> int:
    """Rounds refused as "already verified with different drafts": a retry that is not the same request
    (candidate (a)), or a stale pipelined round whose number a fused continuation took (what the hunt met)."""
    return sum(v for k, v in (line.get("refused") or {}).items() if "different drafts" in k)


def _not_stale(line: dict) -> int:
    """Of those, the ones that were not stale pipelined rounds (runs before the harness told them apart: None)."""
    refused = line.get("refused") or {}
    if any("different drafts" in k for k in refused) and not any("stale" in k for k in refused):
        return None
    return sum(v for k, v in refused.items() if "NOT a stale" in k)


def report(lines: list[dict], note: str, command: str | None = None) -> Path:
    """bench/results/exactness-hunt.json from the hunt's lines: per configuration its runs' p, the
    blocks' KS p, its controls' p, the redo table; fault invariance; the calibration; every run."""
    runs = [x for x in lines if "config" in x]
    calib = next((x["calibration"] for x in reversed(lines) if "calibration" in x), {})
    rows, figures = [], {}
    for name in [c for c in CONFIGS if any(x["config"] == c for x in runs)]:
        mine = [x for x in runs if x["config"] == name]
        blocks = [p for x in mine for p in x["block_p"]]
        controls = [x for x in runs if x["config"].startswith(name + "+")]
        tables = [x["redo_table"] for x in mine if x.get("redo_table") and sum(map(sum, x["redo_table"]))]
        redo = np.sum(tables, axis=0).tolist() if tables else None
        fisher = float(fisher_exact(redo).pvalue) if redo and min(map(sum, redo)) else None
        rows.append([name, len(mine), sum(x["transitions"] for x in mine), ", ".join(f"{x['p']:.3g}" for x in mine),
                     len(blocks), min(blocks) if blocks else None, uniformity_p(blocks) if blocks else None,
                     "; ".join(_control_cell(x) for x in controls), _caught(controls),
                     str(redo) if redo else None, fisher, sum(x["evicted"] for x in mine), sum(x["lost"] for x in mine),
                     sum(_different_drafts(x) for x in mine),
                     None if any(_not_stale(x) is None for x in mine) else sum(_not_stale(x) for x in mine)])
        if blocks:
            figures[f"{name}-block-ks-p"] = Figure(value=uniformity_p(blocks), setup=name, unit="", fmt="{:.2g}",
                                                   quantity="KS p of the p-values of independent blocks of generations")
    fmt = {"min block p": "{:.2g}", "KS p (blocks)": "{:.2g}", "redo Fisher p": "{:.2g}"}
    tables = {"runs": Table(columns=["configuration", "runs", "transitions", "p per run", "blocks", "min block p",
                                     "KS p (blocks)", "controls: p", "controls caught", "redo table", "redo Fisher p", "evictions",
                                     "lost replies", "refused: different drafts", "of which not stale pipelined rounds"],
                            rows=rows, fmt=fmt)}
    inv = [x for x in lines if "invariance" in x]
    tables["invariance"] = Table(columns=["configuration", "generations", "same tokens with faults as without",
                                          "evictions", "lost replies"],
                                 rows=[[x["invariance"], x["generations"], x["identical"], x["evicted"], x["lost"]]
                                       for x in inv])
    tables["calibration"] = Table(columns=["test on samples from the target", "measure", "value"],
                                  rows=[[k, m, v] for k, d in calib.items() for m, v in d.items()],
                                  fmt={"value": "{:.4g}"})
    tables["every-run"] = Table(columns=["configuration", "seed", "transitions", "p", "bonferroni p", "min block p",
                                         "KS p (blocks)", "retries", "replays", "lost", "evicted", "passes",
                                         "shared passes", "redo Fisher p"],
                                rows=[[x["config"], x["seed"], x["transitions"], x["p"], x["bonferroni_p"],
                                       min(x["block_p"]) if x["block_p"] else None, x.get("block_ks_p"), x["retries"],
                                       x["replays"], x["lost"], x["evicted"], x["passes"], x["shared_passes"],
                                       x.get("redo_fisher_p")] for x in runs])
    tables["block-p"] = Table(columns=["configuration", "seed", "p of each block"],
                              rows=[[x["config"], x["seed"], [round(p, 4) for p in x["block_p"]]] for x in runs
                                    if x["block_p"]])
    return write_result("exactness-hunt", figures=figures, tables=tables, note=note, command=command,
                        load_start=list(os.getloadavg()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--transitions", type=int, default=200_000)
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--controls", action="store_true", help="also each configuration's negative controls")
    ap.add_argument("--control-transitions", type=int, default=20_000,
                    help="each control's size (at rate 1 and 20,000 transitions every control is caught by its check: "
                         "docs/exactness.md)")
    ap.add_argument("--only-controls", action="store_true")
    ap.add_argument("--control-rate", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--calibration", type=int, nargs="?", const=2000, default=0, metavar="REPS")
    ap.add_argument("--replay", type=Path, metavar="RECORD", help="run a seeded run's replay record again")
    ap.add_argument("--invariance", action="store_true", help="seeded configurations: faults on against off")
    ap.add_argument("--jsonl", type=Path, required=True, help="one line per run appended here")
    ap.add_argument("--report", action="store_true", help="write bench/results/exactness-hunt.json from --jsonl")
    ap.add_argument("--note", default="")
    ap.add_argument("--command", default=None, help="--report: the hunt's commands, for the result file")
    a = ap.parse_args(argv)
    logging.disable(logging.WARNING)   # a replay logs a warning each time: thousands here

    def emit(line: dict) -> None:
        with a.jsonl.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps({k: v for k, v in line.items() if k not in ("block_p", "plans", "calibration")}), flush=True)
    if a.report:
        lines = [json.loads(x) for x in a.jsonl.read_text().splitlines() if x.strip()]
        print(f"wrote {report(lines, a.note, a.command)}")
        return 0
    if a.calibration:
        emit({"calibration": calibration(a.calibration)})
        return 0
    def attempt(config: HuntConfig, seed: int, transitions: int, blocks: int) -> None:
        try:
            emit(one_run(config, seed, transitions, blocks))
        except Exception as e:  # noqa: BLE001 - a run that fails is a finding: recorded, the hunt goes on
            emit({"error": f"{type(e).__name__}: {e}", "failed_config": config.name, "seed": seed})
    if a.replay:
        from hybridspec.testing.exactness import ReplayRecord
        from hybridspec.testing.hunt import replay
        again, same = asyncio.run(replay(ReplayRecord.read(a.replay)))
        emit({"replayed": str(a.replay), "identical_share": same, **again.summary()})
        return 0
    if a.invariance:
        for name in a.configs.split(","):
            emit(invariance(CONFIGS[name], a.seed, a.transitions))
        return 0
    for name in a.configs.split(","):
        config = CONFIGS[name]
        if a.controls or a.only_controls:
            for c in controls_for(config, a.control_rate):
                attempt(c, a.seed, a.control_transitions, 1)
        if a.only_controls:
            continue
        for k in range(a.runs):
            attempt(config, a.seed + k, a.transitions, a.blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
