"""The fleet on paper: a discrete-event simulation of edges sharing verifiers.

One verifier and the n edges assigned to it are simulated (edges are spread evenly, and one
verifier's edges do not interact with another's, so V verifiers for N edges behave like one
verifier with N/V edges). Per edge, per round (hybrid): draft γ tokens on the device, the
request crosses the uplink, waits for the verifier, is verified, the reply crosses the
downlink, and 1 + k tokens commit, k drawn from the geometric acceptance model (per-token
acceptance α, capped at γ). Cloud-only: the request crosses the uplink once and the verifier
streams one token per pass, each crossing the downlink.

Links are the proxy's own. Each edge's connection opens its profile's uplink and downlink as
`LinkProxy` does (`Link.open`, a generator per connection and direction from
`netsim.proxy.connection_rng`), and each message is cut into the proxy's chunks and leaves when
its link says. So jitter is the proxy's delay curve (independent values every 4 × the spread,
linear in between, never reordering), bandwidth keeps each connection busy for size/rate, loss
is the proxy's recovery stall (tail-loss probe or fast retransmit, RTO backoff) that holds the
rest of the stream behind it, and outages, traces and handovers act as they do in the proxy. A
reset connection is reopened and the message sent again after the client's first retry delay.

The verifier, serial (`batching=False`): one round, or one stream's token, per pass, first come
first served (the model's lock: a random order put 64 cloud-only streams' p95 74% above the
measured). With continuous batching (`batching=True`), `packing="fair-share"` is
cloud_verifier's `Batcher`: when a pass ends, every request that has arrived joins the active
ones, each active request gets a fair share of the pass's `max_batch_tokens` (the backend's
n_ubatch) and the rest of the pass is filled in arrival order; a request is answered after the
pass that holds its last token, and no pass waits for a batch to fill. `packing="fcfs"` takes
whole requests in arrival order up to `max_batch_tokens` (a vLLM-like scheduler: the GPU case).
A pass over T tokens for S sessions costs `cost.pass_s(T, S)`.

Outside its passes the server spends, per round or streamed token, `server_cpu_s` of CPU (gRPC,
protobuf, a round's checks and sampling) on one processor, one piece at a time (one Python
process), then `server_overhead_s` of delay that holds nothing. Neither holds the model: a
stream's next token reaches the batcher that long after its pass ended, and misses the next
pass when other requests were already waiting (the batched synthetic verifier's cloud-only
streams take two passes per token from 4 edges on). The edge side likewise: `edge_cpu_s` of
CPU per round (on a processor of its own, or, in the load test, one shared by every edge) and
`edge_overhead_s` of delay; the load test's proxy process reads every message (`proxy_cpu_s`).

Calibration (`calibrate_from_load`): from a `netsim load` run. Whether the verifier batched (its
recorded arguments, else the per-pass histograms); the pass cost, a line fitted to the per-pass
histograms `hybridspec_batch_tokens/_seconds` (mean seconds against mean tokens of every run),
or model seconds per round where a verifier exported none; the server's time per round outside
the pass ((round − model) seconds per round at one edge) and per streamed token (one edge's TPOT
less a pass); α from committed tokens per round (pooled over the hybrid runs); the edge side's
time per round (what the one-edge round time has beyond drafting, the links' expected delays and
the server). The CPU parts of those times come from each process's measured cores busy, fitted
against rounds and streamed tokens (`cpu_per_unit`). Capacity (`edges_per_verifier`): the
largest n whose simulated p95 time per output token meets the SLO, by bisection.
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field, replace

import numpy as np

from netsim.effects import LinkContext, LinkReset
from netsim.profiles import Profile, get_profile
from netsim.proxy import chunk_bytes, connection_rng

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

MAX_CHUNK_BYTES = 8192   # LinkProxy's max_chunk_bytes default
RECONNECT_S = 0.05       # the edge client's first retry delay (edge_client.client.EdgeClient._verify)

# Bytes a message puts on the wire (gRPC and HTTP/2 framing included), as the proxy read them with
# the synthetic pair, γ = 4 and q fixed:16:16 (bench/fleet_wire.py): a Verify request median 251 B
# (432 B with the prompt), its reply 111–113 B; a Generate request 137 B, a streamed token 22 B.
# Left out: about one 17-byte HTTP/2 PING or its ACK per ten rounds each way (gRPC's BDP probe).
ROUND_BYTES = (250, 112)
STREAM_BYTES = (137, 22)


class EdgeLink:
    """One edge's connection through its proxy, both directions, opened as LinkProxy opens one."""

    def __init__(self, profile: Profile, seed: int) -> None:
        self.profile, self.seed = profile, seed
        self.chunk = {"up": chunk_bytes(profile.uplink, MAX_CHUNK_BYTES),
                      "down": chunk_bytes(profile.downlink, MAX_CHUNK_BYTES)}
        self.connection = -1
        self.resets = 0
        self._open()

    def _open(self) -> None:
        self.connection += 1
        rtt_s = self.profile.rtt_ms() / 1000.0
        self.states = {direction: link.open(LinkContext(rng=connection_rng(self.seed, self.connection, direction),
                                                        epoch_s=0.0, rtt_s=rtt_s, seed=self.seed))
                       for direction, link in (("up", self.profile.uplink), ("down", self.profile.downlink))}

    def arrival_s(self, direction: str, size_bytes: int, sent_s: float) -> float:
        """When a message of `size_bytes` written at `sent_s` has crossed ("up" or "down").

        Calls for one direction come in the order of their `sent_s`, as the proxy reads them.
        """
        while True:
            try:
                arrival_s = sent_s
                chunk = self.chunk[direction]
                for start in range(0, max(size_bytes, 1), chunk):
                    arrival_s = self.states[direction].departure_s(min(chunk, size_bytes - start), sent_s)
                return arrival_s
            except LinkReset:
                # A new connection, and the message again after the client's retry delay.
                self.resets += 1
                self._open()
                sent_s += RECONNECT_S


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
    # Per round (hybrid) or streamed token (cloud-only). CPU work is done by one processor, a piece at
    # a time (the verifier is one Python process; with edges_share_cpu, so are the edges, as in the
    # load test); an overhead is a delay that takes no one's turn (timers, the kernel, the proxy's hops).
    server_cpu_s: float = 0.0           # the verifier's own work outside passes (gRPC, checks, sampling)
    server_overhead_s: float = 0.0      # the rest of the server's time outside passes
    edge_cpu_s: float = 0.0             # the edge's work (client stack, drafting code)
    edge_overhead_s: float = 0.0        # the rest of the edge side's time (timer slack, the proxy's own work)
    edges_share_cpu: bool = False       # every edge on one processor (the load test), else each its own
    proxy_cpu_s: float = 0.0            # per message: the load test's proxy process (every link) reading it
    max_batch_tokens: int = 512         # batching: tokens per pass (n_ubatch; synthetic 512, llama.cpp 32)
    packing: str = "fair-share"         # batching: "fair-share" (cloud_verifier's Batcher) or "fcfs" (whole requests)
    round_bytes: tuple[int, int] = ROUND_BYTES     # hybrid: a Verify request and its reply on the wire (B)
    stream_bytes: tuple[int, int] = STREAM_BYTES   # cloud-only: a Generate request and one streamed token (B)
    duration_s: float = 30.0
    warmup_s: float = 3.0
    seed: int = 1


@dataclass
class _Edge:
    link: EdgeLink
    committed: int = 0                  # tokens of the current request
    request_start: float = 0.0
    token_times: list = field(default_factory=list)   # (time, tokens) of the current request


class _Cpu:
    """A processor that does one piece of work at a time, first come first served."""

    def __init__(self) -> None:
        self.free_s = 0.0

    def run(self, t: float, work_s: float) -> float:
        """When work of `work_s` handed over at `t` is done."""
        self.free_s = max(t, self.free_s) + work_s
        return self.free_s


@dataclass
class _Job:
    """A round (hybrid) or one stream's next token (cloud-only) at the verifier."""
    edge: int
    tokens: int                         # tokens still to evaluate
    arrived_s: float = 0.0              # when it reached the verifier


def _fair_share_plan(active: list[_Job], budget: int) -> list[tuple[_Job, int]]:
    """cloud_verifier.backends.batcher.Batcher._plan: a fair share each, then the rest in arrival order."""
    share = max(1, budget // len(active))
    plan = []
    for job in active:
        n = min(job.tokens, share, budget)
        if n:
            plan.append([job, n])
            budget -= n
    for entry in plan:
        if budget <= 0:
            break
        extra = min(entry[0].tokens - entry[1], budget)
        entry[1] += extra
        budget -= extra
    return [(job, n) for job, n in plan]


def _fcfs_plan(active: list[_Job], budget: int) -> list[tuple[_Job, int]]:
    """Whole requests in arrival order while they fit (the first always does)."""
    plan, tokens = [], 0
    for job in active:
        if plan and tokens + job.tokens > budget:
            break
        plan.append((job, job.tokens))
        tokens += job.tokens
    return plan


def simulate(cfg: FleetConfig) -> dict:
    if cfg.mode not in ("hybrid", "cloud-only"):
        raise ValueError(f"mode must be hybrid or cloud-only, got {cfg.mode!r}")
    rng = random.Random(cfg.seed)
    edges = [_Edge(EdgeLink(get_profile(cfg.profiles[i % len(cfg.profiles)]), cfg.seed * 100_003 + i))
             for i in range(cfg.edges)]
    events: list = []
    seq = 0

    def push(t: float, kind: str, payload) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    t_measure, t_end = cfg.warmup_s, cfg.warmup_s + cfg.duration_s
    finished_tpots: list[float] = []
    ttfts: list[float] = []
    server_times: list[float] = []   # a round's (or token's) time from reaching the verifier to its answer leaving
    committed_in_window = 0
    passes = target_tokens = 0
    busy_s = 0.0
    waiting: list[_Job] = []    # arrived since the last pass started
    active: list[_Job] = []     # batching: taken in, tokens left to evaluate
    streams: dict = {}          # cloud-only: edge -> tokens still to generate
    verifier_free = True
    hybrid = cfg.mode == "hybrid"
    up_bytes, down_bytes = cfg.round_bytes if hybrid else cfg.stream_bytes
    server_cpu, proxy_cpu = _Cpu(), _Cpu()
    shared_edge_cpu = _Cpu()
    edge_cpus = [shared_edge_cpu if cfg.edges_share_cpu else _Cpu() for _ in range(cfg.edges)]

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

    def send(t: float, i: int, direction: str, size_bytes: int, kind: str, payload) -> None:
        """A message written at t: it crosses the edge's link and becomes event `kind` on the far side."""
        push(t, "send", (i, direction, size_bytes, kind, payload))

    def send_round(i: int, t: float, gamma: int, tokens: int) -> None:
        send(t + gamma * cfg.draft_s + cfg.edge_overhead_s, i, "up", up_bytes, "arrive", _Job(i, tokens))

    def start_request(i: int, t: float) -> None:
        e = edges[i]
        if e.token_times:
            tpot = windowed_tpot(e)
            if tpot is not None:
                finished_tpots.append(tpot)
        e.committed, e.request_start, e.token_times = 0, t, []
        if hybrid:
            send_round(i, t, cfg.gamma, cfg.gamma + 1 + cfg.prompt_tokens)
        else:
            streams[i] = cfg.max_tokens
            send(t + cfg.edge_overhead_s, i, "up", up_bytes, "arrive", _Job(i, cfg.prompt_tokens))

    def next_pass(t: float) -> None:
        nonlocal verifier_free, passes, target_tokens, busy_s
        if cfg.batching:
            active.extend(waiting)
            waiting.clear()
            if not active:
                verifier_free = True
                return
            plan = (_fair_share_plan if cfg.packing == "fair-share" else _fcfs_plan)(active, cfg.max_batch_tokens)
        else:
            if not waiting:
                verifier_free = True
                return
            job = waiting.pop(0)   # the model's lock: measured closer to first come than to random
            plan = [(job, job.tokens)]
        tokens = sum(n for _, n in plan)
        duration = cfg.cost.pass_s(tokens, len(plan))
        if t_measure <= t <= t_end:
            passes += 1
            target_tokens += tokens
            busy_s += duration
        verifier_free = False
        push(t + duration, "done", plan)

    for i in range(cfg.edges):
        start_request(i, rng.uniform(0.0, 0.05))

    while events:
        t, _, kind, payload = heapq.heappop(events)
        if t > t_end:
            break
        if kind == "send":
            i, direction, size_bytes, then, message = payload
            taken_s = proxy_cpu.run(t, cfg.proxy_cpu_s)   # the proxy reads it, then its link delays it
            push(edges[i].link.arrival_s(direction, size_bytes, taken_s), then, message)
        elif kind == "arrive":
            payload.arrived_s = t
            waiting.append(payload)
            if verifier_free:
                next_pass(t)
        elif kind == "done":
            for job, n in payload:
                job.tokens -= n
                if job.tokens > 0:
                    continue        # more of it in the next pass
                if cfg.batching:
                    active.remove(job)
                i, e = job.edge, edges[job.edge]
                out = server_cpu.run(t, cfg.server_cpu_s) + cfg.server_overhead_s
                if t_measure <= t <= t_end:
                    server_times.append(out - job.arrived_s)
                if hybrid:
                    remaining = cfg.max_tokens - e.committed
                    accepted = 0
                    while accepted < cfg.gamma and rng.random() < cfg.alpha:
                        accepted += 1
                    send(out, i, "down", down_bytes, "reply", (i, min(accepted + 1, remaining)))
                else:
                    streams[i] -= 1
                    send(out, i, "down", down_bytes, "token", (i, streams[i] == 0))
                    if streams[i] > 0:   # the stream asks for its next token (at once: it is in the next pass)
                        nxt = _Job(i, 1, arrived_s=out)
                        waiting.append(nxt) if out <= t else push(out, "arrive", nxt)
            next_pass(t)
        elif kind == "reply":
            i, n = payload
            ready = edge_cpus[i].run(t, cfg.edge_cpu_s)   # the reply taken in, the next draft's code run
            commit(i, ready, n)
            e = edges[i]
            if e.committed >= cfg.max_tokens:
                start_request(i, ready)
            else:
                gamma = min(cfg.gamma, cfg.max_tokens - e.committed - 1)
                send_round(i, ready, gamma, gamma + 1)
        elif kind == "token":
            i, last = payload
            ready = edge_cpus[i].run(t, cfg.edge_cpu_s)
            commit(i, ready, 1)
            if last:
                start_request(i, ready)
    for e in edges:
        tpot = windowed_tpot(e)
        if tpot is not None:
            finished_tpots.append(tpot)
    committed = max(committed_in_window, 1)
    pct = (lambda q: float(np.percentile(finished_tpots, q)) if finished_tpots else None)
    return {"edges": cfg.edges, "mode": cfg.mode, "batching": cfg.batching,
            "committed_tokens_per_s": committed_in_window / cfg.duration_s,
            "tpot_p50_s": pct(50), "tpot_p95_s": pct(95), "tpot_p99_s": pct(99),
            "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
            "target_forward_passes_per_committed_token": passes / committed,
            "target_tokens_per_committed_token": target_tokens / committed,
            "verifier_utilisation": min(1.0, busy_s / cfg.duration_s),
            "server_s_mean": float(np.mean(server_times)) if server_times else None,
            "link_resets": sum(e.link.resets for e in edges)}


# --- calibration and capacity --------------------------------------------------------------

# Tokens per batched pass (the Batcher's n_ubatch) of the verifiers the load test starts:
# cloud_verifier.backends.synthetic.SyntheticBackend(batch_tokens=512), and the batched llama.cpp
# verifier's batch-invariant passes (llama_runtime.model.INVARIANT_UBATCH = 32).
SYNTHETIC_UBATCH = 512
LLAMA_CPP_UBATCH = 32


def alpha_from_tokens_per_round(tokens_per_round: float, gamma: int) -> float:
    """Invert (1 - α^(γ+1)) / (1 - α) = tokens per round (bisection)."""
    target = min(max(tokens_per_round, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        value = (1 - mid ** (gamma + 1)) / (1 - mid) if mid < 1 else gamma + 1.0
        lo, hi = (mid, hi) if value < target else (lo, mid)
    return (lo + hi) / 2


def load_batching(result: dict) -> bool:
    """Whether a `netsim load` run's verifier batched: what the verifier said of itself (ServerInfo,
    recorded since batching became the default), else `--batching on|off` among the arguments it was
    started with, else whether any pass held more than one session."""
    said = (result.get("server") or {}).get("batching")
    if said is not None:
        return bool(said)
    args = [str(a) for a in result["config"].get("verifier_args") or []]
    setting = None
    for i, arg in enumerate(args):
        if arg == "--batching" and i + 1 < len(args):
            setting = args[i + 1]
        elif arg.startswith("--batching="):
            setting = arg.split("=", 1)[1]
    if setting is not None:
        return setting == "on"
    for run in result["runs"]:
        sessions = (run.get("batch_histograms") or {}).get("hybridspec_batch_sessions")
        if sessions and sessions["count"] and sessions["sum"] > sessions["count"]:
            return True
    return False


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


def calibrate_from_load(result: dict, per_token_s: float = 0.0) -> dict:
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
    return {"cost": cost, "batching": batching, "alpha": alpha, "gamma": gamma, "draft_s": draft_s,
            "server_cpu_s": server_cpu_s, "server_overhead_s": server_overhead_s - server_cpu_s,
            "edge_cpu_s": edge_cpu_s, "edge_overhead_s": edge_overhead_s - edge_cpu_s - 2 * proxy_cpu_s,
            "cloud_server_cpu_s": cloud_server_cpu_s, "cloud_server_overhead_s": cloud_overhead_s - cloud_server_cpu_s,
            "cloud_edge_cpu_s": cloud_edge_cpu_s, "proxy_cpu_s": proxy_cpu_s, "cloud_proxy_cpu_s": proxy_token_s,
            "max_tokens": cfg["max_tokens"],
            "max_batch_tokens": SYNTHETIC_UBATCH if cfg.get("synthetic") else LLAMA_CPP_UBATCH,
            "profiles": cfg["profiles"], "tokens_per_round": tokens_per_round}


def run_alpha(run: dict, gamma: int) -> float | None:
    """α of one hybrid run (its committed tokens per verified round), or None without the counters."""
    if run["mode"] == "hybrid" and run.get("verify_rounds"):
        return alpha_from_tokens_per_round(run["committed_tokens"] / run["verify_rounds"], gamma)
    return None


def fleet_config(params: dict, edges: int, mode: str, batching: bool, harness: bool = False,
                 **overrides) -> FleetConfig:
    """The simulation of `edges` edges on one verifier with calibrated `params`; harness: as in the load
    test (every edge in one process, every link in one proxy process), else a fleet of devices."""
    prefix = "" if mode == "hybrid" else "cloud_"
    base = FleetConfig(edges=edges, mode=mode, cost=params["cost"], batching=batching, profiles=params["profiles"],
                       gamma=params["gamma"], alpha=params["alpha"], draft_s=params["draft_s"],
                       max_tokens=params["max_tokens"],
                       server_cpu_s=params.get(f"{prefix}server_cpu_s", 0.0),
                       server_overhead_s=params[f"{prefix}server_overhead_s"],
                       edge_cpu_s=params.get(f"{prefix}edge_cpu_s", 0.0),
                       edge_overhead_s=params["edge_overhead_s"] if mode == "hybrid" else 0.0,
                       edges_share_cpu=harness, proxy_cpu_s=params.get(f"{prefix}proxy_cpu_s", 0.0) if harness else 0.0,
                       max_batch_tokens=params.get("max_batch_tokens", SYNTHETIC_UBATCH),
                       packing=params.get("packing", "fair-share"))
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

CHECK_SEEDS = 21


def check_against_load(result: dict, params: dict, seeds: int = CHECK_SEEDS) -> list[dict]:
    """Simulate each (edges, mode) of a load result as the load test ran it (its window and warm-up, its
    harness, the run's own α) with `seeds` seeds; simulated vs measured throughput and p95 TPOT.

    Simulated throughput is the mean over seeds; simulated p95 the median, with the 10th to 90th
    percentile of the seeds' p95s: a window of a few requests makes a p95 little more than its
    largest value, so one measured p95 is one draw from a spread about that wide."""
    rows = []
    for run in result["runs"]:
        if run["mode"] not in ("hybrid", "cloud-only"):
            continue
        # A short window holds few requests, and the synthetic pair's acceptance differs from request to
        # request (one edge on 3g for 10 s: one or two requests): the run's own α is an input, as its link is.
        alpha = run_alpha(run, params["gamma"]) or params["alpha"]
        sims = [simulate(fleet_config(params, run["edges"], run["mode"], params["batching"], harness=True,
                                      alpha=alpha, duration_s=run["duration_s"], warmup_s=run["warmup_s"], seed=seed))
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


GPU_BATCH_TOKENS = 4096   # the GPU scheduler's tokens per step, whole requests first come (our assumption)


def run_fleet(load_results: list[dict], *, slo_s: float, totals: list[int], profiles: list[str],
              cpu_per_token_s: float, gpu: str, cpu_cost: LinearCost | None = None, cpu_ubatch: int | None = None,
              gpu_alpha: float, gpu_draft_s: float, gpu_context: int, gpu_overhead_s: float,
              capacity_duration_s: float = 12.0, progress=None) -> dict:
    """Calibrate on each load result and check against it; then the capacity table, whose serial rows take
    the first serial calibration's parameters and whose batched rows (and the GPU case's edges) the first
    batched one's (either falls back to the first calibration)."""
    describe = lambda p: {k: (v.describe() if hasattr(v, "describe") else float(f"{v:.4g}") if isinstance(v, float) else v)  # noqa: E731
                          for k, v in p.items()}
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
                       "calibration": describe(params), "rows": check_against_load(load, params)})
    serial = next((i for i, p in enumerate(calibrations) if not p["batching"]), 0)
    batched = next((i for i, p in enumerate(calibrations) if p["batching"]), 0)

    def cpu_scenario(params: dict) -> dict:
        cpu = {**params, "profiles": profiles}
        if cpu_cost is not None:   # a measured cost curve instead of the load run's own pass cost
            cpu["cost"] = cpu_cost
        if cpu_ubatch is not None:
            cpu["max_batch_tokens"] = cpu_ubatch
        return cpu
    cpu_serial, cpu_batched = cpu_scenario(calibrations[serial]), cpu_scenario(calibrations[batched])
    gpu_spec, memory = (H200, 141e9) if gpu == "h200" else (H100, 80e9)
    gpu_model = gpu_cost(gpu_spec, gpu_context)
    # The GPU verifier's CPU per round is our assumption and nothing else is left of the Python
    # server's time; a GPU engine keeps its streams in its batch (their next token is in the next
    # step, the streaming runs beside the GPU). The edges keep their calibrated figures.
    gpu_params = {**calibrations[batched], "profiles": profiles, "cost": gpu_model, "alpha": gpu_alpha,
                  "draft_s": gpu_draft_s, "server_cpu_s": gpu_overhead_s, "cloud_server_cpu_s": 0.0,
                  "server_overhead_s": 0.0, "cloud_server_overhead_s": 0.0, "max_batch_tokens": GPU_BATCH_TOKENS,
                  "packing": "fcfs"}
    scenarios = [("CPU as measured, serial", cpu_serial, False), ("CPU as measured, batched", cpu_batched, True),
                 (f"{gpu.upper()} roofline, batched", gpu_params, True)]
    rows = []
    for name, scenario, batching in scenarios:
        if progress:
            progress(f"capacity: {name}")
        max_edges = kv_sessions(memory, gpu_model) if scenario is gpu_params else 1 << 12
        rows += capacity_table([(name, scenario, batching)], ["hybrid", "cloud-only"], slo_s, totals,
                               duration_s=capacity_duration_s, max_edges=max_edges)
    return {"slo_s": slo_s, "totals": totals, "profiles": profiles, "checks": checks,
            "capacity_calibration": {"serial": serial, "batched": batched},
            "cpu_cost": {"serial": cpu_serial["cost"].describe(), "batched": cpu_batched["cost"].describe()},
            "cpu_ubatch": cpu_batched["max_batch_tokens"],
            "gpu": describe(gpu_params), "gpu_kv_sessions": kv_sessions(memory, gpu_model), "capacity": rows}


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
