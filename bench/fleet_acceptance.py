"""Our pairs' acceptance curves for the fleet model, from `edge-client eval-draft` reports (a benchmark).

Acceptance does not depend on the machine or its load: the curves are counts over teacher-forced
continuations (edge_client/draftmaker/chain.py). This reads eval-draft JSON reports and writes

  bench/fleet/acceptance/ours.json   the curves netsim.fleet.acceptance.measured_curves() loads, by key:
        ours-<pair>            the device draft of <pair>, greedy (T 0), per position at γ 8
        ours-<pair>-t0.7       the same at T 0.7 (where the report scored it)
        ngram-<cat>-<pair>     vLLM's n-gram rule on <pair>'s target's greedy text: chat (chat and
                               creative prompts), code, all (every category)
        ngram-chat / ngram-code / ngram-all   the same for the first pair given (the map's default n-gram)
  bench/results/gpu-acceptance.json  the registry: every curve the per-GPU model uses, catalogue and
                               measured, with its τ at 2, 4 and 8 drafts and its source

  edge-client eval-draft --target smollm2 --draft models/smollm2-draft.gguf --tokens 48 --temperatures 0,0.7 --json > bundled.json
  edge-client eval-draft --target gemma --draft models/smollm2-draft.gguf --tokens 48 --temperatures 0,0.7 --json > gemma.json
  python bench/fleet_acceptance.py --report bundled=bundled.json --report gemma=gemma.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_client.draftmaker.chain import ChainTally  # noqa: E402  (the pooled sums' own summary)
from netsim.fleet.acceptance import CURVES, MEASURED_DIR, Curve, curve_from_report  # noqa: E402

NGRAM_GROUPS = {"chat": ("chat", "creative"), "code": ("code",), "all": None}


def _pool(by_category: dict, categories) -> dict | None:
    """Several categories' summaries pooled exactly (their counts added)."""
    parts = [by_category[c] for c in (categories or by_category) if c in by_category]
    return ChainTally.from_counts(parts).summary() if parts else None


def curves_from_report(pair: str, report: dict, command: str) -> dict[str, Curve]:
    target, draft = report["target"]["name"], report["draft"]["name"]
    n = report["overall"]["prompts"]
    tokens = report["settings"]["max_new_tokens"]
    src = f"ours: edge-client eval-draft, {target} <- {draft}, {n} prompts x {tokens} tokens ({command})"
    out = {}
    for t, chain in (report.get("chain") or {}).items():
        key = f"ours-{pair}" if t == "0" else f"ours-{pair}-t{t}"
        out[key] = curve_from_report(f"ours: {draft} for {target}, T {t}", chain, src)
    ngram_src = f"ours: vLLM's n-gram rule (prompt lookup 2..4) on {target}'s greedy text, {n} prompts x {tokens} tokens"
    for group, cats in NGRAM_GROUPS.items():
        summary = report.get("ngram") if cats is None else _pool(report.get("ngram_by_category") or {}, cats)
        if summary:
            out[f"ngram-{group}-{pair}"] = curve_from_report(f"n-gram on {group} ({target}'s text)", summary,
                                                              ngram_src + (f", categories {', '.join(cats)}" if cats else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", action="append", required=True, metavar="PAIR=FILE",
                    help="an eval-draft --json report (one draft); the first pair's n-gram curves are the defaults")
    ap.add_argument("--command", action="append", default=[], metavar="PAIR=COMMAND",
                    help="the eval-draft command that made a report (recorded with its curves)")
    ap.add_argument("--out", default=str(MEASURED_DIR / "ours.json"))
    ap.add_argument("--result", default="gpu-acceptance", help="registry name ('' for none)")
    args = ap.parse_args(argv)
    commands = dict(c.split("=", 1) for c in args.command)
    curves: dict[str, Curve] = {}
    first = None
    for spec in args.report:
        pair, path = spec.split("=", 1)
        doc = json.loads(Path(path).read_text())
        reports = doc["reports"] if "reports" in doc else [doc]
        curves.update(curves_from_report(pair, reports[0], commands.get(pair, f"eval-draft report {Path(path).name}")))
        first = first or pair
    for group in NGRAM_GROUPS:
        if f"ngram-{group}-{first}" in curves:
            c = curves[f"ngram-{group}-{first}"]
            curves[f"ngram-{group}"] = Curve(f"n-gram on {group} (ours)", c.reach, c.source)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"note": "acceptance curves: counts, not timings (no machine or load dependence)",
                               "curves": {k: c.to_json() for k, c in sorted(curves.items())}}, indent=1) + "\n")
    print(f"wrote {out}")
    for key, c in sorted(curves.items()):
        print(f"  {key}: {c.describe()}")
    if args.result:
        from hybridspec.figures import Figure, Table, write_result
        rows = [[key, c.name, *[round(c.tokens_per_step(g), 2) for g in (2, 4, 8)],
                 " / ".join(f"{r:.2f}" for r in c.reach[:5]), c.source]
                for key, c in [*CURVES.items(), *sorted(curves.items())]]
        table = Table(["key", "proposer", "τ at 2", "τ at 4", "τ at 8", "per position (1..5)", "measured by"], rows)
        figures = {f"{key}-tau4": Figure(round(c.tokens_per_step(4), 3), "mean acceptance length at 4 drafts (τ4, "
                                         "bonus included)", c.name, "tokens", "{:.2f}")
                   for key, c in [*CURVES.items(), *sorted(curves.items())]}
        path = write_result(args.result, figures=figures, tables={"curves": table},
                            note="acceptance curves: counts, not timings (no machine or load dependence)")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
