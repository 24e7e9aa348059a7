"""The virtual clock's subcommands of `netsim`: `calibrate` (measure a cost table) and `sweep` (the
synthetic grid). `netsim experiment --clock virtual` is the experiment's own option (netsim.cli)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _run_calibrate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hybridspec.calibrate import NotQuiet, calibrate

    models = args.resolve_models(args)
    from llama_runtime import bundled_model_path
    from edge_client.drafters import DEFAULT_DRAFT
    target = models.target or str(bundled_model_path())
    draft = models.draft or str(DEFAULT_DRAFT)
    name = args.name or models.pair or "smollm2"
    out = Path(args.out or f"costs/{name}.json")
    console = Console(stderr=True)
    try:
        with console.status("calibrating") as status:
            table = calibrate(name, target, draft, out, threads=args.threads, busy_ok=args.busy_ok,
                              say=lambda what: status.update(what))
    except NotQuiet as e:
        print(f"netsim calibrate: {e}", file=sys.stderr)
        return 3
    v, e = table.verifier, table.edge
    curve = ", ".join(f"{t} rows {s * 1e3:.1f} ms" for t, s in v.round_curve)
    print(f"{table.label()}: rounds {curve}; a prompt token {v.per_token_s * 1e3:.2f} ms; verifier host "
          f"{v.host_round_s * 1e3:.2f} ms/round + "
          f"{v.host_row_s * 1e3:.3f} ms/row, stream {v.stream_token_s * 1e3:.2f} ms/token; drafting "
          f"{e.draft_base_s * 1e3:.2f} ms + {e.draft_row_s * 1e3:.2f} ms/row (a tree's row "
          f"{e.draft_tree_row_s * 1e3:.2f} ms); edge host {e.host_round_s * 1e3:.2f} "
          f"ms/round; load per core {table.load['start_per_core']:.2f} -> {table.load['end_per_core']:.2f}")
    print(f"wrote {out}")
    return 0


def add_calibrate_command(subparsers, add_model_options, resolve_models) -> None:
    """`netsim calibrate`, with netsim.cli's model options (--pair, --target, --draft) and their reader."""
    parser = subparsers.add_parser(
        "calibrate", help="measure a pair's and its verifier's costs here: the cost table for --clock virtual",
        description="Measure drafting per row, the verifier's pass over tokens and rows read, its acceptance "
                    "maths per row and the host path per round on this machine (quiet: at most 0.5 load per core "
                    "at start and end), and write the cost table that `netsim experiment --clock virtual --costs "
                    "FILE` reads.")
    add_model_options(parser, "target GGUF (default: bundled SmolLM2)")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads of the draft and of the verifier "
                                                               "(the experiment's default: 1 each)")
    parser.add_argument("--name", help="the table's name (default: the pair's)")
    parser.add_argument("--out", help="where to write the table (default: costs/NAME.json)")
    parser.add_argument("--busy-ok", action="store_true",
                        help="measure on a busy machine anyway: the table is marked busy (for development only)")
    parser.set_defaults(run=_run_calibrate, synthetic=False, resolve_models=resolve_models)


def _floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def _run_sweep(args: argparse.Namespace) -> int:
    import itertools
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from netsim.experiment import ALL_MODES
    from netsim.virtual.sweep import SWEEP_MODES, Cell, grid_result, run_grid
    from netsim.virtual.sweep_report import write_all

    modes = list(SWEEP_MODES) if args.modes == "all" else [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        raise SystemExit(f"netsim sweep: unknown modes {unknown}; choose from {', '.join(SWEEP_MODES)} or 'all'")
    cells = [Cell(*values, args.tokens, args.seed) for values in itertools.product(
        _floats(args.rtts), _floats(args.drafts), _floats(args.passes), _floats(args.slopes), _floats(args.alphas))]
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task(f"sweep ({args.workers} workers)", total=len(cells))
        results = run_grid(cells, args.workers, modes, progress=lambda cell: bar.advance(task))
    paths = write_all(grid_result(results, modes), Path(args.out))
    print(f"{len(cells)} cells in {time.perf_counter() - t0:.0f} s; wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def add_sweep_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "sweep", help="the synthetic pair over a grid of links and costs on the virtual clock, every mode",
        description="Run every mode on every cell of a grid (round trip x drafting x pass x per-token slope x α) "
                    "with the synthetic pair on the virtual clock, and write sweep.json, sweep.md and plots "
                    "(tokens/s per mode against the round trip; the best mode per cell). The default grid has 216 "
                    "cells of 256 tokens (netsim.virtual.sweep.default_grid).")
    parser.add_argument("--rtts", default="1,20,80,200,400,600", help="round trips, ms")
    parser.add_argument("--drafts", default="1,8,30", help="drafting per row, ms")
    parser.add_argument("--passes", default="5,40,150", help="the verifier's pass: its base, ms")
    parser.add_argument("--slopes", default="0,1", help="the pass's per-token cost as a share of its base")
    parser.add_argument("--alphas", default="0.4,0.9", help="the draft's expected per-token acceptance")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per run")
    parser.add_argument("--modes", default="all", help="all (every mode but edge-only), or a comma-separated subset")
    parser.add_argument("--seed", type=int, default=1, help="seed of the sampling (each cell's own runs)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (cells are independent)")
    parser.add_argument("--out", default="results/sweep", help="output folder")
    parser.set_defaults(run=_run_sweep)
