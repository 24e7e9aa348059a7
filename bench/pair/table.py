"""The two-family table of docs/benchmarks.md from the raw results in results/pair/ (no measuring):

    .venv/bin/python bench/pair/table.py > results/pair/table.md

Per pair (netsim experiment, bench/pair/run.sh) and profile: per-token α and tokens per round of
hybrid γ = 4, tokens/s of cloud-only, per-token, hybrid γ = 4 and adaptive γ, and draft tokens
re-tokenized per round (two tokenizers); then α by workload and temperature from eval-draft
(bench/pair/eval.sh).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from netsim.experiment import summarise  # noqa: E402

HERE = ROOT / "results" / "pair"   # what bench/pair/run.sh and eval.sh write
PAIRS = [("gemma-smollm2", "Gemma 3 270M ← SmolLM2-135M Q4_0 (two tokenizers, TLI)"),
         ("gemma-self", "Gemma 3 270M ← its Q4_0 requant"),
         ("smollm2", "SmolLM2-135M ← its Q4_0 requant")]
PROFILES = ["lan", "lte", "3g", "geo-sat"]


def fmt(x, digits=2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def netsim_table() -> list[str]:
    lines = ["| pair | profile | α (hybrid γ=4) | tokens/round γ=4 | cloud-only tok/s | per-token tok/s | "
             "hybrid γ=4 tok/s | adaptive tok/s | target passes/token γ=4 | re-tokenized/round |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    machines = set()
    for pair, label in PAIRS:
        path = HERE / pair / "results.json"
        if not path.exists():
            lines.append(f"| {label} | (not run) | | | | | | | | |")
            continue
        result = json.loads(path.read_text())
        machines.add(result.get("started", "") + " " + json.dumps(result.get("machine", {}).get("cpu", {}).get("model", "")))
        by = {(s["profile"], s["mode"]): s for s in summarise(result["rows"])}
        for profile in PROFILES:
            h, a = by.get((profile, "hybrid-g4"), {}), by.get((profile, "adaptive"), {})
            c, p = by.get((profile, "cloud-only"), {}), by.get((profile, "per-token"), {})
            lines.append(f"| {label} | {profile} | {fmt(h.get('alpha'))} | {fmt(h.get('tokens_per_round'))} | "
                         f"{fmt(c.get('tokens_per_s'), 1)} | {fmt(p.get('tokens_per_s'), 1)} | "
                         f"{fmt(h.get('tokens_per_s'), 1)} | {fmt(a.get('tokens_per_s'), 1)} | "
                         f"{fmt(h.get('forward_passes_per_token'))} | {fmt(h.get('rolled_back_per_round'))} |")
    return lines


def eval_table() -> list[str]:
    reports = []
    for name in ("eval-gemma.json", "eval-smollm2.json"):
        path = HERE / name
        if path.exists():
            doc = json.loads(path.read_text())
            reports += doc.get("reports", [doc])
    if not reports:
        return []
    cats = list(reports[0]["categories"])
    lines = ["| target ← draft | T | " + " | ".join(cats) + " | overall | covered |",
             "|---|---|" + "---|" * (len(cats) + 2)]
    for r in reports:
        label = f"{r['target']['name']} ← {r['draft']['name']}"
        for t in r["overall"]["alpha"]:
            cov = r["overall"].get("coverage", {}).get(t)
            lines.append(f"| {label} | {t} | " + " | ".join(fmt(r["categories"][c]["alpha"][t]) for c in cats)
                         + f" | **{fmt(r['overall']['alpha'][t])}** | {fmt(cov)} |")
    v = next((r["vocabulary"] for r in reports if r.get("vocabulary")), None)
    if v:
        lines += ["", f"Vocabulary: {v['shared_strings']:,} of the draft's {v['draft_strings']:,} distinct token strings "
                      f"({100 * v['share']:.1f}%) are target tokens ({v['target_tokens']:,}); {v['mapped_tokens']:,} draft "
                      f"ids in the map; {v['rolled_back_per_sync']:.3f} draft tokens re-tokenized per position."]
    return lines


if __name__ == "__main__":
    print("\n".join(netsim_table() + [""] + eval_table()))
