"""The planner (`auto`) against the held-out best fixed mode, on the virtual clock
(netsim.virtual.heldout): every cell of the synthetic grid (netsim.virtual.sweep.default_grid) and the
named cost tables on named links, each on several prompts.

    python bench/planner_grid.py [--workers 2] [--tokens 128] [--table-tokens 256] [--prompts 2]
    python bench/planner_grid.py --auto-cache /tmp/auto-2.jsonl   # after a planner change: rerun auto only

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
import zlib
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridspec.figures import Figure, Table, write_result  # noqa: E402
from netsim.virtual.heldout import (BESIDE, UNSTEERED, FIXED_MODES, LINKS, TABLES, TableCase, grid_case, held_out,  # noqa: E402
                                    labels, table_case)
from netsim.virtual.sweep import Cell, default_grid  # noqa: E402


TABLE_KEYS = {"smollm2": "bundled", "gemma-smollm2": "gemma", "flat-gpu": "flat", "h100-8b-bf16": "h100-small",
              "h100-70b-fp8": "h100-large"}   # figure keys (a key may not spell a number)


def key(kind: str, case) -> str:
    return json.dumps([kind, asdict(case)], sort_keys=True)


def run_task(task):
    kind, case, prompts, modes = task
    fn = grid_case if kind == "grid" else table_case
    return fn(case, prompts, modes)


def load_cache(path: Path) -> dict:
    """{case key: {"runs", "why"}} from a JSON-lines cache (a line per case run)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            d = json.loads(line)
            out[d["key"]] = d["res"]
    return out


def merge(a: dict, b: dict) -> dict:
    """Two runs of one case (different modes on the same prompts), per prompt."""
    def get(d, s):
        return d.get(s, d.get(str(s)))
    seeds = sorted({int(s) for s in a["runs"]})
    return {"runs": {s: {**get(a["runs"], s), **get(b["runs"], s)} for s in seeds},
            "why": {s: {**get(a["why"], s), **get(b["why"], s)} for s in seeds}}


def order(cases: list) -> list:
    """The named tables first, then the grid in a fixed spread-out order (so that a partial run covers it)."""
    return sorted(cases, key=lambda kc: (kc[0] == "grid", zlib.crc32(key(*kc).encode())))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per reply on the grid")
    ap.add_argument("--table-tokens", type=int, default=256, help="tokens per reply on the named tables")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--cells", type=int, help="only every k-th grid cell, k = 216 // CELLS (a quick check)")
    ap.add_argument("--no-tables", action="store_true")
    ap.add_argument("--fixed-cache", type=Path, default=Path("/tmp/planner-grid-fixed.jsonl"),
                    help="the fixed modes' runs, kept between runs (they do not depend on the planner's choices)")
    ap.add_argument("--auto-cache", type=Path, default=Path("/tmp/planner-grid-auto.jsonl"),
                    help="auto's runs; give a new file after changing the planner")
    ap.add_argument("--unsteered-cache", type=Path, default=Path("/tmp/planner-grid-unsteered.jsonl"),
                    help="auto-unsteered's runs (auto without the verifier's draft budget)")
    ap.add_argument("--report-only", action="store_true", help="report the cases both caches hold; run nothing")
    ap.add_argument("--name", default="planner-grid")
    args = ap.parse_args()
    load_start = list(os.getloadavg())
    cells = default_grid(args.tokens)
    if args.cells:
        cells = cells[:: max(1, len(cells) // args.cells)]
    cases = [("grid", c) for c in cells]
    if not args.no_tables:
        cases += [("table", TableCase(t, link, tokens=args.table_tokens)) for t in TABLES for link in LINKS]
    caches = {"fixed": (args.fixed_cache, (*FIXED_MODES, *BESIDE)), "auto": (args.auto_cache, ("auto",)),
              "unsteered": (args.unsteered_cache, (UNSTEERED,))}
    have = {which: load_cache(path) for which, (path, _) in caches.items()}
    tasks = [(which, kind, case) for kind, case in order(cases) for which in caches
             if key(kind, case) not in have[which]]
    t0 = time.perf_counter()
    if tasks and not args.report_only:
        with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(run_task, (kind, case, args.prompts, caches[which][1])): (which, kind, case)
                       for which, kind, case in tasks}
            for n, fut in enumerate(as_completed(futures), 1):
                which, kind, case = futures[fut]
                res = fut.result()
                with caches[which][0].open("a") as f:
                    f.write(json.dumps({"key": key(kind, case), "res": res}) + "\n")
                have[which][key(kind, case)] = json.loads(json.dumps(res))
                print(f"\r{n}/{len(tasks)} runs, {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    real_s = time.perf_counter() - t0
    done = [(kind, case) for kind, case in cases if all(key(kind, case) in have[w] for w in caches)]
    raw = {key(kind, case): merge(merge(have["fixed"][key(kind, case)], have["auto"][key(kind, case)]),
                                  have["unsteered"][key(kind, case)]) for kind, case in done}
    doc = report(done, raw, args)
    command = (f"PYTHONPATH=. .venv/bin/python bench/planner_grid.py --workers {args.workers} --prompts {args.prompts} "
               f"--tokens {args.tokens} --table-tokens {args.table_tokens}" + (" --no-tables" if args.no_tables else "")
               + (f" --cells {args.cells}" if args.cells else ""))   # what the runs in the caches ran
    path = write_result(args.name, figures=doc["figures"], tables=doc["tables"], load_start=load_start, clock="virtual",
                        command=command,
                        note="virtual clock: the ratios are the cost model's, the same on any machine; the synthetic "
                             f"pair; {len(done)} of {len(cases)} cases")
    out = json.loads(path.read_text())
    out["raw"] = {k: {"runs": v["runs"], "why": {s: {m: w.get("why", "") for m, w in ws.items() if m.startswith("auto")}
                                                 for s, ws in v["why"].items()}} for k, v in raw.items()}
    path.write_text(compact(out))
    for t in doc["tables"].values():
        print(t.render(), end="\n\n")
    for k, f in doc["figures"].items():
        print(f"{k}: {f.render()}  ({f.quantity})")
    print(f"{len(done)} of {len(cases)} cases; wrote {path} in {real_s / 60:.1f} min")
    return 0


def compact(doc: dict) -> str:
    """The result as JSON with a line per top-level entry, per figure, per table row and per case."""
    def block(items, fmt) -> str:
        return "{\n" + ",\n".join(fmt(k, v) for k, v in items) + "\n }"

    def table(t: dict) -> str:
        rows = ",\n   ".join(json.dumps(r, ensure_ascii=False) for r in t["rows"])
        return (f'{{"columns": {json.dumps(t["columns"], ensure_ascii=False)}, '
                f'"fmt": {json.dumps(t.get("fmt", {}), ensure_ascii=False)},\n  "rows": [\n   {rows}]}}')
    parts = []
    for k, v in doc.items():
        if k == "figures":
            v = block(v.items(), lambda a, b: f" {json.dumps(a)}: {json.dumps(b, ensure_ascii=False)}")
        elif k == "tables":
            v = block(v.items(), lambda a, b: f" {json.dumps(a)}: {table(b)}")
        elif k == "raw":
            v = block(v.items(), lambda a, b: f" {json.dumps(a)}: {json.dumps(b, ensure_ascii=False)}")
        else:
            v = json.dumps(v, ensure_ascii=False)
        parts.append(f"{json.dumps(k)}: {v}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


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
    cols = ["auto tok/s", "held-out best", "its tok/s", "auto ÷ held-out best", "auto ÷ in-sample best",
            "unsteered auto ÷ held-out best", "cloud-only tok/s"]
    fmt = {"auto tok/s": "{:.2f}", "its tok/s": "{:.2f}", "auto ÷ held-out best": "{:.2f}×",
           "auto ÷ in-sample best": "{:.2f}×", "unsteered auto ÷ held-out best": "{:.2f}×", "cloud-only tok/s": "{:.2f}", "α": "{:g}", "slope": "{:.0%}"}

    def row(h):
        chosen = "/".join(sorted(set(h["chosen"])))
        its = sum(h["means"][c] for c in h["chosen"]) / len(h["chosen"])
        return [h["auto"], chosen, its, h["ratio"], h["ratio_in_sample"], h["ratio_unsteered"],
                h["means"].get("cloud-only")]
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
        free = [h["ratio_unsteered"] for _, h in grid if h["ratio_unsteered"] is not None]
        if free:
            figures["grid-unsteered-min"] = Figure(min(free), "least auto-unsteered ÷ held-out best (the verifier's "
                                                   "draft budget ignored)", setup, "×", "{:.2f}×")
            figures["grid-unsteered-share"] = Figure(sum(r >= 0.95 for r in free) / len(free),
                                                     "share of cells where auto-unsteered ≥ 0.95× the held-out best",
                                                     setup, "", "{:.0%}")
        worst = sorted(grid, key=lambda ch: ch[1]["ratio"])[:12]
        tables["worst"] = Table(["RTT ms", "draft ms/row", "pass ms", "slope", "α", *cols, "auto's last plan"],
                                [[c.rtt_ms, c.draft_ms, c.pass_ms, c.slope, c.alpha, *row(h), h["why"]] for c, h in worst],
                                fmt)
    if named:
        tables["named"] = Table(["cost table", "link", *cols], [[c.table, c.link, *row(h)] for c, h in named], fmt)
        summary = []
        for t in TABLES:
            rs = [h["ratio"] for c, h in named if c.table == t]
            if rs:
                summary.append([t, len(rs), min(rs), sum(rs) / len(rs), "met" if min(rs) >= 0.95 else "missed"])
        tables["named-summary"] = Table(["cost table", "links", "least auto ÷ held-out best", "mean", "≥ 0.95× on each"],
                                        summary, {"least auto ÷ held-out best": "{:.2f}×", "mean": "{:.2f}×"})
        for t in TABLES:
            rs = [h["ratio"] for c, h in named if c.table == t]
            if rs:
                figures[f"table-{TABLE_KEYS[t]}-min"] = Figure(min(rs), f"least auto ÷ held-out best on {', '.join(LINKS)}",
                                                   f"{t}, synthetic pair at α {named[0][0].alpha:g}, "
                                                   f"{args.table_tokens} tokens, {args.prompts} prompts", "×",
                                                   "{:.2f}×")
    return {"figures": figures, "tables": tables, "labels": labels(FIXED_MODES)}


if __name__ == "__main__":
    raise SystemExit(main())
