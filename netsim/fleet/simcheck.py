"""The regime map's cells in the discrete-event simulation: one model answer per cell, and its error.

For a cell (GPU, target, context, link, device draft) the map (netsim.fleet.regime) picks each mode's
operating point: sessions n, γ, continuations, parked sessions. Here the simulator
(netsim.fleet.simulation: the proxy's own links with their jitter and loss, one pass at a time, each
pass charged its own rounds and prompts, acceptance drawn per round from each side's curve, a window
of rounds in flight with continuations that hit or miss, the device's prefill of each request) runs
that point with the same cost, the same workload and the same inputs, and reports its tokens/s, p95
gap between bursts and TTFT beside the map's. Every mode is checked, rounds in flight included.

The cells checked (`check_cells`): every cell of the map (both GPUs) where the hybrid wins or comes
within 10% of the better baseline, plus `CHECK_CELLS` (a spread of the rest). The largest
|simulated / map − 1| found is the model's stated error (netsim.fleet.modelerror): a map ratio within
it of 1 is a tie. tests/netsim/test_netsim_fleet_regime.py requires `TOLERANCE` on its cells.

Where the two differed and why (found on the 70B at 1k context, where the simulation was 14% below):
a pass that holds a new request's 128-token prompt is compute-bound while the mean pass is not, so
the map now charges each pass's roofline over the number of prompts it holds (regime.mean_pass_s);
and with links shorter than a pass the sessions that share a pass keep the group sizes their start
gave them, unless something moves them (the device's prefill of each request does: it is charged in
both now, and the sessions start over a second). A pipelined round's drafting includes its
continuations', which delays the round after it (regime._period).

`python -m netsim.fleet.simcheck` writes bench/results/gpu-sim.json (the registry's tables).
"""
from __future__ import annotations

from dataclasses import replace

from netsim.fleet.costs import kv_sessions
from netsim.fleet.hostpath import HostPath, HostPathTable
from netsim.fleet.regime import HYBRID_MODES, SPEC_MODES, RegimeConfig, as_curve, cell_costs, regime_cell, spec_cost
from netsim.fleet.simulation import FleetConfig, simulate

TOLERANCE = {"streams": 0.05, "hybrid": 0.05}   # relative, on committed tokens/s per GPU (the test's cells)
# The sessions start over the first second (of 4 s of warm-up): with links shorter than a pass, the
# groups of sessions that share a pass keep the sizes their start gave them (netsim.fleet.simulation).
START_SPREAD_S = 1.0


def tolerance(mode: str) -> float:
    return TOLERANCE["hybrid" if mode.startswith("hybrid") else "streams"]
SIM_MODES = ("cloud-only", *SPEC_MODES, *HYBRID_MODES)
# (GPU, target, context, link, device draft: a name of regime.default_drafts(), a curve key, or a flat α)
CHECK_CELLS = (("h200", "8b-bf16", 1024, "lte", "τ4 2.50"), ("h200", "8b-bf16", 8192, "lan", "τ4 3.08 (= EAGLE-3)"),
               ("h200", "70b-fp8", 32768, "lan", "τ4 3.80"), ("h100", "8b-bf16", 8192, "3g", "τ4 2.50"),
               ("h100", "70b-fp8", 1024, "lte", "τ4 3.80"), ("h200", "70b-fp8", 1024, "lan", "τ4 3.08 (= EAGLE-3)"))
NEAR = 0.9   # a cell where the hybrid reaches this share of the better baseline is checked


def draft_named(draft):
    """A device draft from a cell's name: one of the map's default drafts, a curve key, else a flat α."""
    from netsim.fleet.acceptance import get_curve
    from netsim.fleet.regime import default_drafts
    if not isinstance(draft, str):
        return draft
    for curve in default_drafts():
        if curve.name == draft:
            return curve
    return get_curve(draft)


def check_cells(cfg: RegimeConfig, table=None, setting: str = "greedy", gpus=("h100", "h200")) -> list[tuple]:
    """Every map cell where the hybrid wins or comes within 10% of the better baseline, then CHECK_CELLS."""
    from netsim.fleet.regime import regime_map
    from netsim.fleet.regime_report import hybrid_best
    result = regime_map(gpus=gpus, setting=setting, cfg=cfg, table=table)
    near = [(c["gpu"], c["target"], c["context"], c["link"], c["draft"]) for c in result["cells"]
            if (c["modes"][hybrid_best(c)]["x_best"] or 0.0) >= NEAR]
    return list(dict.fromkeys([*near, *CHECK_CELLS]))


def fleet_config_for(mode: str, point: dict, key: str, context: int, link: str, alpha: float, cfg: RegimeConfig,
                     device: HostPath, duration_s: float, warmup_s: float, seed: int = 1) -> FleetConfig:
    """The simulation of `mode` at the map's point in a cell: its cost, sessions, γ and parking."""
    target, cost = cell_costs(key, context, cfg, device)
    common = dict(edges=point["sessions"], batching=True, profiles=[link], max_tokens=cfg.max_tokens,
                  prompt_tokens=cfg.prompt_tokens, packing="fcfs", max_batch_tokens=1 << 22, duration_s=duration_s,
                  warmup_s=warmup_s, seed=seed, stagger=True, slo_tpot_s=cfg.slo_tpot_s, start_spread_s=START_SPREAD_S)
    if mode == "cloud-only":
        return FleetConfig(mode="cloud-only", cost=cost, **common)
    if mode in SPEC_MODES:
        method = mode.split(", ", 1)[1]
        sc = spec_cost(target, key, method, cost, point["gamma"], cfg)
        return FleetConfig(mode="server-spec", cost=sc, gamma=point["gamma"],
                           curve=cfg.curve(method, as_curve(alpha)), **common)
    parked = point["parked"] > 0
    flight = {}
    if mode == "hybrid, in flight" and point["continuations"]:
        flight = dict(window=cfg.window_(), continuations=point["continuations"], hit=point["hit"],
                      bytes_per_continuation=cfg.bytes_per_continuation_())
    return FleetConfig(mode="hybrid", **flight, cost=cost, gamma=point["gamma"], curve=as_curve(alpha),
                       draft_s=cfg.draft_s_at(context), request_edge_s=cfg.prefill_s(),
                       edge_overhead_s=cfg.edge_s, round_work=cfg.round_work,
                       kv_capacity=kv_sessions(cfg.memory_bytes, cost) if parked else None,
                       kv_bytes_per_session=cost.kv_bytes_per_token * context, offload=cfg.offload if parked else None,
                       **common)


def sim_cell(gpu: str, key: str, context: int, link: str, alpha: float, cfg: RegimeConfig, device: HostPath,
             modes=SIM_MODES, duration_s: float = 12.0, warmup_s: float = 4.0, sim_link: str | None = None) -> list[dict]:
    """Each mode at the map's point: the map's figures and the simulation's side by side. `sim_link`
    simulates another link than the map's (a control)."""
    gcfg = replace(cfg, gpu=gpu)
    alpha = draft_named(alpha)
    cell = regime_cell(key, context, link, alpha, gcfg, device)
    rows = []
    for mode in modes:
        point = cell["modes"][mode]
        row = {"gpu": gpu, "target": key, "context": context, "link": link, "draft": cell["draft"], "mode": mode,
               "sessions": point["sessions"], "gamma": point["gamma"], "parked": point["parked"],
               "model_tokens_per_s": point["tokens_per_s"], "model_gap_p95_s": point["gap_p95_s"],
               "model_ttft_s": point["ttft_s"], "model_tpot_s": point["tpot_s"]}
        if point["sessions"]:
            sim = simulate(fleet_config_for(mode, point, key, context, sim_link or link, alpha, gcfg, device,
                                            duration_s, warmup_s))
            row.update(sim_tokens_per_s=sim["committed_tokens_per_s"], sim_gap_p95_s=sim["gap_p95_s"],
                       sim_gap_mean_s=sim["gap_mean_s"], sim_ttft_mean_s=sim["ttft_mean_s"],
                       sim_ttft_p95_s=sim["ttft_p95_s"])
            row["error"] = row["sim_tokens_per_s"] / row["model_tokens_per_s"] - 1.0
        rows.append(row)
    return rows


def sim_check(cells=None, cfg: RegimeConfig | None = None, setting: str = "greedy", table=None,
              duration_s: float = 12.0, progress=None) -> list[dict]:
    """Each cell's modes simulated (cells None: `check_cells`)."""
    cfg = cfg or RegimeConfig()
    table = table or HostPathTable.load()
    device = table.get("batched-on-device", setting)
    cells = check_cells(cfg, table, setting) if cells is None else cells
    rows = []
    for cell in cells:
        if progress:
            progress(" ".join(map(str, cell)))
        rows += sim_cell(*cell, cfg, device, duration_s=duration_s)
    return rows


SIM_COLUMNS = ["GPU", "target", "context", "link", "device draft", "mode", "sessions", "γ", "map tok/s", "simulated tok/s",
               "error", "map p95 gap ms", "simulated p95 gap ms", "map TTFT ms", "simulated TTFT mean / p95 ms"]


def sim_rows(rows: list[dict]) -> list[list]:
    def ms(v):
        return None if v is None else round(v * 1e3, 1)
    out = []
    for r in rows:
        sim = "sim_tokens_per_s" in r
        out.append([r["gpu"], r["target"], f"{r['context'] // 1024}k", r["link"], r["draft"], r["mode"], r["sessions"],
                    r["gamma"], round(r["model_tokens_per_s"]), round(r["sim_tokens_per_s"]) if sim else None,
                    f"{100 * r['error']:+.1f}%" if sim else None, ms(r["model_gap_p95_s"]),
                    ms(r.get("sim_gap_p95_s")), ms(r["model_ttft_s"]),
                    f"{ms(r.get('sim_ttft_mean_s'))} / {ms(r.get('sim_ttft_p95_s'))}" if sim else None])
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m netsim.fleet.simcheck`: the map's points simulated, into the figures registry."""
    import argparse
    import logging
    import os

    from hybridspec.figures import Figure, Table, write_result
    from netsim.fleet.regime import config_from_args, regime_arguments
    parser = argparse.ArgumentParser(prog="python -m netsim.fleet.simcheck", description=__doc__.split("\n")[0])
    regime_arguments(parser)
    parser.add_argument("--duration", type=float, default=12.0, help="simulated seconds per point (after 4 s warm-up)")
    parser.add_argument("--result", default="gpu-sim", help="the result's name in bench/results/ ('' for none)")
    parser.add_argument("--cells", default="near", choices=("near", "fixed"),
                        help="near: every cell within 10%% of the better baseline and the fixed ones; fixed: CHECK_CELLS")
    parser.add_argument("--part", default="1/1", help="I/N: simulate every N-th cell from the I-th (parallel runs)")
    parser.add_argument("--rows-out", default=None, help="also write the simulated rows (JSON) here")
    parser.add_argument("--merge", nargs="*", default=None,
                        help="no simulation: the registry from --rows-out files of the parts")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = [round(x, 2) for x in os.getloadavg()]
    cfg = config_from_args(args)
    table = HostPathTable.load(args.host_path_table) if args.host_path_table else HostPathTable.load()
    import json
    from pathlib import Path
    checked = check_cells(cfg, table, args.setting) if args.cells == "near" else list(CHECK_CELLS)
    if args.merge is not None:
        rows = [r for path in args.merge for r in json.loads(Path(path).read_text())]
    else:
        i, n = (int(x) for x in args.part.split("/"))
        mine = checked[i - 1::n]
        logging.info("%d cells to simulate (part %s of %d)", len(mine), args.part, len(checked))
        rows = sim_check(mine, cfg=cfg, setting=args.setting, table=table, duration_s=args.duration,
                         progress=logging.info)
        if args.rows_out:
            Path(args.rows_out).write_text(json.dumps(rows, indent=1))
    cells = Table(SIM_COLUMNS, sim_rows(rows), {"map tok/s": "{:,}", "simulated tok/s": "{:,}"})
    logging.info("%s", cells.render())
    errors = {kind: max((abs(r["error"]) for r in rows if "error" in r
                         and r["mode"].startswith("hybrid") == (kind == "hybrid")), default=0.0)
              for kind in TOLERANCE}
    if args.result:
        setup = (f"{len(checked)} cells of the regime map (the hybrid within {1 - NEAR:.0%} of the better baseline, "
                 f"and {len(CHECK_CELLS)} fixed), {len(SIM_MODES)} modes each, at the map's points; "
                 f"SLO {cfg.slo_on} <= {cfg.slo_tpot_s * 1e3:g} ms; {args.duration:g} s simulated per point")
        path = write_result(args.result, load_start=load, clock="model", note="a model: the figures do not depend on the machine",
                            tables={"cells": cells},
                            figures={"max-error": Figure(round(max(errors.values()), 4), "largest |simulated / map - 1| "
                                                         "of tokens/s per GPU, every mode: the map's stated error",
                                                         setup, "", "{:.1%}"),
                                     "cells-checked": Figure(len(checked), "map cells simulated", setup, "cells"),
                                     **{f"max-error-{kind}": Figure(
                                         round(err, 4), f"largest |simulated / map - 1| of tokens/s per GPU, {kind}",
                                         setup, "", "{:.1%}") for kind, err in errors.items()},
                                     **{f"tolerance-{kind}": Figure(t, f"the agreement the test requires, {kind}",
                                                                    "tests/netsim/test_netsim_fleet_regime.py", "",
                                                                    "{:.0%}") for kind, t in TOLERANCE.items()}})
        logging.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
