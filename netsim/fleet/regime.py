"""The regime map: hybrid against cloud-only tokens/s per GPU at a TPOT SLO, and what binds.

A mean-value model (steady state, means, no queueing tails), not the discrete-event simulation: one
cell is a target on one GPU (`Target`, `costs.RooflineCost` with the measured host path of
netsim.fleet.hostpath), a mean context, a link (its profile's round trip and transmission), and α.
Its figures are counts and a roofline, so the map says *where* each mode is bound, not what a GPU
will measure. Terms:

  cloud-only  n streams in the batch, one token each per step: TPOT = step(n) = pass(n tokens, n
              sessions' KV) + vLLM's sampler on the device. The most n with step <= SLO and every
              session's KV on the GPU; tokens/s = n / step.
  hybrid      n sessions, each a cycle of: link wait W (round trip + transmission of a round and its
              reply + γ drafts on the device + the edge's own time), then at the verifier: on average
              half a pass waiting for the running one to end, then its own pass P (back-to-back
              passes; k rounds per pass = n·P / period, Little's law, solved by fixed point). A pass
              charges k·(tokens per round) tokens, k sessions' KV and the host path for k rounds.
              E = (1 − α^(γ+1)) / (1 − α) tokens commit per round; TPOT = period / E; tokens/s = n·E / period.
  rounds in flight   (window w > 1) the edge ships the next round, with continuations for the most
              probable outcomes of the one in flight (spec_core.continuations.chain_outcomes, each
              corrected or bonus token guessed right with probability `guess`), before the reply:
              a hit (probability h, the outcomes covered) answers one pass after the round before it,
              a miss costs the full cycle: period = (1 − h)·cycle + h·max(cycle / w, γ·draft, P).
              A miss costs no target pass (the verifier runs only the continuation that matches).
  KV parking  a session's KV is on the GPU only from its restore until its pass ends; it waits on its
              link parked in host memory (write-through: the host holds every session, parking
              copies nothing, a restore copies the whole context over PCIe). spec_core.kvpark's rules:
              park only when a place is needed (as few sessions as make the rest fit), and only a
              session whose idle gap is longer than its move (`worth_moving`); the restore starts when
              its round arrives, so it lengthens that session's cycle by the copy (`prefetch=True`:
              started ahead, at the forecast of its next round, hidden while the copy fits in the
              link wait; not what the verifier does). Bounds: resident sessions n·(copy + at
              verifier)/period <= the GPU's KV slots, PCIe busy n·copy/period <= `pcie_max_busy`,
              every parked session in host memory.

What binds: the constraint that stops n from growing — "KV capacity" (the GPU's slots, or host
memory with parking), "host link (PCIe)" (restores), or, where the TPOT SLO stops it: "link" when
the wait on the link and drafting alone spend the SLO's time for a round, else what grows with n, the
pass's largest part: "compute", "HBM bandwidth" or "host path" (the acceptance maths); for cloud-only
the step's largest part. A cell whose hybrid cannot meet the SLO with one session says so (0 tok/s).

Left out, in both modes alike: prefill of new requests, TTFT, vLLM's limits on sequences and tokens
per step (an operator raises them), p95 against mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from netsim.fleet.costs import (H200, H200_FP8_FLOPS, H200_MEMORY, LLAMA_8B, LLAMA_8B_ATTENTION, LLAMA_70B_ATTENTION,
                                LLAMA_70B_FP8, KvOffload, RooflineCost, RoundWork, kv_sessions)
from netsim.fleet.hostpath import DEFAULT_TABLE as DEFAULT_TABLE_PATH
from netsim.fleet.hostpath import HostPath, HostPathTable, stream_rows
from netsim.fleet.links import ROUND_BYTES
from netsim.profiles import get_profile
from spec_core.continuations import chain_outcomes
from spec_core.costmodel import expected_tokens_per_round
from spec_core.kvpark import ParkCandidate, ParkCost, worth_moving


@dataclass(frozen=True)
class Target:
    name: str
    weights: dict                # costs.LLAMA_8B-style: params, model_bytes, kv_bytes_per_token
    attention_flops: float       # per query token per context token
    flops_per_s: float           # the GPU's dense FLOP/s at the weights' precision


TARGETS = {
    "8b-bf16": Target("Llama-3.1-8B bf16", LLAMA_8B, LLAMA_8B_ATTENTION, H200["flops_per_s"]),
    "70b-fp8": Target("Llama-3.1-70B fp8", LLAMA_70B_FP8, LLAMA_70B_ATTENTION, H200_FP8_FLOPS),
}


@dataclass(frozen=True)
class RegimeConfig:
    """The assumptions of a map (units in the names)."""

    slo_tpot_s: float = 0.150
    gammas: tuple[int, ...] = (1, 2, 3, 4, 6, 8)   # the best for each cell is reported
    draft_s: float = 0.010             # the device's time per draft token (our assumption)
    edge_s: float = 0.002              # the edge's own time per round outside drafting
    guess: float = 0.5                 # a guessed corrected or bonus token is right (our assumption)
    max_continuations: int = 8         # the edge's default
    window: int = 4                    # rounds in flight, when in flight
    round_work: RoundWork = RoundWork("ideal")   # gamma + 1 tokens in one request (issue 25 item 1)
    offload: KvOffload = field(default_factory=KvOffload)
    pcie_max_busy: float = 0.9
    prefetch: bool = False             # restore parked KV ahead of the forecast round (the verifier does not)
    memory_bytes: float = H200_MEMORY
    gpu: dict = field(default_factory=lambda: dict(H200))


@dataclass(frozen=True)
class Point:
    """One mode's best operating point in a cell."""

    tokens_per_s: float
    sessions: int
    tpot_s: float | None
    binds: str
    gamma: int = 0
    parked: int = 0          # sessions parked in host memory at this point
    hit: float = 0.0


def target_cost(target: Target, context: int, cfg: RegimeConfig, host: HostPath | None,
                stream_host: HostPath | None) -> RooflineCost:
    gpu = dict(cfg.gpu, flops_per_s=target.flops_per_s)
    return RooflineCost(**target.weights, **gpu, context_tokens=context,
                        attention_flops_per_context_token=target.attention_flops, host=host,
                        stream_host=stream_host, name=f"H200, {target.name}")


def link_wait_s(profile_name: str) -> float:
    """A round's time on the link: the round trip and the transmission of a round and its reply."""
    profile = get_profile(profile_name)
    rtt = profile.rtt_ms()
    return (profile.uplink.expected_delay_ms(ROUND_BYTES[0], rtt)
            + profile.downlink.expected_delay_ms(ROUND_BYTES[1], rtt)) / 1000.0


def hit_probability(alpha: float, gamma: int, guess: float, continuations: int) -> float:
    """The chance that one of the edge's continuations is what the round in flight commits."""
    candidates = [(1000 + i, guess * (1.0 - guess) ** i) for i in range(4)]
    outcomes = chain_outcomes(list(range(1, gamma + 1)), alpha, [candidates] * gamma, candidates, continuations)
    return min(1.0, sum(o.prob for o in outcomes))


# --- cloud-only ------------------------------------------------------------------------------

def cloud_only(cost: RooflineCost, kv_slots: int, slo_s: float) -> Point:
    def step(n: int) -> float:
        return cost.pass_s(n, n, hybrid=False)
    if step(1) > slo_s:
        return Point(0.0, 0, step(1), cost.parts(1, 1, hybrid=False).binds())
    lo, hi = 1, max(kv_slots, 1)
    if step(hi) <= slo_s:
        return Point(hi / step(hi), hi, step(hi), "KV capacity")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if step(mid) <= slo_s else (lo, mid)
    return Point(lo / step(lo), lo, step(lo), cost.parts(hi, hi, hybrid=False).binds())


# --- hybrid ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class HybridState:
    period_s: float        # between one round's reply and the next, per session (the parked ones')
    tpot_s: float          # the slower sessions' (the parked ones when any park)
    tokens_per_s: float
    resident: float        # sessions whose KV must be on the GPU at once, on average
    parked: int            # sessions that wait on their link with their KV in host memory
    pcie_busy: float       # share of the host link's time restoring KV
    shares: dict           # the cycle's parts: link, compute, HBM bandwidth, host path, host link (PCIe)


def _period(cycle: float, hit: float, window: int, gamma: int, cfg: RegimeConfig, pass_s: float) -> float:
    return (1.0 - hit) * cycle + hit * max(cycle / window, gamma * cfg.draft_s, pass_s)


def hybrid_state(n: int, gamma: int, alpha: float, cost: RooflineCost, wait_s: float, cfg: RegimeConfig,
                 window: int, kv_slots: int | None = None) -> HybridState:
    """n sessions at γ; with `kv_slots`, the sessions beyond them park while they wait on their link
    (as few as make the rest fit: spec_core.kvpark parks only when it needs a place)."""
    work = cfg.round_work
    tokens = work.tokens(gamma, 1) if work.path == "ideal" else work.mean_tokens(gamma)
    link = wait_s + gamma * cfg.draft_s + cfg.edge_s
    hit = hit_probability(alpha, gamma, cfg.guess, cfg.max_continuations) if window > 1 else 0.0
    nbytes = cost.kv_bytes_per_token * cost.context_tokens
    copy_s = cfg.offload.copy_s(nbytes)
    # Write-through: parking copies nothing, a restore the whole context (as the simulation prices it).
    move = ParkCost(park_s_per_byte=0.0, restore_s_per_byte=copy_s / nbytes)
    exposed = max(0.0, copy_s - link) if cfg.prefetch else copy_s
    k, parked, share = 1.0, 0, 1.0
    for _ in range(80):
        parts = cost.parts(k * tokens, k, hybrid=True)
        pass_s = parts.total_s
        at_verifier = pass_s * (1.0 + 0.5 * min(1.0, k))
        cycle = link + at_verifier
        period = _period(cycle, hit, window, gamma, cfg, pass_s)
        period_parked = _period(cycle + exposed, hit, window, gamma, cfg, pass_s)
        share = min(1.0, (copy_s + at_verifier) / period_parked)   # of its time a parked session is resident
        gap = ParkCandidate(0, 0.0, int(nbytes), max(0.0, period - at_verifier))   # its mean idle gap
        if kv_slots is not None and n > kv_slots and worth_moving(gap, 0.0, move) and share < 1.0:
            parked = min(n, math.ceil((n - kv_slots) / (1.0 - share)))
        else:
            parked = 0
        rounds_per_s = (n - parked) / period + parked / period_parked
        k_new = min(float(n), rounds_per_s * pass_s)
        if abs(k_new - k) < 1e-5 * max(k, 1.0):
            break
        k = 0.5 * k + 0.5 * max(k_new, 1e-6)
    e = expected_tokens_per_round(alpha, gamma)
    slow = period_parked if parked else period
    cycle_slow = cycle + (exposed if parked else 0.0)
    gpu = max(parts.memory_s, parts.compute_s) / pass_s * at_verifier
    scale = slow / cycle_slow
    shares = {"link": link * scale, "host link (PCIe)": (exposed if parked else 0.0) * scale,
              "compute" if parts.compute_s >= parts.memory_s else "HBM bandwidth": gpu * scale,
              "host path": parts.host_s / pass_s * at_verifier * scale}
    return HybridState(slow, slow / e, e * rounds_per_s, (n - parked) + parked * share, parked,
                       parked * copy_s / period_parked, shares)


def _hybrid_fails(state: HybridState, n: int, kv_slots: int, host_slots: int, cfg: RegimeConfig) -> str | None:
    """What stops n sessions, or None when they meet the SLO."""
    if state.resident > kv_slots + 1e-9:
        return "KV capacity"
    if state.parked > host_slots:
        return "KV capacity (host memory)"
    if state.pcie_busy > cfg.pcie_max_busy:
        return "host link (PCIe)"
    if state.tpot_s > cfg.slo_tpot_s:
        # The link when its wait alone (with drafting) spends the SLO; else what grows with n: the pass's
        # largest part, or the restores parked sessions wait for.
        if state.shares["link"] >= state.period_s * cfg.slo_tpot_s / state.tpot_s:
            return "link"
        return max(((k, v) for k, v in state.shares.items() if k != "link"), key=lambda kv: kv[1])[0]
    return None


def hybrid(cost: RooflineCost, alpha: float, wait_s: float, cfg: RegimeConfig, window: int, kv_slots: int,
           host_slots: int) -> Point:
    """The best γ and parking choice: the most tokens/s per GPU at the SLO."""
    best: Point | None = None
    for gamma in cfg.gammas:
        for parking in (False, True):
            bound = kv_slots + host_slots if parking else kv_slots
            slots = kv_slots if parking else None

            def fails(n: int, gamma=gamma, slots=slots) -> str | None:
                return _hybrid_fails(hybrid_state(n, gamma, alpha, cost, wait_s, cfg, window, slots), n, kv_slots,
                                     host_slots, cfg)
            first = fails(1)
            if first:
                point = Point(0.0, 0, hybrid_state(1, gamma, alpha, cost, wait_s, cfg, window, slots).tpot_s,
                              first, gamma)
            else:
                lo, hi = 1, max(bound, 1)
                why = fails(hi)
                if why is None:
                    lo, why = hi, ("KV capacity (host memory)" if parking else "KV capacity")
                else:
                    while hi - lo > 1:
                        mid = (lo + hi) // 2
                        reason = fails(mid)
                        if reason is None:
                            lo = mid
                        else:
                            hi, why = mid, reason
                state = hybrid_state(lo, gamma, alpha, cost, wait_s, cfg, window, slots)
                point = Point(state.tokens_per_s, lo, state.tpot_s, why, gamma, state.parked,
                              hit_probability(alpha, gamma, cfg.guess, cfg.max_continuations) if window > 1 else 0.0)
            if best is None or point.tokens_per_s > best.tokens_per_s * (1 + 1e-9):
                best = point
    assert best is not None
    return best


# --- the map ---------------------------------------------------------------------------------

HOST_VARIANTS = ("numpy-per-session", "batched-on-device")


def regime_map(targets=("8b-bf16", "70b-fp8"), contexts=(1024, 8192, 32768), links=("lan", "lte", "3g"),
               alphas=(0.5, 0.7, 0.85), setting: str = "greedy", cfg: RegimeConfig | None = None,
               table: HostPathTable | None = None) -> dict:
    """Every cell: cloud-only and four hybrids (host path as shipped or batched on the device; without
    and with rounds in flight), tokens/s per GPU at the SLO and what binds."""
    cfg = cfg or RegimeConfig()
    table = table or HostPathTable.load()
    device = table.get("batched-on-device", setting)
    hosts = {name: table.get(name, setting) for name in HOST_VARIANTS}
    cells = []
    for tname in targets:
        target = TARGETS[tname]
        for context in contexts:
            cloud_cost = target_cost(target, context, cfg, None, stream_rows(device, 4))
            kv_slots = kv_sessions(cfg.memory_bytes, cloud_cost)
            host_slots = cfg.offload.host_sessions(cloud_cost)
            cloud = cloud_only(cloud_cost, kv_slots, cfg.slo_tpot_s)
            for link in links:
                wait = link_wait_s(link)
                for alpha in alphas:
                    cell = {"target": tname, "context": context, "link": link, "alpha": alpha,
                            "kv_slots": kv_slots, "host_slots": host_slots, "link_wait_s": wait,
                            "cloud": cloud.__dict__, "hybrid": {}}
                    for host_name, host in hosts.items():
                        cost = target_cost(target, context, cfg, host, None)
                        for window in (1, cfg.window):
                            point = hybrid(cost, alpha, wait, cfg, window, kv_slots, host_slots)
                            key = f"{host_name}, {'in flight' if window > 1 else 'one round'}"
                            cell["hybrid"][key] = {**point.__dict__, "x_cloud": (point.tokens_per_s / cloud.tokens_per_s
                                                                                  if cloud.tokens_per_s else None)}
                    cells.append(cell)
    return {"setting": setting, "slo_tpot_s": cfg.slo_tpot_s, "draft_s": cfg.draft_s, "edge_s": cfg.edge_s,
            "guess": cfg.guess, "window": cfg.window, "max_continuations": cfg.max_continuations,
            "gammas": list(cfg.gammas), "round_work": cfg.round_work.describe(), "offload": cfg.offload.describe(),
            "pcie_max_busy": cfg.pcie_max_busy, "hosts": {k: v.describe() for k, v in hosts.items()},
            "stream_host": stream_rows(device, 4).describe(), "machine": table.machine, "cells": cells}


def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def regime_markdown(result: dict) -> str:
    keys = list(result["cells"][0]["hybrid"]) if result["cells"] else []
    lines = [f"# Regime map: hybrid / cloud-only tokens/s per H200 at TPOT <= {result['slo_tpot_s'] * 1e3:g} ms "
             f"({result['setting']} rounds)", "",
             "A mean-value model (netsim/fleet/regime.py), not a measurement. Per cell: cloud-only tok/s per GPU "
             "and what binds it; each hybrid as × cloud-only, what binds it, its best γ, the sessions n and "
             "how many of them wait with their KV parked in host memory where parking was the best choice.", "",
             "Assumptions: " + "; ".join([
                 f"drafting {result['draft_s'] * 1e3:g} ms/token on the device, {result['edge_s'] * 1e3:g} ms edge time per round",
                 f"a round computes {result['round_work']}",
                 f"rounds in flight: a window of {result['window']}, up to {result['max_continuations']} continuations, "
                 f"each guessed token right with probability {result['guess']:g}",
                 result["offload"], f"PCIe busy at most {result['pcie_max_busy']:g}",
                 "host path: " + "; ".join(result["hosts"].values()),
                 "cloud-only sampling: " + result["stream_host"]]) + ".", "",
             "| target | context | link | α | cloud-only tok/s (binds) | " + " | ".join(keys) + " |",
             "|---|---|---|---|---|" + "---|" * len(keys)]
    for c in result["cells"]:
        cloud = c["cloud"]
        row = [c["target"], f"{c['context'] // 1024}k", c["link"], f"{c['alpha']:g}",
               f"{cloud['tokens_per_s']:,.0f} ({cloud['binds']}, n {cloud['sessions']})"]
        for key in keys:
            h = c["hybrid"][key]
            row.append(f"**{_x(h['x_cloud'])}** {h['binds']}, γ {h['gamma']}, n {h['sessions']}"
                       + (f" ({h['parked']} parked)" if h["parked"] else "")
                       if h["tokens_per_s"] else f"0 ({h['binds']})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def summary(result: dict) -> dict:
    """Counts for the prose: cells where a hybrid reaches 2× cloud-only's tokens/s, its most sessions per GPU
    against cloud-only's, and the cells where cloud-only is KV-bound."""
    out = {}
    for key in (result["cells"][0]["hybrid"] if result["cells"] else {}):
        xs = [c["hybrid"][key]["x_cloud"] or 0.0 for c in result["cells"]]
        sessions = [c["hybrid"][key]["sessions"] / c["cloud"]["sessions"] for c in result["cells"] if c["cloud"]["sessions"]]
        out[key] = {"cells": len(xs), "at_least_2x": sum(x >= 2.0 for x in xs), "above_1x": sum(x > 1.0 for x in xs),
                    "max_x": max(xs) if xs else None, "max_sessions_x": max(sessions) if sessions else None}
    out["cloud_kv_bound_cells"] = sum(c["cloud"]["binds"] == "KV capacity" for c in result["cells"])
    return out



CHECK_CELLS = (("8b-bf16", 8192, "lan", 0.7), ("8b-bf16", 8192, "lte", 0.7), ("8b-bf16", 1024, "lte", 0.7),
               ("70b-fp8", 32768, "lte", 0.85))


def des_check(cells=CHECK_CELLS, setting: str = "greedy", gamma: int = 4, cfg: RegimeConfig | None = None,
              table: HostPathTable | None = None, duration_s: float = 5.0, sim_link: str | None = None) -> list[dict]:
    """The mean-value model against the discrete-event simulation (netsim.fleet.simulation, the proxy's
    own links, jitter and loss) at the GPU's KV slots, one round at a time, nothing parked, the device
    host path: tokens/s and TPOT side by side. (The simulation has no window of rounds in flight, and
    the check parks nothing: those parts of the model are not checked here.)
    `sim_link` simulates another link than the model's (a control)."""
    from netsim.fleet.simulation import FleetConfig, simulate
    cfg = cfg or RegimeConfig()
    table = table or HostPathTable.load()
    device = table.get("batched-on-device", setting)
    rows = []
    for tname, context, link, alpha in cells:
        cost = target_cost(TARGETS[tname], context, cfg, device, stream_rows(device, gamma))
        n = kv_sessions(cfg.memory_bytes, cost)
        model = {"hybrid": hybrid_state(n, gamma, alpha, cost, link_wait_s(link), cfg, 1),
                 "cloud-only": cloud_only(cost, n, float("inf"))}
        for mode, m in model.items():
            sim = simulate(FleetConfig(edges=n, mode=mode, cost=cost, batching=True, profiles=[sim_link or link],
                                       gamma=gamma, alpha=alpha, draft_s=cfg.draft_s,
                                       edge_overhead_s=cfg.edge_s if mode == "hybrid" else 0.0, max_tokens=256,
                                       packing="fcfs", max_batch_tokens=1 << 20, round_work=cfg.round_work,
                                       duration_s=duration_s, warmup_s=2.0))
            rows.append({"target": tname, "context": context, "link": link, "alpha": alpha, "mode": mode,
                         "sessions": n, "model_tokens_per_s": m.tokens_per_s, "model_tpot_s": m.tpot_s,
                         "sim_tokens_per_s": sim["committed_tokens_per_s"], "sim_tpot_p50_s": sim["tpot_p50_s"],
                         "sim_tpot_p95_s": sim["tpot_p95_s"]})
    return rows


def des_check_markdown(rows: list[dict]) -> str:
    lines = ["## The model against the discrete-event simulation", "",
             "At the GPU's KV slots, one round at a time, nothing parked, host path batched on the device, γ 4; "
             "the simulation runs the proxy's own links (jitter, loss) for 5 s after 2 s of warm-up.", "",
             "| target | context | link | α | mode | sessions | model tok/s | simulated tok/s | model TPOT ms | "
             "simulated TPOT p50 / p95 ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['context'] // 1024}k | {r['link']} | {r['alpha']:g} | {r['mode']} | "
                     f"{r['sessions']} | {r['model_tokens_per_s']:,.0f} | {r['sim_tokens_per_s']:,.0f} | "
                     f"{r['model_tpot_s'] * 1e3:.1f} | {r['sim_tpot_p50_s'] * 1e3:.1f} / {r['sim_tpot_p95_s'] * 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m netsim.fleet.regime`: the map as regime.json and regime.md in --out."""
    import argparse
    import json
    import logging
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m netsim.fleet.regime", description=__doc__.split("\n")[0])
    parser.add_argument("--setting", default="greedy", choices=("greedy", "top-k", "top-p"),
                        help="the rounds' sampling setting (picks the host-path rows)")
    parser.add_argument("--slo-tpot-ms", type=float, default=150.0, help="TPOT SLO (ms)")
    parser.add_argument("--draft-ms", type=float, default=10.0, help="device drafting time per token (ms)")
    parser.add_argument("--window", type=int, default=4, help="rounds in flight, when in flight")
    parser.add_argument("--host-path-table", default=str(DEFAULT_TABLE_PATH),
                        help="host-path table (JSON; bench/accept_maths.py's rows or fitted lines)")
    parser.add_argument("--check", action="store_true",
                        help="also run the discrete-event simulation at a few cells beside the model (about a minute)")
    parser.add_argument("--out", default="results/regime", help="output folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = RegimeConfig(slo_tpot_s=args.slo_tpot_ms / 1000.0, draft_s=args.draft_ms / 1000.0, window=args.window)
    result = regime_map(setting=args.setting, cfg=cfg, table=HostPathTable.load(args.host_path_table))
    result["summary"] = summary(result)
    markdown = regime_markdown(result)
    if args.check:
        result["des_check"] = des_check(setting=args.setting, cfg=cfg, table=HostPathTable.load(args.host_path_table))
        markdown += "\n" + des_check_markdown(result["des_check"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "regime.json").write_text(json.dumps(result, indent=1))
    (out / "regime.md").write_text(markdown)
    logging.info("%s", (out / "regime.md").read_text())
    logging.info("wrote %s and %s", out / "regime.json", out / "regime.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
