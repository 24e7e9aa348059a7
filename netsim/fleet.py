"""The fleet on paper: a discrete-event simulation of edges sharing verifiers.

One verifier and the n edges assigned to it are simulated (edges are spread evenly, and one
verifier's edges do not interact with another's, so V verifiers for N edges behave like one
verifier with N/V edges). Per edge, per round (hybrid): draft γ tokens on the device, the
request crosses the uplink, waits for the verifier, is verified in a forward pass, the reply
crosses the downlink, and 1 + k tokens commit, k drawn from the geometric acceptance model
(per-token acceptance α, capped at γ). Cloud-only: the request crosses the uplink once and the
verifier streams one token per forward pass, each crossing the downlink.

The verifier: `batching=False` is today's verifier (one round, or one stream's token, per
pass, first come first served); `batching=True` is continuous batching (when the verifier is
free it takes everything waiting, up to `max_batch_tokens`, and never waits for a batch to
fill). A pass over T tokens for S sessions costs `cost.pass_s(T, S)`, plus a fixed server
overhead per round or token (gRPC, Python), spent serially. Each round also pays an edge-side
overhead (client stack and proxy).

Links: each edge draws its profile from the mix; a message's one-way delay is the link's
fixed delays, a jitter draw, its transmission time, and, with probability 1-(1-p)^segments,
a loss stall of RTT + 200 ms (netsim.effects.loss). Outages, traces and handovers are left out.

Calibration (`calibrate_from_load`): from a `netsim load` run on the same verifier, the pass
cost (model seconds per round), the server overhead per round ((round - model) seconds per
round at one edge), α (from committed tokens per round), and the edge overhead (what the one-
edge round time has beyond drafting, RTT and the verifier). Capacity (`edges_per_verifier`):
the largest n whose simulated p95 time per output token meets the SLO, by bisection.
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field, replace

import numpy as np

from netsim.effects import Bandwidth, Delay, GilbertElliottLoss, Jitter, Loss
from netsim.link import Link
from netsim.profiles import get_profile

RTO_MIN_S = 0.2


# --- cost of a forward pass ----------------------------------------------------------------

@dataclass(frozen=True)
class LinearCost:
    """pass_s = fixed_s + per_token_s · tokens: a CPU backend (compute-bound at any batch)."""

    fixed_s: float
    per_token_s: float
    name: str = "linear"

    def pass_s(self, tokens: int, sessions: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def describe(self) -> str:
        return f"{self.name}: {self.fixed_s * 1e3:.2f} ms + {self.per_token_s * 1e3:.3f} ms/token"


@dataclass(frozen=True)
class RooflineCost:
    """A GPU pass: the slower of reading the weights and the sessions' KV cache at the achieved
    memory bandwidth, and the FLOPs of `tokens` at the achieved compute rate; plus a launch floor.

    pass_s = max((model_bytes + sessions·context·kv_bytes_per_token) / (bw·bw_eff),
                 2·params·tokens / (flops·flops_eff)) + overhead_s
    """

    params: float                  # model parameters
    model_bytes: float             # weight bytes read per pass
    kv_bytes_per_token: float      # KV cache bytes per token of context (all layers, K and V)
    context_tokens: int            # mean context per session
    hbm_bytes_per_s: float         # peak memory bandwidth
    flops_per_s: float             # peak dense bf16 FLOP/s
    bw_efficiency: float = 0.7     # achieved / peak bandwidth (our assumption)
    flops_efficiency: float = 0.5  # achieved / peak FLOPs (our assumption)
    overhead_s: float = 0.0005     # kernel launches, sampling, scheduling per pass (our assumption)
    name: str = "roofline"

    def pass_s(self, tokens: int, sessions: int) -> float:
        memory_s = (self.model_bytes + sessions * self.context_tokens * self.kv_bytes_per_token) / (
            self.hbm_bytes_per_s * self.bw_efficiency)
        compute_s = 2.0 * self.params * tokens / (self.flops_per_s * self.flops_efficiency)
        return max(memory_s, compute_s) + self.overhead_s

    def describe(self) -> str:
        return (f"{self.name}: {self.params / 1e9:g}B params, {self.model_bytes / 1e9:g} GB weights, "
                f"{self.kv_bytes_per_token / 1e3:g} kB KV/token x {self.context_tokens} tokens/session, "
                f"{self.hbm_bytes_per_s / 1e12:g} TB/s x {self.bw_efficiency:g}, "
                f"{self.flops_per_s / 1e12:g} TFLOP/s x {self.flops_efficiency:g}, +{self.overhead_s * 1e3:g} ms")


# Llama-3.1-8B in bf16 (config.json: 32 layers, 8 KV heads of 128 dims; 8.03e9 parameters):
# KV per token = 2 (K, V) x 32 x 8 x 128 x 2 bytes = 131 kB.
LLAMA_8B = dict(params=8.03e9, model_bytes=16.06e9, kv_bytes_per_token=131_072)
# NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16 (1979 with sparsity).
H100 = dict(hbm_bytes_per_s=3.35e12, flops_per_s=989e12)
# NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 141 GB, same compute as the H100 SXM.
H200 = dict(hbm_bytes_per_s=4.8e12, flops_per_s=989e12)


def gpu_cost(gpu: dict = H200, context_tokens: int = 1024) -> RooflineCost:
    return RooflineCost(**LLAMA_8B, **gpu, context_tokens=context_tokens, name="H200, Llama-3.1-8B bf16"
                        if gpu is H200 else "H100, Llama-3.1-8B bf16")


# --- links ---------------------------------------------------------------------------------

class LinkSampler:
    """One-way delays of lone messages on one link (seconds)."""

    def __init__(self, link: Link, rtt_s: float) -> None:
        self.fixed_s = sum(e.delay_ms for e in link.effects if isinstance(e, Delay)) / 1000.0
        self.jitters = [e for e in link.effects if isinstance(e, Jitter)]
        rates = [e.rate_kbit_s for e in link.effects if isinstance(e, Bandwidth)]
        self.rate_bit_s = min(rates) * 1000.0 if rates else None
        self.loss = 1.0 - math.prod(1.0 - e.mean_loss_rate() for e in link.effects
                                    if isinstance(e, (Loss, GilbertElliottLoss)))
        self.stall_s = rtt_s + RTO_MIN_S

    def sample_s(self, size_bytes: int, rng: random.Random) -> float:
        delay_s = self.fixed_s + sum(j.extra_ms(rng) for j in self.jitters) / 1000.0
        if self.rate_bit_s:
            delay_s += size_bytes * 8.0 / self.rate_bit_s
        if self.loss and rng.random() < 1.0 - (1.0 - self.loss) ** max(1, math.ceil(size_bytes / 1448)):
            delay_s += self.stall_s
        return delay_s


# --- the simulation ------------------------------------------------------------------------

@dataclass
class FleetConfig:
    edges: int                          # edges on this one verifier
    mode: str                           # "hybrid" or "cloud-only"
    cost: object                        # LinearCost or RooflineCost
    batching: bool = False
    profiles: list[str] = field(default_factory=lambda: ["lan"])
    gamma: int = 4
    alpha: float = 0.7                  # per-token acceptance
    draft_s: float = 0.002              # device drafting time per token
    max_tokens: int = 64                # per request; requests back to back
    prompt_tokens: int = 13
    server_overhead_s: float = 0.0      # per round (hybrid) or per token (cloud-only), serial on the verifier
    edge_overhead_s: float = 0.0        # per round on the edge side (client stack, proxy)
    max_batch_tokens: int = 4096
    lock_contenders: int = 0            # without batching: rounds contending for the model lock at once
                                        # (the verifier's thread pool: min(32, cores + 4) = 6 here); 0: first come
    up_bytes: int = 300                 # a Verify request (γ ids + q), bytes on the wire
    down_bytes: int = 60                # a reply, or one streamed token
    duration_s: float = 30.0
    warmup_s: float = 3.0
    seed: int = 1


@dataclass
class _Edge:
    up: LinkSampler
    down: LinkSampler
    committed: int = 0                  # tokens of the current request
    request_start: float = 0.0
    token_times: list = field(default_factory=list)   # (time, tokens) of the current request
    last_arrival: float = 0.0           # the downlink delivers in order


def simulate(cfg: FleetConfig) -> dict:
    rng = random.Random(cfg.seed)
    np_rng = np.random.default_rng(cfg.seed)
    edges: list[_Edge] = []
    for i in range(cfg.edges):
        profile = get_profile(cfg.profiles[i % len(cfg.profiles)])
        rtt_s = profile.rtt_ms() / 1000.0
        edges.append(_Edge(LinkSampler(profile.uplink, rtt_s), LinkSampler(profile.downlink, rtt_s)))
    events: list = []
    seq = 0

    def push(t: float, kind: str, payload) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    t_measure, t_end = cfg.warmup_s, cfg.warmup_s + cfg.duration_s
    finished_tpots: list[float] = []
    ttfts: list[float] = []
    committed_in_window = 0
    passes = target_tokens = 0
    busy_s = 0.0
    queue: list = []          # hybrid: (edge, tokens_in_pass); cloud-only: streams ready for a token
    streams: dict = {}        # cloud-only: edge -> tokens still to generate
    verifier_free = True

    def windowed_tpot(e: _Edge) -> float | None:
        inside = [(t, n) for t, n in e.token_times if t_measure <= t <= t_end]
        if len(inside) < 2 or inside[-1][1] == inside[0][1]:
            return None
        return (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1])

    def commit(i: int, t: float, n: int) -> None:
        nonlocal committed_in_window
        e = edges[i]
        if not e.token_times and t_measure <= e.request_start <= t_end:
            ttfts.append(t - e.request_start)
        e.committed += n
        e.token_times.append((t, e.committed))
        if t_measure <= t <= t_end:
            committed_in_window += n

    def start_request(i: int, t: float) -> None:
        e = edges[i]
        if e.token_times:
            tpot = windowed_tpot(e)
            if tpot is not None:
                finished_tpots.append(tpot)
        e.committed, e.request_start, e.token_times = 0, t, []
        if cfg.mode == "hybrid":
            push(t + cfg.gamma * cfg.draft_s + e.up.sample_s(cfg.up_bytes, rng) + cfg.edge_overhead_s,
                 "arrive", (i, cfg.gamma + 1 + cfg.prompt_tokens))
        else:
            push(t + e.up.sample_s(cfg.up_bytes, rng) + cfg.edge_overhead_s, "arrive", (i, cfg.prompt_tokens + 1))

    def next_batch(t: float) -> None:
        nonlocal verifier_free, passes, target_tokens, busy_s
        if not queue:
            verifier_free = True
            return
        if cfg.batching:
            batch, tokens = [], 0
            while queue and (not batch or tokens + queue[0][1] <= cfg.max_batch_tokens):
                item = queue.pop(0)
                batch.append(item)
                tokens += item[1]
        else:
            # Today's verifier: rounds run in a thread pool and take the model's lock one at a
            # time; which of the waiting workers gets it is up to the OS, not first come.
            pick = rng.randrange(min(cfg.lock_contenders, len(queue))) if cfg.lock_contenders else 0
            batch = [queue.pop(pick)]
            tokens = batch[0][1]
        duration = cfg.cost.pass_s(tokens, len(batch)) + cfg.server_overhead_s * len(batch)
        if t_measure <= t <= t_end:
            passes += 1
            target_tokens += tokens
            busy_s += duration
        verifier_free = False
        push(t + duration, "done", batch)

    for i in range(cfg.edges):
        start_request(i, rng.uniform(0.0, 0.05))

    while events:
        t, _, kind, payload = heapq.heappop(events)
        if t > t_end:
            break
        if kind == "arrive":
            queue.append(payload)
            if cfg.mode == "cloud-only":
                streams[payload[0]] = cfg.max_tokens
            if verifier_free:
                next_batch(t)
        elif kind == "done":
            for i, _tokens in payload:
                e = edges[i]
                arrival = max(t + e.down.sample_s(cfg.down_bytes, rng), e.last_arrival)
                e.last_arrival = arrival
                if cfg.mode == "hybrid":
                    remaining = cfg.max_tokens - e.committed
                    accepted = 0
                    while accepted < cfg.gamma and rng.random() < cfg.alpha:
                        accepted += 1
                    push(arrival, "reply", (i, min(accepted + 1, remaining)))
                else:
                    streams[i] -= 1
                    push(arrival, "token", (i, streams[i] == 0))
                    if streams[i] > 0:
                        queue.append((i, 1))   # the stream's next token: one more row in the next pass
            next_batch(t)
        elif kind == "reply":
            i, n = payload
            commit(i, t, n)
            e = edges[i]
            if e.committed >= cfg.max_tokens:
                start_request(i, t)
            else:
                remaining = cfg.max_tokens - e.committed
                gamma = min(cfg.gamma, remaining - 1)
                push(t + gamma * cfg.draft_s + e.up.sample_s(cfg.up_bytes, rng) + cfg.edge_overhead_s,
                     "arrive", (i, gamma + 1))
        elif kind == "token":
            i, last = payload
            commit(i, t, 1)
            if last:
                start_request(i, t)
    for e in edges:
        tpot = windowed_tpot(e)
        if tpot is not None:
            finished_tpots.append(tpot)
    del np_rng
    committed = max(committed_in_window, 1)
    pct = (lambda q: float(np.percentile(finished_tpots, q)) if finished_tpots else None)
    return {"edges": cfg.edges, "mode": cfg.mode, "batching": cfg.batching,
            "committed_tokens_per_s": committed_in_window / cfg.duration_s,
            "tpot_p50_s": pct(50), "tpot_p95_s": pct(95), "tpot_p99_s": pct(99),
            "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
            "target_forward_passes_per_committed_token": passes / committed,
            "target_tokens_per_committed_token": target_tokens / committed,
            "verifier_utilisation": min(1.0, busy_s / cfg.duration_s)}


# --- calibration and capacity --------------------------------------------------------------

def alpha_from_tokens_per_round(tokens_per_round: float, gamma: int) -> float:
    """Invert (1 - α^(γ+1)) / (1 - α) = tokens per round (bisection)."""
    target = min(max(tokens_per_round, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        value = (1 - mid ** (gamma + 1)) / (1 - mid) if mid < 1 else gamma + 1.0
        lo, hi = (mid, hi) if value < target else (lo, mid)
    return (lo + hi) / 2


def calibrate_from_load(result: dict, per_token_s: float = 0.0) -> dict:
    """Fleet parameters from a `netsim load` result (its one-edge hybrid and cloud-only runs)."""
    runs = result["runs"]
    cfg = result["config"]
    one = {r["mode"]: r for r in runs if r["edges"] == min(x["edges"] for x in runs)}
    hybrid, cloud = one.get("hybrid"), one.get("cloud-only")
    if hybrid is None or not hybrid.get("verify_rounds"):
        raise ValueError("calibration needs a hybrid run with the verifier's metrics (verify_rounds)")
    rounds = hybrid["verify_rounds"]
    gamma = cfg["gamma"]
    pass_s = hybrid["model_seconds"] / rounds
    server_overhead_s = max(0.0, (hybrid.get("round_seconds", 0.0) - hybrid["model_seconds"]) / rounds)
    tokens_per_round = hybrid["committed_tokens"] / rounds
    alpha = alpha_from_tokens_per_round(tokens_per_round, gamma)
    profile = get_profile(cfg["profiles"][0])
    draft_s = (cfg["draft_ms"] or 0.0) / 1000.0
    round_s = hybrid["duration_s"] / rounds * hybrid["edges"]
    edge_overhead_s = max(0.0, round_s - gamma * draft_s - profile.rtt_ms() / 1000.0 - pass_s - server_overhead_s)
    fixed_s = max(0.0, pass_s - per_token_s * (gamma + 1))
    cloud_overhead_s = 0.0
    if cloud is not None and cloud.get("tpot_p50_s"):
        cloud_overhead_s = max(0.0, cloud["tpot_p50_s"] - (fixed_s + per_token_s))
    return {"cost": LinearCost(fixed_s, per_token_s, name="measured"), "alpha": alpha, "gamma": gamma,
            "draft_s": draft_s, "server_overhead_s": server_overhead_s, "edge_overhead_s": edge_overhead_s,
            "cloud_server_overhead_s": cloud_overhead_s, "max_tokens": cfg["max_tokens"],
            "profiles": cfg["profiles"], "tokens_per_round": tokens_per_round}


def fleet_config(params: dict, edges: int, mode: str, batching: bool, **overrides) -> FleetConfig:
    overhead = params["server_overhead_s"] if mode == "hybrid" else params["cloud_server_overhead_s"]
    base = FleetConfig(edges=edges, mode=mode, cost=params["cost"], batching=batching, profiles=params["profiles"],
                       gamma=params["gamma"], alpha=params["alpha"], draft_s=params["draft_s"],
                       max_tokens=params["max_tokens"], server_overhead_s=overhead,
                       edge_overhead_s=params["edge_overhead_s"])
    return replace(base, **overrides)


def edges_per_verifier(make, slo_s: float, max_edges: int = 1 << 16, duration_s: float = 20.0) -> tuple[int, dict | None]:
    """The largest n with simulated p95 TPOT <= slo_s (0 when even one edge misses); make(n) -> FleetConfig."""
    def ok(n: int) -> tuple[bool, dict]:
        result = simulate(replace(make(n), duration_s=duration_s))
        return result["tpot_p95_s"] is not None and result["tpot_p95_s"] <= slo_s, result
    good, result = ok(1)
    if not good:
        return 0, result
    lo, best = 1, result
    hi = 2
    while True:
        if hi >= max_edges:
            good, result = ok(max_edges)
            if good:
                return max_edges, result
            hi = max_edges
            break
        good, result = ok(hi)
        if not good:
            break
        lo, best, hi = hi, result, hi * 2
    while hi - lo > max(1, lo // 32):   # to within ~3%
        mid = (lo + hi) // 2
        good, result = ok(mid)
        if good:
            lo, best = mid, result
        else:
            hi = mid
    return lo, best


# --- the report: check against the load test, then capacity --------------------------------

def check_against_load(result: dict, params: dict, batching: bool, seeds: int = 3) -> list[dict]:
    """Simulate each (edges, mode) of a load result with its warm-up and window (mean of `seeds` runs);
    simulated vs measured throughput and p95 TPOT."""
    rows = []
    cfg = result["config"]
    for run in result["runs"]:
        if run["mode"] not in ("hybrid", "cloud-only"):
            continue
        sims = [simulate(fleet_config(params, run["edges"], run["mode"], batching, duration_s=cfg["duration_s"],
                                      warmup_s=cfg["warmup_s"], seed=seed)) for seed in range(1, seeds + 1)]
        sim = {key: float(np.mean([s[key] for s in sims])) if all(s[key] is not None for s in sims) else None
               for key in ("committed_tokens_per_s", "tpot_p95_s")}
        row = {"edges": run["edges"], "mode": run["mode"],
               "measured_tokens_per_s": run["committed_tokens_per_s"], "simulated_tokens_per_s": sim["committed_tokens_per_s"],
               "measured_tpot_p95_s": run["tpot_p95_s"], "simulated_tpot_p95_s": sim["tpot_p95_s"]}
        for key in ("tokens_per_s", "tpot_p95_s"):
            m, s = row[f"measured_{key}"], row[f"simulated_{key}"]
            row[f"{key}_error"] = (s - m) / m if m and s is not None else None
        rows.append(row)
    return rows


def capacity_table(scenarios: list[tuple[str, dict, bool]], modes: list[str], slo_s: float,
                   totals: list[int], duration_s: float = 20.0, max_edges: int = 1 << 14) -> list[dict]:
    rows = []
    for name, params, batching in scenarios:
        for mode in modes:
            per_verifier, sim = edges_per_verifier(lambda n: fleet_config(params, n, mode, batching), slo_s,
                                                   max_edges=max_edges, duration_s=duration_s)
            row = {"backend": name, "mode": mode, "batching": batching, "edges_per_verifier": per_verifier,
                   "tokens_per_s_per_verifier": sim["committed_tokens_per_s"] if sim else None,
                   "tpot_p95_s": sim["tpot_p95_s"] if sim else None,
                   "capped": per_verifier >= max_edges}
            for total in totals:
                row[f"verifiers_for_{total}"] = math.ceil(total / per_verifier) if per_verifier else None
            rows.append(row)
    return rows


def kv_sessions(gpu_memory_bytes: float, cost: RooflineCost, usable: float = 0.9) -> int:
    """Sessions whose KV cache fits next to the weights (vLLM's gpu_memory_utilization 0.9)."""
    return int((gpu_memory_bytes * usable - cost.model_bytes) // (cost.kv_bytes_per_token * cost.context_tokens))


def run_fleet(load_result: dict, *, slo_s: float, totals: list[int], profiles: list[str], cpu_per_token_s: float,
              gpu: str, cpu_cost: LinearCost | None = None, gpu_alpha: float, gpu_draft_s: float, gpu_context: int, gpu_overhead_s: float,
              capacity_duration_s: float = 12.0, progress=None) -> dict:
    params = calibrate_from_load(load_result, per_token_s=cpu_per_token_s)
    check_serial = check_against_load(load_result, params, batching=False)
    gpu_spec, memory = (H200, 141e9) if gpu == "h200" else (H100, 80e9)
    gpu_model = gpu_cost(gpu_spec, gpu_context)
    cpu = {**params, "profiles": profiles}
    if cpu_cost is not None:   # a measured cost curve instead of the load run's own pass cost
        cpu["cost"] = cpu_cost
    gpu_params = {**params, "profiles": profiles, "cost": gpu_model, "alpha": gpu_alpha, "draft_s": gpu_draft_s,
                  "server_overhead_s": gpu_overhead_s, "cloud_server_overhead_s": gpu_overhead_s}
    scenarios = [("CPU as measured, serial (today)", cpu, False), ("CPU as measured, batched", cpu, True),
                 (f"{gpu.upper()} roofline, batched", gpu_params, True)]
    rows = []
    for name, scenario, batching in scenarios:
        if progress:
            progress(name)
        max_edges = kv_sessions(memory, gpu_model) if scenario is gpu_params else 1 << 12
        rows += capacity_table([(name, scenario, batching)], ["hybrid", "cloud-only"], slo_s, totals,
                               duration_s=capacity_duration_s, max_edges=max_edges)
    describe = lambda p: {k: (v.describe() if hasattr(v, "describe") else float(f"{v:.4g}") if isinstance(v, float) else v)  # noqa: E731
                          for k, v in p.items()}
    return {"slo_s": slo_s, "totals": totals, "profiles": profiles, "calibration": describe(params),
            "cpu_cost": cpu["cost"].describe(),
            "gpu": describe(gpu_params), "gpu_kv_sessions": kv_sessions(memory, gpu_model),
            "check": check_serial, "capacity": rows,
            "load_config": {k: load_result["config"][k] for k in ("profiles", "duration_s", "warmup_s", "synthetic",
                                                                 "synthetic_step_ms", "gamma", "draft_ms", "max_tokens")}}


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:+.0f}%"


def _ms(x) -> str:
    return "–" if x is None else f"{1e3 * x:.1f}"


def fleet_markdown(result: dict) -> str:
    lc = result["load_config"]
    lines = ["# netsim fleet", "",
             f"Calibrated on `netsim load` ({'synthetic pair, target ' + str(lc['synthetic_step_ms']) + ' ms/pass' if lc['synthetic'] else 'bundled models'}, "
             f"profiles {', '.join(lc['profiles'])}, {lc['duration_s']:g} s windows): "
             + ", ".join(f"{k} {v}" for k, v in result["calibration"].items() if k in ("cost", "alpha", "server_overhead_s",
                                                                                      "edge_overhead_s", "cloud_server_overhead_s")),
             "", f"CPU backend in the capacity table: {result['cpu_cost']}.",
             "", "## Simulated against measured (today's serial verifier)", "",
             "| edges | mode | tok/s measured | simulated | error | p95 TPOT ms measured | simulated | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["check"]:
        lines.append(f"| {r['edges']} | {r['mode']} | {r['measured_tokens_per_s']:.1f} | {r['simulated_tokens_per_s']:.1f} "
                     f"| {_pct(r['tokens_per_s_error'])} | {_ms(r['measured_tpot_p95_s'])} | {_ms(r['simulated_tpot_p95_s'])} "
                     f"| {_pct(r['tpot_p95_s_error'])} |")
    totals = result["totals"]
    lines += ["", f"## Verifiers needed at p95 time per output token <= {result['slo_s'] * 1e3:g} ms "
                  f"(links: {', '.join(result['profiles'])})", "",
              "| backend | mode | edges per verifier | tok/s per verifier | " + " | ".join(f"{t:,} edges" for t in totals) + " |",
              "|---|---|---|---|" + "---|" * len(totals)]
    for r in result["capacity"]:
        per = f"{r['edges_per_verifier']}{' (bound)' if r['capped'] else ''}"
        tps = "–" if r["tokens_per_s_per_verifier"] is None else f"{r['tokens_per_s_per_verifier']:.0f}"
        lines.append(f"| {r['backend']} | {r['mode']} | {per} | {tps} | "
                     + " | ".join("–" if r[f"verifiers_for_{t}"] is None else f"{r[f'verifiers_for_{t}']:,}" for t in totals) + " |")
    lines += ["", "(bound): the search stopped at its bound (the GPU's KV memory, or 4096 edges on the CPU) "
                  "with the SLO still met.",
              "", f"GPU model: {result['gpu']['cost']}; {result['gpu_kv_sessions']} sessions fit in KV memory; "
                  f"α {result['gpu']['alpha']}, draft {result['gpu']['draft_s'] * 1e3:g} ms/token on the device, "
                  f"server overhead {result['gpu']['server_overhead_s'] * 1e3:g} ms per round or token.", ""]
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
