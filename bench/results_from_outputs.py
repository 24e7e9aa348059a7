"""Write registry entries (bench/results/<name>.json) from benchmark outputs already in bench/.

A benchmark that writes its own result file (`hybridspec.figures.write_result`) needs nothing here.
For outputs written before the registry existed, this reads the report the run left and writes the
figures the pages state, with the command, machine and date the report (or the page that quotes
it) records:

- `netsim-experiment`: bench/netsim_headline.md, the `netsim experiment` report of the bundled pair
  over five links (per profile and mode; tokens/s ratios), the run the README's opening quotes.
The per-GPU results (`gpu-regime*`, `gpu-sim`, `gpu-fleet`) are written by their own benchmarks
(bench/fleet_regime.sh, bench/netsim_fleet.sh) through `write_result`.

    python bench/results_from_outputs.py            # (re)write every entry this script knows

Standard library only.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridspec import figures  # noqa: E402


def md_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """Each `## heading`'s first Markdown table, as rows keyed by column."""
    out = {}
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = block.partition("\n")
        lines = [ln for ln in body.splitlines() if ln.startswith("|")]
        if len(lines) < 3:
            continue
        cols = [c.strip() for c in lines[0].strip("|").split("|")]
        out[title.strip()] = [dict(zip(cols, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    return out


def _write(name: str, doc: dict) -> Path:
    """A result whose machine and date are those the output recorded (not this process's)."""
    path = figures.RESULTS / f"{name}.json"
    path.write_text(json.dumps({"name": name, **doc}, indent=1, ensure_ascii=False) + "\n")
    return path


def netsim_experiment() -> Path:
    src = ROOT / "bench" / "netsim_headline.md"
    text = src.read_text(encoding="utf-8")
    date = re.search(r"\((20\d\d-\d\d-\d\d)", text).group(1)
    machine = re.search(r"^Machine: (.+?)\.?$", text, flags=re.M).group(1)
    tables = md_tables(text)
    rows = {(r["profile"], r["mode"]): r for r in tables["Per profile and mode"]}
    ratios = {r["profile"]: r for r in tables["Ratios of tokens/s"]}
    setup = "bundled pair (SmolLM2-135M Q4_1 target, its Q4_0 draft), code/chat/creative × 32 tokens, seed 1"

    def num(profile: str, mode: str, col: str) -> float:
        return float(rows[(profile, mode)][col])

    def fig(value, quantity, where, fmt, unit=""):
        return figures.Figure(value=value, quantity=quantity, setup=f"{setup}, {where}", unit=unit, fmt=fmt)

    figs = {
        "passes-hybrid-g4": fig(num("3g", "hybrid-g4", "target passes/token"),
                                "target passes per committed token, hybrid γ 4", "every link", "{:.2f}"),
        "passes-cloud-only": fig(num("3g", "cloud-only", "target passes/token"),
                                 "target passes per committed token, cloud-only", "every link", "{:.2f}"),
        "rt-per-token-per-token": fig(num("3g", "per-token", "RT/token"),
                                      "round trips per committed token, per-token (γ 1)", "every link", "{:.2f}"),
        "rt-per-token-hybrid-g4": fig(num("3g", "hybrid-g4", "RT/token"),
                                      "round trips per committed token, hybrid γ 4", "every link", "{:.2f}"),
    }
    for profile in ("3g", "geo-sat", "lte", "lan", "edge-lossy"):
        best = ratios[profile]["best hybrid"]          # "hybrid-g4": the γ with the most tokens/s
        which = f"hybrid γ {best.removeprefix('hybrid-g')}"
        figs[f"hybrid-over-per-token-{profile}"] = fig(
            float(ratios[profile]["hybrid/per-token"]), f"tokens/s, {which} over per-token",
            profile, "{:.2f}×", "x")
        figs[f"hybrid-over-cloud-only-{profile}"] = fig(
            float(ratios[profile]["hybrid/cloud-only"]), f"tokens/s, {which} over cloud-only",
            profile, "{:.2f}×", "x")
        for mode in ("cloud-only", "per-token", "hybrid-g4"):
            figs[f"tok-s-{mode}-{profile}"] = fig(num(profile, mode, "tok/s"), f"tokens/s, {mode}", profile,
                                                  "{:.1f} tok/s", "tok/s")
    rtt = {"lan": "1 ms", "lte": "70 ms", "3g": "300 ms", "edge-lossy": "840 ms, 1% loss", "geo-sat": "600 ms"}
    by_profile = figures.Table(
        columns=["profile (RTT)", "cloud-only tok/s", "per-token tok/s", "hybrid γ=4 tok/s", "adaptive tok/s",
                 "round trips/token per-token → γ=4", "target passes/token hybrid γ=4"],
        rows=[[f"{p} ({rtt[p]})", rows[(p, "cloud-only")]["tok/s"], rows[(p, "per-token")]["tok/s"],
               rows[(p, "hybrid-g4")]["tok/s"], rows[(p, "adaptive")]["tok/s"],
               f'{rows[(p, "per-token")]["RT/token"]} → {rows[(p, "hybrid-g4")]["RT/token"]}',
               rows[(p, "hybrid-g4")]["target passes/token"]] for p in rtt])
    return _write("netsim-experiment", {
        "command": (".venv/bin/netsim experiment --profiles lan,lte,3g,edge-lossy,geo-sat "
                    "--modes edge-only,cloud-only,per-token,hybrid,adaptive --workloads code,chat,creative "
                    "--max-tokens 32 --gammas 2,4,8 --out results/headline"),
        "machine": {"as_stated": f"{machine} (2 vCPU VM, nothing else running)"},
        "load": {"start": None, "end": None}, "date": date,
        "note": "from the run's report, bench/netsim_headline.md",
        "figures": {k: vars(f) for k, f in figs.items()},
        "tables": {"by-profile": {"columns": by_profile.columns, "rows": by_profile.rows, "fmt": {}}},
    })


REGIME_MODES = ("numpy-per-session, one round", "numpy-per-session, in flight",
                "batched-on-device, one round", "batched-on-device, in flight")
REGIME_COLUMNS = ["target", "context", "link", "cloud-only tok/s per GPU (binds; sessions)", "numpy maths",
                  "numpy maths, in flight", "device maths (vLLM ships)", "device maths, in flight"]
def main() -> None:
    makers = [netsim_experiment]
    for make in makers:
        print(make().relative_to(ROOT))


if __name__ == "__main__":
    main()
