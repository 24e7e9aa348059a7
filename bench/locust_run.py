"""One `netsim load --locust` run spread over Locust workers, as docs/many-edges.md gives it, recorded.

Runs the page's command (a master and `--workers` local worker processes, a synthetic verifier it
starts, edges on mixed links) in a subprocess exactly as a user types it, reads the `load.json` it
writes, and records per (edges, mode): tokens/s, TPOT and TTFT percentiles, the committed tokens
in Locust's merged statistics against the verifier's own counter, the harness's CPU and what
reporting to Locust costs the edges' loop per round, and whether the harness flagged the run.

Writes bench/results/locust-run.json (hybridspec.figures) and prints the table. Wall clock: run it
on a quiet machine (the result records the load at start and end, and the run's own share).

  PYTHONPATH=. .venv/bin/python bench/locust_run.py                 # the page's command
  PYTHONPATH=. .venv/bin/python bench/locust_run.py --edges 50,100 --workers 2 --profile lan
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COLUMNS = ["edges", "mode", "workers", "links", "tok/s", "TPOT p50 ms", "TPOT p95 ms", "TTFT p50 ms", "TTFT p99 ms",
           "committed (Locust)", "committed (verifier)", "Locust / verifier", "harness CPU (cores)",
           "reporting µs/round", "flagged"]
FMT = {"tok/s": "{:,.1f}", "TPOT p50 ms": "{:,.0f}", "TPOT p95 ms": "{:,.0f}", "TTFT p50 ms": "{:,.0f}",
       "TTFT p99 ms": "{:,.0f}", "committed (Locust)": "{:,}", "committed (verifier)": "{:,}",
       "Locust / verifier": "{:.4f}", "harness CPU (cores)": "{:.2f}", "reporting µs/round": "{:,.0f}"}


def command(args, out: Path) -> list[str]:
    return [str(ROOT / ".venv/bin/netsim"), "load", "--locust", "--workers", str(args.workers), "--synthetic",
            "--edges", args.edges, "--profile", args.profile, "--mode", args.mode, "--duration", str(args.duration),
            "--out", str(out)]


def registry(load: dict):
    """(figures, tables) from a `netsim load --locust` load.json."""
    from hybridspec.figures import Figure, Table
    rows, figures = [], {}
    for r in load["runs"]:
        ratio = r["committed_tokens"] / r["verifier_committed_tokens"] if r.get("verifier_committed_tokens") else None
        rows.append([r["edges"], r["mode"], r.get("workers"), ", ".join(r.get("profiles") or []),
                     r["committed_tokens_per_s"], r["tpot_p50_s"] * 1e3, r["tpot_p95_s"] * 1e3,
                     r["ttft_p50_s"] * 1e3, r["ttft_p99_s"] * 1e3, int(r["committed_tokens"]),
                     int(r.get("verifier_committed_tokens") or 0), ratio, r.get("harness_cpu_cores"),
                     r.get("report_us_per_round"), r.get("not_representative") or "no"])
    worst = max(load["runs"], key=lambda r: abs(r["committed_tokens"] / r["verifier_committed_tokens"] - 1))
    setup = (f"{worst['edges']} edges, {worst['mode']}, {worst.get('workers')} Locust workers, synthetic pair, "
             f"links {', '.join(worst.get('profiles') or [])}")
    figures["committed-over-verifier"] = Figure(
        round(worst["committed_tokens"] / worst["verifier_committed_tokens"], 4),
        "committed tokens in Locust's merged statistics over the verifier's own counter, the run furthest from 1",
        setup, "x", "{:.4f}")
    most = max(load["runs"], key=lambda r: r["edges"])
    figures["report-us-per-round"] = Figure(
        round(most["report_us_per_round"], 1), "reporting to Locust, µs of the edges' loop per round",
        f"{most['edges']} edges over {most.get('workers')} workers", "µs", "{:,.0f} µs")
    return figures, {"runs": Table(COLUMNS, rows, FMT)}


def main() -> int:
    from hybridspec.figures import publish
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--edges", default="100,200")
    ap.add_argument("--profile", default="lan,3g")
    ap.add_argument("--mode", default="hybrid")
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--name", default="locust-run")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="locust-run-") as tmp:
        cmd = command(args, Path(tmp) / "out")
        subprocess.run(cmd, check=True, cwd=ROOT)
        load = json.loads((Path(tmp) / "out" / "load.json").read_text())
    figures, tables = registry(load)
    shown = " ".join(shlex.quote(c) for c in [".venv/bin/netsim", *cmd[1:-1]]) + " OUT"
    note = (args.note + " " if args.note else "") + f"the command: {shown}"
    return 0 if publish(args.name, figures=figures, tables=tables, load_start=load_start, note=note) else 1


if __name__ == "__main__":
    sys.exit(main())
