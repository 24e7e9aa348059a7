"""Summarise bench/continuations.sh's runs: per pair and profile, hit rate, round trips, bytes up and
tokens/s per token of each mode, and tokens/s against per-token and the chain (hybrid-g4), measured
side by side in one run. Writes summary.json and summary.md to the output folder.

  python bench/continuations_summary.py results/continuations bench/continuations
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = {"bundled": "bundled", "synthetic, CPU curve": "synthetic/cpu", "synthetic, GPU-like curve": "synthetic/gpu-like"}
MODES = ("cloud-only", "per-token", "hybrid-g4", "pipeline-g4", "continuations-g4")


def main(raw: Path, out: Path) -> int:
    table, lines = [], []
    for pair, sub in RUNS.items():
        path = raw / sub / "results.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        from netsim.experiment import summarise
        summary = summarise(result["rows"])
        for profile in dict.fromkeys(s["profile"] for s in summary):
            by = {s["mode"]: s for s in summary if s["profile"] == profile}
            for mode in MODES:
                s = by.get(mode)
                if s is None:
                    continue
                rate = lambda other: (s["tokens_per_s"] / by[other]["tokens_per_s"]  # noqa: E731
                                      if other in by and by[other]["tokens_per_s"] else None)
                table.append({"pair": pair, "profile": profile, "mode": mode, "tokens": s["tokens"],
                              "tokens_per_s": s["tokens_per_s"], "round_trips_per_token": s["round_trips_per_token"],
                              "bytes_up_per_token": s["bytes_up_per_token"], "alpha": s["alpha"],
                              "continuation_rounds": s.get("continuation_rounds", 0),
                              "continuations_sent": s.get("continuations_sent", 0),
                              "continuation_hits": s.get("continuation_hits", 0),
                              "hit_rate": (s.get("continuation_hits", 0) / s["continuation_rounds"]
                                           if s.get("continuation_rounds") else None),
                              "vs_per_token": rate("per-token"), "vs_chain": rate("hybrid-g4")})
    fmt = lambda v, d=2: "–" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines += ["| pair | profile | mode | tokens | tok/s | RT/token | B up/token | α | hits / rounds (sent) | hit rate "
              "| ÷ per-token | ÷ chain |", "|" + "---|" * 12]
    for r in table:
        hits = (f"{r['continuation_hits']} / {r['continuation_rounds']} ({r['continuations_sent']})"
                if r["continuation_rounds"] else "–")
        lines.append(f"| {r['pair']} | {r['profile']} | {r['mode']} | {r['tokens']} | {fmt(r['tokens_per_s'])} | "
                     f"{fmt(r['round_trips_per_token'])} | {fmt(r['bytes_up_per_token'], 0)} | {fmt(r['alpha'])} | "
                     f"{hits} | {fmt(r['hit_rate'])} | {fmt(r['vs_per_token'])} | {fmt(r['vs_chain'])} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(table, indent=1) + "\n")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
