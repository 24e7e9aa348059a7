"""The synthetic grid on the virtual clock: every mode on 216 cells (netsim.virtual.sweep.default_grid),
the table of best modes and the plots for docs/netsim.md.

    python bench/virtual_sweep.py [--workers 2] [--tokens 256]

Writes bench/results/virtual-sweep.json (the registry's result: best-mode counts, every cell's
tokens/s per mode, and the raw sweep under "sweep"; `"clock": "virtual"`) and renders
docs/img/virtual-sweep-*.png from it (netsim.virtual.sweep_report). The cells' figures are virtual and
do not depend on the machine; the grid's own duration (real and CPU seconds) does, and says so.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridspec.figures import Figure, Table, write_result  # noqa: E402
from netsim.virtual.sweep import SWEEP_MODES, default_grid, grid_result, run_grid  # noqa: E402
from netsim.virtual.sweep_report import plot  # noqa: E402

IMG = ROOT / "docs" / "img"


def cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--name", default="virtual-sweep")
    parser.add_argument("--cells", type=int, help="run only every k-th cell, k = 216 // CELLS (a quick check)")
    args = parser.parse_args()
    load_start = list(os.getloadavg())
    cells = default_grid(args.tokens)
    if args.cells:
        cells = cells[:: max(1, len(cells) // args.cells)]
    t0, c0 = time.perf_counter(), cpu_s()
    done = [0]

    def progress(cell) -> None:
        done[0] += 1
        print(f"\r{done[0]}/{len(cells)} cells, {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    results = run_grid(cells, args.workers, SWEEP_MODES, progress=progress)
    real_s, used_s = time.perf_counter() - t0, cpu_s() - c0
    print(file=sys.stderr)
    sweep = grid_result(results, SWEEP_MODES)
    modes = list(sweep["cells"][0]["tokens_per_s"])
    wins = collections.Counter(c["best"] for c in sweep["cells"])
    best = Table(["mode", "cells where it is best"], [[m, wins.get(m, 0)] for m in sorted(modes, key=lambda m: -wins.get(m, 0))])
    every = Table(["RTT ms", "draft ms/row", "pass ms", "slope", "α", "best", *modes],
                  [[c["cell"]["rtt_ms"], c["cell"]["draft_ms"], c["cell"]["pass_ms"], c["cell"]["slope"],
                    c["cell"]["alpha"], c["best"], *(c["tokens_per_s"][m] for m in modes)] for c in sweep["cells"]],
                  fmt={"slope": "{:.0%}", **{m: "{:.1f}" for m in modes}})
    busy = max(load_start[0], os.getloadavg()[0]) / (os.cpu_count() or 1) > 0.5
    figures = {
        "cells": Figure(len(cells), "cells in the grid, every mode each", f"synthetic pair, {args.tokens} tokens", "",
                        "{:d}"),
        "grid-minutes": Figure(real_s / 60, "minutes the grid took, real time" + (" (BUSY machine)" if busy else ""),
                               f"{args.workers} worker processes on this machine", "min", "{:.1f} min"),
        "grid-cpu-minutes": Figure(used_s / 60, "CPU minutes the grid took, all processes",
                                   f"{args.workers} worker processes", "min", "{:.1f} CPU min"),
    }
    path = write_result(args.name, figures=figures, tables={"best-modes": best, "cells": every},
                        load_start=load_start,
                        note="virtual clock: the cells' figures are the cost model's, the same on any machine; the "
                             "grid's duration is this machine's" + (", measured busy" if busy else ""))
    doc = json.loads(path.read_text())
    doc.update(clock="virtual", cost_table=sweep["cost_table"], sweep=sweep)
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    IMG.mkdir(parents=True, exist_ok=True)
    for kind, made in plot(sweep, IMG).items():
        shutil.move(made, IMG / f"{args.name}-{kind}.png")
    print(best.render())
    print(f"{len(cells)} cells in {real_s / 60:.1f} min ({used_s / 60:.1f} CPU min); wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
