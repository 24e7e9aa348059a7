"""The steering verifier against today's, side by side in one run, on the machine at hand.

Arms (each a verifier setting and an edge mode, run with the same edges, links and requests):
  today    the fair-share batcher, no draft budget (`--schedule fair --steer off`), fixed γ (hybrid);
  steer    least slack first against the SLO with capped prefills, draft budgets in every reply
           (`--schedule slack --steer on --slo-tpot-ms/--slo-ttft-ms`), adaptive γ capped by them;
  adaptive (optional) today's batcher with adaptive γ, no budget: what the edge's own cost model does
           without the verifier's word;
  budget   (optional) today's fair-share batcher with draft budgets and adaptive γ (steer without
           the least-slack schedule).
The arms alternate (today, steer, today, ...; the order flips every rep) so that drifting load on
a shared machine hits them alike; the script prints goodput and throughput of each pair, their
ratios and the median, and the machine.

    .venv/bin/python bench/steer_vs_fixed.py                                # bundled target, 16 edges, lan
    .venv/bin/python bench/steer_vs_fixed.py --drafter gguf --reps 2        # a draft model per edge
    .venv/bin/python bench/steer_vs_fixed.py --synthetic --edges 1,4,16,64  # the synthetic GPU-like target
    .venv/bin/python bench/steer_vs_fixed.py --pair gemma-smollm2 --drafter gguf --edges 4  # two families

Results: results/load/steer-vs-fixed-<target>-<profile>/result.json and result.md (every run's own
load.json under runs/).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from hybridspec.machine import describe, summary
from netsim.load import LoadConfig, goodput_at, run_load, write_all


def arms(slo_tpot_ms: float, slo_ttft_ms: float) -> dict[str, tuple[list[str], str]]:
    """name -> (verifier arguments, edge mode)."""
    slo = ["--slo-tpot-ms", str(slo_tpot_ms), "--slo-ttft-ms", str(slo_ttft_ms)]
    return {"today": (["--schedule", "fair", "--steer", "off"], "hybrid"),
            "steer": (["--schedule", "slack", "--steer", "on"] + slo, "adaptive"),
            "adaptive": (["--schedule", "fair", "--steer", "off"], "adaptive"),
            "budget": (["--schedule", "fair", "--steer", "on"], "adaptive")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edges", default="16", help="comma-separated edge counts")
    ap.add_argument("--profile", default="lan")
    ap.add_argument("--arms", default="today,steer", help="which of today, steer, adaptive, budget")
    ap.add_argument("--reps", type=int, default=2, help="rounds of every arm per edge count")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4, help="today's fixed γ")
    ap.add_argument("--drafter", choices=["lookup", "gguf"], default="lookup")
    ap.add_argument("--draft-ms", type=float, default=2.0, help="emulated drafting per token (lookup, synthetic)")
    ap.add_argument("--synthetic", action="store_true", help="the synthetic target (a pass: step + per-token ms)")
    ap.add_argument("--pair", help="a named model pair (netsim/pairs.py), e.g. gemma-smollm2: the two-family pair "
                                   "(needs --drafter gguf: prompt lookup does not draft across tokenizers)")
    ap.add_argument("--synthetic-step-ms", type=float, default=20.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=400.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    ap.add_argument("--slo-sweep", default="250,400,600,1000",
                    help="TPOT SLOs (ms) at which goodput is judged again from the same runs (TTFT as given)")
    ap.add_argument("--verifier-arg", action="append", default=[], help="passed to every verifier")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from netsim.pairs import resolve
    models = resolve(args.pair, None, None)
    target = "synthetic" if args.synthetic else (args.pair or "bundled")
    out = Path(args.out or f"results/load/steer-vs-fixed-{target}-{args.profile}")
    edges = [int(e) for e in args.edges.split(",")]
    chosen = {k: v for k, v in arms(args.slo_tpot_ms, args.slo_ttft_ms).items() if k in args.arms.split(",")}
    machine = describe()
    print(f"Machine: {summary(machine)}", flush=True)

    rows = []
    t0 = time.time()
    for rep in range(args.reps):
        order = list(chosen.items()) if rep % 2 == 0 else list(reversed(chosen.items()))
        for name, (flags, mode) in order:
            cfg = LoadConfig(edges=edges, profiles=[args.profile], modes=[mode], duration_s=args.duration,
                             out=out / "runs" / f"{name}-{rep}", verifier_args=flags + args.verifier_arg,
                             gamma=args.gamma, max_tokens=args.max_tokens, drafter=args.drafter,
                             draft_ms=args.draft_ms, synthetic=args.synthetic,
                             synthetic_step_ms=args.synthetic_step_ms, warmup_s=args.warmup,
                             slo_tpot_ms=args.slo_tpot_ms, slo_ttft_ms=args.slo_ttft_ms,
                             target=models.target, draft=models.draft, pair=models.pair)
            result = asyncio.run(run_load(cfg))
            write_all(result, cfg.out)
            for run in result["runs"]:
                rows.append({"rep": rep, "arm": name, "edges": run["edges"], "mode": mode,
                             "goodput": run["goodput_tokens_per_s"], "tok_s": run["committed_tokens_per_s"],
                             "tpot_p95_s": run["tpot_p95_s"], "ttft_p95_s": run["ttft_p95_s"],
                             "slo_met_share": run["slo_met_share"],
                             "target_tokens_per_token": run["target_tokens_per_committed_token"],
                             "threads": result["verifier_threads"],
                             "goodput_by_slo": {ms: goodput_at(run, float(ms) / 1e3, args.slo_ttft_ms / 1e3)
                                                for ms in args.slo_sweep.split(",")},
                             "not_representative": run["not_representative"]})
                r = rows[-1]
                print(f"  rep {rep} {name:8s} {r['edges']:3d} edges: goodput {r['goodput']:6.1f} tok/s, "
                      f"{r['tok_s']:6.1f} tok/s, p95 TPOT {_ms(r['tpot_p95_s'])} ms"
                      f"{'  (not representative: ' + r['not_representative'] + ')' if r['not_representative'] else ''}",
                      flush=True)

    def pick(rep, arm, n):
        return next(r for r in rows if (r["rep"], r["arm"], r["edges"]) == (rep, arm, n))

    table = []
    for n in edges:
        entry = {"edges": n}
        for name in chosen:
            runs = [pick(rep, name, n) for rep in range(args.reps)]
            entry[name] = {k: [r[k] for r in runs] for k in ("goodput", "tok_s", "tpot_p95_s", "slo_met_share",
                                                              "target_tokens_per_token")}
            entry[name]["flagged"] = sum(1 for r in runs if r["not_representative"])
        for name in chosen:
            if name == "today":
                continue
            for key in ("goodput", "tok_s"):
                ratios = [(b / a if a else float("inf")) for a, b in zip(entry["today"][key], entry[name][key])]
                entry[name][f"{key}_ratio"] = ratios
                entry[name][f"{key}_ratio_median"] = statistics.median(ratios)
        table.append(entry)

    pair = ("synthetic target " f"({args.synthetic_step_ms:g} ms/pass), synthetic drafts ({args.draft_ms:g} ms/token)"
            if args.synthetic else (f"pair {args.pair} (target {Path(models.target).name}), " if args.pair
                                    else "bundled target (SmolLM2-135M Q4_1), ")
            + (f"a draft model per edge ({Path(models.draft).name if models.draft else 'models/smollm2-draft.gguf'})"
               if args.drafter == "gguf"
               else f"prompt-lookup drafts ({args.draft_ms:g} ms/token emulated)"))
    lines = [f"# Steering vs today's batcher with fixed γ, side by side ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Machine: {summary(machine)}.", "",
             f"{pair}; {args.profile} links; {args.duration:g} s windows after {args.warmup:g} s; "
             f"{args.max_tokens} tokens per request; SLO p95 TPOT ≤ {args.slo_tpot_ms:g} ms, TTFT ≤ "
             f"{args.slo_ttft_ms:g} ms (goodput: tokens of requests that met it); verifier threads "
             f"{rows[0]['threads']}; today: fixed γ {args.gamma}; {args.reps} reps, alternating order; "
             f"{(time.time() - t0) / 60:.0f} min.", "",
             "| edges | arm | goodput tok/s | tok/s | p95 TPOT ms | met SLO | target tok / tok | goodput × today "
             "| tok/s × today | runs flagged |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        for name in chosen:
            e = t[name]
            ratio = (f"{' / '.join(f'{v:.2f}' for v in e['goodput_ratio'])} (**{e['goodput_ratio_median']:.2f}×**)"
                     if "goodput_ratio" in e else "–")
            tratio = (f"{' / '.join(f'{v:.2f}' for v in e['tok_s_ratio'])} (**{e['tok_s_ratio_median']:.2f}×**)"
                      if "tok_s_ratio" in e else "–")
            lines.append(f"| {t['edges']} | {name} | {_join(e['goodput'])} | {_join(e['tok_s'])} "
                         f"| {_join(e['tpot_p95_s'], 1e3, 0)} | {_join(e['slo_met_share'], 100, 0)}% "
                         f"| {_join(e['target_tokens_per_token'], 1, 2)} | {ratio} | {tratio} | {e['flagged']} |")
    sweep = args.slo_sweep.split(",")
    lines += ["", "Goodput judged again at other TPOT SLOs (same runs; median over reps, tok/s; ratio to today):", "",
              "| edges | arm | " + " | ".join(f"TPOT ≤ {ms} ms" for ms in sweep) + " |",
              "|---|---|" + "---|" * len(sweep)]
    for n in edges:
        for name in chosen:
            cells = []
            for ms in sweep:
                mine = statistics.median(pick(rep, name, n)["goodput_by_slo"][ms] for rep in range(args.reps))
                base = statistics.median(pick(rep, "today", n)["goodput_by_slo"][ms] for rep in range(args.reps)) \
                    if "today" in chosen else 0.0
                cells.append(f"{mine:.1f}" + (f" ({mine / base:.2f}×)" if name != "today" and base else ""))
            lines.append(f"| {n} | {name} | " + " | ".join(cells) + " |")
    if any(r["not_representative"] for r in rows):
        lines += ["", "Runs flagged: the harness (edges and proxies) saturated the cores the verifier left it; "
                      "their figures are the harness's (see each run's load.md)."]
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows,
                                                 "table": table}, indent=1))
    (out / "result.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / 'result.json'}, {out / 'result.md'}")


def _ms(v) -> str:
    return "–" if v is None else f"{v * 1e3:.0f}"


def _join(values, scale=1.0, digits=1) -> str:
    return " / ".join("–" if v is None else f"{v * scale:.{digits}f}" for v in values)


if __name__ == "__main__":
    main()
