"""The load test's runs: one run (N edges, one mode, through their links) and the sweep, with
the verifier it starts (its arguments, threads), drains between runs and flags when the harness
saturated the machine."""
from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import grpc
import numpy as np

from hybridspec.machine import describe as describe_machine
from netsim.load.config import SYNTHETIC_VOCAB, LoadConfig
from netsim.load.edges import DraftCost, Edges, Request, Window, run_edge
from netsim.load.metering import (BATCH_HISTOGRAMS, ProcessMeter, free_port, histogram_delta, kv_between_rounds,
                                  metric_delta, scrape, verifier_committed)
from netsim.cmdline import option_value
from netsim.load.verdicts import capacity_at_slo
from netsim.profiles import get_profile
from netsim.proxyhost import LinkSpec, ProxyHost

log = logging.getLogger(__name__)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def run_once(cfg: LoadConfig, edges: Edges, mode: str, n_edges: int, upstream: tuple[str, int],
                   metrics_url: str | None, verifier_pid: int | None) -> dict:
    """One run: `n_edges` edges in `mode` through their links for warm-up plus the measured window;
    the run's record for load.json."""
    profiles = edge_profiles(cfg, n_edges)
    traffic = await _drive(cfg, edges, mode, n_edges, upstream, metrics_url, verifier_pid, profiles)
    return run_record(cfg, mode, n_edges, profiles, traffic, metrics_url)


def edge_profiles(cfg: LoadConfig, n_edges: int) -> list:
    """Edge i's link profile: the i-th of cfg.profiles, cycling."""
    return [get_profile(cfg.profiles[i % len(cfg.profiles)]) for i in range(n_edges)]


def run_record(cfg: LoadConfig, mode: str, n_edges: int, profiles: list, traffic: "Traffic",
               metrics_url: str | None) -> dict:
    """One run's record for load.json from what its edges did and the verifier's metrics across
    the window (wall clock, or netsim.virtual.load's virtual clock)."""
    requests = _request_figures(cfg, traffic.requests, traffic.window)
    before, after = traffic.measured.before, traffic.measured.after
    rounds = metric_delta(before, after, "hybridspec_verify_rounds_total")
    batch = {name: histogram_delta(before, after, name) for name in BATCH_HISTOGRAMS}
    verifier_errors = {key.split('code="')[1].rstrip('"}'): metric_delta(before, after, key)
                       for key in after if key.startswith("hybridspec_request_errors_total{")}
    lateness = [s["late_s"] / s["chunks"] for s in traffic.proxy_stats if s.get("chunks")]
    window = traffic.window
    trips = [seconds for when, seconds in traffic.round_trips if window.start_s <= when <= window.end_s]
    return {
        "edges": n_edges, "mode": mode, "profiles": sorted({p.name for p in profiles}),
        "duration_s": cfg.duration_s, "warmup_s": traffic.warmup_s,
        **requests,
        **_target_cost(mode, requests["committed_tokens"], before, after, rounds, batch, metrics_url),
        "verify_rounds": rounds,
        "round_trip_mean_s": statistics.fmean(trips) if trips else None,   # the edges' view: link + verifier
        "round_trip_p50_s": percentile(trips, 50),
        "verifier_committed_tokens": verifier_committed(before, after),
        "errors": traffic.errors, "verifier_errors": verifier_errors,
        "session_replays": sum(r.replays for r in traffic.requests),
        "sessions_opened": metric_delta(before, after, "hybridspec_sessions_opened_total"),
        "model_seconds": metric_delta(before, after, "hybridspec_model_seconds_sum"),
        "round_seconds": metric_delta(before, after, "hybridspec_round_seconds_sum"),
        "kv": kv_between_rounds(before, after, rounds),
        "gamma": cfg.gamma if mode == "hybrid" else None, "draft_ms": cfg.draft_ms if cfg.synthetic else None,
        "batch_histograms": {k: v for k, v in batch.items() if v is not None},
        **traffic.measured.cpu,
        "proxy_mean_lateness_ms": 1000 * statistics.fmean(lateness) if lateness else None,
        "proxy_max_lateness_ms": 1000 * max(s["late_max_s"] for s in traffic.proxy_stats) if traffic.proxy_stats else None,
    }


class _Meters(NamedTuple):
    """CPU meters over the measured window. This process runs every edge (one event loop) and the
    proxy process every link: their CPU says how close the harness itself is to its limits (the
    fleet simulator calibrates on it)."""
    verifier: ProcessMeter
    edges: ProcessMeter
    proxy: ProcessMeter


class _Measured(NamedTuple):
    before: dict   # the verifier's metrics when the window opened
    after: dict    # and when it closed
    cpu: dict      # cores kept busy over the window (verifier, edges, proxy) and the verifier's peak RSS


@dataclass
class Traffic:
    """What one run's edges did, and what was measured around them."""
    requests: list[Request]
    errors: dict[str, int]      # the edges' errors by kind
    window: Window              # start_s, end_s: the measured window on the event loop's clock
    warmup_s: float             # from the first request to the measured window
    measured: _Measured
    proxy_stats: list[dict]     # per link, from the proxy process
    round_trips: list           # (when, seconds on the wire) of each committed round


async def _drive(cfg: LoadConfig, edges: Edges, mode: str, n_edges: int, upstream: tuple[str, int],
                 metrics_url: str | None, verifier_pid: int | None, profiles: list) -> Traffic:
    """Run the edges through their links until the measured window closes."""
    costs = [DraftCost() for _ in range(n_edges)]
    drafters = [edges.drafter(costs[i], i) for i in range(n_edges)]   # loaded before the clock starts
    with ProxyHost([LinkSpec(profile, upstream, seed=cfg.seed * 100_003 + i) for i, profile in enumerate(profiles)]) as host:
        loop = asyncio.get_running_loop()
        requests: list[Request] = []
        errors: dict[str, int] = {}
        round_trips: list[tuple[float, float]] = []
        t_start = loop.time()
        window = Window(n_edges, cfg.warmup_s, cfg.duration_s)
        meters = _Meters(ProcessMeter(verifier_pid), ProcessMeter(os.getpid()), ProcessMeter(host.process.pid))
        measuring = asyncio.create_task(measure_window(cfg, window, n_edges, lambda: scrape(metrics_url), meters))
        await asyncio.gather(*(run_edge(edges, mode, i, host.ports[i], window, requests, errors,
                                        np.random.default_rng([cfg.seed, n_edges, i]), costs[i], drafters[i],
                                        round_trips)
                               for i in range(n_edges)))
        measured = await measuring
        proxy_stats = host.stop()
    return Traffic(requests, errors, window, window.start_s - t_start, measured, proxy_stats, round_trips)


async def measure_window(cfg: LoadConfig, window: Window, n_edges: int, read_metrics: Callable[[], dict],
                         meters: _Meters | None) -> _Measured:
    """Open the window once every edge has committed (or the warm-up ran out), read the verifier's
    metrics (`read_metrics`, run in the loop's executor) and meter the CPU across it (`meters`;
    None: no CPU figures, as on the virtual clock), then tell the edges to stop."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(cfg.warmup_s)
    try:
        async with asyncio.timeout(window.max_wait_s):
            await window.all_started.wait()
    except asyncio.TimeoutError:
        log.warning("%d of %d edges committed nothing in %.0f s; measuring anyway",
                    n_edges - len(window.started), n_edges, cfg.warmup_s + window.max_wait_s)
    window.start_s = loop.time()
    window.end_s = window.start_s + cfg.duration_s
    before = await loop.run_in_executor(None, read_metrics)
    for m in meters or ():
        m.start()
    await asyncio.sleep(max(0.0, window.end_s - loop.time()))
    after = await loop.run_in_executor(None, read_metrics)
    window.stop.set()
    if meters is None:
        return _Measured(before, after, dict.fromkeys(("verifier_cpu_cores", "verifier_peak_rss_mb", "edges_cpu_cores",
                                                       "proxy_cpu_cores")))
    verifier = meters.verifier.stop()
    return _Measured(before, after, {
        "verifier_cpu_cores": verifier["cpu_cores"], "verifier_peak_rss_mb": verifier["peak_rss_mb"],
        "edges_cpu_cores": meters.edges.stop()["cpu_cores"], "proxy_cpu_cores": meters.proxy.stop()["cpu_cores"]})


def _request_figures(cfg: LoadConfig, requests: list[Request], window: Window) -> dict:
    """Throughput, latency and goodput of the requests inside the measured window (run record keys)."""
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
    return {
        "requests": len(requests), "requests_completed": sum(r.done for r in requests),
        "committed_tokens": committed, "committed_tokens_per_s": committed / cfg.duration_s,
        "tpot_p50_s": percentile(tpots, 50), "tpot_p95_s": percentile(tpots, 95), "tpot_p99_s": percentile(tpots, 99),
        "tpot_per_edge_mean_s": {str(e): statistics.fmean(v) for e, v in sorted(per_edge_tpot.items())},
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95), "ttft_p99_s": percentile(ttfts, 99),
        "goodput_tokens_per_s": good / cfg.duration_s,
        "slo_met_share": sum(judged) / len(judged) if judged else None,
        # Per request the window saw: [TPOT inside it, TTFT if it arrived inside it, tokens inside it],
        # so goodput can be judged again at other SLOs (goodput_at).
        "per_request": [[tpot_of[id(r)], r.ttft_s() if t_measure <= r.arrival_s <= t_end else None,
                         r.tokens_by(t_end) - r.tokens_by(t_measure)] for r in requests],
    }


def _target_cost(mode: str, committed: int, before: dict, after: dict, rounds: float, batch: dict,
                 metrics_url: str | None) -> dict:
    """The target's forward passes and tokens over the window, from the verifier's batch histograms
    where it has them, else derived from the mode and the Verify rounds (run record keys)."""
    if batch["hybridspec_batch_tokens"] is not None:
        passes, target_tokens, source = batch["hybridspec_batch_tokens"]["count"], batch["hybridspec_batch_tokens"]["sum"], "batch histograms"
    elif mode == "cloud-only":
        passes = target_tokens = float(committed)
        source = "derived: one pass per generated token"
    elif metrics_url:
        drafts = metric_delta(before, after, "hybridspec_draft_tokens_total")
        passes, target_tokens, source = rounds, drafts + rounds, "derived: one pass of γ+1 tokens per Verify round"
    else:
        passes = target_tokens = None
        source = "no metrics endpoint"
    return {
        "target_forward_passes": passes, "target_tokens": target_tokens, "target_cost_source": source,
        "target_forward_passes_per_committed_token": passes / committed if passes is not None and committed else None,
        "target_tokens_per_committed_token": target_tokens / committed if target_tokens is not None and committed else None,
    }


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
        n_ctx = int(option_value(cfg.verifier_args, "--n-ctx") or LOAD_N_CTX)
        args += ["--kv-tokens", str(max(8, max_edges) * n_ctx)]
    return args + ["--metrics-port", str(metrics_port)] + list(cfg.verifier_args)


LOAD_N_CTX = 512


def verifier_threads(cores: int | None = None) -> int:
    """Threads for a verifier that shares this machine with the harness: half the cores, at least
    one. llama.cpp's threads spin-wait, so a verifier on every core stalls against the edges'
    drafting, the proxies and the event loop on the same cores (docs/benchmarks.md has the figures).
    `--verifier-arg=--threads=N` overrides it; load.json records what the verifier ran with."""
    return max(1, (cores or os.cpu_count() or 1) // 2)


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
        reasons.append(f"the edges' event loop kept {edges:.2f} cores busy" if not run.get("workers")
                       else f"the busiest worker's edges kept {edges:.2f} cores busy (one event loop each)")
    left = max(1, cores - (verifier_threads or 0))
    harness = run.get("harness_cpu_cores") or edges + (proxy or 0.0)
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
    return info_record(info)


def info_record(info) -> dict:
    """A ServerInfo as load.json records it."""
    return {"backend": info.backend, "model": info.model, "batching": info.batching, "n_ctx": info.n_ctx,
            "max_sessions": info.max_sessions, "max_tree_nodes": info.max_tree_nodes, "version": info.version}


class Verifier(NamedTuple):
    """The verifier a sweep loads: one it started (`process`, `args`) or the user's (`--server`)."""
    upstream: tuple[str, int]
    metrics_url: str | None
    process: object | None      # subprocess.Popen
    args: list[str]

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def threads(self) -> int | None:
        given = option_value(self.args, "--threads") if self.process is not None else None
        return int(given) if given else None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(30)


def start_verifier(cfg: LoadConfig, progress=None, task=None) -> Verifier:
    """`cfg.server` (and its metrics endpoint), or a verifier started for the sweep's largest run."""
    from hybridspec.launch import spawn_verifier
    if cfg.server:
        host, _, port = cfg.server.rpartition(":")
        return Verifier((host, int(port)), cfg.metrics_url, None, [])
    metrics_port = free_port()
    args = verifier_args(cfg, metrics_port, max(cfg.edges))
    if progress:
        progress.update(task, description="starting the verifier" + ("" if cfg.synthetic else " (~1 min)"))
    proc, address = spawn_verifier(args)
    return Verifier(("127.0.0.1", int(address.rsplit(":", 1)[1])), f"http://127.0.0.1:{metrics_port}/metrics",
                    proc, args)


def sweep_result(cfg: LoadConfig, info: dict, runs: list[dict], verifier: Verifier) -> dict:
    """load.json's record of a sweep: its settings, the runs with their saturation flags, capacity, machine."""
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    machine = describe_machine()
    threads = verifier.threads()
    for run in runs:
        run["not_representative"] = saturation(run, machine["cores"] or 1, threads)
    return {"config": config, "server": info, "runs": runs, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "capacity": capacity_at_slo(runs, cfg.slo_tpot_ms / 1e3, cfg.slo_ttft_ms / 1e3),
            "verifier_threads": threads,
            "machine": {**machine, "load_1min_at_end": os.getloadavg()[0]}}


async def sweep(cfg: LoadConfig, run_one, progress=None, task=None, label: str = "") -> dict:
    """Each (edges, mode) of cfg, one run after another (`await run_one(verifier, n_edges, mode)`: the
    run's record) against one verifier, drained between runs; load.json's record of them."""
    verifier = start_verifier(cfg, progress, task)
    runs = []
    try:
        info = await server_info(verifier.upstream)
        for n_edges in cfg.edges:
            for mode in cfg.modes:
                if progress:
                    progress.update(task, description=f"{n_edges} edges, {mode}{label} "
                                                      f"({cfg.warmup_s + cfg.duration_s:g} s)")
                runs.append(await run_one(verifier, n_edges, mode))
                runs[-1]["drain_s"] = await drain(verifier.metrics_url)
                if progress:
                    progress.advance(task)
    finally:
        verifier.stop()
    return sweep_result(cfg, info, runs, verifier)


async def run_load(cfg: LoadConfig, progress=None) -> dict:
    for name in cfg.profiles:
        get_profile(name)
    cfg.out.mkdir(parents=True, exist_ok=True)
    # Say what happens before the first measured run: loading drafts and starting a verifier take
    # up to a minute (the verifier's first start on a model checks batch invariance).
    task = progress.add_task("loading the edges' models", total=len(cfg.edges) * len(cfg.modes)) if progress else None
    edges = Edges(cfg)
    return await sweep(cfg, lambda verifier, n_edges, mode: run_once(cfg, edges, mode, n_edges, verifier.upstream,
                                                                     verifier.metrics_url, verifier.pid),
                       progress, task)
