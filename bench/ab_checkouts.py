"""Two checkouts of the project side by side on the wall clock: the same `netsim experiment` run from
checkout A and from checkout B, alternated A B B A per cycle (so a drift in the machine's load falls
on both), each run with its own code (cwd and PYTHONPATH are the checkout's, its .venv's Python when
it has one). Per profile and mode it prints each checkout's median tokens/s over its runs with the
spread (lowest–highest run), B ÷ A, and per run the mode's tokens/s over the anchor mode's of the
same run (a ratio measured side by side, which a busy machine moves less than either figure).
Writes bench/results/<name>.json (hybridspec.figures: command, machine, load) and keeps every run's
results.json under --out.

Quiet machine only (load ≤ 0.5 per core, nothing else running). For example, the planner before and
after a change, on the bundled pair at 3g, chat at T = 0.7, six prompts, 128 tokens:

  PYTHONPATH=. .venv/bin/python bench/ab_checkouts.py --a /work/main --b /work/wt/i46 --cycles 2 \\
      --name plan_ab_bundled_3g -- --profiles 3g --workloads chat --prompts-per-workload 6 \\
      --modes auto,hybrid --gammas 4 --max-tokens 128 --no-crossover
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def python_of(checkout: Path) -> str:
    venv = checkout / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def run_once(checkout: Path, args: list[str], out: Path) -> list[dict]:
    """One `netsim experiment` from `checkout`; its result rows."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [python_of(checkout), "-m", "netsim", "experiment", *args, "--out", str(out)]
    print("[ab] " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())["rows"]


def per_run(rows: list[dict]) -> dict[tuple[str, str], float]:
    """(profile, mode) -> the median tokens/s over the run's prompts."""
    by: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        by.setdefault((r["profile"], r["mode"]), []).append(r["tokens_per_s"])
    return {k: statistics.median(v) for k, v in by.items()}


def main() -> int:
    from hybridspec.figures import Table, write_result
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, type=Path, help="checkout A (e.g. main)")
    ap.add_argument("--b", required=True, type=Path, help="checkout B (e.g. the branch)")
    ap.add_argument("--cycles", type=int, default=2, help="A B B A cycles (runs per checkout: 2 × cycles)")
    ap.add_argument("--anchor", default="hybrid-g4", help="the mode each run's others are divided by")
    ap.add_argument("--name", required=True, help="bench/results/<name>.json")
    ap.add_argument("--out", type=Path, default=Path("results/ab"))
    ap.add_argument("experiment", nargs=argparse.REMAINDER, help="-- then netsim experiment's arguments")
    args = ap.parse_args()
    exp = [a for a in args.experiment if a != "--"]
    load_start = list(os.getloadavg())
    runs: dict[str, list[dict[tuple[str, str], float]]] = {"A": [], "B": []}
    for cycle in range(args.cycles):
        for k, label in enumerate(("A", "B", "B", "A")):
            checkout = args.a if label == "A" else args.b
            out = (args.out / args.name / f"c{cycle}_{k}_{label}").resolve()
            runs[label].append(per_run(run_once(checkout.resolve(), exp, out)))
    keys = sorted({key for rs in runs.values() for r in rs for key in r})
    cols = ["link", "mode", "A median tok/s", "A spread", "B median tok/s", "B spread", "B ÷ A",
            f"A ÷ {args.anchor}", f"B ÷ {args.anchor}"]
    rows = []
    for profile, mode in keys:
        med, spread, ratio = {}, {}, {}
        for label, rs in runs.items():
            vals = [r[(profile, mode)] for r in rs if (profile, mode) in r]
            anchored = [r[(profile, mode)] / r[(profile, args.anchor)] for r in rs
                        if (profile, mode) in r and r.get((profile, args.anchor))]
            med[label] = statistics.median(vals) if vals else None
            spread[label] = f"{min(vals):.2f}–{max(vals):.2f}" if vals else "–"
            ratio[label] = statistics.median(anchored) if anchored else None
        rows.append([profile, mode, med["A"], spread["A"], med["B"], spread["B"],
                     med["B"] / med["A"] if med["A"] and med["B"] else None, ratio["A"], ratio["B"]])
    fmt = {"A median tok/s": "{:.2f}", "B median tok/s": "{:.2f}", "B ÷ A": "{:.2f}×",
           f"A ÷ {args.anchor}": "{:.2f}×", f"B ÷ {args.anchor}": "{:.2f}×"}
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join("–" if v is None else fmt[c].format(v) if c in fmt else str(v)
                                for c, v in zip(cols, r)) + " |")
    path = write_result(args.name, tables={"ab": Table(cols, rows, fmt)}, load_start=load_start,
                        note=f"A = {args.a}, B = {args.b}; {args.cycles} A B B A cycle(s); netsim experiment "
                             + " ".join(exp))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
