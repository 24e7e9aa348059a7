"""`netsim load --locust`: the load test's edges as Locust users (netsim/load/locustfile.py), on a
master and worker processes, and the merged CSV read back into `netsim load`'s report.

This module never imports Locust (importing it monkey-patches the process for gevent): it starts
`python -m locust` processes, and reads the files they write, `<prefix>_stats.csv` (Locust's merged
statistics) and `<prefix>_netsim.json` (what the locustfile's master recorded: the verifier's
Prometheus counters when the test started, when spawning completed and when it ended, and each
worker's CPU).

    master:  python -m locust -f netsim/load/locustfile.py --master --headless -u N -r R --expect-workers W
                 --server HOST:PORT --metrics-url URL --links lan,3g --edge-mode hybrid --warmup 1 --window S
                 --csv PREFIX
    workers: python -m locust -f netsim/load/locustfile.py --worker --master-host HOST   (each machine, as often)
"""
from __future__ import annotations

import asyncio
import csv
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from netsim.load.config import ALL_LINKS, LoadConfig
from netsim.load.metering import BATCH_HISTOGRAMS, free_port, histogram_delta, metric_delta, verifier_committed
from netsim.profiles import get_profile

log = logging.getLogger(__name__)

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def locust_options(cfg: LoadConfig, mode: str, server: str, metrics_url: str | None, window_s: float) -> list[str]:
    """The locustfile's own options for one run of `cfg` in `mode` (the master forwards them to workers)."""
    options = ["--server", server, "--links", ",".join(cfg.profiles), "--edge-mode", mode,
               "--gamma", str(cfg.gamma), "--max-tokens", str(cfg.max_tokens), "--arrival-rate", str(cfg.arrival_rate),
               "--draft-ms", str(cfg.draft_ms), "--edge-seed", str(cfg.seed), "--slo-tpot-ms", str(cfg.slo_tpot_ms),
               "--slo-ttft-ms", str(cfg.slo_ttft_ms), "--warmup", str(cfg.warmup_s), "--window", str(window_s),
               "--drafter", cfg.drafter]
    if metrics_url:
        options += ["--metrics-url", metrics_url]
    if cfg.synthetic:
        options.append("--synthetic")
    if cfg.target:
        options += ["--target", str(cfg.target)]
    if cfg.draft:
        options += ["--draft", str(cfg.draft)]
    return options


def master_argv(cfg: LoadConfig, mode: str, users: int, workers: int, server: str, metrics_url: str | None,
                prefix: Path, port: int) -> list[str]:
    """A headless master that waits for `workers`, starts `users` at once, opens the measured window
    cfg.warmup_s after, once every edge has committed (as `netsim load` does), and ends the run
    cfg.duration_s later."""
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--master", "--headless",
            "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port), "--expect-workers", str(workers),
            "--expect-workers-max-wait", "120", "-u", str(users), "-r", str(users),
            "--csv", str(prefix), "--only-summary", "--loglevel", "WARNING",
            *locust_options(cfg, mode, server, metrics_url, cfg.duration_s)]


def worker_argv(port: int, master_host: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", master_host,
            "--master-port", str(port), "--loglevel", "WARNING"]


class LocustRun:
    """A master and `workers` local worker processes for one run; each in a process group of its own
    (a worker's edge host and links are in its group: `kill_worker` takes a whole worker down)."""

    def __init__(self, cfg: LoadConfig, mode: str, users: int, workers: int, server: str,
                 metrics_url: str | None, prefix: Path, extra_master_args: list[str] = ()) -> None:
        port = free_port()
        prefix.parent.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.logs = [open(f"{prefix}_{name}.log", "w") for name in ["master"] + [f"worker{i}" for i in range(workers)]]
        argv = master_argv(cfg, mode, users, workers, server, metrics_url, prefix, port) + list(extra_master_args)
        self.master = subprocess.Popen(argv,
                                       stdout=self.logs[0], stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.workers = [subprocess.Popen(worker_argv(port), stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True) for log_file in self.logs[1:]]

    def __enter__(self) -> LocustRun:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Take down whatever is still running (each process group: a worker with its edge host and links)."""
        import signal
        for process in [self.master, *self.workers]:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        for log_file in self.logs:
            log_file.close()

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker i with its edge host and links, as a machine that goes away."""
        import signal
        os.killpg(self.workers[i].pid, signal.SIGKILL)

    def wait(self, timeout_s: float) -> int:
        """Wait for the master to end the run; then for the workers (the master tells them to quit)."""
        try:
            code = self.master.wait(timeout_s)
            for process in self.workers:
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    log.warning("a Locust worker did not quit with its master: killed")
        finally:
            self.close()
        return code

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {Path(f.name).name}\n{Path(f.name).read_text()[-chars:]}" for f in self.logs)


# --- the merged CSV into netsim load's run record ------------------------------------------

def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def read_stats_csv(path: Path) -> dict[tuple[str, str], dict]:
    """Locust's `<prefix>_stats.csv`: {(type, name): row}, the numbers as floats (N/A: None)."""
    with open(path, newline="") as f:
        return {(row["Type"], row["Name"]): {k: _number(v) for k, v in row.items() if k not in ("Type", "Name")}
                for row in csv.DictReader(f)}


def _overall(rows: dict, kind: str) -> dict | None:
    """A request type's row over every edge: the run's one profile, or the mixed run's 'all links'."""
    named = {name: row for (k, name), row in rows.items() if k == kind}
    if ALL_LINKS in named:
        return named[ALL_LINKS]
    return next(iter(named.values())) if len(named) == 1 else None


def _ms(row: dict | None, column: str) -> float | None:
    value = row.get(column) if row else None
    return value / 1e3 if value is not None and row.get("Request Count") else None


def _total_length(row: dict) -> float:
    return (row.get("Request Count") or 0) * (row.get("Average Content Size") or 0)


def _cores(samples: list[dict], key: str, t_from: float, t_to: float) -> float | None:
    """Cores a process kept busy over [t_from, t_to] (master clock), from a worker's reported CPU samples."""
    inside = [s for s in samples if t_from <= s.get("received", s["t"]) <= t_to and s.get(key) is not None]
    if len(inside) < 2 or inside[-1]["t"] <= inside[0]["t"]:
        return None
    return (inside[-1][key] - inside[0][key]) / (inside[-1]["t"] - inside[0]["t"])


def harness_cpu(sidecar: dict, t_from: float, t_to: float) -> dict:
    """Per worker: cores busy in its Locust process, its edge host, its links; the busiest edge
    loop and their sum over every worker (the run's harness)."""
    per_worker, report_s, rounds = {}, 0.0, 0
    for worker, samples in sidecar.get("cpu", {}).items():
        per_worker[worker] = {k: _cores(samples, k, t_from, t_to) for k in ("worker", "edges", "links")}
        inside = [s for s in samples if t_from <= s.get("received", s["t"]) <= t_to and s.get("rounds") is not None]
        if len(inside) >= 2:
            report_s += inside[-1]["report_s"] - inside[0]["report_s"]
            rounds += inside[-1]["rounds"] - inside[0]["rounds"]
    edges = [w["edges"] for w in per_worker.values() if w["edges"] is not None]
    total = [v for w in per_worker.values() for v in w.values() if v is not None]
    return {"edges_cpu_cores": max(edges) if edges else None,
            "proxy_cpu_cores": sum(w["links"] or 0.0 for w in per_worker.values()) if per_worker else None,
            "locust_cpu_cores": sum(w["worker"] or 0.0 for w in per_worker.values()) if per_worker else None,
            "harness_cpu_cores": sum(total) if total else None, "per_worker_cpu": per_worker,
            # the edges' loops' time spent reporting to Locust, per round reported (microseconds)
            "report_us_per_round": 1e6 * report_s / rounds if rounds else None}


def read_locust(prefix: Path | str, mode: str | None = None) -> dict:
    """One run's record, as `netsim load` writes it, from a Locust run's `<prefix>_stats.csv` and (when
    there) the locustfile's `<prefix>_netsim.json`: tokens/s, TPOT and TTFT percentiles, goodput, errors
    by gRPC status, and with the verifier's counters its rounds, committed tokens and target cost."""
    prefix = Path(prefix)
    rows = read_stats_csv(Path(f"{prefix}_stats.csv"))
    sidecar_path = Path(f"{prefix}_netsim.json")
    sidecar = json.loads(sidecar_path.read_text()) if sidecar_path.exists() else {}
    config, marks = sidecar.get("config", {}), sidecar.get("marks", {})
    # The statistics cover the run from the window's opening (--warmup) or from its start.
    start = marks.get("window_start" if config.get("warmup") else "start")
    end = marks.get("end")
    rounds = [row for (kind, _), row in rows.items() if kind == "round"]
    committed = round(sum(_total_length(row) for row in rounds))
    request, ttft, good = (_overall(rows, kind) for kind in ("request", "ttft", "goodput"))
    if start and end:
        duration = end["t"] - start["t"]
    else:   # no sidecar: Locust's own rate (requests over the entry's first to last request)
        rate = sum((row.get("Requests/s") or 0) * (row.get("Average Content Size") or 0) for row in rounds)
        duration = committed / rate if rate else None
    before, after = (start or {}).get("metrics", {}), (end or {}).get("metrics", {})
    verify_rounds = metric_delta(before, after, "hybridspec_verify_rounds_total") if after else None
    errors = {}
    failures = Path(f"{prefix}_failures.csv")
    if failures.exists():
        with open(failures, newline="") as f:
            for row in csv.DictReader(f):   # the locustfile names a failure GrpcStatus('<status name>')
                if row["Name"] == ALL_LINKS:   # a mixed run's copy of a failure counted under its link
                    continue
                status = re.search(r"GrpcStatus\('(\w+)'\)", row["Error"])
                code = status.group(1) if status else row["Error"]
                errors[code] = errors.get(code, 0) + int(row["Occurrences"])
    mode = mode or config.get("edge_mode")
    profiles = sorted({name for (_, name) in rows if name not in (ALL_LINKS, "Aggregated")})
    completed = request.get("Request Count") if request else 0
    record = {
        "edges": sidecar.get("users"), "mode": mode, "profiles": profiles, "harness": "locust",
        "workers": sidecar.get("workers"), "duration_s": duration, "warmup_s": None,
        "requests": int(completed or 0), "requests_completed": int((completed or 0) - (request or {}).get("Failure Count", 0)),
        "committed_tokens": committed, "committed_tokens_per_s": committed / duration if duration else None,
        "edge_rounds": int(sum(row.get("Request Count") or 0 for row in rounds)) if mode != "cloud-only" else None,
        "tpot_p50_s": _ms(request, "50%"), "tpot_p95_s": _ms(request, "95%"), "tpot_p99_s": _ms(request, "99%"),
        "ttft_p50_s": _ms(ttft, "50%"), "ttft_p95_s": _ms(ttft, "95%"), "ttft_p99_s": _ms(ttft, "99%"),
        "round_trip_mean_s": (sum((r.get("Request Count") or 0) * (r.get("Average Response Time") or 0) for r in rounds)
                              / 1e3 / sum(r.get("Request Count") or 0 for r in rounds))
        if any(r.get("Request Count") for r in rounds) else None,
        "round_trip_p50_s": _ms(rounds[0], "50%") if len(rounds) == 1 else None,
        "round_trip_p50_by_link_s": {name: row["50%"] / 1e3 for (kind, name), row in rows.items()
                                     if kind == "round" and row.get("Request Count") and row.get("50%") is not None},
        # the window's tokens in the share that requests meeting the SLO committed (a request that
        # straddles the window's opening counts whole in Locust's rows, so its tokens are scaled, not summed)
        "goodput_tokens_per_s": committed / duration * _total_length(good) / _total_length(request)
        if good and request and _total_length(request) and duration else (0.0 if duration else None),
        "slo_met_share": ((good or {}).get("Request Count") or 0) / completed if completed else None,
        "errors": errors, "session_replays": None,
        "verify_rounds": verify_rounds,
        "verifier_committed_tokens": verifier_committed(before, after) if after else None,
        "sessions_opened": metric_delta(before, after, "hybridspec_sessions_opened_total") if after else None,
        "verifier_errors": {key.split('code="')[1].rstrip('"}'): metric_delta(before, after, key)
                            for key in after if key.startswith("hybridspec_request_errors_total{")},
        "gamma": config.get("gamma") if mode == "hybrid" else None,
        "draft_ms": config.get("draft_ms") if config.get("synthetic") else None,
        "proxy_mean_lateness_ms": None, "proxy_max_lateness_ms": None, "kv": None,
    }
    record.update(_verifier_side(mode, committed, before, after, verify_rounds, duration))
    if start and end:
        record.update(harness_cpu(sidecar, start["t"], end["t"] + 3.5))   # + the report after the end
    else:
        record.update({"edges_cpu_cores": None, "proxy_cpu_cores": None, "harness_cpu_cores": None})
    return record


def _verifier_side(mode, committed, before, after, verify_rounds, duration) -> dict:
    """Target cost per token and the verifier's CPU and memory, from its Prometheus counters
    (prometheus_client's process collector: the verifier's own CPU seconds and RSS)."""
    from netsim.load.runs import _target_cost
    batch = {name: histogram_delta(before, after, name) for name in BATCH_HISTOGRAMS} if after else \
        {name: None for name in BATCH_HISTOGRAMS}
    cost = _target_cost(mode, committed, before, after, verify_rounds or 0.0, batch, "scraped" if after else None)
    cpu = metric_delta(before, after, "process_cpu_seconds_total") if "process_cpu_seconds_total" in after else None
    rss = after.get("process_resident_memory_bytes")
    return {**cost, "batch_histograms": {k: v for k, v in batch.items() if v is not None},
            "verifier_cpu_cores": cpu / duration if cpu is not None and duration else None,
            "verifier_peak_rss_mb": rss / 2**20 if rss else None,   # the RSS at the end: the endpoint has no peak
            "model_seconds": metric_delta(before, after, "hybridspec_model_seconds_sum") if after else None,
            "round_seconds": metric_delta(before, after, "hybridspec_round_seconds_sum") if after else None}


# --- the sweep ------------------------------------------------------------------------------

async def run_locust_load(cfg: LoadConfig, workers: int, progress=None) -> dict:
    """`netsim load --locust --workers W`: each (edges, mode) of cfg as a Locust run with a master and W
    local workers against one verifier (started here, or cfg.server), read back into load.json's record."""
    from netsim.load.runs import sweep
    for name in cfg.profiles:
        get_profile(name)
    cfg.out.mkdir(parents=True, exist_ok=True)
    task = progress.add_task("starting", total=len(cfg.edges) * len(cfg.modes)) if progress else None

    async def one(verifier, n_edges: int, mode: str) -> dict:
        prefix = cfg.out / "locust" / f"{n_edges}-{mode}"
        server = f"{verifier.upstream[0]}:{verifier.upstream[1]}"
        with LocustRun(cfg, mode, n_edges, workers, server, verifier.metrics_url, prefix) as run:
            code = await asyncio.get_running_loop().run_in_executor(None, run.wait,
                                                                    cfg.warmup_s + cfg.duration_s + 300)
        if code not in (0, 1) or not Path(f"{prefix}_stats.csv").exists():
            raise RuntimeError(f"the Locust master exited with {code}:\n{run.log_tail()}")
        record = read_locust(prefix, mode)
        record["locust_exit_code"] = code   # 1: Locust counted failures (they are in "errors")
        return record

    result = await sweep(cfg, one, progress, task, label=f", {workers} Locust workers")
    result["harness"] = {"kind": "locust", "workers": workers}
    return result


SLO_FLAGS = {"slo_tpot_ms": "--slo-tpot-ms", "slo_ttft_ms": "--slo-ttft-ms"}


def read_locust_runs(prefixes: list[str], cfg: LoadConfig, asked: dict[str, float | None] | None = None) -> dict:
    """`netsim load --locust-csv PREFIX ...`: load.json's record from Locust runs made elsewhere. The
    runs' own settings replace cfg's; an SLO the user `asked` for (by LoadConfig field) other than the
    one the runs judged their requests by is refused (goodput is counted while a run goes)."""
    from netsim.load.runs import Verifier, sweep_result
    runs = [read_locust(p) for p in prefixes]
    first = json.loads(Path(f"{prefixes[0]}_netsim.json").read_text()) if Path(f"{prefixes[0]}_netsim.json").exists() \
        else {}
    given = first.get("config", {})
    for key, value in (asked or {}).items():
        judged = given.get(key)
        if value is not None and judged not in (None, "") and float(judged) != value:
            flag = SLO_FLAGS[key]
            raise ValueError(f"{flag} {value:g} differs from the {float(judged):g} ms its runs judged their requests "
                             f"by (the master's {flag}): goodput is counted while the run goes; run the master again "
                             f"with {flag} {value:g}")
    cfg.profiles = [p for p in (given.get("links") or ",".join(cfg.profiles)).split(",") if p]
    cfg.modes = sorted({r["mode"] for r in runs if r["mode"]}) or cfg.modes
    cfg.edges = sorted({r["edges"] for r in runs if r["edges"]}) or cfg.edges
    for key, field in (("synthetic", "synthetic"), ("draft_ms", "draft_ms"), ("gamma", "gamma"),
                       ("max_tokens", "max_tokens"), ("arrival_rate", "arrival_rate"), ("server", "server"),
                       ("warmup", "warmup_s"), ("slo_tpot_ms", "slo_tpot_ms"), ("slo_ttft_ms", "slo_ttft_ms")):
        if given.get(key) not in (None, ""):
            setattr(cfg, field, given[key])
    cfg.duration_s = round(runs[0]["duration_s"], 1) if runs[0]["duration_s"] else cfg.duration_s
    cfg.synthetic_step_ms = None   # the verifier was not started here: its pass cost is its own
    result = sweep_result(cfg, None, runs, Verifier(("", 0), None, None, []))
    result["harness"] = {"kind": "locust", "workers": max((r["workers"] or 1) for r in runs),
                         "from": [str(p) for p in prefixes]}
    if first.get("machine"):
        result["machine"] = {**first["machine"], "load_1min_at_end": first.get("load_1min_at_end")}
    return result
