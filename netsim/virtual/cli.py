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
    print(f"{table.label()}: pass {v.base_s * 1e3:.2f} ms + {v.per_token_s * 1e3:.3f} ms/token + "
          f"{v.per_row_s * 1e3:.3f} ms/row read; verifier host {v.host_round_s * 1e3:.2f} ms/round + "
          f"{v.host_row_s * 1e3:.3f} ms/row, stream {v.stream_token_s * 1e3:.2f} ms/token; drafting "
          f"{e.draft_base_s * 1e3:.2f} ms + {e.draft_row_s * 1e3:.2f} ms/row; edge host {e.host_round_s * 1e3:.2f} "
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
