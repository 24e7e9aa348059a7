"""Batched against serial verifier, side by side in one run, on the machine at hand.

`netsim load` measures one verifier setting per invocation, and its tokens/s depend on the machine
(CPU family, cores, how busy it is). What travels between machines is a ratio measured side by
side: this script alternates the two verifiers (batched, serial, batched, serial, ...) with the same
edges, links and requests, so that drifting load hits both alike, and prints the ratio of each
pair and their median, with the machine it ran on.

    .venv/bin/python bench/batched_vs_serial.py                      # bundled target, 16 edges, lan, 3 pairs
    .venv/bin/python bench/batched_vs_serial.py --edges 1,16 --profile 3g --reps 2
    .venv/bin/python bench/batched_vs_serial.py --drafter gguf       # a draft model per edge (the defaults of netsim load)

Results: results/load/batched-vs-serial-<profile>/result.json and result.md (plus every run's own
load.json under runs/).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from hybridspec.machine import describe, summary
from netsim.load import LoadConfig, run_load, write_all

VERIFIERS = {"batched": ["--batching", "on"], "serial": ["--batching", "off"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edges", default="16", help="comma-separated edge counts")
    ap.add_argument("--profile", default="lan")
    ap.add_argument("--modes", default="hybrid,cloud-only")
    ap.add_argument("--reps", type=int, default=3, help="pairs (batched, serial) per edge count")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--drafter", choices=["lookup", "gguf"], default="lookup")
    ap.add_argument("--verifier-arg", action="append", default=[], help="passed to both verifiers")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or f"results/load/batched-vs-serial-{args.profile}")
    edges, modes = [int(e) for e in args.edges.split(",")], args.modes.split(",")
    machine = describe()
    print(f"Machine: {summary(machine)}", flush=True)

    rows = []   # one per (edges, mode, rep): both verifiers' tokens/s and p95 TPOT
    t0 = time.time()
    for rep in range(args.reps):
        for name, flag in (VERIFIERS.items() if rep % 2 == 0 else reversed(VERIFIERS.items())):
            cfg = LoadConfig(edges=edges, profiles=[args.profile], modes=modes, duration_s=args.duration,
                             out=out / "runs" / f"{name}-{rep}", verifier_args=flag + args.verifier_arg,
                             max_tokens=args.max_tokens, drafter=args.drafter, warmup_s=args.warmup)
            result = asyncio.run(run_load(cfg))
            write_all(result, cfg.out)
            for run in result["runs"]:
                rows.append({"rep": rep, "verifier": name, "edges": run["edges"], "mode": run["mode"],
                             "tok_s": run["committed_tokens_per_s"], "tpot_p95_s": run["tpot_p95_s"],
                             "threads": result["verifier_threads"],
                             "not_representative": run["not_representative"]})
                print(f"  rep {rep} {name:7s} {run['edges']:3d} edges {run['mode']:10s} "
                      f"{run['committed_tokens_per_s']:7.1f} tok/s"
                      f"{'  (not representative: ' + run['not_representative'] + ')' if run['not_representative'] else ''}",
                      flush=True)

    table = []
    for n in edges:
        for mode in modes:
            ratios, b_all, s_all = [], [], []
            for rep in range(args.reps):
                b = next(r for r in rows if (r["rep"], r["verifier"], r["edges"], r["mode"]) == (rep, "batched", n, mode))
                s = next(r for r in rows if (r["rep"], r["verifier"], r["edges"], r["mode"]) == (rep, "serial", n, mode))
                b_all.append(b["tok_s"]); s_all.append(s["tok_s"])
                ratios.append(b["tok_s"] / s["tok_s"] if s["tok_s"] else float("nan"))
            flagged = sum(1 for r in rows if r["edges"] == n and r["mode"] == mode and r["not_representative"])
            table.append({"edges": n, "mode": mode, "batched_tok_s": b_all, "serial_tok_s": s_all,
                          "ratios": ratios, "ratio_median": statistics.median(ratios), "runs_flagged": flagged})

    lines = [f"# Batched vs serial verifier, side by side ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Machine: {summary(machine)}.", "",
             f"Bundled target, {args.drafter} drafts, {args.profile} links, {args.duration:g} s windows after "
             f"{args.warmup:g} s, {args.max_tokens} tokens per request; verifier threads "
             f"{rows[0]['threads']} (netsim load's default: half the cores); {args.reps} pairs, alternating order; "
             f"{(time.time() - t0) / 60:.0f} min.", "",
             "| edges | mode | batched tok/s | serial tok/s | ratio per pair | median ratio | runs flagged |",
             "|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['edges']} | {t['mode']} | {' / '.join(f'{v:.1f}' for v in t['batched_tok_s'])} "
                     f"| {' / '.join(f'{v:.1f}' for v in t['serial_tok_s'])} "
                     f"| {' / '.join(f'{v:.2f}' for v in t['ratios'])} | **{t['ratio_median']:.2f}×** "
                     f"| {t['runs_flagged']} |")
    lines += ["", "Runs flagged: the harness (edges and proxies) saturated the cores the verifier left it; "
                  "their figures are the harness's (see each run's load.md)."]
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows,
                                                 "table": table}, indent=1))
    (out / "result.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / 'result.json'}, {out / 'result.md'}")


if __name__ == "__main__":
    main()
