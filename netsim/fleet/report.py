"""The fleet report: each load run checked against the simulator calibrated on it, then capacity.

Capacity (`capacity.edges_per_verifier`): the largest n whose simulated p95 time per output token
meets the SLO, by bisection; `capacity_table` turns it into verifiers per N edges for each scenario
(the CPU backend as measured, serial and batched, and a GPU roofline). `run_fleet` does it all
and returns a JSON-ready dict; `fleet_markdown` and `fleet_plot` draw it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from netsim.fleet.calibration import Calibration, calibrate_from_load, fleet_config, load_schedule, run_alpha
from netsim.fleet.capacity import edges_per_verifier
from netsim.fleet.costs import H100, H200, LinearCost, kv_sessions
from netsim.fleet.hostpath import PATHS, HostPathTable, stream_rows
from netsim.fleet.simulation import simulate


CHECK_SEEDS = 21


def check_against_load(result: dict, params: Calibration, seeds: int = CHECK_SEEDS) -> list[dict]:
    """Simulate each (edges, mode) of a load result as the load test ran it (its window and warm-up, its
    harness, the run's own α, its verifier's schedule) with `seeds` seeds; simulated vs measured
    throughput and p95 TPOT.

    Simulated throughput is the mean over seeds; simulated p95 the median, with the 10th to 90th
    percentile of the seeds' p95s: a window of a few requests makes a p95 little more than its
    largest value, so one measured p95 is one draw from a spread about that wide."""
    rows = []
    for run in result["runs"]:
        if run["mode"] not in ("hybrid", "cloud-only"):
            continue
        # A short window holds few requests, and the synthetic pair's acceptance differs from request to
        # request (one edge on 3g for 10 s: one or two requests): the run's own α is an input, as its link is.
        alpha = run_alpha(run, params.gamma) or params.alpha
        schedule = load_schedule(result) if params.batching else {}
        sims = [simulate(fleet_config(params, run["edges"], run["mode"], params.batching, harness=True,
                                      alpha=alpha, duration_s=run["duration_s"], warmup_s=run["warmup_s"], seed=seed,
                                      **schedule))
                for seed in range(1, seeds + 1)]
        p95s = [s["tpot_p95_s"] for s in sims if s["tpot_p95_s"] is not None]
        row = {"edges": run["edges"], "mode": run["mode"], "alpha": alpha if run["mode"] == "hybrid" else None,
               "measured_tokens_per_s": run["committed_tokens_per_s"],
               "simulated_tokens_per_s": float(np.mean([s["committed_tokens_per_s"] for s in sims])),
               "measured_tpot_p95_s": run["tpot_p95_s"],
               "simulated_tpot_p95_s": float(np.median(p95s)) if p95s else None,
               "simulated_tpot_p95_range_s": [float(np.percentile(p95s, 10)), float(np.percentile(p95s, 90))]
               if p95s else None}
        for key in ("tokens_per_s", "tpot_p95_s"):
            m, s = row[f"measured_{key}"], row[f"simulated_{key}"]
            row[f"{key}_error"] = (s - m) / m if m and s is not None else None
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Scenario:
    """A row group of the capacity table: a verifier with its calibration."""
    name: str
    params: Calibration
    batching: bool
    packing: str = "fair-share"         # FleetConfig.packing


def capacity_table(scenarios: list[Scenario], modes: list[str], slo_s: float,
                   totals: list[int], duration_s: float = 20.0, max_edges: int = 1 << 14,
                   slo_ttft_s: float | None = None) -> list[dict]:
    rows = []
    for s in scenarios:
        for mode in modes:
            per_verifier, sim = edges_per_verifier(
                lambda n: fleet_config(s.params, n, mode, s.batching, packing=s.packing), slo_s,
                max_edges=max_edges, duration_s=duration_s, slo_ttft_s=slo_ttft_s)
            row = {"backend": s.name, "mode": mode, "batching": s.batching, "edges_per_verifier": per_verifier,
                   "tokens_per_s_per_verifier": sim["committed_tokens_per_s"] if sim else None,
                   "goodput_tokens_per_s_per_verifier": sim.get("goodput_tokens_per_s") if sim and per_verifier else None,
                   "tpot_p95_s": sim["tpot_p95_s"] if sim else None,
                   "capped": per_verifier >= max_edges}
            for total in totals:
                row[f"verifiers_for_{total}"] = math.ceil(total / per_verifier) if per_verifier else None
            rows.append(row)
    return rows


GPU_BATCH_TOKENS = 4096   # the GPU scheduler's tokens per step, whole requests first come (our assumption)


def run_fleet(load_results: list[dict], *, slo_s: float, totals: list[int], profiles: list[str],
              cpu_per_token_s: float, gpu: str, cpu_cost: LinearCost | None = None, cpu_ubatch: int | None = None,
              gpu_alpha: float, gpu_draft_s: float, gpu_context: int, gpu_overhead_s: float,
              capacity_duration_s: float = 12.0, progress=None, slo_ttft_s: float | None = None,
              gpu_cases: list | None = None, gpu_duration_s: float = 6.0, specedge: dict | None = None,
              host_path: str = "batched-on-device", host_setting: str = "greedy", gpu_max_tokens: int = 256,
              gpu_prompt_tokens: int = 128) -> dict:
    """Calibrate on each load result and check against it; then the capacity table, whose serial rows take
    the first serial calibration's parameters and whose batched rows (and the GPU case's edges) the first
    batched one's (either falls back to the first calibration). The GPU's host path per pass is the
    measured table's row (netsim.fleet.hostpath): `host_path` for the hybrid's rounds at `host_setting`
    (by default the batched call in the engine, which the vLLM backend's sessions ship; a GPU case
    naming its own path is charged that row), vLLM's sampler on the device for cloud-only streams."""
    calibrations, checks = [], []
    for load in load_results:
        params = calibrate_from_load(load, per_token_s=cpu_per_token_s)
        if progress:
            progress(f"check: {' '.join(load['config'].get('verifier_args') or []) or 'serial'}, "
                     f"{','.join(load['config']['profiles'])}")
        calibrations.append(params)
        checks.append({"load_config": {k: load["config"].get(k) for k in (
                           "out", "profiles", "duration_s", "warmup_s", "synthetic", "synthetic_step_ms", "gamma",
                           "draft_ms", "max_tokens", "verifier_args")},
                       "calibration": params.describe(), "rows": check_against_load(load, params)})
    serial = next((i for i, p in enumerate(calibrations) if not p.batching), 0)
    batched = next((i for i, p in enumerate(calibrations) if p.batching), 0)

    def cpu_scenario(params: Calibration) -> Calibration:
        return replace(params, profiles=profiles,
                       # a measured cost curve instead of the load run's own pass cost
                       cost=params.cost if cpu_cost is None else cpu_cost,
                       max_batch_tokens=params.max_batch_tokens if cpu_ubatch is None else cpu_ubatch)
    cpu_serial, cpu_batched = cpu_scenario(calibrations[serial]), cpu_scenario(calibrations[batched])
    gpu_spec, memory = (H200, 141e9) if gpu == "h200" else (H100, 80e9)
    table = HostPathTable.load()
    device_row = table.get("batched-on-device", host_setting)
    # The GPU case is the regime map's cell (netsim.fleet.regime: its efficiencies, its workload of
    # `gpu_prompt_tokens` new and `gpu_max_tokens` generated tokens a request), so both give one answer.
    from netsim.fleet.regime import RegimeConfig, cell_costs
    gpu_model = replace(cell_costs("8b-bf16", gpu_context, RegimeConfig(gpu=gpu), device_row)[1],
                        host=table.get(host_path, host_setting),
                        stream_host=stream_rows(device_row, calibrations[batched].gamma))
    # The GPU verifier's CPU per round is our assumption and nothing else is left of the Python
    # server's time; a GPU engine keeps its streams in its batch (their next token is in the next
    # step, the streaming runs beside the GPU). The edges keep their calibrated figures.
    gpu_scenario = Scenario(f"{gpu.upper()} roofline, batched", replace(
        calibrations[batched], profiles=profiles, cost=gpu_model, alpha=gpu_alpha, draft_s=gpu_draft_s,
        server_cpu_s=gpu_overhead_s, cloud_server_cpu_s=0.0, server_overhead_s=0.0, cloud_server_overhead_s=0.0,
        max_batch_tokens=GPU_BATCH_TOKENS, max_tokens=gpu_max_tokens), True, packing="fcfs")
    batched_packing = load_schedule(load_results[batched])["packing"]   # the batched verifier's schedule, as it ran
    scenarios = [Scenario("CPU as measured, serial", cpu_serial, False),
                 Scenario("CPU as measured, batched" + (", least slack first" if batched_packing == "slack" else ""),
                          cpu_batched, True, packing=batched_packing), gpu_scenario]
    rows = []
    for scenario in scenarios:
        if progress:
            progress(f"capacity: {scenario.name}")
        max_edges = kv_sessions(memory, gpu_model) if scenario is gpu_scenario else 1 << 12
        rows += capacity_table([scenario], ["hybrid", "cloud-only"], slo_s, totals,
                               duration_s=capacity_duration_s, max_edges=max_edges, slo_ttft_s=slo_ttft_s)
    out = {}
    if gpu_cases:
        from netsim.fleet.costs import KvOffload
        from netsim.fleet.gpu import gpu_capacity
        out["gpu_capacity"] = gpu_capacity(gpu_scenario.params, gpu_model, memory, gpu_cases, KvOffload(), totals,
                                           slo_s, slo_ttft_s if slo_ttft_s is not None else 2.0,
                                           duration_s=gpu_duration_s, progress=progress,
                                           hosts={p: table.get(p, host_setting) for p in PATHS},
                                           workload={"prompt_tokens": gpu_prompt_tokens, "stagger": True})
    if specedge:
        from netsim.fleet.gpu import specedge_table
        out["specedge"] = specedge_table(**specedge, slo_tpot_s=slo_s,
                                         slo_ttft_s=slo_ttft_s if slo_ttft_s is not None else 2.0,
                                         duration_s=gpu_duration_s, progress=progress)
    return {**out, "slo_s": slo_s, "slo_ttft_s": slo_ttft_s, "totals": totals, "profiles": profiles, "checks": checks,
            "capacity_calibration": {"serial": serial, "batched": batched},
            "cpu_cost": {"serial": cpu_serial.cost.describe(), "batched": cpu_batched.cost.describe()},
            "cpu_ubatch": cpu_batched.max_batch_tokens,
            "gpu": {**gpu_scenario.params.describe(), "packing": gpu_scenario.packing},
            "gpu_kv_sessions": kv_sessions(memory, gpu_model), "capacity": rows}


def _headline(gpu: dict) -> list[str]:
    """The figure of merit first: committed tokens/s per GPU at the SLO, best hybrid case against cloud-only."""
    rows = gpu["rows"]
    cloud = next((r for r in rows if r["mode"] == "cloud-only"), None)
    hybrids = [r for r in rows if r["mode"] == "hybrid" and r["committed_tokens_per_s"] is not None
               and "bound" not in r["case"] and "before" not in r["case"]]
    best = max(hybrids, key=lambda r: r["committed_tokens_per_s"], default=None)
    if not cloud or not best or not cloud["committed_tokens_per_s"]:
        return []
    return [f"**Headline** (p95 TPOT <= {gpu['slo_tpot_s'] * 1e3:g} ms, p95 TTFT <= {gpu['slo_ttft_s'] * 1e3:g} ms, "
            f"per GPU, {gpu['cost'].split(':')[0]}): cloud-only {cloud['edges_per_gpu']} edges, "
            f"{cloud['committed_tokens_per_s']:,.0f} tok/s (goodput {cloud['goodput_tokens_per_s']:,.0f}); best shipped "
            f"hybrid ({best['case']}) {best['edges_per_gpu']} edges, {best['committed_tokens_per_s']:,.0f} tok/s "
            f"(goodput {best['goodput_tokens_per_s']:,.0f}): **{best['committed_tokens_per_s_vs_cloud']:.2f}×** "
            "cloud-only's committed tokens/s per GPU.", ""]


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:+.0f}%"


def _ms(x) -> str:
    return "–" if x is None else f"{1e3 * x:.1f}"


_CALIBRATION_MS = (("server_cpu_s", "server CPU per round"), ("server_overhead_s", "other server time per round"),
                   ("edge_cpu_s", "edge CPU per round"), ("edge_overhead_s", "other edge-side time per round"),
                   ("proxy_cpu_s", "proxy CPU per message"), ("cloud_server_cpu_s", "server CPU per streamed token"),
                   ("cloud_server_overhead_s", "other server time per streamed token"))


def _check_markdown(check: dict) -> list[str]:
    lc, cal = check["load_config"], check["calibration"]
    verifier = "batched" if cal["batching"] else "serial"
    started_with = " ".join(lc.get("verifier_args") or []) or "(defaults)"
    target = f"synthetic pair, target {lc['synthetic_step_ms']} ms/pass" if lc["synthetic"] else "bundled models"
    lines = [f"## Simulated against measured ({verifier} verifier, {', '.join(lc['profiles'])})", "",
             f"Calibrated on `netsim load` ({lc.get('out') or 'a load run'}: {target}, verifier started with "
             f"{started_with}, {lc['duration_s']:g} s windows): pass cost {cal['cost']}; α {cal['alpha']:.3f} "
             f"({cal['tokens_per_round']:.3f} tokens per round); "
             + "; ".join(f"{label} {cal[key] * 1e3:.2f} ms" for key, label in _CALIBRATION_MS if key in cal) + ".", "",
             "Each run simulated as the load test ran it (its window; its harness: every edge in one process, every "
             f"link in one proxy process; the run's own α); tok/s the mean of {CHECK_SEEDS} seeds, p95 the median "
             "(in brackets the seeds' 10th to 90th percentile).", "",
             "| edges | mode | α | tok/s measured | simulated | error | p95 TPOT ms measured | simulated | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in check["rows"]:
        spread = r.get("simulated_tpot_p95_range_s")
        spread = f" [{spread[0] * 1e3:.0f}–{spread[1] * 1e3:.0f}]" if spread else ""
        alpha = "–" if r.get("alpha") is None else f"{r['alpha']:.2f}"
        lines.append(f"| {r['edges']} | {r['mode']} | {alpha} | {r['measured_tokens_per_s']:.1f} "
                     f"| {r['simulated_tokens_per_s']:.1f} | {_pct(r['tokens_per_s_error'])} "
                     f"| {_ms(r['measured_tpot_p95_s'])} | {_ms(r['simulated_tpot_p95_s'])}{spread} "
                     f"| {_pct(r['tpot_p95_s_error'])} |")
    return lines + [""]


def fleet_markdown(result: dict) -> str:
    lines = ["# netsim fleet", ""]
    if result.get("gpu_capacity"):
        from netsim.fleet.gpu import gpu_markdown
        gpu = result["gpu_capacity"]
        lines += _headline(gpu)
        lines += gpu_markdown(gpu, "Capacity and goodput at the SLO per GPU (the vLLM path's true cost)")
    if result.get("specedge"):
        from netsim.fleet.gpu import specedge_markdown
        lines += specedge_markdown(result["specedge"])
    for check in result["checks"]:
        lines += _check_markdown(check)
    totals = result["totals"]
    source = {kind: result["checks"][i]["load_config"].get("out") or f"calibration {i + 1}"
              for kind, i in result["capacity_calibration"].items()}
    lines += [f"## Verifiers needed at p95 time per output token <= {result['slo_s'] * 1e3:g} ms "
              f"(links: {', '.join(result['profiles'])})", "",
              f"Serial rows calibrated on {source['serial']} (pass cost {result['cpu_cost']['serial']}); batched "
              f"rows and the GPU case's edges on {source['batched']} (pass cost {result['cpu_cost']['batched']}, "
              f"up to {result['cpu_ubatch']} tokens per batched pass).", "",
              "| backend | mode | edges per verifier | tok/s per verifier | " + " | ".join(f"{t:,} edges" for t in totals) + " |",
              "|---|---|---|---|" + "---|" * len(totals)]
    for r in result["capacity"]:
        per = f"{r['edges_per_verifier']}{' (bound)' if r['capped'] else ''}"
        tps = "–" if r["tokens_per_s_per_verifier"] is None else f"{r['tokens_per_s_per_verifier']:.0f}"
        lines.append(f"| {r['backend']} | {r['mode']} | {per} | {tps} | "
                     + " | ".join("–" if r[f"verifiers_for_{t}"] is None else f"{r[f'verifiers_for_{t}']:,}" for t in totals) + " |")
    lines += ["", "(bound): the search stopped at its bound (the GPU's KV memory, or 4096 edges on the CPU) "
                  "with the SLO still met. The capacity table's edges are devices of their own (no shared "
                  "process, no proxy); the verifier keeps its measured CPU per round and per streamed token.",
              "", f"GPU model: {result['gpu']['cost']}; {result['gpu_kv_sessions']} sessions fit in KV memory; "
                  f"α {result['gpu']['alpha']}, draft {result['gpu']['draft_s'] * 1e3:g} ms/token on the device, "
                  f"server CPU {result['gpu']['server_cpu_s'] * 1e3:g} ms per round (streams stay in the batch), whole "
                  f"requests first come up to {result['gpu']['max_batch_tokens']} tokens per pass.", ""]
    return "\n".join(lines)


def fleet_plot(result: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    totals = result["totals"]
    for r in result["capacity"]:
        ys = [r[f"verifiers_for_{t}"] for t in totals]
        if any(y is None for y in ys):
            continue
        ax.plot(totals, ys, marker="o", linestyle="-" if r["mode"] == "hybrid" else "--",
                label=f"{r['backend']}: {r['mode']}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("edges")
    ax.set_ylabel("verifiers")
    ax.set_title(f"verifiers for p95 TPOT <= {result['slo_s'] * 1e3:g} ms ({', '.join(result['profiles'])})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
