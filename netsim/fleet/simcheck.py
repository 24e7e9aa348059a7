"""The regime map's cells in the discrete-event simulation: one model answer per cell.

For a cell (GPU, target, context, link, α) the map (netsim.fleet.regime) picks each mode's operating
point: sessions n, γ, parked sessions. Here the simulator (netsim.fleet.simulation, the proxy's own
links with their jitter and loss, one pass at a time, acceptance drawn per round) runs that point
with the same cost, the same workload (prompt and generated tokens per request) and the same inputs,
and reports its tokens/s, p95 gap between bursts and TTFT beside the map's. The two agree on
tokens/s within `TOLERANCE` (tests/netsim/test_netsim_fleet_regime.py checks it): 5% for streams
(plain decoding, vLLM spec), 8% for the hybrid, whose wait at the verifier the map takes as half a
pass while the simulation queues each round behind the pass it finds (few sessions wait less, many
more), and where a pass's compute and memory terms vary from pass to pass (the map charges the
mean pass, the simulation the max of each pass's two terms). The simulation has no window of rounds
in flight, so the hybrid is checked one round at a time; the map's p95 gap has no pass-to-pass
variation, the simulation's does (it is the larger).

`python -m netsim.fleet.simcheck` writes bench/results/gpu-sim.json (the registry's tables).
"""
from __future__ import annotations

from dataclasses import replace

from netsim.fleet.costs import kv_sessions
from netsim.fleet.hostpath import HostPath, HostPathTable
from netsim.fleet.regime import SPEC_MODES, RegimeConfig, cell_costs, regime_cell, spec_cost
from netsim.fleet.simulation import FleetConfig, simulate

TOLERANCE = {"streams": 0.05, "hybrid": 0.08}   # relative, on committed tokens/s per GPU


def tolerance(mode: str) -> float:
    return TOLERANCE["hybrid" if mode.startswith("hybrid") else "streams"]
SIM_MODES = ("cloud-only", *SPEC_MODES, "hybrid, one round")
CHECK_CELLS = (("h200", "8b-bf16", 1024, "lte", 0.7), ("h200", "8b-bf16", 8192, "lan", 0.7),
               ("h200", "70b-fp8", 32768, "lan", 0.85), ("h100", "8b-bf16", 8192, "3g", 0.5),
               ("h100", "70b-fp8", 1024, "lte", 0.85))


def fleet_config_for(mode: str, point: dict, key: str, context: int, link: str, alpha: float, cfg: RegimeConfig,
                     device: HostPath, duration_s: float, warmup_s: float, seed: int = 1) -> FleetConfig:
    """The simulation of `mode` at the map's point in a cell: its cost, sessions, γ and parking."""
    target, cost = cell_costs(key, context, cfg, device)
    common = dict(edges=point["sessions"], batching=True, profiles=[link], max_tokens=cfg.max_tokens,
                  prompt_tokens=cfg.prompt_tokens, packing="fcfs", max_batch_tokens=1 << 22, duration_s=duration_s,
                  warmup_s=warmup_s, seed=seed, stagger=True, slo_tpot_s=cfg.slo_tpot_s)
    if mode == "cloud-only":
        return FleetConfig(mode="cloud-only", cost=cost, **common)
    if mode in SPEC_MODES:
        method = mode.split(", ", 1)[1]
        sc = spec_cost(target, key, method, cost, point["gamma"], cfg)
        return FleetConfig(mode="server-spec", cost=sc, gamma=point["gamma"],
                           alpha=cfg.ngram_alpha if method == "n-gram" else alpha, **common)
    parked = point["parked"] > 0
    return FleetConfig(mode="hybrid", cost=cost, gamma=point["gamma"], alpha=alpha, draft_s=cfg.draft_s,
                       edge_overhead_s=cfg.edge_s, round_work=cfg.round_work,
                       kv_capacity=kv_sessions(cfg.memory_bytes, cost) if parked else None,
                       kv_bytes_per_session=cost.kv_bytes_per_token * context, offload=cfg.offload if parked else None,
                       **common)


def sim_cell(gpu: str, key: str, context: int, link: str, alpha: float, cfg: RegimeConfig, device: HostPath,
             modes=SIM_MODES, duration_s: float = 12.0, warmup_s: float = 4.0, sim_link: str | None = None) -> list[dict]:
    """Each mode at the map's point: the map's figures and the simulation's side by side. `sim_link`
    simulates another link than the map's (a control)."""
    gcfg = replace(cfg, gpu=gpu)
    cell = regime_cell(key, context, link, alpha, gcfg, device)
    rows = []
    for mode in modes:
        point = cell["modes"][mode]
        row = {"gpu": gpu, "target": key, "context": context, "link": link, "alpha": alpha, "mode": mode,
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


def sim_check(cells=CHECK_CELLS, cfg: RegimeConfig | None = None, setting: str = "greedy", table=None,
              duration_s: float = 12.0, progress=None) -> list[dict]:
    cfg = cfg or RegimeConfig()
    device = (table or HostPathTable.load()).get("batched-on-device", setting)
    rows = []
    for cell in cells:
        if progress:
            progress(" ".join(map(str, cell)))
        rows += sim_cell(*cell, cfg, device, duration_s=duration_s)
    return rows


SIM_COLUMNS = ["GPU", "target", "context", "link", "α", "mode", "sessions", "γ", "map tok/s", "simulated tok/s",
               "error", "map p95 gap ms", "simulated p95 gap ms", "map TTFT ms", "simulated TTFT mean / p95 ms"]


def sim_rows(rows: list[dict]) -> list[list]:
    def ms(v):
        return None if v is None else round(v * 1e3, 1)
    out = []
    for r in rows:
        sim = "sim_tokens_per_s" in r
        out.append([r["gpu"], r["target"], f"{r['context'] // 1024}k", r["link"], r["alpha"], r["mode"], r["sessions"],
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = [round(x, 2) for x in os.getloadavg()]
    cfg = config_from_args(args)
    table = HostPathTable.load(args.host_path_table) if args.host_path_table else HostPathTable.load()
    rows = sim_check(cfg=cfg, setting=args.setting, table=table,
                     duration_s=args.duration, progress=logging.info)
    cells = Table(SIM_COLUMNS, sim_rows(rows), {"map tok/s": "{:,}", "simulated tok/s": "{:,}"})
    logging.info("%s", cells.render())
    errors = {kind: max((abs(r["error"]) for r in rows if "error" in r
                         and r["mode"].startswith("hybrid") == (kind == "hybrid")), default=0.0)
              for kind in TOLERANCE}
    if args.result:
        setup = (f"{len(CHECK_CELLS)} cells of the regime map, {len(SIM_MODES)} modes each, at the map's points; "
                 f"SLO {cfg.slo_on} <= {cfg.slo_tpot_s * 1e3:g} ms; {args.duration:g} s simulated per point")
        path = write_result(args.result, load_start=load, clock="model", note="a model: the figures do not depend on the machine",
                            tables={"cells": cells},
                            figures={**{f"max-error-{kind}": Figure(
                                         round(err, 4), f"largest |simulated / map - 1| of tokens/s per GPU, {kind}",
                                         setup, "", "{:.1%}") for kind, err in errors.items()},
                                     **{f"tolerance-{kind}": Figure(t, f"the agreement the test requires, {kind}",
                                                                    "tests/netsim/test_netsim_fleet_regime.py", "",
                                                                    "{:.0%}") for kind, t in TOLERANCE.items()}})
        logging.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
