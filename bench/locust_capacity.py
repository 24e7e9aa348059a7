"""How many edges one machine's harness drives: `netsim load` in one process against `netsim load
--locust` on worker processes, side by side, against one synthetic verifier (a flat pass cost, so
the verifier is not what saturates).

For each edge count, interleaved (the order alternates between repeats): an in-process run (every
edge on one event loop, as `netsim load`) and a Locust run on --workers local workers (each: its
edges on one event loop in its edge host, its links in a proxy process, its Locust process). A run
is saturated as `netsim load` flags it (netsim.load.runs.saturation: the busiest event loop of
edges kept >= 0.9 of a core busy, or the harness >= 0.9 of the cores the verifier left it; the
synthetic verifier is given no cores of its own), and, stricter, when the harness and the verifier
together kept >= 0.9 of the machine's cores busy (on one machine they share the cores). The
saturation point of a harness is the most edges with no saturated run, by each criterion.
Printed and recorded: both points and their ratio (the goal: >= 1.6 with two workers on two cores),
the Locust runs' committed tokens over the verifier's own count (the goal: within 1 %),
TPOT p95 of both at the largest count where neither saturated (the goal: within 10 %), and the
harness's added time per round at --added-at users per worker: the mean round time on the wire of a
one-worker Locust run over an in-process run of as many edges, side by side, and what reporting to
Locust costs the edges' loop per round (measured in the edge host).

  PYTHONPATH=. python bench/locust_capacity.py                                  # the quiet run (~12 min)
  PYTHONPATH=. python bench/locust_capacity.py --edges 8,16 --added-at 8 --duration 3 --repeats 1 \\
      --results-dir /tmp/locust-capacity                                        # a check that it works

Writes bench/results/<name>.json (hybridspec.figures, with the machine and its load) and each run's
files under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOOP_SATURATED = 0.9      # one event loop: share of a core
MACHINE_SATURATED = 0.9   # harness + verifier: share of the machine's cores
COLUMNS = ["harness", "edges", "repeat", "tok/s", "TPOT p95 ms", "round ms", "busiest loop cores", "harness cores",
           "verifier cores", "flagged", "machine saturated", "tokens / verifier's"]
FMT = {"tokens / verifier's": "{:.3f}", "tok/s": "{:,.0f}", "TPOT p95 ms": "{:.1f}", "round ms": "{:.2f}", "busiest loop cores": "{:.2f}",
       "harness cores": "{:.2f}", "verifier cores": "{:.2f}"}


def flagged(run: dict, cores: int) -> bool:
    """What `netsim load` marks not representative (the harness alone)."""
    from netsim.load.runs import saturation
    return saturation(run, cores, None) is not None


def machine_saturated(run: dict, cores: int) -> bool:
    """Stricter: the busiest loop, or the harness and the verifier together on the machine's cores."""
    loop = run.get("edges_cpu_cores") or 0.0
    harness = run.get("harness_cpu_cores") or (loop + (run.get("proxy_cpu_cores") or 0.0))
    return loop >= LOOP_SATURATED or harness + (run.get("verifier_cpu_cores") or 0.0) >= MACHINE_SATURATED * cores


async def in_process(cfg, edges, n: int, verifier) -> dict:
    from netsim.load.runs import drain, run_once
    run = await run_once(cfg, edges, "hybrid", n, verifier.upstream, verifier.metrics_url, verifier.pid)
    run["harness_cpu_cores"] = (run.get("edges_cpu_cores") or 0.0) + (run.get("proxy_cpu_cores") or 0.0)
    await drain(verifier.metrics_url)
    return run


async def on_locust(cfg, n: int, workers: int, verifier, prefix: Path) -> dict:
    from netsim.load.locustrun import LocustRun, read_locust
    from netsim.load.runs import drain
    server = f"{verifier.upstream[0]}:{verifier.upstream[1]}"
    run = LocustRun(cfg, "hybrid", n, workers, server, verifier.metrics_url, prefix)
    code = await asyncio.get_running_loop().run_in_executor(None, run.wait, cfg.warmup_s + cfg.duration_s + 300)
    if not Path(f"{prefix}_stats.csv").exists():
        raise RuntimeError(f"the Locust master exited with {code}:\n{run.log_tail()}")
    record = read_locust(prefix, "hybrid")
    await drain(verifier.metrics_url)
    return record


def _row(label: str, run: dict, repeat: int, cores: int) -> list:
    ms = lambda v: None if v is None else 1e3 * v   # noqa: E731
    return [label, run["edges"], repeat, run["committed_tokens_per_s"], ms(run["tpot_p95_s"]),
            ms(run.get("round_trip_mean_s")), run.get("edges_cpu_cores"), run.get("harness_cpu_cores"),
            run.get("verifier_cpu_cores"), "yes" if flagged(run, cores) else "no",
            "yes" if machine_saturated(run, cores) else "no",
            run["committed_tokens"] / run["verifier_committed_tokens"] if run.get("verifier_committed_tokens") else None]


def _most_unsaturated(runs: list[dict], cores: int, saturated=flagged) -> int:
    by_n: dict[int, list[bool]] = {}
    for r in runs:
        by_n.setdefault(r["edges"], []).append(saturated(r, cores))
    ok = [n for n, flags in by_n.items() if not any(flags)]
    return max(ok, default=0)


async def main_async(args) -> int:
    from hybridspec.figures import Figure, Table, write_result
    from netsim.load import LoadConfig
    from netsim.load.edges import Edges
    from netsim.load.runs import start_verifier
    load_start = list(os.getloadavg())
    cores = os.cpu_count() or 1
    counts = [int(n) for n in args.edges.split(",")]
    out = Path(args.out)
    cfg = LoadConfig(edges=[max(counts + [args.added_at])], profiles=[args.profile], modes=["hybrid"],
                     duration_s=args.duration, out=out, synthetic=True, warmup_s=args.warmup,
                     synthetic_step_ms=args.step_ms, draft_ms=args.draft_ms, max_tokens=args.max_tokens,
                     verifier_args=["--session-ttl", "60"])
    edges = Edges(cfg)
    verifier = start_verifier(cfg)
    runs: dict[str, list[dict]] = {"in-process": [], f"locust x{args.workers}": [], "locust x1": []}
    rows = []
    try:
        for repeat in range(args.repeats):
            for n in counts:
                order = ["in-process", "locust"] if repeat % 2 == 0 else ["locust", "in-process"]
                for harness in order:
                    if harness == "in-process":
                        run, label = await in_process(cfg, edges, n, verifier), "in-process"
                    else:
                        label = f"locust x{args.workers}"
                        run = await on_locust(cfg, n, args.workers, verifier, out / f"{n}-w{args.workers}-r{repeat}")
                    runs[label].append(run)
                    rows.append(_row(label, run, repeat, cores))
                    print(Table(COLUMNS, [rows[-1]], FMT).render().splitlines()[-1], flush=True)
            # The harness's added time per round: as many edges on one worker as in one process.
            order = ["in-process", "locust"] if repeat % 2 == 0 else ["locust", "in-process"]
            for harness in order:
                if harness == "in-process":
                    run, label = await in_process(cfg, edges, args.added_at, verifier), "in-process (added)"
                    runs.setdefault(label, []).append(run)
                else:
                    label = "locust x1"
                    run = await on_locust(cfg, args.added_at, 1, verifier, out / f"{args.added_at}-w1-r{repeat}")
                    runs[label].append(run)
                rows.append(_row(label, run, repeat, cores))
                print(Table(COLUMNS, [rows[-1]], FMT).render().splitlines()[-1], flush=True)
    finally:
        verifier.stop()

    locust_label = f"locust x{args.workers}"
    most_in, most_locust = _most_unsaturated(runs["in-process"], cores), _most_unsaturated(runs[locust_label], cores)
    setup = (f"synthetic pair ({args.step_ms:g} ms per target pass, {args.draft_ms:g} ms per drafted token), "
             f"{args.profile}, γ 4, {args.max_tokens} tokens per request, {args.duration:g} s windows, "
             f"{args.repeats} repeat(s), one {cores}-core machine")
    at_least = lambda most: " (no count run saturated it: at least this many)" if most == max(counts) else ""  # noqa: E731
    figures = {
        "inprocess-max-edges": Figure(most_in, "edges driven before the harness saturates, netsim load in one "
                                               f"process{at_least(most_in)}", setup, "edges", "{:,}"),
        "locust-max-edges": Figure(most_locust, f"edges driven before the harness saturates, netsim load --locust "
                                                f"with {args.workers} workers{at_least(most_locust)}", setup, "edges",
                                   "{:,}"),
    }
    if most_in:
        figures["edges-ratio"] = Figure(round(most_locust / most_in, 2), f"edges driven before the harness "
                                        f"saturates, {args.workers} Locust workers over one process", setup, "x",
                                        "{:.2f}×")
    strict = {label: _most_unsaturated(runs[label], cores, machine_saturated) for label in ("in-process", locust_label)}
    if strict["in-process"]:
        figures["edges-ratio-machine"] = Figure(
            round(strict[locust_label] / strict["in-process"], 2),
            f"edges driven before the harness and the verifier together saturate the machine, {args.workers} Locust "
            f"workers over one process ({strict[locust_label]} and {strict['in-process']} edges)", setup, "x",
            "{:.2f}×")
    common = min(most_in, most_locust)
    if common:
        p95 = {label: statistics.median(r["tpot_p95_s"] for r in runs[label] if r["edges"] == common and
                                        r["tpot_p95_s"] is not None) for label in ("in-process", locust_label)}
        figures["tpot-p95-ratio"] = Figure(round(p95[locust_label] / p95["in-process"], 3),
                                           f"p95 TPOT at {common} edges, {args.workers} Locust workers over one "
                                           "process (median over repeats)", setup, "x", "{:.2f}×")
    added = [(b["round_trip_mean_s"], a["round_trip_mean_s"])
             for a, b in zip(runs["in-process (added)"], runs["locust x1"])
             if a.get("round_trip_mean_s") and b.get("round_trip_mean_s")]
    if added:
        diffs = [1e3 * (b - a) for b, a in added]
        figures["added-ms-per-round"] = Figure(round(statistics.median(diffs), 3),
                                               f"mean round time on the wire, one Locust worker over one process, "
                                               f"{args.added_at} edges each (median over repeats; spread "
                                               f"{min(diffs):.2f}..{max(diffs):.2f} ms)", setup, "ms", "{:+.2f} ms")
    counted = [r["committed_tokens"] / r["verifier_committed_tokens"] for r in runs[locust_label] + runs["locust x1"]
               if r.get("verifier_committed_tokens")]
    if counted:
        worst = max(counted, key=lambda x: abs(x - 1))
        figures["tokens-over-verifiers"] = Figure(round(worst, 4), "committed tokens in Locust's merged statistics "
                                                  "over the verifier's own counter, the run furthest from 1", setup,
                                                  "x", "{:.3f}×")
    reporting = [r["report_us_per_round"] for r in runs["locust x1"] if r.get("report_us_per_round")]
    if reporting:
        figures["report-us-per-round"] = Figure(round(statistics.median(reporting), 1),
                                                f"the edges' loop's time reporting to Locust per round, "
                                                f"{args.added_at} users on one worker", setup, "µs", "{:.1f} µs")
    for key, f in figures.items():
        print(f"{key}: {f.render()}  ({f.quantity})")
    table = Table(COLUMNS, rows, FMT)
    print(table.render())
    path = write_result(args.name, figures=figures, tables={args.profile: table}, load_start=load_start,
                        note=args.note, results_dir=Path(args.results_dir) if args.results_dir else None)
    print(f"wrote {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--edges", default="50,100,150,200,300,400", help="edge counts, each run by both harnesses")
    ap.add_argument("--workers", type=int, default=2, help="Locust workers (default 2)")
    ap.add_argument("--added-at", type=int, default=200, help="users per worker for the added-time comparison")
    ap.add_argument("--profile", default="lan")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds from spawning to the window (and every edge has committed)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--step-ms", type=float, default=20.0, help="the synthetic verifier's pass (flat)")
    ap.add_argument("--draft-ms", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--name", default="locust-capacity", help="bench/results/<name>.json")
    ap.add_argument("--results-dir", default="", help="where the result file goes (default bench/results)")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default="results/locust-capacity")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
