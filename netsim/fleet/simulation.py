"""The discrete-event simulation of one verifier and the edges assigned to it.

Per edge, per round (hybrid): draft γ tokens on the device, the request crosses the uplink,
waits for the verifier, is verified, the reply crosses the downlink, and 1 + k tokens commit, k
drawn from the geometric acceptance model (per-token acceptance α, capped at γ). Cloud-only: the
request crosses the uplink once and the verifier streams one token per pass, each crossing the
downlink. Server-spec (vLLM speculating for itself, netsim.fleet.serverspec): the same streams, but
each pass verifies γ + 1 tokens per stream after the draft's passes on the GPU (`cost` a
`ServerSpecCost`), and 1 + k tokens cross the downlink together. Links are the proxy's own
(netsim.fleet.links). Every burst of tokens reaching an edge after its first is a gap (`gap_p95_s`:
a burst counts as one gap, as a reader waits for it).

The verifier, serial (`batching=False`): one round, or one stream's token, per pass, first come
first served (the model's lock: a random order put 64 cloud-only streams' p95 74% above the
measured). With continuous batching (`batching=True`), `packing="fair-share"` is
cloud_verifier's `Batcher`, planned by the same function (`spec_core.batchplan.fair_share`):
when a pass ends, every request that has arrived joins the active ones, each active request gets
a fair share of the pass's `max_batch_tokens` (the backend's n_ubatch) and the rest of the pass
is filled in arrival order; a request is answered after the pass that holds its last token, and
no pass waits for a batch to fill. `packing="slack"` is the Batcher's `--schedule slack`
(`spec_core.batchplan.least_slack_first`, each request's deadline from the SLO as the engine sets
it). `packing="fcfs"` takes whole requests in arrival order up to `max_batch_tokens` (a vLLM-like
scheduler: the GPU case). A pass over T tokens for S sessions costs `cost.pass_s(T, S, hybrid)` (a GPU's host path differs: the
rounds' acceptance maths or the streams' sampler). The
verifier's policies (batch order, draft budget, KV victim, SLO verdict) are the shipped functions,
through netsim.fleet.policies.

Outside its passes the server spends, per round or streamed token, `server_cpu_s` of CPU (gRPC,
protobuf, a round's checks and sampling) on one processor, one piece at a time (one Python
process), then `server_overhead_s` of delay that holds nothing. Neither holds the model: a
stream's next token reaches the batcher that long after its pass ended, and misses the next
pass when other requests were already waiting (the batched synthetic verifier's cloud-only
streams take two passes per token from 4 edges on). The edge side likewise: `edge_cpu_s` of
CPU per round (on a processor of its own, or, in the load test, one shared by every edge) and
`edge_overhead_s` of delay; the load test's proxy process reads every message (`proxy_cpu_s`).

Events (one heap, ordered by time, then by when they were pushed): `Send` (a message written:
the proxy reads it and its link carries it), then on the far side `Arrive` (a request reaches
the verifier), `Reply` (a round's answer reaches the edge) or `Token` (a streamed token does);
`PassDone` (the verifier finished a pass); `Retry` (offload: look again for a session to park).
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import numpy as np

from netsim.fleet.costs import KvOffload, RoundWork
from netsim.fleet.links import ROUND_BYTES, STREAM_BYTES, EdgeLink
from netsim.fleet.policies import (PACKINGS, Acceptance, ParkCandidate, ParkCost, Slo, Steering, Take, choose_victim,
                                   ewma, meets_slo, plan_pass, window_tpot)
from netsim.profiles import Profile, get_profile


@dataclass
class FleetConfig:
    edges: int                          # edges on this one verifier
    mode: str                           # "hybrid", "cloud-only" or "server-spec" (vLLM speculating for itself)
    cost: object                        # LinearCost or RooflineCost
    batching: bool = False
    profiles: list = field(default_factory=lambda: ["lan"])   # profile names (or Profile objects)
    gamma: int = 4
    alpha: float = 0.7                  # per-token acceptance
    # Acceptance by draft position (netsim.fleet.acceptance.Curve); None: flat α. Draft k is accepted with
    # the curve's conditional probability given the k − 1 before it (one uniform draw each, as for α).
    curve: object | None = None
    draft_s: float = 0.002              # device drafting time per token
    request_edge_s: float = 0.0         # hybrid: the edge's work before a request's first round (its prefill)
    # Rounds in flight (hybrid): up to `window` rounds per edge at once. While a round is in flight the
    # edge drafts the next one with `continuations` alternatives for the outcomes it thinks likely
    # (drafting (1 + continuations)·γ tokens, uploading `bytes_per_continuation` more each); when the round
    # before it is verified, one of them is what it committed with probability `hit` (the map's model of
    # the measured hits, netsim.fleet.measured): the verifier then runs that one in a later pass; on a
    # miss it runs none, and the edge, told by the reply, drafts afresh from what was committed.
    window: int = 1
    continuations: int = 0
    hit: float = 0.0
    bytes_per_continuation: float = 0.0
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
    packing: str = "fair-share"         # batching: "fair-share" or "slack" (the Batcher's schedules), "fcfs" (whole requests)
    prefill_chunk: int | None = None    # batching: a prefill's tokens per pass while rounds wait
                                        # (None: max_batch_tokens // 4, the Batcher's default)
    round_bytes: tuple[int, int] = ROUND_BYTES     # hybrid: a Verify request and its reply on the wire (B)
    stream_bytes: tuple[int, int] = STREAM_BYTES   # cloud-only: a Generate request and one streamed token (B)
    # The GPU verifier as shipped: target tokens per hybrid round (RoundWork: vLLM's partial-block
    # re-prefill, requests per round); None: gamma + 1 tokens.
    round_work: RoundWork | None = None
    # KV memory: sessions whose KV fits on the verifier (None: no bound inside the simulation). With
    # `offload`, a hybrid session's KV is resident only while a round of it is at the verifier: a round
    # that finds its KV parked waits for a free slot (the idle session spec_core.kvpark.choose_victim
    # picks is parked; none may be yet: it looks again every 5 ms, as the shipped SeqBook waits) and
    # for the copy over the host link.
    kv_capacity: int | None = None
    kv_bytes_per_session: float = 0.0
    offload: KvOffload | None = None
    # The verifier steers (batching only, as shipped): each reply carries a draft budget
    # (spec_core.steering.draft_budget at the verifier's measured price) and the edge drafts min(gamma, budget).
    steer: bool = False
    # A request meets the SLO with TPOT (over the window) and TTFT (if it started in the window) within these.
    slo_tpot_s: float = 0.150
    slo_ttft_s: float = 2.0
    duration_s: float = 30.0
    warmup_s: float = 3.0
    seed: int = 1
    # Each edge's first request starts with a uniformly drawn share of its tokens already made, so the
    # edges' requests are out of step from the start (a steady state; else they all end together).
    stagger: bool = False
    # Each edge's first request starts at a uniform draw from [0, start_spread_s). With back-to-back passes
    # and links shorter than a pass, the passes' groups of sessions keep the sizes their start gave them
    # (a round returns within the next pass and joins the one after); a spread over many passes starts
    # them in groups of nearly equal size, as request boundaries do over a longer run.
    start_spread_s: float = 0.05


# --- the verifier's work --------------------------------------------------------------------

@dataclass
class _Job:
    """A round (hybrid) or one stream's next token (cloud-only) at the verifier."""
    edge: int
    tokens: int                         # tokens still to evaluate
    arrived_s: float = 0.0              # when it reached the verifier
    gamma: int = 0                      # hybrid: drafts in the round
    rows: int = 1                       # of its tokens, those whose logits it wants (the last ones)
    deadline: float | None = None       # when it is due under the SLO (spec_core.slo.Slo.due)
    # rounds in flight (hybrid, window > 1)
    prev: "_Job | None" = None          # the round in flight it was drafted after (its base is that one's outcome)
    next: "_Job | None" = None
    verified: bool = False              # its pass is done
    hit: bool | None = None             # a pipelined round: whether one of its continuations was committed (None: not known yet)
    held: bool = False                  # it reached the verifier before the round it follows was verified
    dropped: bool = False               # a miss (or after one, or past its request's end): never verified


class _Cpu:
    """A processor that does one piece of work at a time, first come first served."""

    def __init__(self) -> None:
        self.free_s = 0.0

    def run(self, t: float, work_s: float) -> float:
        """When work of `work_s` handed over at `t` is done."""
        self.free_s = max(t, self.free_s) + work_s
        return self.free_s


# --- events ---------------------------------------------------------------------------------

@dataclass(slots=True)
class Arrive:
    """A request (a round, a stream's opening or its next token) reaches the verifier."""
    job: _Job


@dataclass(slots=True)
class Reply:
    """A round's answer reaches its edge."""
    edge: int
    tokens: int                         # tokens it commits (accepted + 1, within max_tokens)
    job: object = None                  # the round answered


@dataclass(slots=True)
class Token:
    """A streamed token (or a server-spec step's burst) reaches its edge."""
    edge: int
    last: bool                          # the stream's last
    tokens: int = 1


@dataclass(slots=True)
class Send:
    """A message written by one side: the proxy reads it, its link carries it, then `deliver`."""
    edge: int
    direction: str                      # "up" (to the verifier) or "down"
    size_bytes: int
    deliver: Arrive | Reply | Token


@dataclass(slots=True)
class Ready:
    """A round whose session's KV is back on the verifier (offload) joins the verifier's queue."""
    job: _Job


@dataclass(slots=True)
class PassDone:
    """The verifier finished a pass."""
    plan: list[Take]
    tokens: int
    seconds: float


@dataclass(slots=True)
class Retry:
    """Offload: rounds wait for a place and no idle session was worth parking; look again."""


@dataclass
class _Edge:
    link: EdgeLink
    committed: int = 0                  # tokens of the current request
    request_start: float = 0.0
    started: bool = False               # its first request has begun
    first_committed: int = 0            # tokens the current request began with (stagger), not its own
    token_times: list = field(default_factory=list)   # (time, tokens) of the current request
    budget: int | None = None           # the draft budget of the verifier's last reply
    acceptance: Acceptance = field(default_factory=Acceptance)   # the verifier's α of its rounds
    first_token_at: tuple[float, int] | None = None   # the verifier's (time, tokens) at its first commit
    resident: bool = True               # offload: its KV is on the verifier
    at_verifier: bool = False           # offload: a round of it is queued, copied in or in a pass
    answered_s: float | None = None     # when its last round's pass ended (None: no round yet)
    mean_gap_s: float | None = None     # offload: its mean idle gap, the victim choice's forecast
    inflight: list = field(default_factory=list)   # rounds sent (or being drafted), not yet answered, oldest first
    draft_free_s: float = 0.0           # when its device is done drafting what it has started


# --- the run --------------------------------------------------------------------------------

class _Simulation:
    """One run of `simulate`: the state, a handler per event, and the figures measured."""

    def __init__(self, cfg: FleetConfig) -> None:
        if cfg.mode not in ("hybrid", "cloud-only", "server-spec"):
            raise ValueError(f"mode must be hybrid, cloud-only or server-spec, got {cfg.mode!r}")
        if cfg.packing not in PACKINGS:
            raise ValueError(f"packing must be one of {PACKINGS}, got {cfg.packing!r}")
        if cfg.steer and not cfg.batching:
            raise ValueError("steer needs batching: the shipped verifier prices drafts from its batched passes' "
                             "cost line, and a serial backend has none (it sends no budget)")
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        profiles = [p if isinstance(p, Profile) else get_profile(p) for p in cfg.profiles]
        self.edges = [_Edge(EdgeLink(profiles[i % len(profiles)], cfg.seed * 100_003 + i)) for i in range(cfg.edges)]
        self.events: list[tuple[float, int, object]] = []   # (time, push order, event)
        self.pushed = 0
        self.t_measure, self.t_end = cfg.warmup_s, cfg.warmup_s + cfg.duration_s
        self.finished_tpots: list[float] = []
        self.ttfts: list[float] = []
        self.gaps: list[float] = []           # between bursts reaching an edge, a burst one gap
        self.server_times: list[float] = []   # from reaching the verifier to its answer leaving
        self.committed_in_window = 0
        self.passes = self.target_tokens = 0
        self.busy_s = 0.0
        self.waiting: list[_Job] = []    # arrived since the last pass started
        self.active: list[_Job] = []     # batching: taken in, tokens left to evaluate
        self.streams: dict[int, int] = {}   # cloud-only: edge -> tokens still to generate
        self.verifier_free = True
        self.hybrid = cfg.mode == "hybrid"
        self.spec = cfg.mode == "server-spec"
        self.up_bytes, self.down_bytes = cfg.round_bytes if self.hybrid else cfg.stream_bytes
        self.server_cpu, self.proxy_cpu = _Cpu(), _Cpu()
        shared_edge_cpu = _Cpu()
        self.edge_cpus = [shared_edge_cpu if cfg.edges_share_cpu else _Cpu() for _ in range(cfg.edges)]
        self.work = cfg.round_work or RoundWork()
        self.slo = Slo(cfg.slo_tpot_s, cfg.slo_ttft_s)
        self.prefill_chunk = max(1, cfg.prefill_chunk or cfg.max_batch_tokens // 4)
        self.steering = Steering(cfg.gamma) if cfg.steer else None
        self.work_rng = random.Random(cfg.seed * 7_919 + 1)   # its own, so the acceptance draws stay as they were
        self.hit_rng = random.Random(cfg.seed * 15_485_863 + 5)   # rounds in flight: whether a continuation hit
        self.stagger_rng = random.Random(cfg.seed * 104_729 + 3)
        self.good_tokens = 0                 # committed in the window by requests that met the SLO
        self.verdicts: list[bool] = []
        self.requests_sent = 0               # engine requests (RoundWork.requests) in the window
        self.budgets: list[int] = []         # steer: budgets sent in the window
        # KV offload (hybrid sessions beyond kv_capacity park their KV on the host while they wait)
        self.offloading = bool(self.hybrid and cfg.offload is not None and cfg.kv_capacity
                               and cfg.edges > cfg.kv_capacity)
        self.kv_exceeded = bool(cfg.kv_capacity is not None and cfg.edges > cfg.kv_capacity and not self.offloading)
        self.kv_queue: list[_Job] = []       # rounds whose KV is parked, waiting for a slot
        self.idle_resident: set[int] = set()   # edges whose KV is resident with no round at the verifier
        self.retry_pending = False
        if self.offloading:
            # The verifier's park cost as it measures it on this host link: write-through, so parking
            # copies nothing; bringing back copies the whole session.
            self.park_cost = ParkCost(park_s_per_byte=0.0,
                                      restore_s_per_byte=1.0 / (cfg.offload.host_bytes_per_s * cfg.offload.efficiency))
        self.host_link = _Cpu()              # host -> GPU copies, one at a time
        self.copies = 0
        self.resident = self.resident_max = 0
        self.copy_wait_s: list[float] = []   # from a round's arrival to its KV being back
        if self.offloading:
            for i, e in enumerate(self.edges):
                e.resident = i < cfg.kv_capacity
                if e.resident:
                    self.idle_resident.add(i)
            self.resident = self.resident_max = cfg.kv_capacity

    def push(self, t: float, event) -> None:
        heapq.heappush(self.events, (t, self.pushed, event))
        self.pushed += 1

    def in_window(self, t: float) -> bool:
        return self.t_measure <= t <= self.t_end

    def close_request(self, e: _Edge) -> None:
        """Its TPOT over the window, and whether it met the SLO (spec_core.slo's verdict, as the load
        test judges: TPOT inside the window, TTFT if it started inside it)."""
        tpot = window_tpot(e.token_times, self.t_measure, self.t_end)
        if tpot is not None:
            self.finished_tpots.append(tpot)
        ttft = (e.token_times[0][0] - e.request_start) if e.token_times and self.in_window(e.request_start) else None
        met = meets_slo(tpot, ttft, self.cfg.slo_tpot_s, self.cfg.slo_ttft_s)
        if met is None:
            return
        self.verdicts.append(met)
        if met:
            before = e.first_committed   # a staggered first request began with tokens already made
            for t, n in e.token_times:
                if self.in_window(t):
                    self.good_tokens += n - before
                before = n

    def commit(self, i: int, t: float, n: int) -> None:
        e = self.edges[i]
        if not e.token_times and self.in_window(e.request_start):
            self.ttfts.append(t - e.request_start)
        elif e.token_times and self.in_window(t):
            self.gaps.append(t - e.token_times[-1][0])
        e.committed += n
        e.token_times.append((t, e.committed))
        if self.in_window(t):
            self.committed_in_window += n

    def send_round(self, i: int, t: float, gamma: int, extra_tokens: int = 0, after: _Job | None = None) -> _Job:
        """Draft a round on edge i from `t` (once its device is free) and send it; `after`: the round in
        flight it is pipelined behind (drafted with its continuations)."""
        cfg, e = self.cfg, self.edges[i]
        r = self.work_rng.randint(1, self.work.block_size) if self.work.path != "ideal" else 1
        tokens = self.work.tokens(gamma, r) + extra_tokens
        if self.in_window(t):
            self.requests_sent += self.work.requests(gamma)
        job = _Job(i, tokens, gamma=gamma, rows=gamma + 1, prev=after)
        extra = cfg.continuations if after is not None else 0
        start = max(t, e.draft_free_s)
        e.draft_free_s = start + (1 + extra) * gamma * cfg.draft_s
        nbytes = self.up_bytes + int(extra * cfg.bytes_per_continuation)
        if after is not None:
            after.next = job
        e.inflight.append(job)
        self.push(e.draft_free_s + cfg.edge_overhead_s, Send(i, "up", nbytes, Arrive(job)))
        return job

    def fill_window(self, i: int, t: float) -> None:
        """Rounds in flight: pipeline rounds behind the last one in flight while the window has room and
        the request has tokens left for them (each counted at its full γ + 1)."""
        cfg, e = self.cfg, self.edges[i]
        while 0 < len(e.inflight) < cfg.window:
            left = cfg.max_tokens - e.committed - sum(j.gamma + 1 for j in e.inflight)
            if left < 2:
                return
            self.send_round(i, t, self.gamma_for(e, left), after=e.inflight[-1])

    def drop_after(self, job: _Job) -> None:
        """`job` will never be verified: neither will any round pipelined behind it."""
        while job is not None and not job.dropped:
            job.dropped = True
            job = job.next

    def start_request(self, i: int, t: float) -> None:
        cfg, e = self.cfg, self.edges[i]
        if e.token_times:
            self.close_request(e)
        done = self.stagger_rng.randint(0, cfg.max_tokens - 1) if cfg.stagger and not e.started else 0
        e.started = True
        e.committed, e.request_start, e.token_times, e.first_committed = done, t, [], done
        # A new session on the verifier: no α measured, no first token yet.
        e.acceptance, e.first_token_at = Acceptance(), None
        if self.hybrid:
            for job in e.inflight:   # rounds past the request's end are never verified
                self.drop_after(job)
            e.inflight, e.draft_free_s = [], t
            self.send_round(i, t + cfg.request_edge_s, self.gamma_for(e, cfg.max_tokens - done), cfg.prompt_tokens)
            self.fill_window(i, t + cfg.request_edge_s)
        else:
            self.streams[i] = cfg.max_tokens - done
            self.push(t + cfg.edge_overhead_s, Send(i, "up", self.up_bytes, Arrive(_Job(i, cfg.prompt_tokens))))

    def next_pass(self, t: float) -> None:
        cfg = self.cfg
        if cfg.batching:
            self.active.extend(self.waiting)
            self.waiting.clear()
            if not self.active:
                self.verifier_free = True
                return
            plan = plan_pass(cfg.packing, self.active, cfg.max_batch_tokens, t, self.prefill_chunk)
        else:
            if not self.waiting:
                self.verifier_free = True
                return
            job = self.waiting.pop(0)   # the model's lock: measured closer to first come than to random
            plan = [Take(job, job.tokens)]
        tokens = sum(take.tokens for take in plan)
        duration = cfg.cost.pass_s(tokens, len(plan), self.hybrid)
        if self.in_window(t):
            self.passes += 1
            self.target_tokens += tokens
            self.busy_s += duration
        self.verifier_free = False
        self.push(t + duration, PassDone(plan, tokens, duration))

    # --- handlers ---

    def on_send(self, t: float, send: Send) -> None:
        taken_s = self.proxy_cpu.run(t, self.cfg.proxy_cpu_s)   # the proxy reads it, then its link delays it
        self.push(self.edges[send.edge].link.arrival_s(send.direction, send.size_bytes, taken_s), send.deliver)

    def gamma_for(self, e: _Edge, remaining: int) -> int:
        """The edge's drafts: its gamma, within the verifier's last budget and the request's end."""
        gamma = min(self.cfg.gamma, remaining - 1)
        if self.cfg.steer and e.budget is not None:
            gamma = min(gamma, e.budget)
        return max(gamma, 0)

    def reach_verifier(self, job: _Job, t: float) -> None:
        """A job reaches the verifier: when it is due under the SLO, as the engine tells the batcher."""
        e = self.edges[job.edge]
        job.arrived_s = t
        committed = e.committed if self.hybrid else self.cfg.max_tokens - self.streams[job.edge]
        job.deadline = self.slo.due(t, e.first_token_at, committed)

    def on_arrive(self, t: float, arrive: Arrive) -> None:
        job = arrive.job
        if job.dropped:
            return                      # a miss: the verifier runs none of its continuations
        if job.prev is not None and not job.prev.verified:
            job.held = True             # its base is not committed yet: it waits for the round before it
            job.arrived_s = t
            return
        self.reach_verifier(job, t)
        if self.offloading:
            e = self.edges[job.edge]
            e.at_verifier = True
            self.idle_resident.discard(job.edge)
            if e.answered_s is not None:   # the idle gap just ended: the forecast of the next one
                e.mean_gap_s = ewma(e.mean_gap_s, t - e.answered_s)
            if not e.resident:
                self.kv_queue.append(job)
                self.bring_back(t)
                return
        self.waiting.append(job)
        if self.verifier_free:
            self.next_pass(t)

    def on_ready(self, t: float, ready: Ready) -> None:
        if self.in_window(t):
            self.copy_wait_s.append(t - ready.job.arrived_s)
        self.waiting.append(ready.job)
        if self.verifier_free:
            self.next_pass(t)

    def on_retry(self, t: float, _: Retry) -> None:
        self.retry_pending = False
        self.bring_back(t)

    def bring_back(self, t: float) -> None:
        """Rounds whose KV is parked, first come: a place (parking the idle session that the shipped
        rule, spec_core.kvpark.choose_victim, picks), then the copy over the host link. When no idle
        session is worth parking yet, look again in 5 ms or when a pass ends (as SeqBook waits)."""
        cfg = self.cfg
        while self.kv_queue:
            if self.resident >= cfg.kv_capacity:
                nbytes = int(cfg.kv_bytes_per_session)
                parked = cfg.edges - self.resident
                bytes_free = int(cfg.offload.host_memory_bytes - parked * cfg.kv_bytes_per_session)
                # A session with no round yet has been idle since the start (SeqBook: `idle_since or 0.0`).
                key = choose_victim([ParkCandidate(i, self.edges[i].answered_s or 0.0, nbytes, self.edges[i].mean_gap_s)
                                     for i in self.idle_resident], t, self.park_cost, bytes_free)
                if key is None:
                    if self.idle_resident and not self.retry_pending:
                        self.retry_pending = True
                        self.push(t + 0.005, Retry())
                    return                      # none yet (or every resident session has a round here)
                self.idle_resident.discard(key)
                self.edges[key].resident = False   # write-through: its host copy is current
                self.resident -= 1
            job = self.kv_queue.pop(0)
            self.edges[job.edge].resident = True
            self.resident += 1
            self.resident_max = max(self.resident_max, self.resident)
            done = self.host_link.run(t, cfg.offload.copy_s(cfg.kv_bytes_per_session))
            if self.in_window(t):
                self.copies += 1
            self.push(done, Ready(job))

    def on_pass_done(self, t: float, done: PassDone) -> None:
        cfg = self.cfg
        if self.steering:
            self.steering.observe_pass(done.tokens, done.seconds)
        if cfg.batching:   # the finished leave the active ones (in one sweep: a pass may hold thousands)
            for job, n in done.plan:
                job.tokens -= n
            self.active = [job for job in self.active if job.tokens > 0]
        for job, n in done.plan:
            if not cfg.batching:
                job.tokens -= n
            if job.tokens > 0:
                continue        # more of it in the next pass
            i, e = job.edge, self.edges[job.edge]
            out = self.server_cpu.run(t, cfg.server_cpu_s) + cfg.server_overhead_s
            if self.in_window(t):
                self.server_times.append(out - job.arrived_s)
            if self.hybrid:
                remaining = cfg.max_tokens - e.committed
                accepted = self.accepted(job.gamma)
                committed = min(accepted + 1, remaining)
                if e.first_token_at is None:
                    e.first_token_at = (t, e.committed + committed)
                e.acceptance.observe(job.gamma, accepted, accepted < job.gamma)
                job.verified = True
                nxt = job.next
                if nxt is not None and not nxt.dropped:
                    nxt.hit = self.hit_rng.random() < cfg.hit and committed < remaining
                    if not nxt.hit:
                        self.drop_after(nxt)
                    elif nxt.held:      # it is here already: it joins the next pass
                        nxt.held = False
                        arrived = nxt.arrived_s
                        self.reach_verifier(nxt, t)
                        nxt.arrived_s = arrived
                        self.waiting.append(nxt)
                if self.steering:
                    self.steering.observe_commit(t, committed)
                    e.budget = self.steering.budget(e.acceptance, t)
                    if self.in_window(t):
                        self.budgets.append(e.budget)
                e.answered_s = t
                if self.offloading:
                    e.at_verifier = False
                    self.idle_resident.add(i)
                self.push(out, Send(i, "down", self.down_bytes, Reply(i, committed, job)))
            else:
                accepted = self.accepted(job.gamma)
                made = min(accepted + 1, self.streams[i])
                self.streams[i] -= made
                if e.first_token_at is None:
                    e.first_token_at = (t, cfg.max_tokens - self.streams[i])
                if self.steering:
                    self.steering.observe_commit(t, made)
                self.push(out, Send(i, "down", self.down_bytes, Token(i, self.streams[i] == 0, made)))
                if self.streams[i] > 0:   # the stream asks for its next token (at once: it is in the next pass)
                    gamma = min(cfg.gamma, self.streams[i] - 1) if self.spec else 0
                    nxt = _Job(i, gamma + 1, gamma=gamma, rows=gamma + 1)
                    if out <= t:
                        self.reach_verifier(nxt, out)
                        self.waiting.append(nxt)
                    else:
                        self.push(out, Arrive(nxt))
        if self.offloading and self.kv_queue:
            self.bring_back(t)
        self.next_pass(t)

    def accepted(self, gamma: int) -> int:
        """Drafts accepted of `gamma`: each in turn with its acceptance given the ones before."""
        accepted, curve = 0, self.cfg.curve
        while accepted < gamma and self.rng.random() < (curve.conditional(accepted + 1) if curve is not None
                                                        else self.cfg.alpha):
            accepted += 1
        return accepted

    def on_reply(self, t: float, reply: Reply) -> None:
        cfg, i = self.cfg, reply.edge
        ready = self.edge_cpus[i].run(t, cfg.edge_cpu_s)   # the reply taken in, the next draft's code run
        self.commit(i, ready, reply.tokens)
        e = self.edges[i]
        if reply.job in e.inflight:
            e.inflight.remove(reply.job)
        if e.committed >= cfg.max_tokens:
            self.start_request(i, ready)
            return
        if e.inflight and e.inflight[0].dropped:   # a miss: what was drafted ahead is void
            e.inflight, e.draft_free_s = [], ready
        if not e.inflight:
            self.send_round(i, ready, self.gamma_for(e, cfg.max_tokens - e.committed))
        self.fill_window(i, ready)

    def on_token(self, t: float, token: Token) -> None:
        ready = self.edge_cpus[token.edge].run(t, self.cfg.edge_cpu_s)
        self.commit(token.edge, ready, token.tokens)
        if token.last:
            self.start_request(token.edge, ready)

    def run(self) -> dict:
        cfg = self.cfg
        handlers = {Send: self.on_send, Arrive: self.on_arrive, PassDone: self.on_pass_done, Reply: self.on_reply,
                    Token: self.on_token, Ready: self.on_ready, Retry: self.on_retry}
        for i in range(cfg.edges):
            self.start_request(i, self.rng.uniform(0.0, cfg.start_spread_s))
        while self.events:
            t, _, event = heapq.heappop(self.events)
            if t > self.t_end:
                break
            handlers[type(event)](t, event)
        for e in self.edges:
            self.close_request(e)
        return self.result()

    def result(self) -> dict:
        cfg = self.cfg
        committed = max(self.committed_in_window, 1)
        tpots = self.finished_tpots
        pct = (lambda q: float(np.percentile(tpots, q)) if tpots else None)
        return {"edges": cfg.edges, "mode": cfg.mode, "batching": cfg.batching,
                "committed_tokens_per_s": self.committed_in_window / cfg.duration_s,
                "tpot_p50_s": pct(50), "tpot_p95_s": pct(95), "tpot_p99_s": pct(99),
                "ttft_p50_s": float(np.percentile(self.ttfts, 50)) if self.ttfts else None,
                "ttft_p95_s": float(np.percentile(self.ttfts, 95)) if self.ttfts else None,
                "ttft_mean_s": float(np.mean(self.ttfts)) if self.ttfts else None,
                "gap_p50_s": float(np.percentile(self.gaps, 50)) if self.gaps else None,
                "gap_p95_s": float(np.percentile(self.gaps, 95)) if self.gaps else None,
                "gap_mean_s": float(np.mean(self.gaps)) if self.gaps else None,
                "goodput_tokens_per_s": self.good_tokens / cfg.duration_s,
                "slo_met_share": sum(self.verdicts) / len(self.verdicts) if self.verdicts else None,
                "engine_requests_per_committed_token": self.requests_sent / committed if self.hybrid else None,
                "budget_mean": float(np.mean(self.budgets)) if self.budgets else None,
                "kv_exceeded": self.kv_exceeded,
                "kv_copies_per_s": self.copies / cfg.duration_s,
                "kv_resident_max": self.resident_max if self.offloading else None,
                "kv_copy_wait_p95_s": float(np.percentile(self.copy_wait_s, 95)) if self.copy_wait_s else None,
                "host_link_utilisation": (min(1.0, self.copies * cfg.offload.copy_s(cfg.kv_bytes_per_session)
                                              / cfg.duration_s) if self.offloading else None),
                "target_forward_passes_per_committed_token": self.passes / committed,
                "target_tokens_per_committed_token": self.target_tokens / committed,
                "verifier_utilisation": min(1.0, self.busy_s / cfg.duration_s),
                "server_s_mean": float(np.mean(self.server_times)) if self.server_times else None,
                "link_resets": sum(e.link.resets for e in self.edges)}


def simulate(cfg: FleetConfig) -> dict:
    """Run `cfg` for its warm-up and window: throughput, TPOT and TTFT percentiles, the verifier's
    passes and busy time, per committed token, measured in the window."""
    return _Simulation(cfg).run()
