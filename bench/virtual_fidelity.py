"""Fidelity of the virtual clock: the bundled pair's tokens/s on the virtual clock against a quiet
wall-clock run of the same experiment, cell by cell (link x mode x workload, the workload's prompts
pooled: tokens over seconds), with the error per cell.

    python bench/virtual_fidelity.py virtual [--costs smollm2]    # the virtual side (any machine, any load)
    python bench/virtual_fidelity.py wall [--repeats 1]            # the wall side: QUIET machine only
    python bench/virtual_fidelity.py compare                       # both -> bench/results/virtual-fidelity.json

Defaults: lan, lte, 3g, geo-sat; per-token, cloud-only, cloud-stepwise, hybrid γ 4, tree, pipeline,
continuations, window, fused, auto; chat, code, summarisation; 2 prompts each; 128 tokens; seed 1.
The wall side runs the wall-clock experiment's own measurement (netsim.experiment.Runner.measure:
a verifier process, the link proxy) prompt by prompt with every mode on each prompt, the modes'
order rotated per prompt and repeat; it refuses to start above 0.5 load per core (--busy-ok runs
anyway and marks the file busy) and records the load at start and end. Each side writes its rows to
bench/virtual/fidelity-<side>.json; `compare` reads both (the same configuration, else it refuses).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridspec.figures import Figure, Table, command_line, own_load, write_result  # noqa: E402
from hybridspec.machine import describe  # noqa: E402
from netsim.experiment import ExperimentConfig, Row, Runner, expand_modes, load_workloads, start_verifier  # noqa: E402
from netsim.profiles import get_profile  # noqa: E402

DATA = ROOT / "bench" / "virtual"
PROFILES = "lan,lte,3g,geo-sat"
MODES = "per-token,cloud-only,cloud-stepwise,hybrid,tree,pipeline,continuations,window,fused,auto"
WORKLOADS = "chat,code,summarisation"
QUIET = 0.5   # load per core


def config(args) -> ExperimentConfig:
    csv = lambda text: [t.strip() for t in text.split(",") if t.strip()]   # noqa: E731
    return ExperimentConfig(profiles=csv(args.profiles), modes=csv(args.modes), out=DATA, workloads=csv(args.workloads),
                            prompts_per_workload=args.prompts, max_tokens=args.max_tokens, gammas=[4], seed=args.seed,
                            pair="smollm2", crossover=False)


def same_config(cfg: ExperimentConfig) -> dict:
    return {"profiles": cfg.profiles, "modes": cfg.modes, "workloads": cfg.workloads,
            "prompts_per_workload": cfg.prompts_per_workload, "max_tokens": cfg.max_tokens, "seed": cfg.seed,
            "gammas": cfg.gammas, "qmode": cfg.qmode}


def load_per_core() -> float:
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def run_virtual(args) -> Path:
    from hybridspec.virtual import make_verifier
    from netsim.virtual.costs import load_table
    from netsim.virtual.experiment import run_virtual_experiment
    cfg, costs = config(args), load_table(args.costs)
    t0 = time.perf_counter()
    result = run_virtual_experiment(cfg, costs, make_verifier, workers=args.workers)
    doc = {"side": "virtual", "clock": "virtual", "config": same_config(cfg), "cost_table": result["cost_table"],
           "rows": result["rows"], "real_s": time.perf_counter() - t0, "machine": describe(), "command": command_line()}
    return _save("virtual", doc)


async def _wall_rows(cfg: ExperimentConfig, repeats: int, say) -> list[dict]:
    from netsim.proxy import LinkProxy
    runner = Runner(cfg)
    workloads = load_workloads(cfg.workloads, cfg.prompts_per_workload)
    modes = expand_modes(cfg.modes, cfg.gammas)
    rows: list[dict] = []
    proc, port = start_verifier(runner.verifier_args())
    try:
        for name in cfg.profiles:
            profile = get_profile(name)
            thread = LinkProxy(upstream=("127.0.0.1", port), profile=profile, seed=cfg.seed).start_in_thread()
            try:
                turn = 0
                for repeat in range(repeats):
                    for workload, index, prompt in workloads:
                        k = turn % len(modes)
                        for mode, gamma in modes[k:] + modes[:k]:   # interleaved, the order rotated each prompt
                            say(f"{name} r{repeat} {workload}{index} {mode}")
                            row: Row = await runner.measure(thread.proxy, thread.port, profile, mode, gamma, workload,
                                                            index, runner.prompt_ids(prompt), cfg.max_tokens,
                                                            chat=prompt)
                            rows.append({**row.__dict__, "repeat": repeat})
                        turn += 1
            finally:
                thread.stop()
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


def run_wall(args) -> Path:
    cfg = config(args)
    start = load_per_core()
    if start > QUIET and not args.busy_ok:
        raise SystemExit(f"virtual_fidelity wall: the machine is busy ({start:.2f} load per core, the limit is "
                         f"{QUIET}): wall-clock figures are taken quiet (--busy-ok runs anyway, marked busy)")
    t0 = time.perf_counter()
    rows = asyncio.run(_wall_rows(cfg, args.repeats, lambda what: print(f"\r{what:<60}", end="", file=sys.stderr)))
    end, own = load_per_core(), (own_load() or 0.0) / (os.cpu_count() or 1)
    print(file=sys.stderr)
    # The end reading counts this run's own processes (its edges and verifier): the rule of
    # hybridspec.figures, the machine's other load is the end less the run's own.
    doc = {"side": "wall", "clock": "wall", "config": same_config(cfg), "rows": rows, "repeats": args.repeats,
           "busy": max(start, end - own) > QUIET, "load_per_core": {"start": start, "end": end, "own": own},
           "real_s": time.perf_counter() - t0, "machine": describe(), "command": command_line()}
    return _save("wall", doc)


def _save(side: str, doc: dict) -> Path:
    DATA.mkdir(parents=True, exist_ok=True)
    path = DATA / f"fidelity-{side}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path} ({doc['real_s'] / 60:.1f} min)")
    return path


def cells(rows: list[dict]) -> dict[tuple[str, str, str], float]:
    """(profile, mode, workload) -> tokens/s over the cell's prompts (and repeats: their median)."""
    by = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for r in rows:
        acc = by[(r["profile"], r["mode"], r["workload"])][r.get("repeat", 0)]
        acc[0] += r["tokens"]
        acc[1] += r["wall_s"]
    return {k: statistics.median(t / s for t, s in reps.values() if s) for k, reps in by.items()}


def spread(rows: list[dict]) -> dict[tuple[str, str, str], float]:
    """Per cell, the repeats' (max - min) / median of tokens/s (0 with one repeat)."""
    by = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for r in rows:
        acc = by[(r["profile"], r["mode"], r["workload"])][r.get("repeat", 0)]
        acc[0] += r["tokens"]
        acc[1] += r["wall_s"]
    out = {}
    for k, reps in by.items():
        rates = [t / s for t, s in reps.values() if s]
        out[k] = (max(rates) - min(rates)) / statistics.median(rates) if len(rates) > 1 else 0.0
    return out


def compare(args) -> Path:
    wall, virtual = (json.loads((DATA / f"fidelity-{side}.json").read_text()) for side in ("wall", "virtual"))
    if wall["config"] != virtual["config"]:
        raise SystemExit(f"the two sides ran different configurations:\n wall {wall['config']}\n virtual "
                         f"{virtual['config']}")
    w, v, sp = cells(wall["rows"]), cells(virtual["rows"]), spread(wall["rows"])
    keys = [k for k in w if k in v]
    errors = {k: (v[k] - w[k]) / w[k] for k in keys if w[k]}
    table = Table(["link", "mode", "workload", "wall tok/s", "virtual tok/s", "error", "wall spread"],
                  [[p, m, wl, w[(p, m, wl)], v[(p, m, wl)], errors.get((p, m, wl)), sp.get((p, m, wl))]
                   for p, m, wl in keys],
                  fmt={"wall tok/s": "{:.2f}", "virtual tok/s": "{:.2f}", "error": "{:+.1%}", "wall spread": "{:.0%}"})
    absolute = sorted(abs(e) for e in errors.values())
    per_mode = defaultdict(list)
    for (p, m, wl), e in errors.items():
        per_mode[m].append(abs(e))
    by_mode = Table(["mode", "median abs error", "largest abs error", "cells over 12 %"],
                    [[m, statistics.median(es), max(es), sum(e > 0.12 for e in es)] for m, es in per_mode.items()],
                    fmt={"median abs error": "{:.1%}", "largest abs error": "{:.1%}"})
    busy = wall.get("busy", True)
    setup = (f"bundled pair, {', '.join(wall['config']['profiles'])}, {len(per_mode)} modes, "
             f"{', '.join(wall['config']['workloads'])}, {wall['config']['max_tokens']} tokens; virtual on "
             f"`{virtual['cost_table']['name']}`" + ("; wall side BUSY" if busy else ""))
    figures = {
        "median-abs-error": Figure(statistics.median(absolute), "median |virtual − wall| / wall tokens/s over the cells",
                                   setup, "", "{:.1%}"),
        "largest-abs-error": Figure(absolute[-1], "largest |virtual − wall| / wall tokens/s of a cell", setup, "",
                                    "{:.1%}"),
        "cells-over-limit": Figure(sum(e > 0.12 for e in absolute), "cells whose error is above 12 %", setup, "",
                                   "{:d}"),
    }
    path = write_result(args.name, figures=figures, tables={"cells": table, "by-mode": by_mode},
                        command=wall["command"], load_start=None,
                        note=f"wall: {wall['command']} on {wall['machine'].get('cpu_model', '?')}, load per core "
                             f"{wall['load_per_core']['start']:.2f} -> {wall['load_per_core']['end']:.2f}"
                             + (f" ({wall['load_per_core']['own']:.2f} of it the run's own)"
                                if wall["load_per_core"].get("own") else "")
                             + (" (BUSY: not a quiet figure)" if busy else "") + f"; virtual: {virtual['command']}")
    doc = json.loads(path.read_text())
    doc.update(clock="wall+virtual", cost_table=virtual["cost_table"]["name"], wall_busy=busy,
               load={"start": [wall["load_per_core"]["start"] * (os.cpu_count() or 1)],
                     "end": [wall["load_per_core"]["end"] * (os.cpu_count() or 1)],
                     "own": (wall["load_per_core"].get("own") or 0.0) * (os.cpu_count() or 1)})
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(by_mode.render())
    print(f"median |error| {statistics.median(absolute):.1%}, largest {absolute[-1]:.1%}; wrote {path}")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("side", choices=["virtual", "wall", "compare"])
    parser.add_argument("--profiles", default=PROFILES)
    parser.add_argument("--modes", default=MODES)
    parser.add_argument("--workloads", default=WORKLOADS)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--costs", default="smollm2", help="(virtual) the cost table: a shipped name or a file")
    parser.add_argument("--workers", type=int, default=2, help="(virtual) processes, a link each at a time")
    parser.add_argument("--repeats", type=int, default=1, help="(wall) runs of every cell; the median is compared")
    parser.add_argument("--busy-ok", action="store_true", help="(wall) run on a busy machine: the file says busy")
    parser.add_argument("--name", default="virtual-fidelity", help="(compare) the result's name")
    args = parser.parse_args()
    {"virtual": run_virtual, "wall": run_wall, "compare": compare}[args.side](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
