"""Many edges on one verifier: the batching verifier (the default) against the serial one
(`--batching off`), hybrid and cloud-only, on the synthetic pair (a flat 20 ms per target pass
whatever it holds, as on a GPU below its compute roof; drafting 2 ms per token on each device), in
`netsim load` runs made one after another by this script. Tokens/s and p95 time per output token
(TPOT) per edge count; the ratios compare runs of this one invocation.

Writes bench/results/<name>.json (hybridspec.figures) and prints the table.

  PYTHONPATH=. python bench/many_edges.py                       # lan, 1/16/64 edges, 6 s windows
  PYTHONPATH=. python bench/many_edges.py --profile 3g --duration 10
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VERIFIERS = {"serial": "off", "batched": "on"}
COLUMNS = ["verifier", "mode", "edges", "tok/s", "p95 TPOT ms", "target passes / token"]
FMT = {"tok/s": "{:,.1f}", "p95 TPOT ms": "{:,.0f}", "target passes / token": "{:.3f}"}


def registry(runs: dict[str, list[dict]], profile: str, setup: str):
    """(figures, tables) from each verifier's `netsim load` runs."""
    from hybridspec.figures import Figure, Table
    rows, at = [], {}
    for verifier, rs in runs.items():
        for r in rs:
            rows.append([verifier, r["mode"], r["edges"], r["committed_tokens_per_s"], r["tpot_p95_s"] * 1e3,
                         r["target_forward_passes_per_committed_token"]])
            at[(verifier, r["mode"], r["edges"])] = r
    most = max(r["edges"] for rs in runs.values() for r in rs)
    figures = {}
    for mode in ("hybrid", "cloud-only"):
        b, s = at[("batched", mode, most)], at[("serial", mode, most)]
        where = f"{profile}, {most} edges, {setup}"
        figures[f"{mode}-{most}-batched-over-serial"] = Figure(
            round(b["committed_tokens_per_s"] / s["committed_tokens_per_s"], 2),
            f"tokens/s, batching verifier over serial, {mode}", where, "x", "{:.1f}×")
        for verifier, r in (("batched", b), ("serial", s)):
            figures[f"{mode}-{most}-{verifier}-tok-s"] = Figure(
                round(r["committed_tokens_per_s"], 1), f"tokens/s, {mode}, {verifier} verifier", where, "tok/s",
                "{:,.0f} tok/s")
            figures[f"{mode}-{most}-{verifier}-p95-tpot"] = Figure(
                round(r["tpot_p95_s"] * 1e3, 1), f"p95 time per output token, {mode}, {verifier} verifier", where,
                "ms", "{:,.0f} ms")
    return figures, {f"{profile}": Table(COLUMNS, rows, FMT)}


def main() -> int:
    from hybridspec.figures import publish
    from netsim.load import LoadConfig, run_load, write_all
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="lan")
    ap.add_argument("--edges", default="1,16,64")
    ap.add_argument("--duration", type=float, default=6.0, help="measured seconds per run")
    ap.add_argument("--name", default="many-edges-synthetic", help="bench/results/<name>.json")
    ap.add_argument("--out", default="results/many-edges")
    args = ap.parse_args()
    load_start = list(os.getloadavg())
    runs = {}
    for verifier, batching in VERIFIERS.items():
        cfg = LoadConfig(edges=[int(n) for n in args.edges.split(",")], profiles=[args.profile],
                         modes=["hybrid", "cloud-only"], duration_s=args.duration,
                         out=Path(args.out) / f"{args.profile}-{verifier}", synthetic=True,
                         verifier_args=["--batching", batching], warmup_s=1.0)
        result = asyncio.run(run_load(cfg))
        write_all(result, cfg.out)
        runs[verifier] = result["runs"]
    setup = "synthetic pair (20 ms per target pass, 2 ms per drafted token), γ 4, 64 tokens per request"
    figures, tables = registry(runs, args.profile, setup)
    publish(args.name, figures=figures, tables=tables, load_start=load_start, show=[args.profile],
            note="shared 2-core VM, other benchmarks and test runs on it; the synthetic pair's costs are "
                 "configured sleeps, so its figures move less with the load than a real model's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
