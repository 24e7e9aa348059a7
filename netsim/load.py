"""The load test: N edges, each its own gRPC channel through its own emulated link, against one verifier.

All edges run on one asyncio event loop in this process; their links run in a process of their
own (netsim.proxyhost), so the edges' work never delays the network. Each edge is a device
that generates one request at a time: back to back (fixed concurrency, `arrival_rate` 0) or
requests arriving as a Poisson process of `arrival_rate` per edge, queued on the device while
it is busy (their TTFT counts the wait). The measured window opens after `warmup_s` once every
edge has committed a token (so the cold start of many sessions, or of many draft models, does
not eat it) and lasts `duration_s`; requests still running at its end are cut off there, and
their tokens committed by then count.

The synthetic drafter's cost per token is emulated by a sleep on the event loop before each
Verify call (a client interceptor), so each edge drafts as if on its own device; real GGUF
drafters (one model per edge) run for real, one at a time, on this machine's CPU, so with
more than a few edges they measure this machine's drafting, not the verifier: use --synthetic
for server capacity.

What is measured, per mode (hybrid = fixed γ chain, adaptive = γ from the cost model,
cloud-only = the verifier's Generate stream):
- committed tokens/s over all edges (server throughput);
- time per output token of each request over its commits inside the measured window, (last
  commit time - first commit time) / (tokens committed between them), and its p50/p95/p99 over
  requests; TTFT p50/p99 from the arrival, for requests that arrived inside the window;
- errors by gRPC status, session replays (the edge's count), sessions opened (the verifier's);
- from the verifier's Prometheus endpoint: rounds and draft tokens (hence target forward passes
  and target tokens per committed token: a Verify round is one pass over γ + 1 tokens; a
  Generate token is one pass over one token, prompts' prefill left out), and, when the verifier
  exports them, the per-batch histograms hybridspec_batch_tokens / _seconds / _sessions,
  which then replace the derived pass counts;
- the verifier process's CPU (cores busy) and peak RSS (psutil), and the CPU of this process (every
  edge) and of the proxy process (every link): the harness's own load.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import socket
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np

from hybridspec.machine import describe as describe_machine, summary as machine_summary
from netsim.profiles import get_profile
from netsim.proxyhost import LinkSpec, ProxyHost

log = logging.getLogger(__name__)

MODES = ("hybrid", "adaptive", "cloud-only")
SYNTHETIC_VOCAB = 64
BATCH_HISTOGRAMS = ("hybridspec_batch_tokens", "hybridspec_batch_seconds", "hybridspec_batch_sessions")


@dataclass
class LoadConfig:
    edges: list[int]                    # one run per value, per mode
    profiles: list[str]                 # edge i gets profiles[i % len(profiles)]
    modes: list[str]
    duration_s: float
    out: Path
    synthetic: bool = False
    server: str | None = None           # a running verifier (host:port); else one is started
    metrics_url: str | None = None      # its Prometheus endpoint, with --server
    verifier_args: list[str] = field(default_factory=list)
    gamma: int = 4
    max_tokens: int = 64                # per request
    arrival_rate: float = 0.0           # requests/s per edge (Poisson); 0: back to back
    seed: int = 1
    draft_ms: float = 2.0               # synthetic drafter: cost per drafted token (ms)
    synthetic_step_ms: float = 20.0     # synthetic verifier we start: cost per forward pass (ms)
    synthetic_alpha_noise: float = 1.0
    target: str | None = None
    draft: str | None = None
    pair: str | None = None             # the named pair target and draft came from (netsim/pairs.py)
    drafter: str = "gguf"               # real target: "gguf" (a draft model per edge, run on this CPU)
                                        # or "lookup" (prompt lookup, no model; draft_ms emulated per token)
    qmode: str = "fixed:16:16"
    warmup_s: float = 1.0               # each run's first seconds are not measured
    slo_tpot_ms: float = 150.0          # a request meets the SLO with time per output token at most this
    slo_ttft_ms: float = 2000.0         # ... and time to first token at most this (when it arrived in the window)


# --- the verifier: start, scrape ------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$')


def scrape(url: str | None) -> dict[str, float]:
    """Prometheus text format -> {"name{labels}": value}; {} when there is no endpoint."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    except OSError as exc:
        log.warning("could not scrape %s: %s", url, exc)
        return {}
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def metric_delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def histogram_delta(before: dict, after: dict, name: str) -> dict | None:
    """Count, sum and per-bucket counts of a histogram over the run; None if the verifier has none."""
    if f"{name}_count" not in after:
        return None
    buckets = {}
    for key, value in after.items():
        if key.startswith(f"{name}_bucket{{"):
            le = re.search(r'le="([^"]+)"', key).group(1)
            buckets[le] = value - before.get(key, 0.0)
    return {"count": metric_delta(before, after, f"{name}_count"), "sum": metric_delta(before, after, f"{name}_sum"),
            "buckets": buckets}


class ProcessMeter:
    """CPU (cores busy) and peak RSS of a process (the verifier, the edges, the proxies), sampled every `every_s`."""

    def __init__(self, pid: int | None, every_s: float = 0.25) -> None:
        import psutil
        self.process = psutil.Process(pid) if pid else None
        self.every_s = every_s
        self.peak_rss = 0
        self._task: asyncio.Task | None = None

    def _sample(self) -> None:
        try:
            self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
        except Exception:   # psutil.Error: the process is gone; keep the last figures
            pass

    async def _loop(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(self.every_s)

    def start(self) -> None:
        if self.process is None:
            return
        self.cpu0 = sum(self.process.cpu_times()[:2])
        self.t0 = time.monotonic()
        self.peak_rss = 0
        self._task = asyncio.create_task(self._loop())

    def stop(self) -> dict:
        if self.process is None:
            return {"cpu_cores": None, "peak_rss_mb": None}
        self._task.cancel()
        self._sample()
        cpu_s = sum(self.process.cpu_times()[:2]) - self.cpu0
        return {"cpu_cores": cpu_s / (time.monotonic() - self.t0), "peak_rss_mb": self.peak_rss / 2**20}


# --- the edges ------------------------------------------------------------------------------

class DraftCost(grpc.aio.UnaryUnaryClientInterceptor):
    """Before each Verify call, sleep the drafting time the synthetic drafter owes (see EmulatedDrafter)."""

    def __init__(self) -> None:
        self.owed_s = 0.0

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        if self.owed_s > 0:
            owed_s, self.owed_s = self.owed_s, 0.0
            await asyncio.sleep(owed_s)
        return await continuation(client_call_details, request)


class EmulatedDrafter:
    """A drafter whose cost per token is owed to a DraftCost interceptor instead of slept on the loop."""

    def __init__(self, inner, per_token_s: float, cost: DraftCost) -> None:
        self.inner, self.per_token_s, self.cost = inner, per_token_s, cost
        self.name, self.fingerprint = inner.name, inner.fingerprint

    def propose(self, committed, gamma, settings, qmode, rng):
        draft = self.inner.propose(committed, gamma, settings, qmode, rng)
        emulated_s = self.per_token_s * len(draft.tokens)
        self.cost.owed_s += emulated_s
        draft.seconds += emulated_s   # what the device would have measured: the adaptive γ uses it
        return draft

    def observe(self, committed, num_accepted) -> None:
        self.inner.observe(committed, num_accepted)

    def __getattr__(self, name):
        # The rest of the drafter contract (retokenization, supports_trees, ...) is the inner one's.
        return getattr(self.inner, name)


@dataclass
class Request:
    edge: int
    arrival_s: float
    start_s: float = 0.0
    token_times: list[tuple[float, int]] = field(default_factory=list)   # (time, tokens committed so far)
    done: bool = False
    replays: int = 0
    rounds: int = 0

    def tokens_by(self, t_s: float) -> int:
        counted = [n for when, n in self.token_times if when <= t_s]
        return counted[-1] if counted else 0

    def ttft_s(self) -> float | None:
        return self.token_times[0][0] - self.arrival_s if self.token_times else None

    def tpot_s(self, t_from: float, t_to: float) -> float | None:
        """Time per output token over the commits inside [t_from, t_to] (None with fewer than two)."""
        inside = [(t, n) for t, n in self.token_times if t_from <= t <= t_to]
        if len(inside) < 2:
            return None
        (t_first, n_first), (t_last, n_last) = inside[0], inside[-1]
        return (t_last - t_first) / (n_last - n_first) if n_last > n_first else None

    def meets(self, t_from: float, t_to: float, slo_tpot_s: float, slo_ttft_s: float) -> bool | None:
        """Whether this request met the SLO, judged on what the window saw of it: its TPOT inside
        the window, and its TTFT if it arrived inside it. None: the window saw too little to say."""
        tpot = self.tpot_s(t_from, t_to)
        ttft = self.ttft_s() if t_from <= self.arrival_s <= t_to else None
        if tpot is None and ttft is None:
            return None
        return (tpot is None or tpot <= slo_tpot_s) and (ttft is None or ttft <= slo_ttft_s)


class Edges:
    """Builds per-edge drafters and prompts (real or synthetic) and runs one edge's requests."""

    def __init__(self, cfg: LoadConfig) -> None:
        from spec_core.warping import SamplingSettings
        self.cfg = cfg
        self.settings = SamplingSettings(temperature=0.7, top_p=0.95, max_new_tokens=cfg.max_tokens, seed=cfg.seed,
                                         ignore_eos=cfg.synthetic)
        if cfg.synthetic:
            from edge_client.text import SyntheticTokenizer
            self.tokenizer = SyntheticTokenizer(SYNTHETIC_VOCAB)
            self._gguf = None
        elif cfg.drafter == "lookup":
            from llama_runtime import GGUFModel, bundled_model_path
            self._gguf = None
            self.tokenizer = GGUFModel(cfg.target or bundled_model_path(), vocab_only=True)
        else:
            from edge_client.drafters import DEFAULT_DRAFT
            from edge_client.drafters import GGUFDrafter
            draft = cfg.draft or str(DEFAULT_DRAFT)
            if not Path(draft).is_file():
                raise FileNotFoundError(f"no draft at {draft}: run scripts/setup.sh or edge-client make-draft")
            self._draft_path = draft
            self._gguf = GGUFDrafter(draft, n_threads=1)   # edge 0's; the others get their own
            self._gguf_by_edge = {0: self._gguf}
            self.tokenizer = self._gguf.model
        if not cfg.synthetic:
            from edge_client.text import render_chat
            from netsim.experiment import load_workloads, target_vocabulary
            # The prompt is the target's (its tokens and chat template), whatever the draft's tokenizer.
            vocab = target_vocabulary(cfg.target)
            self._prompts = [render_chat(vocab, p) for _, _, p in load_workloads(["chat", "code"], 2)]

    def drafter(self, cost: DraftCost, edge: int = 0):
        if self._gguf is not None:
            # One model (and KV cache) per edge, as on separate devices; drafting runs on this
            # CPU, one edge at a time (propose is synchronous on the event loop).
            if edge not in self._gguf_by_edge:
                from edge_client.drafters import GGUFDrafter
                self._gguf_by_edge[edge] = GGUFDrafter(self._draft_path, n_threads=1)
            return self._gguf_by_edge[edge]
        if not self.cfg.synthetic:   # prompt lookup: no model on the edge
            from edge_client.drafters import PromptLookupDrafter
            inner = PromptLookupDrafter(fingerprint=self.tokenizer.fingerprint)
            return EmulatedDrafter(inner, self.cfg.draft_ms / 1000.0, cost)
        from edge_client.drafters import SyntheticDrafter
        inner = SyntheticDrafter(SYNTHETIC_VOCAB, 0, self.cfg.synthetic_alpha_noise)
        return EmulatedDrafter(inner, self.cfg.draft_ms / 1000.0, cost)

    def prompt(self, edge: int, number: int) -> list[int]:
        if not self.cfg.synthetic:
            return self._prompts[(edge + number) % len(self._prompts)]
        rng = np.random.default_rng([self.cfg.seed, edge, number])
        return [0] + rng.integers(2, SYNTHETIC_VOCAB, size=12).tolist()

    def settings_for(self, edge: int, number: int):
        from dataclasses import replace
        return replace(self.settings, seed=self.cfg.seed * 1_000_003 + edge * 1009 + number)


@dataclass
class Window:
    """The measured window: it opens after the warm-up once every edge has committed a token
    (a cold start of many sessions must not eat the window), and lasts duration_s."""

    edges: int
    warmup_s: float
    duration_s: float
    start_s: float = math.inf
    end_s: float = math.inf
    started: set = field(default_factory=set)   # edges that have committed a token
    all_started: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    max_wait_s: float = 120.0                   # open the window anyway after warm-up + this

    def committed(self, edge: int) -> None:
        if edge not in self.started:
            self.started.add(edge)
            if len(self.started) == self.edges:
                self.all_started.set()


async def run_edge(edges: Edges, mode: str, edge: int, port: int, window: Window, requests: list[Request],
                   errors: dict[str, int], rng: np.random.Generator, cost: DraftCost, drafter) -> None:
    """One device: its own channel through its own link; requests until the window ends."""
    from edge_client.client import EdgeClient, EdgeError, sampling_proto
    from spec_core.proto import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
    cfg = edges.cfg
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=[cost]) as channel:
        stub = pb_grpc.VerifierStub(channel)
        await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=60)   # connect before the clock starts
        next_arrival = loop.time()
        number = 0
        stop = asyncio.create_task(window.stop.wait())
        while not window.stop.is_set():
            if cfg.arrival_rate > 0:
                next_arrival += rng.exponential(1.0 / cfg.arrival_rate)
                if next_arrival >= window.end_s:
                    break
                await asyncio.wait([stop], timeout=max(0.0, next_arrival - loop.time()))
                if window.stop.is_set():
                    break
                arrival = next_arrival
            else:
                arrival = loop.time()
            request = Request(edge, arrival, start_s=loop.time())
            requests.append(request)
            prompt, settings = edges.prompt(edge, number), edges.settings_for(edge, number)
            number += 1
            running = asyncio.create_task(_one_request(mode, stub, channel, drafter, edges, prompt, settings,
                                                       request, window, EdgeClient, sampling_proto, pb))
            await asyncio.wait([running, stop], return_when=asyncio.FIRST_COMPLETED)
            if not running.done():
                running.cancel()   # cut off at the end of the run
                await asyncio.gather(running, return_exceptions=True)
                break
            try:
                running.result()
                request.done = True
            except EdgeError as exc:
                errors[exc.code.name] = errors.get(exc.code.name, 0) + 1
                await asyncio.sleep(0.1)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                await asyncio.sleep(0.1)
        stop.cancel()


async def _one_request(mode, stub, channel, drafter, edges, prompt, settings, request, window, EdgeClient,
                       sampling_proto, pb):
    loop = asyncio.get_running_loop()

    def committed(tokens: int) -> None:
        request.token_times.append((loop.time(), tokens))
        window.committed(request.edge)
    if mode == "cloud-only":
        count = 0
        async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling_proto(settings)),
                                         timeout=600):
            count += len(chunk.token_ids)
            committed(count)
        return
    gamma = "adaptive" if mode == "adaptive" else edges.cfg.gamma
    from edge_client.options import EdgeOptions, Speculation, Transport
    options = EdgeOptions(Transport("", deadline_s=120), Speculation(gamma=gamma, qmode=edges.cfg.qmode))
    async with EdgeClient(options, drafter, edges.tokenizer, channel=channel) as client:
        generation = client.generate(prompt, settings)
        try:
            async for _ in generation:
                stats = generation.stats
                committed(stats.accepted + stats.rounds)
        finally:
            # Cut off at the window's end, the generation closes its session itself (EdgeClient
            # waits for that Close before it lets the channel go).
            request.replays = generation.stats.replays
            request.rounds = generation.stats.rounds


# --- one run, and the whole sweep -----------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def run_once(cfg: LoadConfig, edges: Edges, mode: str, n_edges: int, upstream: tuple[str, int],
                   metrics_url: str | None, verifier_pid: int | None) -> dict:
    profiles = [get_profile(cfg.profiles[i % len(cfg.profiles)]) for i in range(n_edges)]
    costs = [DraftCost() for _ in range(n_edges)]
    drafters = [edges.drafter(costs[i], i) for i in range(n_edges)]   # loaded before the clock starts
    with ProxyHost([LinkSpec(profile, upstream, seed=cfg.seed * 100_003 + i) for i, profile in enumerate(profiles)]) as host:
        loop = asyncio.get_running_loop()
        requests: list[Request] = []
        errors: dict[str, int] = {}
        t_start = loop.time()
        window = Window(n_edges, cfg.warmup_s, cfg.duration_s)
        meter = ProcessMeter(verifier_pid)
        # This process runs every edge (one event loop) and the proxy process every link: their CPU
        # says how close the harness itself is to its limits (the fleet simulator calibrates on it).
        edge_meter, proxy_meter = ProcessMeter(os.getpid()), ProcessMeter(host.process.pid)

        async def measure_window() -> dict:
            await asyncio.sleep(cfg.warmup_s)
            try:
                await asyncio.wait_for(window.all_started.wait(), timeout=window.max_wait_s)
            except asyncio.TimeoutError:
                log.warning("%d of %d edges committed nothing in %.0f s; measuring anyway",
                            n_edges - len(window.started), n_edges, cfg.warmup_s + window.max_wait_s)
            window.start_s = loop.time()
            window.end_s = window.start_s + cfg.duration_s
            before = await loop.run_in_executor(None, scrape, metrics_url)
            for m in (meter, edge_meter, proxy_meter):
                m.start()
            await asyncio.sleep(max(0.0, window.end_s - loop.time()))
            after = await loop.run_in_executor(None, scrape, metrics_url)
            window.stop.set()
            verifier = meter.stop()
            return {"before": before, "after": after,
                    "cpu": {"verifier_cpu_cores": verifier["cpu_cores"], "verifier_peak_rss_mb": verifier["peak_rss_mb"],
                            "edges_cpu_cores": edge_meter.stop()["cpu_cores"],
                            "proxy_cpu_cores": proxy_meter.stop()["cpu_cores"]}}

        measuring = asyncio.create_task(measure_window())
        await asyncio.gather(*(run_edge(edges, mode, i, host.ports[i], window, requests, errors,
                                        np.random.default_rng([cfg.seed, n_edges, i]), costs[i], drafters[i])
                               for i in range(n_edges)))
        measured = await measuring
        proxy_stats = host.stop()
    t_measure, t_end = window.start_s, window.end_s
    # Tokens committed inside the measured window, whatever request they belong to.
    committed = sum(r.tokens_by(t_end) - r.tokens_by(t_measure) for r in requests)
    # TPOT: every request's commits inside the window (a slow link's long request counts too);
    # TTFT: requests that arrived inside it.
    tpot_of = {id(r): r.tpot_s(t_measure, t_end) for r in requests}
    tpots = [t for t in tpot_of.values() if t is not None]
    ttfts = [t for r in requests if t_measure <= r.arrival_s <= t_end and (t := r.ttft_s()) is not None]
    # Goodput: tokens committed inside the window by requests that met the SLO (SLED, WISP, SpecEdge's
    # figure of merit); a request the window saw too little of to judge does not count either way.
    verdicts = {id(r): r.meets(t_measure, t_end, cfg.slo_tpot_ms / 1e3, cfg.slo_ttft_ms / 1e3) for r in requests}
    judged = [v for v in verdicts.values() if v is not None]
    good = sum(r.tokens_by(t_end) - r.tokens_by(t_measure) for r in requests if verdicts[id(r)])
    per_edge_tpot = {}
    for r in requests:
        if tpot_of[id(r)] is not None:
            per_edge_tpot.setdefault(r.edge, []).append(tpot_of[id(r)])
    before, after = measured["before"], measured["after"]
    rounds = metric_delta(before, after, "hybridspec_verify_rounds_total")
    drafts = metric_delta(before, after, "hybridspec_draft_tokens_total")
    batch = {name: histogram_delta(before, after, name) for name in BATCH_HISTOGRAMS}
    if batch["hybridspec_batch_tokens"] is not None:
        passes, target_tokens, source = batch["hybridspec_batch_tokens"]["count"], batch["hybridspec_batch_tokens"]["sum"], "batch histograms"
    elif mode == "cloud-only":
        passes = target_tokens = float(committed)
        source = "derived: one pass per generated token"
    elif metrics_url:
        passes, target_tokens, source = rounds, drafts + rounds, "derived: one pass of γ+1 tokens per Verify round"
    else:
        passes = target_tokens = None
        source = "no metrics endpoint"
    verifier_errors = {key.split('code="')[1].rstrip('"}'): metric_delta(before, after, key)
                       for key in after if key.startswith("hybridspec_request_errors_total{")}
    duration = cfg.duration_s
    lateness = [s["late_s"] / s["chunks"] for s in proxy_stats if s.get("chunks")]
    return {
        "edges": n_edges, "mode": mode, "profiles": sorted({p.name for p in profiles}),
        "duration_s": duration, "warmup_s": t_measure - t_start, "requests": len(requests), "requests_completed": sum(r.done for r in requests),
        "committed_tokens": committed, "committed_tokens_per_s": committed / duration,
        "tpot_p50_s": percentile(tpots, 50), "tpot_p95_s": percentile(tpots, 95), "tpot_p99_s": percentile(tpots, 99),
        "tpot_per_edge_mean_s": {str(e): statistics.fmean(v) for e, v in sorted(per_edge_tpot.items())},
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95), "ttft_p99_s": percentile(ttfts, 99),
        "goodput_tokens_per_s": good / cfg.duration_s,
        "slo_met_share": sum(judged) / len(judged) if judged else None,
        # Per request the window saw: [TPOT inside it, TTFT if it arrived inside it, tokens inside it],
        # so goodput can be judged again at other SLOs (goodput_at).
        "per_request": [[tpot_of[id(r)], r.ttft_s() if t_measure <= r.arrival_s <= t_end else None,
                         r.tokens_by(t_end) - r.tokens_by(t_measure)] for r in requests],
        "target_forward_passes": passes, "target_tokens": target_tokens, "target_cost_source": source,
        "target_forward_passes_per_committed_token": passes / committed if passes is not None and committed else None,
        "target_tokens_per_committed_token": target_tokens / committed if target_tokens is not None and committed else None,
        "verify_rounds": rounds,
        "errors": errors, "verifier_errors": verifier_errors,
        "session_replays": sum(r.replays for r in requests),
        "sessions_opened": metric_delta(before, after, "hybridspec_sessions_opened_total"),
        "model_seconds": metric_delta(before, after, "hybridspec_model_seconds_sum"),
        "round_seconds": metric_delta(before, after, "hybridspec_round_seconds_sum"),
        "kv": kv_between_rounds(before, after, rounds),
        "gamma": cfg.gamma if mode == "hybrid" else None, "draft_ms": cfg.draft_ms if cfg.synthetic else None,
        "batch_histograms": {k: v for k, v in batch.items() if v is not None},
        **measured["cpu"],
        "proxy_mean_lateness_ms": 1000 * statistics.fmean(lateness) if lateness else None,
        "proxy_max_lateness_ms": 1000 * max((s["late_max_s"] for s in proxy_stats), default=0.0),
    }


def kv_between_rounds(before: dict, after: dict, rounds: float) -> dict | None:
    """Where sessions' KV spent the time between rounds (the batched llama.cpp verifier's
    hybridspec_kv_* metrics), and what parking cost; None when the verifier exports none."""
    from spec_core.kvpark import idle_share
    key = 'hybridspec_kv_session_seconds_total{{state="{}"}}'
    if key.format("busy") not in after:
        return None
    busy, idle, parked = (metric_delta(before, after, key.format(k)) for k in ("busy", "idle", "parked"))
    d = {k: metric_delta(before, after, f"hybridspec_kv_{k}_total")
         for k in ("parks", "restores", "park_seconds", "restore_seconds", "park_bytes", "restore_wait_seconds",
                   "compaction_seconds")}
    per = lambda x, n: x / n if n else None   # noqa: E731
    return {"idle_share": idle_share(busy, idle + parked), "parked_share": per(parked, busy + idle + parked),
            "parks": d["parks"], "restores": d["restores"], "park_ms": per(1e3 * d["park_seconds"], d["parks"]),
            "restore_ms": per(1e3 * d["restore_seconds"], d["restores"]),
            "park_bytes": per(d["park_bytes"], d["parks"]),
            "restore_wait_ms": per(1e3 * d["restore_wait_seconds"], d["restores"]),
            "move_ms_per_round": per(1e3 * (d["park_seconds"] + d["restore_seconds"]), rounds),
            "compaction_ms_per_round": per(1e3 * d["compaction_seconds"], rounds),
            "failures": sum(metric_delta(before, after, k) for k in after
                            if k.startswith("hybridspec_kv_park_failures_total{"))}


def verifier_args(cfg: LoadConfig, metrics_port: int, max_edges: int) -> list[str]:
    if cfg.synthetic:
        args = ["--backend", "synthetic", "--synthetic-vocab", str(SYNTHETIC_VOCAB),
                "--synthetic-step-ms", str(cfg.synthetic_step_ms)]
    else:
        from llama_runtime import bundled_model_path
        args = ["--model", cfg.target or str(bundled_model_path())]
    # Room for every edge's session (the verifier's default is 8): evictions are then a finding,
    # not a setting. Requests are short: 512-token contexts, and KV cells for all of them.
    given = {a.split("=", 1)[0] for a in cfg.verifier_args if a.startswith("--")}
    if "--threads" not in given and not cfg.synthetic:
        args += ["--threads", str(verifier_threads())]
    if "--n-ctx" not in given:
        args += ["--n-ctx", str(LOAD_N_CTX)]
    if "--max-sessions" not in given:
        args += ["--max-sessions", str(max(8, max_edges))]
    if "--kv-tokens" not in given and not cfg.synthetic:
        n_ctx = int(_arg_value(cfg.verifier_args, "--n-ctx") or LOAD_N_CTX)
        args += ["--kv-tokens", str(max(8, max_edges) * n_ctx)]
    return args + ["--metrics-port", str(metrics_port)] + list(cfg.verifier_args)


LOAD_N_CTX = 512


def verifier_threads(cores: int | None = None) -> int:
    """Threads for a verifier that shares this machine with the harness: half the cores, at least
    one. llama.cpp's threads spin-wait, so a verifier on every core stalls against the edges'
    drafting, the proxies and the event loop on the same cores (docs/benchmarks.md has the figures).
    `--verifier-arg=--threads=N` overrides it; load.json records what the verifier ran with."""
    return max(1, (cores or os.cpu_count() or 1) // 2)


def _arg_value(args: list[str], name: str) -> str | None:
    """The value of option `name` in a command line (`--name V` or `--name=V`; the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


HARNESS_SATURATED = 0.9   # share of the cores left to the harness above which a run is flagged


def saturation(run: dict, cores: int, verifier_threads: int | None) -> str | None:
    """Why a run is not representative of the verifier, or None: the harness (every edge in this
    process's one event loop, every link in the proxy process) used the cores the verifier left it,
    so the edges, not the verifier, set the pace."""
    edges, proxy = run.get("edges_cpu_cores"), run.get("proxy_cpu_cores")
    if edges is None:
        return None
    reasons = []
    if edges >= HARNESS_SATURATED:
        reasons.append(f"the edges' event loop kept {edges:.2f} cores busy")
    left = max(1, cores - (verifier_threads or 0))
    harness = edges + (proxy or 0.0)
    if harness >= HARNESS_SATURATED * left:
        reasons.append(f"edges and proxies kept {harness:.2f} of the {left} cores the verifier left them busy")
    return "; ".join(reasons) or None


async def drain(metrics_url: str | None, timeout_s: float = 120.0) -> float | None:
    """After a run, wait for the verifier to finish what the cut-off edges left queued (rounds in
    flight, KV cells of closed sessions), so that the next run starts on an idle verifier.
    Returns the seconds waited (None without a metrics endpoint)."""
    if not metrics_url:
        return None
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while loop.time() - t0 < timeout_s:
        m = await loop.run_in_executor(None, scrape, metrics_url)
        if m.get("hybridspec_inflight_rounds", 0.0) == 0 and m.get('hybridspec_kv_cells{state="live"}', 0.0) == 0:
            return loop.time() - t0
        await asyncio.sleep(0.2)
    log.warning("the verifier still had work in flight %.0f s after the run", timeout_s)
    return loop.time() - t0


async def server_info(upstream: tuple[str, int]) -> dict:
    """What the verifier says of itself (recorded with the results: batching or not)."""
    from spec_core.proto import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
    async with grpc.aio.insecure_channel(f"{upstream[0]}:{upstream[1]}") as channel:
        info = await pb_grpc.VerifierStub(channel).GetServerInfo(pb.ServerInfoRequest(), timeout=60)
    return {"backend": info.backend, "model": info.model, "batching": info.batching, "n_ctx": info.n_ctx,
            "max_sessions": info.max_sessions, "max_tree_nodes": info.max_tree_nodes, "version": info.version}


async def run_load(cfg: LoadConfig, progress=None) -> dict:
    from hybridspec.launch import spawn_verifier
    for name in cfg.profiles:
        get_profile(name)
    cfg.out.mkdir(parents=True, exist_ok=True)
    edges = Edges(cfg)
    proc, args = None, []
    if cfg.server:
        host, _, port = cfg.server.rpartition(":")
        upstream, metrics_url, pid = (host, int(port)), cfg.metrics_url, None
    else:
        metrics_port = free_port()
        args = verifier_args(cfg, metrics_port, max(cfg.edges))
        proc, address = spawn_verifier(args)
        upstream = ("127.0.0.1", int(address.rsplit(":", 1)[1]))
        metrics_url, pid = f"http://127.0.0.1:{metrics_port}/metrics", proc.pid
    runs = []
    task = progress.add_task("load", total=len(cfg.edges) * len(cfg.modes)) if progress else None
    try:
        info = await server_info(upstream)
        for n_edges in cfg.edges:
            for mode in cfg.modes:
                if progress:
                    progress.update(task, description=f"{n_edges} edges, {mode}")
                runs.append(await run_once(cfg, edges, mode, n_edges, upstream, metrics_url, pid))
                runs[-1]["drain_s"] = await drain(metrics_url)
                if progress:
                    progress.advance(task)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    machine = describe_machine()
    given_threads = _arg_value(args, "--threads") if proc is not None else None
    threads = int(given_threads) if given_threads else None
    for run in runs:
        run["not_representative"] = saturation(run, machine["cores"] or 1, threads)
    return {"config": config, "server": info, "runs": runs, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "capacity": capacity_at_slo(runs, cfg.slo_tpot_ms / 1e3, cfg.slo_ttft_ms / 1e3),
            "verifier_threads": threads,
            "machine": {**machine, "load_1min_at_end": os.getloadavg()[0]}}


# --- report ---------------------------------------------------------------------------------

def goodput_at(run: dict, slo_tpot_s: float, slo_ttft_s: float) -> float:
    """A run's goodput (tokens/s of requests that met it) at another SLO than the one it ran with,
    judged as Request.meets does: TPOT inside the window, TTFT if the request arrived inside it."""
    good = 0
    for tpot, ttft, tokens in run.get("per_request", []):
        if (tpot is not None or ttft is not None) and (tpot is None or tpot <= slo_tpot_s) \
                and (ttft is None or ttft <= slo_ttft_s):
            good += tokens
    return good / run["duration_s"]


def meets_slo_p95(run: dict, slo_tpot_s: float, slo_ttft_s: float) -> bool:
    """A run meets the SLO when its p95 TPOT and p95 TTFT are within it (an unmeasured TTFT, e.g.
    no request arrived in the window, does not count against it)."""
    tpot, ttft = run.get("tpot_p95_s"), run.get("ttft_p95_s")
    return tpot is not None and tpot <= slo_tpot_s and (ttft is None or ttft <= slo_ttft_s)


def capacity_at_slo(runs: list[dict], slo_tpot_s: float, slo_ttft_s: float) -> dict:
    """Per mode: the most edges among the counts run whose p95 TPOT and TTFT met the SLO (0: none
    did), and the goodput there. Counts between those run are not interpolated."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        ok = [r for r in runs if r["mode"] == mode and meets_slo_p95(r, slo_tpot_s, slo_ttft_s)]
        best = max(ok, key=lambda r: r["edges"], default=None)
        out[mode] = {"edges": best["edges"] if best else 0,
                     "goodput_tokens_per_s": best["goodput_tokens_per_s"] if best else 0.0,
                     "edges_run": sorted({r["edges"] for r in runs if r["mode"] == mode})}
    return out


def _capacity_ratio(capacity: dict) -> str:
    """Each drafting mode's capacity over cloud-only's, when both ran (the issue's side by side)."""
    base = capacity.get("cloud-only", {}).get("edges")
    parts = [f"{mode} {c['edges'] / base:.2f}×" for mode, c in capacity.items() if mode != "cloud-only" and base]
    return f". Capacity over cloud-only's: {', '.join(parts)}" if parts else ""


def _pair(cfg: dict) -> str:
    if cfg["synthetic"]:
        return f"synthetic pair (draft {cfg['draft_ms']} ms/token, target {cfg['synthetic_step_ms']} ms/pass)"
    target = Path(cfg["target"]).name if cfg.get("target") else "bundled target"
    if cfg.get("drafter") == "lookup":
        return f"{target} (llama.cpp) + prompt-lookup drafts ({cfg['draft_ms']} ms/token emulated)"
    return f"{target} + draft model per edge (llama.cpp)"


def _server_says(info: dict | None) -> str:
    if not info:
        return ""
    return f" ({info['backend']}, {'batching' if info['batching'] else 'serial: one round at a time'})"


def _f(value, scale=1.0, digits=1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value * scale:.{digits}f}"


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [f"# netsim load ({result['started']})", "",
             f"Profiles {', '.join(cfg['profiles'])}; {cfg['duration_s']:g} s per run after {cfg['warmup_s']:g} s "
             f"warm-up; {_pair(cfg)}; "
             f"γ {cfg['gamma']} (hybrid); up to {cfg['max_tokens']} tokens per request; "
             f"{'Poisson arrivals, ' + str(cfg['arrival_rate']) + '/s per edge' if cfg['arrival_rate'] else 'back-to-back requests'}; "
             f"{'verifier at ' + cfg['server'] if cfg['server'] else 'verifier started with ' + ' '.join(cfg['verifier_args'] or ['(defaults)'])}"
             f"{_server_says(result.get('server'))}"
             f"{'; verifier threads ' + str(result['verifier_threads']) if result.get('verifier_threads') else ''}.",
             "", f"Machine: {machine_summary(result['machine']) if 'cpu_model' in result.get('machine', {}) else 'not recorded'}.",
             ""]
    flagged = [r for r in result["runs"] if r.get("not_representative")]
    if flagged:
        lines += ["**Not representative** (the harness saturated this machine's CPU; the verifier's figures "
                  "are the harness's): " + "; ".join(f"{r['edges']} edges {r['mode']}: {r['not_representative']}"
                                                    for r in flagged), ""]
    slo = (f"p95 TPOT ≤ {cfg.get('slo_tpot_ms', 150.0):g} ms and p95 TTFT ≤ {cfg.get('slo_ttft_ms', 2000.0):g} ms")
    if result.get("capacity"):
        lines += [f"**Capacity at the SLO** ({slo}; the most edges among {', '.join(map(str, next(iter(result['capacity'].values()))['edges_run']))} "
                  "that met it): " + "; ".join(f"{mode} **{c['edges']}** edges ({c['goodput_tokens_per_s']:.1f} tok/s of "
                                              f"goodput there)" for mode, c in result["capacity"].items())
                  + _capacity_ratio(result["capacity"]), ""]
    lines += ["| edges | mode | tok/s | goodput tok/s | met SLO | TPOT p50 ms | p95 | p99 | TTFT p50 ms | p99 | passes/tok "
             "| target tok/tok | errors | replays | verifier CPU | RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"
        mark = " ⚠" if r.get("not_representative") else ""
        lines.append(f"| {r['edges']}{mark} | {r['mode']} | {_f(r['committed_tokens_per_s'])} "
                     f"| {_f(r.get('goodput_tokens_per_s'))} | {_f(r.get('slo_met_share'), 100, 0)}% | {_f(r['tpot_p50_s'], 1e3)} "
                     f"| {_f(r['tpot_p95_s'], 1e3)} | {_f(r['tpot_p99_s'], 1e3)} | {_f(r['ttft_p50_s'], 1e3, 0)} "
                     f"| {_f(r['ttft_p99_s'], 1e3, 0)} | {_f(r['target_forward_passes_per_committed_token'], 1, 3)} "
                     f"| {_f(r['target_tokens_per_committed_token'], 1, 2)} | {errors} | {r['session_replays']} "
                     f"| {_f(r['verifier_cpu_cores'], 1, 2)} | {_f(r['verifier_peak_rss_mb'], 1, 0)} |")
    sources = sorted({r["target_cost_source"] for r in result["runs"]})
    lines += ["", "Goodput: tokens/s committed inside the window by requests that met the SLO (each judged on its "
                  "TPOT inside the window and, if it arrived inside it, its TTFT); 'met SLO' is the share of requests judged.",
              f"Target cost: {'; '.join(sources)}. TPOT is per request over its commits inside the window: "
                  "(last commit − first commit) / tokens between them; TTFT counts from the request's arrival. Verifier CPU is in cores busy.",
              "CPU of the harness (cores busy; edges: this process, every edge's client and drafting; proxies: every "
              "link): " + ", ".join(f"{r['edges']}/{r['mode']}: {_f(r.get('edges_cpu_cores'), 1, 2)}/"
                                    f"{_f(r.get('proxy_cpu_cores'), 1, 2)}" for r in result["runs"]),
              *_kv_lines(result["runs"]),
              "Proxy lateness (mean per chunk, max): " + ", ".join(
                  f"{r['edges']}/{r['mode']}: {_f(r['proxy_mean_lateness_ms'], 1, 2)}/{_f(r['proxy_max_lateness_ms'], 1, 1)} ms"
                  for r in result["runs"]), ""]
    return "\n".join(lines)


def _kv_lines(runs: list[dict]) -> list[str]:
    kv = [(r, r["kv"]) for r in runs if r.get("kv")]
    if not kv:
        return []
    return ["Sessions' KV between rounds (idle share of the time from a round's arrival to the next's; parks, "
            "restores, ms each, MB per park; park + restore ms per round): " + ", ".join(
                f"{r['edges']}/{r['mode']}: {_f(k['idle_share'], 100, 0)}% idle, {k['parks']:.0f}/{k['restores']:.0f}, "
                f"{_f(k['park_ms'], 1, 2)}/{_f(k['restore_ms'], 1, 2)} ms, {_f(k['park_bytes'], 1e-6, 2)} MB, "
                f"{_f(k['move_ms_per_round'], 1, 2)} ms" for r, k in kv)]


def plot(result: dict, out: Path) -> dict[str, Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = {}
    modes = list(dict.fromkeys(r["mode"] for r in result["runs"]))
    for key, ylabel, name, scale in (("committed_tokens_per_s", "committed tokens/s (all edges)", "throughput", 1.0),
                                     ("tpot_p95_s", "time per output token p95 (ms)", "latency", 1e3)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in modes:
            rs = sorted((r for r in result["runs"] if r["mode"] == mode), key=lambda r: r["edges"])
            xs = [r["edges"] for r in rs if r[key] is not None]
            ys = [r[key] * scale for r in rs if r[key] is not None]
            ax.plot(xs, ys, marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("edges")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name} vs edges ({', '.join(result['config']['profiles'])})")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        paths[name] = out / f"{name}_vs_edges.png"
        fig.savefig(paths[name], dpi=110)
        plt.close(fig)
    return paths


def write_all(result: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "load.json", "report": out / "load.md"}
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["report"].write_text(markdown(result))
    paths.update(plot(result, out))
    return paths
