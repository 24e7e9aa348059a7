"""The planner (`auto`) against the held-out best fixed mode, on the virtual clock
(netsim.virtual.heldout): every cell of the synthetic grid (netsim.virtual.sweep.default_grid) and the
named cost tables on named links, each on several prompts.

    python bench/planner_grid.py [--workers 2] [--tokens 128] [--table-tokens 256] [--prompts 4]
    python bench/planner_grid.py --fixed-from bench/results/planner-grid.json   # rerun auto only

Writes bench/results/planner-grid.json (`"clock": "virtual"`): the goal's figures (the least ratio,
the share of cells at ≥ 0.95×, per named table), the named cases' table, the worst cells with the
planner's reasons, and every run under "raw" (what --fixed-from reuses: the fixed modes do not go
through the planner's choices, so a change to them needs a full run). The ratios are the cost model's
and the same on any machine; the run's duration is this machine's.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridspec.figures import Figure, Table, write_result  # noqa: E402
from netsim.virtual.heldout import (BESIDE, FIXED_MODES, LINKS, TABLES, TableCase, grid_case, held_out,  # noqa: E402
                                    labels, meets, table_case)
from netsim.virtual.sweep import Cell, default_grid  # noqa: E402


def key(kind: str, case) -> str:
    return json.dumps([kind, asdict(case)], sort_keys=True)


def run_task(task):
    kind, case, prompts, modes = task
    fn = grid_case if kind == "grid" else table_case
    return fn(case, prompts, modes)


def merge(new: dict, old: dict | None) -> dict:
    """new's runs (auto) over old's (every mode), per prompt."""
    if old is None:
        return new
    out = {"runs": {}, "why": {}}
    for seed in new["runs"]:
        s = str(seed)
        out["runs"][seed] = {**old["runs"][s], **new["runs"][seed]}
        out["why"][seed] = {**old["why"][s], **new["why"][seed]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per reply on the grid")
    ap.add_argument("--table-tokens", type=int, default=256, help="tokens per reply on the named tables")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--cells", type=int, help="only every k-th grid cell, k = 216 // CELLS (a quick check)")
    ap.add_argument("--no-tables", action="store_true")
    ap.add_argument("--fixed-from", type=Path, help="reuse the fixed modes' runs of this result; rerun auto only")
    ap.add_argument("--name", default="planner-grid")
    args = ap.parse_args()
    load_start = list(os.getloadavg())
    cells = default_grid(args.tokens)
    if args.cells:
        cells = cells[:: max(1, len(cells) // args.cells)]
    cases = [("grid", c) for c in cells]
    if not args.no_tables:
        cases += [("table", TableCase(t, link, tokens=args.table_tokens)) for t in TABLES for link in LINKS]
    old = json.loads(args.fixed_from.read_text())["raw"] if args.fixed_from else None
    modes = ("auto",) if old else (*FIXED_MODES, "auto", *BESIDE)
    tasks = [(kind, case, args.prompts, modes) for kind, case in cases]
    t0 = time.perf_counter()
    raw = {}
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for n, ((kind, case), res) in enumerate(zip(cases, pool.map(run_task, tasks)), 1):
            k = key(kind, case)
            raw[k] = merge(res, old.get(k) if old else None)
            print(f"\r{n}/{len(cases)} cases, {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    real_s = time.perf_counter() - t0
    doc = report(cases, raw, args)
    path = write_result(args.name, figures=doc["figures"], tables=doc["tables"], load_start=load_start, clock="virtual",
                        note="virtual clock: the ratios are the cost model's, the same on any machine; the synthetic "
                             f"pair; {real_s / 60:.1f} min on this machine")
    out = json.loads(path.read_text())
    out["raw"] = {k: {"runs": v["runs"], "why": v["why"]} for k, v in raw.items()}
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    for t in doc["tables"].values():
        print(t.render(), end="\n\n")
    for k, f in doc["figures"].items():
        print(f"{k}: {f.render()}  ({f.quantity})")
    print(f"wrote {path} in {real_s / 60:.1f} min")
    return 0


def report(cases, raw, args) -> dict:
    grid, named = [], []
    for kind, case in cases:
        res = raw[key(kind, case)]
        h = held_out(res["runs"])
        first = next(iter(res["why"].values()))
        h["why"] = first.get("auto", {}).get("why", "")
        h["shapes"] = first.get("auto", {}).get("shapes") or {}
        (grid if kind == "grid" else named).append((case, h))
    figures, tables = {}, {}
    cols = ["auto tok/s", "held-out best", "its tok/s", "auto ÷ held-out best", "auto ÷ in-sample best", "cloud-only tok/s"]
    fmt = {"auto tok/s": "{:.2f}", "its tok/s": "{:.2f}", "auto ÷ held-out best": "{:.2f}×",
           "auto ÷ in-sample best": "{:.2f}×", "cloud-only tok/s": "{:.2f}", "α": "{:g}", "slope": "{:.0%}"}

    def row(h):
        chosen = "/".join(sorted(set(h["chosen"])))
        its = sum(h["means"][c] for c in h["chosen"]) / len(h["chosen"])
        return [h["auto"], chosen, its, h["ratio"], h["ratio_in_sample"], h["means"].get("cloud-only")]
    if grid:
        ratios = [h["ratio"] for _, h in grid]
        setup = f"synthetic grid, {len(grid)} cells, {args.tokens} tokens, {args.prompts} prompts (virtual clock)"
        figures["grid-min"] = Figure(min(ratios), "least auto ÷ held-out best fixed mode over the grid's cells", setup,
                                     "×", "{:.2f}×")
        figures["grid-share"] = Figure(sum(r >= 0.95 for r in ratios) / len(ratios),
                                       "share of the grid's cells where auto ≥ 0.95× the held-out best", setup, "",
                                       "{:.0%}")
        figures["grid-median"] = Figure(sorted(ratios)[len(ratios) // 2], "median auto ÷ held-out best", setup, "×",
                                        "{:.2f}×")
        figures["grid-cells"] = Figure(len(grid), "grid cells", setup, "", "{:d}")
        figures["grid-goal"] = Figure("met" if meets(ratios) else "missed",
                                      "≥ 0.95× in ≥ 95 % of cells and never below 0.85×", setup)
        worst = sorted(grid, key=lambda ch: ch[1]["ratio"])[:12]
        tables["worst"] = Table(["RTT ms", "draft ms/row", "pass ms", "slope", "α", *cols, "auto's last plan"],
                                [[c.rtt_ms, c.draft_ms, c.pass_ms, c.slope, c.alpha, *row(h), h["why"]] for c, h in worst],
                                fmt)
    if named:
        tables["named"] = Table(["cost table", "link", *cols], [[c.table, c.link, *row(h)] for c, h in named], fmt)
        for t in TABLES:
            rs = [h["ratio"] for c, h in named if c.table == t]
            if rs:
                figures[f"table-{t}-min"] = Figure(min(rs), f"least auto ÷ held-out best on {', '.join(LINKS)}",
                                                   f"{t}, synthetic pair at α {named[0][0].alpha:g}, "
                                                   f"{args.table_tokens} tokens, {args.prompts} prompts", "×",
                                                   "{:.2f}×")
    return {"figures": figures, "tables": tables, "labels": labels(FIXED_MODES)}


if __name__ == "__main__":
    raise SystemExit(main())
