"""The regime map: the hybrid per GPU against both baselines an operator would run, at a latency SLO.

A mean-value model (steady state, means, no queueing tails), not the discrete-event simulation
(netsim.fleet.simcheck runs that on the same cells and checks that the two agree). One cell is a GPU
(H100 or H200) and a target on it (`Target`: weights, KV cache dtype, `costs.RooflineCost` with the
measured host path of netsim.fleet.hostpath), a mean context, a link (its profile's delays and
transmission) and α. Its figures are counts and a roofline: the map says *where* each mode is bound,
not what a GPU will measure.

The workload, the same in every mode and in the simulation: a session keeps its context's KV on the
GPU (`context` tokens on average); a request adds `prompt_tokens` new tokens (prefilled in its first
pass) and generates `max_tokens`; the next request follows at once.

  cloud-only  n streams; a step computes one token for each stream in the batch (and the prompts of
              new requests): step = pass(tokens, KV of the streams in it) + vLLM's sampler. Between
              requests a stream is out of the batch for its last token's way down, the next request's
              way up and half a step.
  vLLM spec   the same streams, vLLM speculating for itself (netsim.fleet.serverspec: a draft model,
              an EAGLE head, n-gram): a step is the draft's γ passes and the target's pass over γ + 1
              tokens per sequence, and commits E = (1 − α^(γ+1)) / (1 − α) tokens per sequence in one
              burst. The draft's weights and KV take their place in GPU memory.
  hybrid      n sessions, each a cycle of: link wait (round trip, transmission of a round and its
              reply), γ drafts on the device and the edge's own time, then at the verifier on average
              half a pass waiting for the running one, then its own pass P (k rounds per pass = n·P /
              period, Little's law, solved by fixed point). E tokens commit per round.
  in flight   a window of w rounds: the edge ships the next round with c continuations for the most
              probable outcomes of the one in flight (netsim.fleet.measured: hit rate h from the
              measured guess, w from the measured window depth, upload and drafting of every
              continuation charged): period = max((1 − h)·cycle + h·max(cycle / w, P), (1 + c)·γ·draft).
  KV parking  (hybrid) a session's KV is on the GPU only from its restore until its pass ends
              (spec_core.kvpark's rules; write-through, a restore copies the context over PCIe).

The SLO as a reader feels it (`slo_on="p95-gap"`, the default): the p95 of the gaps between bursts of
tokens reaching the user, a burst counting as one gap. A cloud-only stream's gap is its step; vLLM
spec's is its step (E tokens at once); the hybrid's is its period, and with rounds in flight a miss
waits the whole cycle, so the p95 gap is the cycle unless 95% of rounds hit. `slo_on="mean-tpot"`
judges the mean time per output token instead. Each point also reports TTFT (mean, with the
request's prefill).

What binds: the constraint that stops n from growing — "KV capacity" (the GPU's slots, or host
memory with parking), "host link (PCIe)" (restores), or, where the SLO stops it: "link" when the wait
on the link and drafting alone spend the SLO, else the pass's largest part: "compute", "HBM bandwidth"
or "host path". A mode that cannot meet the SLO with one session says so (0 tok/s).

Left out in every mode alike: vLLM's limits on sequences and tokens per step, CUDA graphs and kernel
launch overheads, queueing tails (the simulation has them).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from netsim.fleet.acceptance import Curve, get_curve
from netsim.fleet.acceptance import rounds_per_request as _curve_rounds
from netsim.fleet.costs import (H100, H100_FP8_FLOPS, H100_MEMORY, H200, H200_FP8_FLOPS, H200_MEMORY, LLAMA_8B,
                                LLAMA_8B_ATTENTION, LLAMA_70B_ATTENTION, LLAMA_70B_FP8, KvOffload, RooflineCost,
                                RoundWork, kv_sessions)
from netsim.fleet.hostpath import HostPath
from netsim.fleet.links import ROUND_BYTES, STREAM_BYTES
from netsim.fleet.devices import DEFAULT_DEVICE, DEVICES, Device, get_device
from netsim.fleet.measured import MeasuredInputs, hit_probability, hit_probability_curve, load_measured  # noqa: F401
from netsim.fleet.regime_report import GPU_NAMES, HYBRID_MODES, SPEC_MODES
from netsim.fleet.serverspec import DRAFTS, ServerSpecCost, draft_cost
from netsim.profiles import get_profile
from spec_core.kvpark import ParkCandidate, ParkCost, worth_moving


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float      # dense
    fp8_flops_per_s: float       # dense
    memory_bytes: float


GPUS = {"h100": Gpu(GPU_NAMES["h100"], H100["hbm_bytes_per_s"], H100["flops_per_s"], H100_FP8_FLOPS, H100_MEMORY),
        "h200": Gpu(GPU_NAMES["h200"], H200["hbm_bytes_per_s"], H200["flops_per_s"], H200_FP8_FLOPS, H200_MEMORY)}


@dataclass(frozen=True)
class Target:
    name: str
    weights: dict                # costs.LLAMA_8B-style: params, model_bytes, kv_bytes_per_token (at the KV dtype)
    attention_flops: float       # per query token per context token
    flops_per_s: float           # the GPU's dense FLOP/s at the weights' precision
    attention_flops_per_s: float  # ... at the KV cache's precision
    kv_dtype: str = "bf16"


# key: (name, weights at a bf16 KV cache, attention FLOPs, weight precision)
TARGET_MODELS = {"8b-bf16": ("Llama-3.1-8B bf16", LLAMA_8B, LLAMA_8B_ATTENTION, "bf16"),
                 "70b-fp8": ("Llama-3.1-70B fp8", LLAMA_70B_FP8, LLAMA_70B_ATTENTION, "fp8")}
KV_DTYPES = ("bf16", "fp8")


def make_target(key: str, gpu: str = "h200", kv_dtype: str = "bf16") -> Target:
    """The target on `gpu` with its KV cache in `kv_dtype` (vLLM's kv_cache_dtype "auto" keeps the
    model's bf16 activations; "fp8" halves the bytes). Attention runs at the KV dtype's rate."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    name, weights, attention, precision = TARGET_MODELS[key]
    g = GPUS[gpu]
    rate = {"bf16": g.bf16_flops_per_s, "fp8": g.fp8_flops_per_s}
    kv = weights["kv_bytes_per_token"] * (0.5 if kv_dtype == "fp8" else 1.0)
    return Target(f"{name}, KV {kv_dtype}", dict(weights, kv_bytes_per_token=kv), attention, rate[precision],
                  rate[kv_dtype], kv_dtype)


TARGETS = {key: make_target(key) for key in TARGET_MODELS}


@dataclass(frozen=True)
class RegimeConfig:
    """The assumptions of a map (units in the names). Fields left None take the measured inputs
    (netsim.fleet.measured)."""

    slo_tpot_s: float = 0.150          # the SLO, on the p95 gap or the mean TPOT (`slo_on`)
    slo_on: str = "p95-gap"            # "p95-gap" (as a reader feels it) or "mean-tpot"
    gammas: tuple[int, ...] = (1, 2, 3, 4, 6, 8)   # the best for each cell and mode is reported
    # The device (netsim.fleet.devices: a published llama.cpp measurement per class) and its time per draft
    # token at short context; draft_s overrides the device's (the break-even sweeps it). The draft's KV
    # grows the time with the context; a request's new prompt tokens are prefilled on the device.
    device: str = DEFAULT_DEVICE
    draft_s: float | None = None
    device_prefill: bool = True
    draft_kv: bool = True              # the draft's KV read per token grows its time with the context
    edge_s: float = 0.002              # the edge's own time per round outside drafting
    continuations: tuple[int, ...] = (1, 2, 4, 8)   # per round in flight; the best is reported
    guess: float | None = None         # None: measured (netsim.fleet.measured)
    window: int | None = None          # rounds in flight; None: the measured depth
    bytes_per_continuation: float | None = None     # upload per continuation; None: measured
    round_work: RoundWork = RoundWork("ideal")   # gamma + 1 tokens in one request, as the vLLM session ships
    offload: KvOffload = field(default_factory=KvOffload)
    pcie_max_busy: float = 0.9
    prefetch: bool = False             # restore parked KV ahead of the forecast round (the verifier does not)
    # The hybrid parks waiting sessions' KV in host memory. Off by default: the baselines could offload
    # too (vLLM's KV offloading connector), and the simulation's parked points fall short of this
    # model's near its bound (netsim.fleet.simcheck).
    parking: bool = False
    gpu: str = "h200"
    kv_dtype: str = "bf16"
    # Achieved / peak: 0.7 of HBM bandwidth (what vLLM's decode kernels reach on large batches), 0.6 of
    # dense tensor FLOPs (cuBLAS reaches 0.7–0.8 on large GEMMs; vLLM's mixed passes, attention and
    # the smaller GEMMs of a decode batch less). Our assumptions, stated in every result.
    bw_efficiency: float = 0.7
    flops_efficiency: float = 0.6
    max_tokens: int = 256              # generated per request
    prompt_tokens: int = 128           # new tokens per request (the session's earlier context is cached)
    # Each server proposer's acceptance curve (netsim.fleet.acceptance: a named measurement each); the
    # draft model on the GPU runs the device's own draft (None) unless one is named.
    eagle_curve: str = "eagle3-llama8b"
    ngram_curve: str = "ngram-chat"
    draft_model_curve: str | None = None
    measured: MeasuredInputs | None = None

    def inputs(self) -> MeasuredInputs:
        return self.measured or _measured()

    def guess_(self) -> float:
        return self.inputs().guess if self.guess is None else self.guess

    def window_(self) -> int:
        return self.inputs().window if self.window is None else self.window

    def bytes_per_continuation_(self) -> float:
        m = self.inputs().bytes_per_continuation
        return m if self.bytes_per_continuation is None else self.bytes_per_continuation

    @property
    def memory_bytes(self) -> float:
        return GPUS[self.gpu].memory_bytes

    def device_(self) -> Device:
        return get_device(self.device)

    def draft_s_short(self) -> float:
        return self.device_().draft_s if self.draft_s is None else self.draft_s

    def draft_s_at(self, context: int) -> float:
        """The device's time per draft token with `context` tokens in its draft's KV."""
        return self.device_().draft_s_at(context if self.draft_kv else 0, self.draft_s_short())

    def prefill_s(self) -> float:
        """A request's new prompt on the device (scaled with draft_s when that is overridden)."""
        if not self.device_prefill:
            return 0.0
        d = self.device_()
        return self.prompt_tokens * d.prefill_s * self.draft_s_short() / d.draft_s

    def curve(self, method: str, device_curve: Curve) -> Curve:
        """The acceptance curve of vLLM's `method`: its named measurement, or the device's own draft."""
        if method == "EAGLE":
            return get_curve(self.eagle_curve)
        if method == "n-gram":
            return get_curve(self.ngram_curve)
        return device_curve if self.draft_model_curve is None else get_curve(self.draft_model_curve)

    def describe(self) -> dict:
        g = GPUS[self.gpu]
        return {"gpu": g.name, "memory_gb": g.memory_bytes / 1e9, "hbm_tb_s": g.hbm_bytes_per_s / 1e12,
                "kv_dtype": self.kv_dtype, "bw_efficiency": self.bw_efficiency,
                "flops_efficiency": self.flops_efficiency, "slo_s": self.slo_tpot_s, "slo_on": self.slo_on,
                "device": self.device_().to_json(), "draft_ms": self.draft_s_short() * 1e3,
                "device_prefill_ms": self.prefill_s() * 1e3, "edge_ms": self.edge_s * 1e3, "max_tokens": self.max_tokens,
                "prompt_tokens": self.prompt_tokens, "guess": self.guess_(), "window": self.window_(),
                "bytes_per_continuation": self.bytes_per_continuation_(), "continuations": list(self.continuations),
                "gammas": list(self.gammas), "curves": {m: self.curve(m, Curve.flat(0.0, "the device's draft")).describe()
                                                      if m != "draft model" or self.draft_model_curve
                                                      else "the device's draft (on the GPU)"
                                                      for m in ("EAGLE", "n-gram", "draft model")},
                "measured": self.inputs().describe(),
                "round_work": self.round_work.describe(), "offload": self.offload.describe(), "parking": self.parking}


_hit = functools.lru_cache(maxsize=65536)(hit_probability_curve)


def as_curve(draft) -> Curve:
    """A device draft given as a flat α or a Curve."""
    return draft if isinstance(draft, Curve) else Curve.flat(float(draft))


@functools.lru_cache(maxsize=1)
def _measured() -> MeasuredInputs:
    return load_measured()


@dataclass(frozen=True)
class Point:
    """One mode's best operating point in a cell."""

    tokens_per_s: float
    sessions: int
    tpot_s: float | None       # mean time per output token
    binds: str
    gamma: int = 0
    parked: int = 0            # sessions parked in host memory at this point
    hit: float = 0.0
    gap_p95_s: float | None = None   # p95 gap between bursts reaching the user
    ttft_s: float | None = None      # mean, with the prefill
    continuations: int = 0


def target_cost(target: Target, context: int, cfg: RegimeConfig, host: HostPath | None,
                stream_host: HostPath | None) -> RooflineCost:
    g = GPUS[cfg.gpu]
    return RooflineCost(**target.weights, hbm_bytes_per_s=g.hbm_bytes_per_s, flops_per_s=target.flops_per_s,
                        attention_flops_per_s=target.attention_flops_per_s, bw_efficiency=cfg.bw_efficiency,
                        flops_efficiency=cfg.flops_efficiency, context_tokens=context,
                        attention_flops_per_context_token=target.attention_flops, host=host,
                        stream_host=stream_host, name=f"{g.name.split()[0]}, {target.name}")


def one_way_s(profile_name: str, up_bytes: float, down_bytes: float) -> tuple[float, float]:
    """A message's mean way up and its answer's way down (delays, transmission, loss stalls)."""
    profile = get_profile(profile_name)
    rtt = profile.rtt_ms()
    return (profile.uplink.expected_delay_ms(int(up_bytes), rtt) / 1000.0,
            profile.downlink.expected_delay_ms(int(down_bytes), rtt) / 1000.0)


def link_wait_s(profile_name: str, up_bytes: float = ROUND_BYTES[0], down_bytes: float = ROUND_BYTES[1]) -> float:
    """A round's time on the link: the round trip and the transmission of a round and its reply."""
    return sum(one_way_s(profile_name, up_bytes, down_bytes))


def rounds_per_request(draft, gamma: int, tokens: int) -> float:
    """Expected rounds (or spec steps) to commit `tokens` with a device draft (a flat α or a Curve),
    each committing 1 + accepted within what is left (γ capped at the tokens left − 1, as the edge and
    the simulation cap it)."""
    return _curve_rounds(as_curve(draft), gamma, tokens)


def mean_pass_s(cost, tokens: float, sessions: float, prompt_tokens: float, prompts: float, hybrid: bool) -> float:
    """A pass's mean time when `tokens` are its rounds' (or steps') own and a Poisson number of new
    requests' prompts (mean `prompts`) add `prompt_tokens` each: the mean of each pass's roofline, not
    the roofline of the mean pass (a pass that holds a prompt can be compute-bound while the mean pass
    is not: the 70B at 1k context, where the simulation charges each pass its own prompts)."""
    if prompts <= 0 or prompt_tokens <= 0:
        return cost.pass_s(max(1.0, tokens), max(1.0, sessions), hybrid)
    total = acc = 0.0
    p, m = math.exp(-prompts), 0
    top = prompts + 8.0 * math.sqrt(prompts) + 8.0
    while m <= top and acc < 1.0 - 1e-7:
        total += p * cost.pass_s(max(1.0, tokens + m * prompt_tokens), max(1.0, sessions), hybrid)
        acc += p
        m += 1
        p *= prompts / m
    return total / acc


def _p95_gap(gaps: list[tuple[float, float]]) -> float:
    """The 95th percentile of gaps given as (gap, probability) pairs, one per burst."""
    acc = 0.0
    for gap, prob in sorted(gaps):
        acc += prob
        if acc >= 0.95 - 1e-12:
            return gap
    return max(g for g, _ in gaps)


def _meets(cfg: RegimeConfig, tpot_s: float, gap_s: float) -> bool:
    return (gap_s if cfg.slo_on == "p95-gap" else tpot_s) <= cfg.slo_tpot_s


# --- cloud-only and vLLM speculating for itself: streams in the GPU's batch ------------------

@dataclass(frozen=True)
class StreamState:
    step_s: float
    tokens_per_s: float
    tpot_s: float
    gap_p95_s: float
    ttft_s: float
    parts: object


def stream_state(n: int, cost, link: str, cfg: RegimeConfig, gamma: int = 0, alpha=0.0) -> StreamState:
    """n streams; gamma 0: plain decoding (one token a step), else vLLM speculating with `cost` a
    ServerSpecCost and acceptance `alpha` (a flat α or a Curve). A request: its prompt's pass makes its
    first token, then steps of E tokens."""
    up, down = one_way_s(link, *STREAM_BYTES)
    L, P = cfg.max_tokens, cfg.prompt_tokens
    steps = 1.0 + (rounds_per_request(alpha, gamma, L - 1) if gamma else L - 1)   # per request
    per_step = 1.0 + gamma                  # target tokens per sequence in a step (after the prompt's)
    tokens_per_request = P + per_step * (steps - 1)
    target = cost.target if gamma else cost
    k, step = float(n), 0.0
    for _ in range(60):
        step_tokens = k * tokens_per_request / steps
        # a ServerSpecCost ignores hybrid; each step's prompts are its own (mean_pass_s)
        step = mean_pass_s(cost, k * per_step * (steps - 1) / steps, k, P, k / steps, hybrid=False)
        cycle = steps * step + up + down + 0.5 * step
        k_new = n * steps * step / cycle
        if abs(k_new - k) < 1e-6 * max(k, 1.0):
            break
        k = 0.5 * k + 0.5 * k_new
    cycle = steps * step + up + down + 0.5 * step
    e = L / steps if gamma else 1.0
    parts = target.parts(max(1.0, k * tokens_per_request / steps), max(1.0, k), hybrid=bool(gamma))
    return StreamState(step, n * L / cycle, step / max(e, 1.0) if gamma else step, step, up + 1.5 * step + down,
                       parts)


def _stream_point(n_max: int, state, cfg: RegimeConfig, gamma: int = 0) -> Point:
    """The most streams within n_max that meet the SLO (state(n) -> StreamState)."""
    def ok(n: int) -> bool:
        s = state(n)
        return _meets(cfg, s.tpot_s, s.gap_p95_s)
    if n_max < 1:
        return Point(0.0, 0, None, "KV capacity", gamma)
    if not ok(1):
        s = state(1)
        return Point(0.0, 0, s.tpot_s, s.parts.binds(), gamma, gap_p95_s=s.gap_p95_s, ttft_s=s.ttft_s)
    lo, hi = 1, n_max
    if ok(hi):
        s = state(hi)
        return Point(s.tokens_per_s, hi, s.tpot_s, "KV capacity", gamma, gap_p95_s=s.gap_p95_s, ttft_s=s.ttft_s)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    s = state(lo)
    return Point(s.tokens_per_s, lo, s.tpot_s, state(hi).parts.binds(), gamma, gap_p95_s=s.gap_p95_s,
                 ttft_s=s.ttft_s)


def cloud_only(cost: RooflineCost, kv_slots: int, link: str, cfg: RegimeConfig) -> Point:
    return _stream_point(kv_slots, lambda n: stream_state(n, cost, link, cfg), cfg)


def spec_cost(target: Target, key: str, method: str, cost: RooflineCost, gamma: int, cfg: RegimeConfig) -> ServerSpecCost:
    draft = DRAFTS[key][method]
    return ServerSpecCost(cost, draft_cost(draft, cost, 0.5 if cfg.kv_dtype == "fp8" else 1.0), gamma)


def server_spec(target: Target, key: str, method: str, cost: RooflineCost, alpha, link: str,
                cfg: RegimeConfig) -> Point:
    """vLLM speculating for itself with `method` at acceptance `alpha` (a flat α or a Curve): the best γ;
    the draft's weights and KV take their share of memory (every session holds both caches)."""
    best = None
    for gamma in cfg.gammas:
        sc = spec_cost(target, key, method, cost, gamma, cfg)
        slots = kv_sessions(cfg.memory_bytes, sc)
        point = _stream_point(slots, lambda n, sc=sc, gamma=gamma: stream_state(n, sc, link, cfg, gamma, alpha), cfg,
                              gamma)
        if best is None or point.tokens_per_s > best.tokens_per_s * (1 + 1e-9):
            best = point
    return best


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
    gap_p95_s: float = 0.0
    ttft_s: float = 0.0
    hit: float = 0.0


def _period(cycle: float, hit: float, window: int, edge_busy: float, pass_s: float, ahead_s: float = 0.0) -> float:
    """A round's mean period: a miss waits the whole cycle; a hit follows the round before it by a
    window's share of the cycle of a pipelined round, whose drafting is its continuations' too
    (`ahead_s` more than a plain round's: the edge drafts it after the reply of the round two back,
    as netsim.fleet.simulation's window does), and never sooner than a pass."""
    return max((1.0 - hit) * cycle + hit * max((cycle + ahead_s) / window, pass_s), edge_busy)


def hybrid_state(n: int, gamma: int, alpha: float, cost: RooflineCost, link: str, cfg: RegimeConfig,
                 continuations: int = 0, kv_slots: int | None = None) -> HybridState:
    """n sessions at γ, with `continuations` per round in flight (0: one round at a time); with
    `kv_slots`, the sessions beyond them park while they wait on their link (as few as make the rest
    fit: spec_core.kvpark parks only when it needs a place)."""
    work = cfg.round_work
    window = cfg.window_() if continuations else 1
    up_bytes = ROUND_BYTES[0] + continuations * cfg.bytes_per_continuation_()
    curve = as_curve(alpha)
    rounds = rounds_per_request(curve, gamma, cfg.max_tokens)
    own = work.tokens(gamma, 1) if work.path == "ideal" else work.mean_tokens(gamma)   # a round's, prompt aside
    tokens = own + cfg.prompt_tokens / rounds
    draft_s = cfg.draft_s_at(cost.context_tokens)
    link_s = link_wait_s(link, up_bytes) + gamma * draft_s + cfg.edge_s
    edge_busy = (1 + continuations) * gamma * draft_s + cfg.edge_s
    ahead_s = continuations * gamma * draft_s   # a pipelined round's drafting beyond a plain round's
    prefill = cfg.prefill_s()   # per request, on the device before its first round's drafts
    hit = _hit(curve, gamma, cfg.guess_(), continuations) if continuations else 0.0
    nbytes = cost.kv_bytes_per_token * cost.context_tokens
    copy_s = cfg.offload.copy_s(nbytes)
    # Write-through: parking copies nothing, a restore the whole context (as the simulation prices it).
    move = ParkCost(park_s_per_byte=0.0, restore_s_per_byte=copy_s / nbytes)
    exposed = max(0.0, copy_s - link_s) if cfg.prefetch else copy_s
    k, parked = 1.0, 0
    for _ in range(80):
        parts = cost.parts(k * tokens, k, hybrid=True)
        pass_s = mean_pass_s(cost, k * own, k, cfg.prompt_tokens, k / rounds, hybrid=True)
        at_verifier = pass_s * (1.0 + 0.5 * min(1.0, k))
        cycle = link_s + at_verifier
        period = _period(cycle, hit, window, edge_busy, pass_s, ahead_s)
        period_parked = _period(cycle + exposed, hit, window, edge_busy, pass_s, ahead_s)
        share = min(1.0, (copy_s + at_verifier) / period_parked)   # of its time a parked session is resident
        gap = ParkCandidate(0, 0.0, int(nbytes), max(0.0, period - at_verifier))   # its mean idle gap
        if kv_slots is not None and n > kv_slots and worth_moving(gap, 0.0, move) and share < 1.0:
            parked = min(n, math.ceil((n - kv_slots) / (1.0 - share)))
        else:
            parked = 0
        # a request's device prefill keeps its session away from the verifier once per `rounds` rounds
        rounds_per_s = (n - parked) / (period + prefill / rounds) + parked / (period_parked + prefill / rounds)
        k_new = min(float(n), rounds_per_s * pass_s)
        if abs(k_new - k) < 1e-5 * max(k, 1.0):
            break
        k = 0.5 * k + 0.5 * max(k_new, 1e-6)
    e = cfg.max_tokens / rounds
    slow = period_parked if parked else period
    cycle_slow = cycle + (exposed if parked else 0.0)
    gpu = (pass_s - parts.host_s - parts.overhead_s) / pass_s * at_verifier
    scale = slow / cycle_slow
    shares = {"link": link_s * scale, "host link (PCIe)": (exposed if parked else 0.0) * scale,
              "compute" if parts.compute_s >= parts.memory_s else "HBM bandwidth": gpu * scale,
              "host path": parts.host_s / pass_s * at_verifier * scale}
    # Gaps between replies: a miss (or every round, one at a time) waits the cycle; a hit follows its
    # round by the rest of the period's share.
    short = max((cycle_slow + ahead_s) / window, pass_s, edge_busy) if hit else cycle_slow
    gap95 = _p95_gap([(cycle_slow, 1.0 - hit), (short, hit)] if hit else [(max(cycle_slow, edge_busy), 1.0)])
    return HybridState(slow, slow / e, e * rounds_per_s, (n - parked) + parked * share, parked,
                       parked * copy_s / period_parked, shares, gap95, cycle_slow + prefill, hit)


def _hybrid_fails(state: HybridState, n: int, kv_slots: int, host_slots: int, cfg: RegimeConfig) -> str | None:
    """What stops n sessions, or None when they meet the SLO."""
    if state.resident > kv_slots + 1e-9:
        return "KV capacity"
    if state.parked > host_slots:
        return "KV capacity (host memory)"
    if state.pcie_busy > cfg.pcie_max_busy:
        return "host link (PCIe)"
    if not _meets(cfg, state.tpot_s, state.gap_p95_s):
        # The link when its wait alone (with drafting) spends the SLO; else what grows with n: the pass's
        # largest part, or the restores parked sessions wait for.
        judged = state.gap_p95_s if cfg.slo_on == "p95-gap" else state.tpot_s
        if state.shares["link"] * judged / state.period_s >= cfg.slo_tpot_s:
            return "link"
        return max(((k, v) for k, v in state.shares.items() if k != "link"), key=lambda kv: kv[1])[0]
    return None


def hybrid(cost: RooflineCost, alpha: float, link: str, cfg: RegimeConfig, in_flight: bool, kv_slots: int,
           host_slots: int) -> Point:
    """The best γ, continuations and parking choice: the most tokens/s per GPU at the SLO."""
    best: Point | None = None
    for gamma in cfg.gammas:
        for c in (cfg.continuations if in_flight else (0,)):
            for parking in ((False, True) if cfg.parking else (False,)):
                point = _hybrid_point(cost, alpha, link, cfg, gamma, c, parking, kv_slots, host_slots)
                if best is None or point.tokens_per_s > best.tokens_per_s * (1 + 1e-9):
                    best = point
    assert best is not None
    return best


def _hybrid_point(cost, alpha, link, cfg, gamma, c, parking, kv_slots, host_slots) -> Point:
    bound = kv_slots + host_slots if parking else kv_slots
    slots = kv_slots if parking else None

    def state(n: int) -> HybridState:
        return hybrid_state(n, gamma, alpha, cost, link, cfg, c, slots)

    def fails(n: int) -> str | None:
        return _hybrid_fails(state(n), n, kv_slots, host_slots, cfg)
    if bound < 1:
        return Point(0.0, 0, None, "KV capacity", gamma, continuations=c)
    first = fails(1)
    if first:
        s = state(1)
        return Point(0.0, 0, s.tpot_s, first, gamma, gap_p95_s=s.gap_p95_s, ttft_s=s.ttft_s, continuations=c)
    lo, hi = 1, bound
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
    s = state(lo)
    return Point(s.tokens_per_s, lo, s.tpot_s, why, gamma, s.parked, s.hit, s.gap_p95_s, s.ttft_s, c)


# --- the map ---------------------------------------------------------------------------------

MODES = ("cloud-only", *SPEC_MODES, *HYBRID_MODES)


def cell_costs(key: str, context: int, cfg: RegimeConfig, device: HostPath) -> tuple[Target, RooflineCost]:
    """The target's cost in a cell: the rounds' maths batched on the device (`device`, the hybrid's and
    vLLM's rejection sampler), vLLM's own sampler for plain decoding."""
    from netsim.fleet.hostpath import stream_rows
    target = make_target(key, cfg.gpu, cfg.kv_dtype)
    return target, target_cost(target, context, cfg, device, stream_rows(device, 4))


def regime_cell(key: str, context: int, link: str, draft, cfg: RegimeConfig, device: HostPath,
                modes=None) -> dict:
    """Every mode's best point in one cell, and the hybrid's ratios to both baselines. `draft`: the
    device draft's acceptance (a Curve, or a flat α); each of vLLM's proposers has its own curve
    (RegimeConfig.curve)."""
    target, cost = cell_costs(key, context, cfg, device)
    curve = as_curve(draft)
    kv_slots = kv_sessions(cfg.memory_bytes, cost)
    host_slots = cfg.offload.host_sessions(cost)
    points = {"cloud-only": cloud_only(cost, kv_slots, link, cfg)}
    for mode in SPEC_MODES:
        method = mode.split(", ", 1)[1]
        points[mode] = server_spec(target, key, method, cost, cfg.curve(method, curve), link, cfg)
    for mode in HYBRID_MODES:
        points[mode] = hybrid(cost, curve, link, cfg, mode.endswith("in flight"), kv_slots, host_slots)
    cloud = points["cloud-only"].tokens_per_s
    spec = max(points[m].tokens_per_s for m in SPEC_MODES)
    baseline = max(cloud, spec)   # what the operator would run: plain decoding or its best speculation
    best_spec = max(SPEC_MODES, key=lambda m: points[m].tokens_per_s)
    out = {"gpu": cfg.gpu, "target": key, "kv_dtype": cfg.kv_dtype, "context": context, "link": link,
           "draft": curve.name, "tau4": round(curve.tokens_per_step(4), 3), "draft_ms": cfg.draft_s_short() * 1e3,
           "kv_slots": kv_slots, "host_slots": host_slots, "best_spec": best_spec, "modes": {}}
    for mode, p in points.items():
        out["modes"][mode] = {**p.__dict__, "x_cloud": p.tokens_per_s / cloud if cloud else None,
                              "x_spec": p.tokens_per_s / spec if spec else None,
                              "x_best": p.tokens_per_s / baseline if baseline else None}
    return out


def default_drafts() -> tuple[Curve, ...]:
    """The device drafts of the map: the family of vLLM's EAGLE-3 curve (its shape, RegimeConfig's
    eagle_curve) at τ(4) 2.5, at EAGLE-3's own 3.08 (the device's draft as good as the server's head)
    and at 3.8 (a draft better than the head, e.g. from context only the device has)."""
    base = get_curve(RegimeConfig.eagle_curve)
    return (base.with_tokens_per_step(2.5, name="τ4 2.50"), Curve(f"τ4 {base.tokens_per_step(4):.2f} (= EAGLE-3)",
            base.reach, base.source), base.with_tokens_per_step(3.8, name="τ4 3.80"))


def regime_map(gpus=("h100", "h200"), targets=("8b-bf16", "70b-fp8"), contexts=(1024, 8192, 32768),
               links=("lan", "lte", "3g"), drafts=None, setting: str = "greedy",
               cfg: RegimeConfig | None = None, table=None, progress=None) -> dict:
    """Every cell: plain decoding, vLLM speculating for itself (three proposers) and the hybrid (one
    round at a time; rounds in flight), tokens/s per GPU at the SLO, what binds, the p95 gap and TTFT.
    `drafts`: the device drafts (Curves or flat α; default `default_drafts()`)."""
    from dataclasses import replace

    from netsim.fleet.hostpath import HostPathTable
    cfg = cfg or RegimeConfig()
    table = table or HostPathTable.load()
    device = table.get("batched-on-device", setting)
    drafts = default_drafts() if drafts is None else drafts
    cells = []
    for gpu in gpus:
        gcfg = replace(cfg, gpu=gpu)
        for key in targets:
            if progress:
                progress(f"{gpu} {key}")
            for context in contexts:
                for link in links:
                    for draft in drafts:
                        cells.append(regime_cell(key, context, link, draft, gcfg, device))
    return {"setting": setting, "config": cfg.describe(), "host": device.describe(), "cells": cells,
            "drafts": [as_curve(d).to_json() for d in drafts]}


def regime_arguments(parser) -> None:
    """The map's inputs as options (shared with netsim.fleet.simcheck): each is printed with the result."""
    d = RegimeConfig()
    parser.add_argument("--setting", default="greedy", choices=("greedy", "top-k", "top-p"),
                        help="the rounds' sampling setting (picks the host-path rows)")
    parser.add_argument("--slo-ms", type=float, default=d.slo_tpot_s * 1e3, help="the latency SLO (ms)")
    parser.add_argument("--slo-on", default=d.slo_on, choices=("p95-gap", "mean-tpot"),
                        help="judge the SLO on the p95 gap between bursts reaching the user, or on the mean TPOT")
    parser.add_argument("--kv-dtype", default=d.kv_dtype, choices=KV_DTYPES, help="the KV cache's dtype")
    parser.add_argument("--flops-efficiency", type=float, default=d.flops_efficiency, help="achieved / peak FLOPs")
    parser.add_argument("--bw-efficiency", type=float, default=d.bw_efficiency, help="achieved / peak HBM bandwidth")
    parser.add_argument("--device", default=d.device, choices=sorted(DEVICES),
                        help="the device class (netsim/fleet/devices.py: its drafting and prefill times, sourced)")
    parser.add_argument("--draft-ms", type=float, default=None,
                        help="device drafting time per token at short context (ms; default: the device's)")
    parser.add_argument("--no-device-prefill", action="store_true",
                        help="do not charge a request's new prompt tokens on the device")
    parser.add_argument("--edge-ms", type=float, default=d.edge_s * 1e3, help="the edge's own time per round (ms)")
    parser.add_argument("--window", type=int, default=None, help="rounds in flight (default: the measured depth)")
    parser.add_argument("--guess", type=float, default=None,
                        help="a continuation's guessed token is right with this probability (default: measured)")
    parser.add_argument("--bytes-per-continuation", type=float, default=None,
                        help="upload bytes a continuation adds to its round (default: measured)")
    parser.add_argument("--continuations", default=",".join(map(str, d.continuations)),
                        help="continuations per round in flight to try (comma-separated)")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens generated per request")
    parser.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="new prompt tokens per request")
    parser.add_argument("--eagle-curve", default=d.eagle_curve,
                        help="acceptance curve of vLLM's EAGLE head (netsim/fleet/acceptance.py: a key, or flat:ALPHA)")
    parser.add_argument("--ngram-curve", default=d.ngram_curve, help="acceptance curve of vLLM's n-gram proposer")
    parser.add_argument("--draft-model-curve", default=None,
                        help="acceptance curve of vLLM's draft model (default: the device's draft, run on the GPU)")
    parser.add_argument("--parking", action="store_true",
                        help="let the hybrid park waiting sessions' KV in host memory (off: every mode holds its "
                             "sessions' KV on the GPU, as the baselines do)")
    parser.add_argument("--host-path-table", default=None,
                        help="host-path table (JSON; default bench/fleet/host_path.json)")


def config_from_args(args) -> RegimeConfig:
    return RegimeConfig(slo_tpot_s=args.slo_ms / 1e3, slo_on=args.slo_on, kv_dtype=args.kv_dtype,
                        flops_efficiency=args.flops_efficiency, bw_efficiency=args.bw_efficiency,
                        device=args.device, draft_s=None if args.draft_ms is None else args.draft_ms / 1e3,
                        device_prefill=not args.no_device_prefill, edge_s=args.edge_ms / 1e3, window=args.window, guess=args.guess,
                        bytes_per_continuation=args.bytes_per_continuation,
                        continuations=tuple(int(c) for c in args.continuations.split(",")),
                        max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens, eagle_curve=args.eagle_curve,
                        ngram_curve=args.ngram_curve, draft_model_curve=args.draft_model_curve,
                        parking=args.parking)


def main(argv: list[str] | None = None) -> int:
    """`python -m netsim.fleet.regime`: the map as regime.json and regime.md in --out, and its tables
    and headline figures in the registry (bench/results/<--result>.json)."""
    import argparse
    import json
    import logging
    import os
    from pathlib import Path

    from netsim.fleet.hostpath import HostPathTable
    from netsim.fleet.regime_report import regime_markdown, summary, write_results
    parser = argparse.ArgumentParser(prog="python -m netsim.fleet.regime", description=__doc__.split("\n")[0])
    regime_arguments(parser)
    parser.add_argument("--gpus", default="h100,h200", help="comma-separated: h100, h200")
    parser.add_argument("--out", default="results/regime", help="output folder for regime.json and regime.md")
    parser.add_argument("--result", default="", help="also write bench/results/<RESULT>.json (the figures registry)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = [round(x, 2) for x in os.getloadavg()]
    cfg = config_from_args(args)
    table = HostPathTable.load(args.host_path_table) if args.host_path_table else HostPathTable.load()
    result = regime_map(gpus=tuple(args.gpus.split(",")), setting=args.setting, cfg=cfg, table=table)
    result["summary"] = summary(result)
    markdown = regime_markdown(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "regime.json").write_text(json.dumps(result, indent=1))
    (out / "regime.md").write_text(markdown)
    logging.info("%s", markdown)
    logging.info("wrote %s and %s", out / "regime.json", out / "regime.md")
    if args.result:
        logging.info("wrote %s", write_results(result, args.result, load_start=load))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
