"""The planner (mode `auto`, the default edge) beside every fixed mode in one `netsim experiment` run:
per profile, each mode's median tokens/s over its runs (one per workload prompt), that median over
per-token's and over the best fixed mode's of the same run, round trips per token, and the shapes
the planner chose most. Writes bench/results/<name>.json (hybridspec.figures) and prints the table.

  # the synthetic pair on the flat GPU-like verifier (20 ms per pass + 0.05 ms per node)
  PYTHONPATH=. python bench/auto_side_by_side.py --synthetic --profiles 3g,geo-sat --name auto_synthetic_flat
  # the bundled pair (SmolLM2 target and draft on llama.cpp), chat at T = 0.7, one profile per run
  PYTHONPATH=. python bench/auto_side_by_side.py --profiles 3g --workloads chat --name auto_bundled_3g
  # ... at T = 0; the code prompt; the two-family pair
  PYTHONPATH=. python bench/auto_side_by_side.py --profiles 3g --workloads chat --temperature 0 --name auto_bundled_3g_t0
  PYTHONPATH=. python bench/auto_side_by_side.py --profiles 3g --workloads code --name auto_bundled_3g_code
  PYTHONPATH=. python bench/auto_side_by_side.py --pair gemma-smollm2 --profiles 3g --workloads chat --name auto_gemma_3g
  # one table over those runs' result files (bench/results/auto_summary.json)
  PYTHONPATH=. python bench/auto_side_by_side.py --summarise auto_bundled_3g,auto_synthetic_flat,auto_gemma_3g
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = "per-token,hybrid,tree,pipeline,continuations,window,fused,auto"


def summary_rows(rows: list[dict], profile: str) -> list[list]:
    """[mode, runs, tokens, median tok/s, ÷ per-token, ÷ best fixed, RT / token, top shapes] per mode."""
    by_mode: dict[str, list[dict]] = {}
    for r in rows:
        if r["profile"] == profile:
            by_mode.setdefault(r["mode"], []).append(r)
    med = {m: statistics.median(r["tokens_per_s"] for r in rs) for m, rs in by_mode.items()}
    per_token = med.get("per-token")
    fixed = [v for m, v in med.items() if m != "auto"]
    best = max(fixed) if fixed else None
    out = []
    for mode in sorted(med, key=lambda m: (m != "auto", -med[m])):
        rs = by_mode[mode]
        tokens = sum(r["tokens"] for r in rs)
        rt = sum(r["round_trips"] for r in rs) / max(tokens, 1)
        shapes: dict[str, int] = {}
        for r in rs:
            for k, v in (r.get("shapes") or {}).items():
                shapes[k] = shapes.get(k, 0) + v
        top = ", ".join(f"{k} ×{v}" for k, v in sorted(shapes.items(), key=lambda kv: -kv[1])[:3]) if mode == "auto" \
            else ""
        out.append([mode, len(rs), tokens, med[mode], med[mode] / per_token if per_token else None,
                    med[mode] / best if best else None, rt, top])
    return out


def summarise(names: list[str]) -> int:
    """One table over earlier runs' result files (bench/results/<name>.json): per set-up and profile,
    auto's median tokens/s beside per-token's and the best fixed mode's of the same run."""
    from hybridspec.figures import Table, load, write_result
    registry = load()
    cols = ["set-up", "link", "auto tok/s", "auto ÷ per-token", "best fixed mode", "its tok/s", "auto ÷ best fixed",
            "load at start"]
    rows = []
    for name in names:
        result = registry[name]
        for profile, table in result.tables.items():
            by_mode = {r[0]: r for r in table.rows}
            auto = by_mode["auto"]
            best = max((r for m, r in by_mode.items() if m != "auto"), key=lambda r: r[3])
            fig = result.figures.get(f"{profile}_auto_x_per_token")   # its setup: "<profile>, <pair, workloads...>"
            setup = fig.setup.partition(", ")[2] if fig else name
            rows.append([setup, profile.replace("_", "-"), auto[3], auto[4], best[0], best[3], auto[5],
                         (result.load.get("start") or [None])[0]])
    fmt = {"auto tok/s": "{:.2f}", "auto ÷ per-token": "{:.2f}×", "its tok/s": "{:.2f}", "auto ÷ best fixed": "{:.2f}×",
           "load at start": "{:.1f}"}
    path = write_result("auto_summary", tables={"all": Table(cols, rows, fmt)},
                        note="collected from the result files " + ", ".join(names) + "; each holds its own command, "
                             "machine and load; shared 2-core machine")
    print(f"wrote {path}")
    return 0


def main() -> int:
    from hybridspec.figures import Figure, Table, write_result
    from netsim.experiment import ExperimentConfig, run_experiment
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="3g,geo-sat")
    ap.add_argument("--modes", default=MODES)
    ap.add_argument("--workloads", default="chat,summarisation")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=None,
                    help="every workload at this temperature (default: the experiment's per workload: chat 0.7, code 0.2)")
    ap.add_argument("--repeats", type=int, default=1, help="prompts per workload (runs per mode = workloads × this)")
    ap.add_argument("--synthetic", action="store_true", help="the synthetic pair on a flat verifier curve")
    ap.add_argument("--noise", type=float, default=0.5, help="synthetic draft noise")
    ap.add_argument("--draft-ms", type=float, default=2.0, help="synthetic draft cost per row")
    ap.add_argument("--curve", default="20,0.05", help="synthetic verifier: ms per pass, ms per node")
    ap.add_argument("--pair", default=None, help="netsim pair name (e.g. gemma-smollm2); default: bundled")
    ap.add_argument("--name", help="bench/results/<name>.json (required unless --summarise)")
    ap.add_argument("--out", default="results/auto")
    ap.add_argument("--from-results", help="tabulate an earlier run's results.json instead of running")
    ap.add_argument("--summarise", help="comma-separated result names: one table over them (auto_summary)")
    args = ap.parse_args()
    if args.summarise:
        return summarise(args.summarise.split(","))
    if not args.name:
        ap.error("--name is required (or --summarise)")
    load_start = list(os.getloadavg())
    step, per_node = (float(x) for x in args.curve.split(","))
    kw = dict(synthetic=True, synthetic_alpha_noise=args.noise, synthetic_draft_ms=args.draft_ms,
              synthetic_step_ms=step, synthetic_per_token_ms=per_node) if args.synthetic else {}
    if args.pair:
        from netsim.pairs import resolve
        models = resolve(args.pair, None, None)
        kw.update(target=models.target, draft=models.draft, pair=models.pair)
    cfg = ExperimentConfig(profiles=args.profiles.split(","), modes=args.modes.split(","),
                           out=Path(args.out) / args.name, workloads=args.workloads.split(","),
                           max_tokens=args.max_tokens, gammas=[args.gamma], crossover=False,
                           temperature=args.temperature, prompts_per_workload=args.repeats, **kw)
    if args.from_results:
        result = json.loads(Path(args.from_results).read_text())
    else:
        result = asyncio.run(run_experiment(cfg))
        from netsim.report import write_all
        write_all(result, cfg.out)
    cols = ["mode", "runs", "tokens", "median tok/s", "÷ per-token", "÷ best fixed", "RT / token",
            "planner's most chosen shapes"]
    fmt = ["", "d", "d", ".2f", ".2f", ".2f", ".2f", ""]
    table_fmt = {c: "{:" + f + "}" for c, f in zip(cols, fmt) if f}
    tables, figures = {}, {}
    setup = (f"synthetic pair, flat verifier {step:g} ms + {per_node:g} ms/node" if args.synthetic
             else f"pair {args.pair or 'bundled'}") + f", {args.workloads}, {args.max_tokens} tokens" + \
        (f", T = {args.temperature:g}" if args.temperature is not None else "")
    for profile in cfg.profiles:
        rows = summary_rows(result["rows"], profile)
        tables[profile.replace("-", "_")] = Table(cols, rows, table_fmt)
        auto = next((r for r in rows if r[0] == "auto"), None)
        if auto is not None:
            key = profile.replace("-", "_")
            setup_p = f"{profile}, {setup}"
            figures[f"{key}_auto_x_per_token"] = Figure(auto[4], "auto ÷ per-token, median tok/s", setup_p, "×",
                                                        "{:.2f}×")
            figures[f"{key}_auto_x_best_fixed"] = Figure(auto[5], "auto ÷ best fixed mode, median tok/s", setup_p, "×",
                                                         "{:.2f}×")
        print(f"\n## {profile} ({setup})\n")
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join("–" if v is None else format(v, f) for v, f in zip(r, fmt)) + " |")
    path = write_result(args.name, figures=figures, tables=tables, load_start=load_start,
                        note=f"{args.repeats} prompt(s) per workload per mode; seed 1")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
