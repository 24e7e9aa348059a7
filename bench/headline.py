"""The README's opening figures: cloud-only, per-token and the hybrid at a fixed γ side by side in one
`netsim experiment` run of the bundled pair (SmolLM2-135M-Instruct Q4_1 target, its Q4_0 draft), per
link profile; then the crossover map (the synthetic pair over a grid of link RTT × the cloud's time per
target pass: hybrid with adaptive γ over cloud-only tokens/s). Counts (target passes, target tokens computed
and round trips per committed token, tokens per round, α) do not
depend on the machine; tokens/s and their ratios are measured side by side in the same run.

Writes bench/results/<name>.json (hybridspec.figures) and prints the table.

  PYTHONPATH=. python bench/headline.py            # lan, lte, 3g and geo-sat; code/chat/creative × 32 tokens
  PYTHONPATH=. python bench/headline.py --profiles 3g --max-tokens 48 --no-crossover
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("cloud-only", "per-token", "hybrid")
COLUMNS = ["profile", "mode", "tok/s", "÷ cloud-only", "÷ per-token", "round trips / token",
           "target passes / token", "target tokens computed / token", "tokens / round", "α", "B up / token"]
FMT = {"tok/s": "{:.1f}", "÷ cloud-only": "{:.2f}×", "÷ per-token": "{:.2f}×", "round trips / token": "{:.2f}",
       "target passes / token": "{:.2f}", "target tokens computed / token": "{:.2f}", "tokens / round": "{:.2f}", "α": "{:.2f}", "B up / token": "{:.0f}"}


def _key(mode: str) -> str:
    """'hybrid-g4' → 'hybrid', the other modes as they are (one γ per run)."""
    return "hybrid" if mode.startswith("hybrid") else mode


def headline(summary: list[dict], profiles: list[str], gamma: int, setup: str):
    """(figures, tables) of the registry from `netsim.experiment.summarise` rows."""
    from hybridspec.figures import Figure, Table
    by = {(s["profile"], _key(s["mode"])): s for s in summary}
    rows, figures = [], {}
    hybrid = f"hybrid γ {gamma}"
    for profile in profiles:
        cloud, per_token = by[(profile, "cloud-only")], by[(profile, "per-token")]
        for mode in MODES:
            s = by[(profile, mode)]
            rows.append([profile, hybrid if mode == "hybrid" else mode, s["tokens_per_s"],
                         s["tokens_per_s"] / cloud["tokens_per_s"], s["tokens_per_s"] / per_token["tokens_per_s"],
                         s["round_trips_per_token"], s["forward_passes_per_token"], s["target_tokens_per_token"],
                         s["tokens_per_round"],
                         s["alpha"], s["bytes_up_per_token"]])
            figures[f"{profile}-{mode}-tok-s"] = Figure(round(s["tokens_per_s"], 2), f"tokens/s, {mode}",
                                                        f"{profile}, {setup}", "tok/s", "{:.1f} tok/s")
        h = by[(profile, "hybrid")]
        figures[f"{profile}-hybrid-over-per-token"] = Figure(
            round(h["tokens_per_s"] / per_token["tokens_per_s"], 3), f"tokens/s, {hybrid} over per-token",
            f"{profile}, {setup}", "x", "{:.2f}×")
        figures[f"{profile}-hybrid-over-cloud-only"] = Figure(
            round(h["tokens_per_s"] / cloud["tokens_per_s"], 3), f"tokens/s, {hybrid} over cloud-only",
            f"{profile}, {setup}", "x", "{:.2f}×")
    # Counts: the same on every link (the run's seeds fix the text); stated once, from all profiles.
    for mode in MODES:
        ss = [by[(p, mode)] for p in profiles]
        name = hybrid if mode == "hybrid" else mode
        figures[f"{mode}-passes-per-token"] = Figure(
            round(sum(s["forward_passes_per_token"] for s in ss) / len(ss), 3),
            f"target passes per committed token, {name}", setup, "", "{:.2f}")
        # What a pass costs depends on the hardware: a GPU pass costs about the same for 1 or γ + 1 tokens
        # (passes are the cost), a CPU pass in proportion to its tokens (computed tokens are).
        figures[f"{mode}-target-tokens-per-token"] = Figure(
            round(sum(s["target_tokens_per_token"] for s in ss) / len(ss), 3),
            f"target tokens computed per committed token, {name}", setup, "", "{:.2f}")
        figures[f"{mode}-round-trips-per-token"] = Figure(
            round(sum(s["round_trips_per_token"] for s in ss) / len(ss), 3),
            f"round trips per committed token, {name}", setup, "", "{:.2f}")
    hs = [by[(p, "hybrid")] for p in profiles]
    figures["hybrid-tokens-per-round"] = Figure(round(sum(s["tokens_per_round"] for s in hs) / len(hs), 3),
                                                f"tokens per round, {hybrid}", setup, "", "{:.2f}")
    figures["hybrid-alpha"] = Figure(round(sum(s["alpha"] for s in hs) / len(hs), 3),
                                     f"per-token acceptance α, {hybrid}", setup, "", "{:.2f}")
    return figures, {"by-profile": Table(COLUMNS, rows, FMT)}


def crossover_table(points: list[dict]):
    """Rows: the cloud's ms per target pass; columns: the link's RTT; cells: hybrid ÷ cloud-only tokens/s."""
    from hybridspec.figures import Table
    rtts = sorted({p["rtt_ms"] for p in points})
    steps = sorted({p["step_ms"] for p in points})
    at = {(p["step_ms"], p["rtt_ms"]): p["speedup"] for p in points}
    cols = ["cloud ms per pass \\ RTT ms", *(f"{r:g}" for r in rtts)]
    rows = [[f"{s:g}", *(round(at[(s, r)], 3) if (s, r) in at else None for r in rtts)] for s in steps]
    return Table(cols, rows, {c: "{:.2f}" for c in cols[1:]})


def main() -> int:
    from hybridspec.figures import publish
    from netsim.experiment import ExperimentConfig, run_experiment, summarise
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="lan,lte,3g,geo-sat")
    ap.add_argument("--workloads", default="code,chat,creative")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--no-crossover", action="store_true", help="skip the synthetic RTT × pass-time grid")
    ap.add_argument("--name", default="headline", help="bench/results/<name>.json")
    ap.add_argument("--out", default="results/headline")
    ap.add_argument("--prompts-per-workload", type=int, default=1)
    ap.add_argument("--note", default="tokens/s and their ratios measured side by side in one run; counts do not "
                                      "depend on timing", help="recorded with the result (the load is recorded anyway)")
    args = ap.parse_args()
    load_start = list(os.getloadavg())
    profiles = args.profiles.split(",")
    cfg = ExperimentConfig(profiles=profiles, modes=list(MODES), out=Path(args.out),
                           workloads=args.workloads.split(","), max_tokens=args.max_tokens,
                           prompts_per_workload=args.prompts_per_workload,
                           gammas=[args.gamma], crossover=not args.no_crossover)
    result = asyncio.run(run_experiment(cfg))
    from netsim.report import write_all
    write_all(result, cfg.out)
    setup = (f"bundled pair (SmolLM2-135M-Instruct Q4_1 target, its Q4_0 draft), "
             f"{args.workloads.replace(',', '/')} × {args.max_tokens} tokens, seed 1")
    figures, tables = headline(summarise(result["rows"]), profiles, args.gamma, setup)
    if result.get("crossover"):
        tables["crossover"] = crossover_table(result["crossover"])
    publish(args.name, figures=figures, tables=tables, load_start=load_start, note=args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
