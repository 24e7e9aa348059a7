"""Calibration (`calibrate_from_load`): the simulator's parameters from a `netsim load` run.

Whether the verifier batched (what it said of itself, its recorded arguments, else the per-pass
histograms); the pass cost, a line fitted to the per-pass histograms
`hybridspec_batch_tokens/_seconds` (mean seconds against mean tokens of every run), or model
seconds per round where a verifier exported none; the server's time per round outside the pass
((round − model) seconds per round at one edge) and per streamed token (one edge's TPOT less a
pass); α from committed tokens per round (pooled over the hybrid runs); the edge side's time per
round (what the one-edge round time has beyond drafting, the links' expected delays and the
server). The CPU parts of those times come from each process's measured cores busy, fitted
against rounds and streamed tokens (`cpu_per_unit`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from netsim.fleet.costs import LinearCost, RooflineCost
from netsim.fleet.links import ROUND_BYTES
from netsim.fleet.simulation import FleetConfig
from netsim.cmdline import option_value
from netsim.profiles import get_profile
from spec_core.costmodel import expected_tokens_per_round

# Tokens per batched pass (the Batcher's n_ubatch) of the verifiers the load test starts:
# cloud_verifier.backends.synthetic.SyntheticBackend(batch_tokens=512), and the batched llama.cpp
# verifier's batch-invariant passes for the bundled SmolLM2 target (llama_runtime.invariance.INVARIANT_UBATCH
# = 32; GGUFModel.invariant_ubatch probes a smaller cut for models that need one, e.g. 6 for Gemma 3).
SYNTHETIC_UBATCH = 512
LLAMA_CPP_UBATCH = 32


@dataclass(frozen=True)
class Calibration:
    """Fleet parameters of one verifier and its edges. Per round for hybrid; the `cloud_` ones per
    streamed token. A CPU part takes its process's turn; an overhead is a delay that holds nothing."""
    cost: LinearCost | RooflineCost     # a pass
    batching: bool                      # whether the verifier batched
    alpha: float                        # per-token acceptance
    gamma: int
    draft_s: float                      # device drafting time per token
    server_cpu_s: float
    server_overhead_s: float
    edge_cpu_s: float
    edge_overhead_s: float
    cloud_server_cpu_s: float
    cloud_server_overhead_s: float
    cloud_edge_cpu_s: float
    proxy_cpu_s: float                  # per message (the load test's proxy process)
    cloud_proxy_cpu_s: float            # per streamed token
    max_tokens: int                     # per request
    max_batch_tokens: int               # tokens per batched pass (the backend's n_ubatch)
    profiles: list[str]                 # the edges' links
    tokens_per_round: float             # committed, pooled over the hybrid runs (what α was fitted to)

    def describe(self) -> dict:
        """The figures for a report (JSON): the cost described, floats to 4 significant digits."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.describe() if hasattr(v, "describe") else float(f"{v:.4g}") if isinstance(v, float) else v
        return out


def alpha_from_tokens_per_round(tokens_per_round: float, gamma: int) -> float:
    """Invert (1 - α^(γ+1)) / (1 - α) = tokens per round (bisection)."""
    target = min(max(tokens_per_round, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        value = expected_tokens_per_round(mid, gamma)
        lo, hi = (mid, hi) if value < target else (lo, mid)
    return (lo + hi) / 2


def load_batching(result: dict) -> bool:
    """Whether a `netsim load` run's verifier batched: what the verifier said of itself (ServerInfo,
    recorded since batching became the default), else `--batching on|off` among the arguments it was
    started with, else whether any pass held more than one session."""
    said = (result.get("server") or {}).get("batching")
    if said is not None:
        return bool(said)
    setting = _verifier_arg(result, "--batching")
    if setting is not None:
        return setting == "on"
    for run in result["runs"]:
        sessions = (run.get("batch_histograms") or {}).get("hybridspec_batch_sessions")
        if sessions and sessions["count"] and sessions["sum"] > sessions["count"]:
            return True
    return False


def _verifier_arg(result: dict, name: str) -> str | None:
    """The value of option `name` among the arguments a load run's verifier was started with."""
    return option_value(result["config"].get("verifier_args") or [], name)


def load_schedule(result: dict) -> dict:
    """How a load run's batching verifier planned its passes, as FleetConfig fields: packing "slack"
    (`--schedule slack`, with the latency target it scheduled by, `--slo-tpot-ms`/`--slo-ttft-ms`)
    or "fair-share" (the default), and its `--prefill-chunk` under either."""
    out: dict = {"packing": "slack" if _verifier_arg(result, "--schedule") == "slack" else "fair-share"}
    chunk = _verifier_arg(result, "--prefill-chunk")
    if chunk:
        out["prefill_chunk"] = int(chunk)
    if out["packing"] == "slack":
        for arg, key in (("--slo-tpot-ms", "slo_tpot_s"), ("--slo-ttft-ms", "slo_ttft_s")):
            ms = _verifier_arg(result, arg)
            if ms is not None and float(ms) > 0:   # 0: the verifier's "none"
                out[key] = float(ms) / 1e3
    return out


def pass_cost_from_histograms(runs: list[dict], per_token_s: float | None = None) -> LinearCost | None:
    """A line through the runs' per-pass means (seconds against tokens, weighted by passes), from the
    verifier's `hybridspec_batch_tokens` and `_seconds` histograms; None when no run has them.
    `per_token_s` fixes the slope (then only the fixed part is fitted)."""
    points = []
    for run in runs:
        hist = run.get("batch_histograms") or {}
        tokens, seconds = hist.get("hybridspec_batch_tokens"), hist.get("hybridspec_batch_seconds")
        if tokens and seconds and tokens["count"] > 0:
            points.append((tokens["sum"] / tokens["count"], seconds["sum"] / seconds["count"], tokens["count"]))
    if not points:
        return None
    x, y, w = (np.array(v, dtype=float) for v in zip(*points))
    x_mean, y_mean = np.average(x, weights=w), np.average(y, weights=w)
    if per_token_s is None:
        spread = np.average((x - x_mean) ** 2, weights=w)
        slope = np.average((x - x_mean) * (y - y_mean), weights=w) / spread if spread > 0 else 0.0
        per_token_s = max(0.0, float(slope))
    fixed_s = max(0.0, float(y_mean - per_token_s * x_mean))
    return LinearCost(fixed_s, per_token_s, name="measured per pass")


def cpu_per_unit(runs: list[dict], key: str) -> tuple[float, float]:
    """CPU seconds per hybrid round and per streamed token of one process of the load test, from its
    measured cores busy (`key`): cores·duration = idle cores·duration + a·rounds + b·tokens, by least
    squares over the runs; (0, 0) without the figures."""
    rows = [(r["duration_s"], r["verify_rounds"] if r["mode"] == "hybrid" else 0.0,
             r["committed_tokens"] if r["mode"] == "cloud-only" else 0.0, r[key] * r["duration_s"])
            for r in runs if r.get(key) is not None and r["mode"] in ("hybrid", "cloud-only")]
    if len(rows) < 3 or not any(r[1] for r in rows) or not any(r[2] for r in rows):
        return 0.0, 0.0
    a = np.array([row[:3] for row in rows], dtype=float)
    y = np.array([row[3] for row in rows], dtype=float)
    _, per_round, per_token = np.linalg.lstsq(a, y, rcond=None)[0]
    return max(0.0, float(per_round)), max(0.0, float(per_token))


def calibrate_from_load(result: dict, per_token_s: float = 0.0) -> Calibration:
    """Fleet parameters from a `netsim load` result (its one-edge hybrid and cloud-only runs, its
    per-pass histograms, and its hybrid runs' tokens per round).

    per_token_s: the pass cost per token when known (the fixed part is then fitted); 0 fits both
    parts to the histograms, or, without histograms, takes a flat cost of model seconds per round."""
    runs = result["runs"]
    cfg = result["config"]
    one = {r["mode"]: r for r in runs if r["edges"] == min(x["edges"] for x in runs)}
    hybrid, cloud = one.get("hybrid"), one.get("cloud-only")
    if hybrid is None or not hybrid.get("verify_rounds"):
        raise ValueError("calibration needs a hybrid run with the verifier's metrics (verify_rounds)")
    rounds = hybrid["verify_rounds"]
    gamma = cfg["gamma"]
    batching = load_batching(result)
    pass_s = hybrid["model_seconds"] / rounds            # the one-edge run's own pass (and queue) per round
    server_overhead_s = max(0.0, (hybrid.get("round_seconds", 0.0) - hybrid["model_seconds"]) / rounds)
    cost = pass_cost_from_histograms(runs, per_token_s or None)
    if cost is None:
        cost = LinearCost(max(0.0, pass_s - per_token_s * (gamma + 1)), per_token_s, name="measured per round")
    hybrid_runs = [r for r in runs if r["mode"] == "hybrid" and r.get("verify_rounds")]
    tokens_per_round = sum(r["committed_tokens"] for r in hybrid_runs) / sum(r["verify_rounds"] for r in hybrid_runs)
    alpha = alpha_from_tokens_per_round(tokens_per_round, gamma)
    profile = get_profile(cfg["profiles"][0])
    draft_s = (cfg["draft_ms"] or 0.0) / 1000.0
    round_s = hybrid["duration_s"] / rounds * hybrid["edges"]
    rtt_ms = profile.rtt_ms()
    links_s = (profile.uplink.expected_delay_ms(ROUND_BYTES[0], rtt_ms)
               + profile.downlink.expected_delay_ms(ROUND_BYTES[1], rtt_ms)) / 1000.0
    edge_overhead_s = max(0.0, round_s - gamma * draft_s - links_s - pass_s - server_overhead_s)
    cloud_overhead_s = 0.0
    if cloud is not None and cloud.get("tpot_p50_s"):
        cloud_overhead_s = max(0.0, cloud["tpot_p50_s"] - cost.pass_s(1, 1))
    # The part of each overhead that is CPU work of one process: it waits its turn when many rounds
    # want that process at once. The proxies' work (two messages a round, one a streamed token) is
    # the load test's own, counted only when simulating it.
    server_cpu_s, cloud_server_cpu_s = cpu_per_unit(runs, "verifier_cpu_cores")
    edge_cpu_s, cloud_edge_cpu_s = cpu_per_unit(runs, "edges_cpu_cores")
    proxy_round_s, proxy_token_s = cpu_per_unit(runs, "proxy_cpu_cores")
    server_cpu_s, cloud_server_cpu_s = min(server_cpu_s, server_overhead_s), min(cloud_server_cpu_s, cloud_overhead_s)
    edge_cpu_s = min(edge_cpu_s, edge_overhead_s)
    proxy_cpu_s = min(proxy_round_s / 2, (edge_overhead_s - edge_cpu_s) / 2)
    return Calibration(
        cost=cost, batching=batching, alpha=alpha, gamma=gamma, draft_s=draft_s,
        server_cpu_s=server_cpu_s, server_overhead_s=server_overhead_s - server_cpu_s,
        edge_cpu_s=edge_cpu_s, edge_overhead_s=edge_overhead_s - edge_cpu_s - 2 * proxy_cpu_s,
        cloud_server_cpu_s=cloud_server_cpu_s, cloud_server_overhead_s=cloud_overhead_s - cloud_server_cpu_s,
        cloud_edge_cpu_s=cloud_edge_cpu_s, proxy_cpu_s=proxy_cpu_s, cloud_proxy_cpu_s=proxy_token_s,
        max_tokens=cfg["max_tokens"],
        max_batch_tokens=SYNTHETIC_UBATCH if cfg.get("synthetic") else LLAMA_CPP_UBATCH,
        profiles=cfg["profiles"], tokens_per_round=tokens_per_round)


def run_alpha(run: dict, gamma: int) -> float | None:
    """α of one hybrid run (its committed tokens per verified round), or None without the counters."""
    if run["mode"] == "hybrid" and run.get("verify_rounds"):
        return alpha_from_tokens_per_round(run["committed_tokens"] / run["verify_rounds"], gamma)
    return None


def fleet_config(params: Calibration, edges: int, mode: str, batching: bool, harness: bool = False,
                 **overrides) -> FleetConfig:
    """The simulation of `edges` edges on one verifier with calibrated `params`; harness: as in the load
    test (every edge in one process, every link in one proxy process), else a fleet of devices.
    `overrides` are FleetConfig fields."""
    hybrid = mode == "hybrid"
    base = FleetConfig(edges=edges, mode=mode, cost=params.cost, batching=batching, profiles=params.profiles,
                       gamma=params.gamma, alpha=params.alpha, draft_s=params.draft_s,
                       max_tokens=params.max_tokens,
                       server_cpu_s=params.server_cpu_s if hybrid else params.cloud_server_cpu_s,
                       server_overhead_s=params.server_overhead_s if hybrid else params.cloud_server_overhead_s,
                       edge_cpu_s=params.edge_cpu_s if hybrid else params.cloud_edge_cpu_s,
                       edge_overhead_s=params.edge_overhead_s if hybrid else 0.0,
                       edges_share_cpu=harness,
                       proxy_cpu_s=(params.proxy_cpu_s if hybrid else params.cloud_proxy_cpu_s) if harness else 0.0,
                       max_batch_tokens=params.max_batch_tokens)
    return replace(base, **overrides)
