"""Capacity and goodput at the SLO on one GPU verifier, hybrid and cloud-only side by side.

Each case is searched for the most edges per GPU whose simulated p95 TPOT and p95 TTFT meet the SLO
(`capacity.edges_per_verifier`); at that count: committed tokens/s per GPU, goodput (tokens/s of
requests that met the SLO), GPUs per N edges. What a hybrid round costs the GPU is what the shipped
vLLM backend computes (`costs.RoundWork`, counted with vLLM's own counters by
bench/fleet_vllm_counters.py); KV memory bounds the sessions a GPU holds (`costs.kv_sessions`), unless
waiting sessions park their KV in host memory (`costs.KvOffload`; the victim chosen by the shipped
rule, spec_core.kvpark.choose_victim); the verifier may tell each edge a draft budget (the shipped
rule, spec_core.steering.draft_budget, priced from the simulated passes: netsim.fleet.policies). The
shipped vLLM backend measures no pass cost line and parks nothing itself (vLLM's own offloading
connector does), so the budget and parking rows say what those rules would do on this GPU.

`specedge_table` puts SpecEdge's published set-up (NeurIPS 2025, arXiv 2505.17052; repository
kaist-ina/specedge) through the same simulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from netsim.effects import Delay
from netsim.fleet.calibration import Calibration, fleet_config
from netsim.fleet.costs import (A100_80, QWEN3_14B, KvOffload, RooflineCost, RoundWork, kv_sessions)
from netsim.fleet.capacity import edges_per_verifier
from netsim.fleet.serverspec import DRAFTS, ServerSpecCost, draft_cost
from netsim.fleet.simulation import simulate
from netsim.link import Link
from netsim.profiles import Profile


@dataclass(frozen=True)
class GpuCase:
    name: str
    mode: str                           # "hybrid" or "cloud-only"
    work: RoundWork | None = None       # hybrid: what a round computes (None: gamma + 1 tokens)
    offload: bool = False               # hybrid: park waiting sessions' KV in host memory
    steer: bool = False                 # hybrid: the verifier's draft budget
    host_path: str | None = None        # hybrid: the acceptance maths (netsim.fleet.hostpath.PATHS); None: the cost's own
    draft: str | None = None            # server-spec: vLLM's proposer (netsim.fleet.serverspec.METHODS)


def gpu_cases(block_size: int = 16) -> list[GpuCase]:
    """The vLLM backend's paths: what ships (a session's own request, gamma + 1 tokens a round, the round
    decided in the engine by one batched call a pass) first, then the paths without a session (numpy
    maths per session on the host), kept to show what each piece buys."""
    one, per, session = (RoundWork("one-request", block_size), RoundWork("per-position", block_size),
                         RoundWork("ideal"))
    device, numpy_ = "batched-on-device", "numpy-per-session"
    return [
        GpuCase("cloud-only (vLLM decode)", "cloud-only"),
        *[GpuCase(f"vLLM speculating for itself: {m}", "server-spec", host_path=device, draft=m)
          for m in ("draft model", "EAGLE", "n-gram")],
        GpuCase("hybrid, vLLM session, maths in the engine (what ships)", "hybrid", session, host_path=device),
        GpuCase("hybrid, session, maths in the engine + KV offload + draft budget", "hybrid", session,
                offload=True, steer=True, host_path=device),
        GpuCase("hybrid, session, numpy maths per session (the host path before)", "hybrid", session,
                host_path=numpy_),
        GpuCase("hybrid, vLLM one request, numpy maths (no session: greedy or top-k rounds)", "hybrid", one,
                host_path=numpy_),
        GpuCase("hybrid, vLLM per-position requests, numpy maths (no session: sampled rounds without top-k)",
                "hybrid", per, host_path=numpy_),
        GpuCase("hybrid, one request, numpy maths + KV offload + draft budget", "hybrid", one, offload=True,
                steer=True, host_path=numpy_),
    ]


def gpu_capacity(params: Calibration, cost: RooflineCost, memory_bytes: float, cases: list[GpuCase],
                 offload: KvOffload, totals: list[int], slo_tpot_s: float, slo_ttft_s: float,
                 duration_s: float = 6.0, progress=None, hosts: dict | None = None, workload: dict | None = None,
                 ngram_alpha: float = 0.3) -> dict:
    """Per case: edges per GPU at the SLO and the figures there; ratios to the first cloud-only case.
    `hosts`: path name -> HostPath, for the cases that name their acceptance maths' path. `workload`:
    FleetConfig fields every case shares (prompt tokens per request, ...). A server-spec case is vLLM
    speculating for itself (netsim.fleet.serverspec): its draft's weights and KV take their share of
    the GPU's memory, its passes their share of each step."""
    kv = kv_sessions(memory_bytes, cost)
    host = offload.host_sessions(cost)
    session_bytes = cost.kv_bytes_per_token * cost.context_tokens
    rows = []
    for case in cases:
        if progress:
            progress(f"GPU capacity: {case.name}")
        hybrid = case.mode == "hybrid"
        parks = case.offload and hybrid
        case_params, case_kv = params, kv
        if case.mode == "server-spec":
            spec = ServerSpecCost(replace(cost, host=hosts[case.host_path]),
                                  draft_cost(DRAFTS["8b-bf16"][case.draft], cost, 1.0), params.gamma)
            case_params = replace(params, cost=spec, alpha=ngram_alpha if case.draft == "n-gram" else params.alpha)
            case_kv = kv_sessions(memory_bytes, spec)
        elif hybrid and case.host_path is not None:
            if not hosts or case.host_path not in hosts:
                raise ValueError(f"GPU case {case.name!r} names host path {case.host_path!r}, which no table row gives")
            case_params = replace(params, cost=replace(params.cost, host=hosts[case.host_path]))

        def make(n: int, case=case, parks=parks, hybrid=hybrid, case_params=case_params):
            return fleet_config(case_params, n, case.mode, True, packing="fcfs", round_work=case.work if hybrid else None,
                                steer=case.steer and hybrid, kv_capacity=case_kv, kv_bytes_per_session=session_bytes,
                                offload=offload if parks else None, slo_tpot_s=slo_tpot_s, slo_ttft_s=slo_ttft_s,
                                **(workload or {}))
        n, sim = edges_per_verifier(make, slo_tpot_s, max_edges=host if parks else case_kv, duration_s=duration_s,
                                    slo_ttft_s=slo_ttft_s)
        row = {"case": case.name, "mode": case.mode, "work": case.work.describe() if case.work and hybrid else None,
               "host_path": case_params.cost.host.describe() if hybrid and getattr(case_params.cost, "host", None) else None,
               "offload": parks, "steer": case.steer and hybrid, "edges_per_gpu": n,
               "bound": n >= (host if parks else case_kv)}
        for key in ("committed_tokens_per_s", "goodput_tokens_per_s", "tpot_p50_s", "tpot_p95_s", "ttft_p95_s",
                    "target_tokens_per_committed_token", "engine_requests_per_committed_token", "budget_mean",
                    "kv_copies_per_s", "host_link_utilisation", "verifier_utilisation"):
            row[key] = sim.get(key) if sim and n else None
        for total in totals:
            row[f"gpus_for_{total}"] = math.ceil(total / n) if n else None
        rows.append(row)
    cloud = next((r for r in rows if r["mode"] == "cloud-only"), None)
    for row in rows:
        for key in ("committed_tokens_per_s", "goodput_tokens_per_s", "edges_per_gpu"):
            ref = cloud and cloud[key]
            row[f"{key}_vs_cloud"] = row[key] / ref if ref and row[key] is not None else None
    return {"cost": cost.describe(), "kv_sessions": kv, "host_sessions": host, "offload": offload.describe(),
            "slo_tpot_s": slo_tpot_s, "slo_ttft_s": slo_ttft_s, "alpha": params.alpha, "gamma": params.gamma,
            "draft_s": params.draft_s, "profiles": [str(getattr(p, "name", p)) for p in params.profiles],
            "max_tokens": params.max_tokens, "duration_s": duration_s, "totals": totals, "rows": rows}


def _f(x, scale=1.0, digits=0) -> str:
    return "–" if x is None else f"{x * scale:,.{digits}f}"


def gpu_markdown(result: dict, title: str) -> list[str]:
    totals = result["totals"]
    lines = [f"## {title}", "",
             f"SLO: p95 TPOT <= {result['slo_tpot_s'] * 1e3:g} ms and p95 TTFT <= {result['slo_ttft_s'] * 1e3:g} ms. "
             f"Model: {result['cost']}; {result['kv_sessions']} sessions' KV fit on the GPU, {result['host_sessions']} "
             f"in host memory ({result['offload']}). Edges: {', '.join(result['profiles'])}, α {result['alpha']:.3g}, "
             f"γ {result['gamma']}, drafting {result['draft_s'] * 1e3:g} ms/token, {result['max_tokens']} tokens per "
             f"request; {result['duration_s']:g} s simulated per point.", "",
             "| case | edges per GPU at the SLO | committed tok/s per GPU | goodput tok/s | × cloud-only (tok/s) | "
             "p95 TPOT ms | p95 TTFT ms | target tokens / committed | engine requests / token | mean draft budget | "
             "KV copies/s (host link busy) | " + " | ".join(f"GPUs for {t:,} edges" for t in totals) + " |",
             "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(totals)]
    for r in result["rows"]:
        copies = "–" if not r["offload"] else (f"{_f(r['kv_copies_per_s'])} ({_f(r['host_link_utilisation'], 100)}%)"
                                               if r["kv_copies_per_s"] is not None else "–")
        lines.append(f"| {r['case']} | {r['edges_per_gpu']}{' (bound)' if r['bound'] else ''} "
                     f"| {_f(r['committed_tokens_per_s'])} | {_f(r['goodput_tokens_per_s'])} "
                     f"| {_f(r['committed_tokens_per_s_vs_cloud'], 1, 2)} | {_f(r['tpot_p95_s'], 1e3, 1)} "
                     f"| {_f(r['ttft_p95_s'], 1e3)} | {_f(r['target_tokens_per_committed_token'], 1, 2)} "
                     f"| {_f(r['engine_requests_per_committed_token'], 1, 2)} | {_f(r['budget_mean'], 1, 1)} | {copies} | "
                     + " | ".join(_f(r[f"gpus_for_{t}"]) for t in totals) + " |")
    lines += ["", "(bound): the search stopped at the sessions that fit (KV on the GPU, or in host memory with "
                  "offload) with the SLO still met.", ""]
    return lines


# --- SpecEdge's set-up ---------------------------------------------------------------------------
#
# Paper (arXiv 2505.17052, NeurIPS 2025) and repository kaist-ina/specedge (config/specedge.example.yaml):
# Qwen3-14B target on one A100 (GCP a2-ultragpu-1g: A100 80 GB), Qwen3-1.7B drafts on RTX 4090 edges
# (two edge GPUs per concurrent request), measured mean WAN round trip 14.07 ms; SpecExec trees of
# max_budget 32 nodes, max_beam_len 4 (depth), temperature 0.7, max_new_tokens 64; headline 2.22x server
# throughput and -11.24% inter-token latency against *server-only* SpecExec (draft and target on the
# server's GPUs), not against autoregressive decoding. Their acceptance (tokens per round) is not in the
# text we could read here, so it is swept.
SPECEDGE_WAN = Profile("specedge-wan", Link((Delay(14.07 / 2),)), Link((Delay(14.07 / 2),)),
                       description="SpecEdge's WAN: 14.07 ms mean round trip, no loss, bandwidth not limiting",
                       source="SpecEdge (arXiv 2505.17052), evaluation set-up: measured average RTT 14.07 ms")
SPECEDGE_TREE_NODES = 32
SPECEDGE_DEPTH = 4
SPECEDGE_MAX_TOKENS = 64
# Qwen3-1.7B on an RTX 4090: 1.7e9 parameters in bf16 (3.4 GB) read per draft pass at the 4090's
# 1008 GB/s (NVIDIA RTX 4090 specifications) x 0.7 (our efficiency, as for the servers): 4.8 ms a level.
SPECEDGE_DRAFT_S = 3.4e9 / (1008e9 * 0.7)
SPECEDGE_FIGURES = {"server_throughput_x": 2.22, "inter_token_latency_change": -0.1124, "cost_efficiency_x": 1.91}


def specedge_params(alpha: float) -> Calibration:
    """SpecEdge's edges and server as fleet parameters: no client-stack costs (not modelled), the tree as
    one pass of 33 tokens (their engine's tree attention), a chain of depth 4 for what commits."""
    return Calibration(
        cost=specedge_cost(), batching=True, alpha=alpha, gamma=SPECEDGE_DEPTH, draft_s=SPECEDGE_DRAFT_S,
        server_cpu_s=0.0, server_overhead_s=0.0, edge_cpu_s=0.0, edge_overhead_s=0.0, cloud_server_cpu_s=0.0,
        cloud_server_overhead_s=0.0, cloud_edge_cpu_s=0.0, proxy_cpu_s=0.0, cloud_proxy_cpu_s=0.0,
        max_tokens=SPECEDGE_MAX_TOKENS, max_batch_tokens=8192, profiles=[SPECEDGE_WAN], tokens_per_round=0.0)


def specedge_cost(context_tokens: int = 1024) -> RooflineCost:
    return RooflineCost(**QWEN3_14B, **A100_80, context_tokens=context_tokens, name="A100 80 GB, Qwen3-14B bf16")


def specedge_table(tokens_per_round: list[float], batches: list[int], slo_tpot_s: float, slo_ttft_s: float,
                   duration_s: float = 6.0, progress=None) -> dict:
    """Hybrid (SpecEdge-like trees) against cloud-only decoding on one A100, at SpecEdge's own operating
    points (a few concurrent requests per server GPU) and at capacity under the SLO."""
    from netsim.fleet.calibration import alpha_from_tokens_per_round
    work = RoundWork("ideal", tree_nodes=SPECEDGE_TREE_NODES)
    cost = specedge_cost()
    kv = kv_sessions(80e9, cost)
    rows = []
    for tpr in tokens_per_round:
        params = specedge_params(alpha_from_tokens_per_round(tpr, SPECEDGE_DEPTH))
        if progress:
            progress(f"SpecEdge set-up, {tpr:g} tokens per round")
        for n in batches:
            hyb = simulate(fleet_config(params, n, "hybrid", True, packing="fcfs", round_work=work, duration_s=duration_s,
                                        slo_tpot_s=slo_tpot_s, slo_ttft_s=slo_ttft_s))
            cld = simulate(fleet_config(params, n, "cloud-only", True, packing="fcfs", duration_s=duration_s,
                                        slo_tpot_s=slo_tpot_s, slo_ttft_s=slo_ttft_s))
            rows.append({"tokens_per_round": tpr, "alpha": params.alpha, "edges": n,
                         "hybrid_tokens_per_s": hyb["committed_tokens_per_s"],
                         "cloud_tokens_per_s": cld["committed_tokens_per_s"],
                         "throughput_x": hyb["committed_tokens_per_s"] / cld["committed_tokens_per_s"],
                         "hybrid_tpot_p50_s": hyb["tpot_p50_s"], "cloud_tpot_p50_s": cld["tpot_p50_s"],
                         "itl_change": hyb["tpot_p50_s"] / cld["tpot_p50_s"] - 1.0})
    capacity = {}
    mid = tokens_per_round[len(tokens_per_round) // 2]
    params = specedge_params(alpha_from_tokens_per_round(mid, SPECEDGE_DEPTH))
    for mode in ("hybrid", "cloud-only"):
        n, sim = edges_per_verifier(
            lambda n, mode=mode: fleet_config(params, n, mode, True, packing="fcfs",
                                              round_work=work if mode == "hybrid" else None, kv_capacity=kv,
                                              slo_tpot_s=slo_tpot_s, slo_ttft_s=slo_ttft_s),
            slo_tpot_s, max_edges=kv, duration_s=duration_s, slo_ttft_s=slo_ttft_s)
        capacity[mode] = {"edges": n, "tokens_per_s": sim["committed_tokens_per_s"] if sim and n else None,
                          "tpot_p95_s": sim["tpot_p95_s"] if sim and n else None}
    return {"theirs": SPECEDGE_FIGURES, "cost": cost.describe(), "kv_sessions": kv, "tree_nodes": SPECEDGE_TREE_NODES,
            "depth": SPECEDGE_DEPTH, "draft_s": SPECEDGE_DRAFT_S, "rtt_ms": SPECEDGE_WAN.rtt_ms(),
            "max_tokens": SPECEDGE_MAX_TOKENS, "rows": rows, "capacity_tokens_per_round": mid, "capacity": capacity,
            "slo_tpot_s": slo_tpot_s, "slo_ttft_s": slo_ttft_s}


def specedge_markdown(result: dict) -> list[str]:
    theirs = result["theirs"]
    lines = ["## SpecEdge's set-up in the fleet simulator", "",
             f"Server: {result['cost']} ({result['kv_sessions']} sessions' KV fit). Edges: Qwen3-1.7B on an RTX 4090, "
             f"{result['draft_s'] * 1e3:.1f} ms per tree level (weights read at 1008 GB/s x 0.7), trees of "
             f"{result['tree_nodes']} nodes and depth {result['depth']} verified in one pass of "
             f"{result['tree_nodes'] + 1} tokens, {result['rtt_ms']:.2f} ms round trip, {result['max_tokens']} tokens "
             "per request. Their acceptance is not in the text we could read: swept as tokens committed per round.",
             "", f"**Theirs** (against server-only SpecExec, draft and target on the server): "
                 f"{theirs['server_throughput_x']:.2f}x server throughput, {100 * theirs['inter_token_latency_change']:+.2f}% "
                 "inter-token latency. **Ours** (against cloud-only autoregressive decoding on the same A100):", "",
             "| tokens per round | concurrent requests per A100 | hybrid tok/s | cloud-only tok/s | throughput × | "
             "hybrid ITL p50 ms | cloud-only ITL p50 ms | ITL change |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['tokens_per_round']:g} | {r['edges']} | {r['hybrid_tokens_per_s']:,.0f} | "
                     f"{r['cloud_tokens_per_s']:,.0f} | {r['throughput_x']:.2f} | {r['hybrid_tpot_p50_s'] * 1e3:.1f} | "
                     f"{r['cloud_tpot_p50_s'] * 1e3:.1f} | {100 * r['itl_change']:+.0f}% |")
    cap = result["capacity"]
    lines += ["", f"At capacity (p95 TPOT <= {result['slo_tpot_s'] * 1e3:g} ms, p95 TTFT <= {result['slo_ttft_s'] * 1e3:g} ms; "
                  f"{result['capacity_tokens_per_round']:g} tokens per round): "
              + "; ".join(f"{mode} {c['edges']} edges, {_f(c['tokens_per_s'])} tok/s" for mode, c in cap.items()), ""]
    return lines


def gpu_registry(result: dict) -> tuple[dict, dict]:
    """The GPU table as the figures registry's tables and figures (hybridspec.figures)."""
    from hybridspec.figures import Figure, Table
    gpu = result["gpu_capacity"]
    setup = (f"{gpu['cost'].split('; host path')[0]}; edges on {', '.join(gpu['profiles'])}, α {gpu['alpha']:.3g}, γ {gpu['gamma']}, p95 TPOT <= "
             f"{gpu['slo_tpot_s'] * 1e3:g} ms, p95 TTFT <= {gpu['slo_ttft_s'] * 1e3:g} ms, {gpu['max_tokens']} tokens a request")
    columns = ["case", "edges per GPU", "committed tok/s per GPU", "× cloud-only", "p95 TPOT ms", "p95 TTFT ms",
               "target tokens / committed"]
    rows = [[r["case"], f"{r['edges_per_gpu']}{' (bound)' if r['bound'] else ''}",
             round(r["committed_tokens_per_s"]) if r["committed_tokens_per_s"] is not None else None,
             r["committed_tokens_per_s_vs_cloud"], _ms(r["tpot_p95_s"]), _ms(r["ttft_p95_s"]),
             r["target_tokens_per_committed_token"]] for r in gpu["rows"]]
    tables = {"capacity": Table(columns, rows, {"committed tok/s per GPU": "{:,}", "× cloud-only": "{:.2f}",
                                                "target tokens / committed": "{:.2f}"})}
    figures = {}
    for r in gpu["rows"]:
        key = {"cloud-only": "cloud"}.get(r["mode"], None)
        if r["case"].startswith("hybrid, vLLM session, maths in the engine (what ships)"):
            key = "hybrid-shipped"
        elif r["mode"] == "server-spec":
            key = "spec-" + r["case"].split(": ")[-1].replace(" ", "-").lower()
        if key and r["committed_tokens_per_s"] is not None:
            figures[f"{key}-tokens-per-s"] = Figure(round(r["committed_tokens_per_s"]), f"committed tokens/s per GPU at "
                                                    f"the SLO, {r['case']}", setup, "tok/s", "{:,.0f}")
    return figures, tables


def _ms(x):
    return None if x is None else round(x * 1e3, 1)
