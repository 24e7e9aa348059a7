"""`netsim load`'s edges as Locust users: `locust -f netsim/load/locustfile.py --server HOST:PORT ...`.

Each user is one emulated edge, the `Edge` that `netsim load` runs (netsim.load.edges: the
synthetic drafter with its emulated cost, prompt lookup, or a GGUF draft model), with its own
netsim link (`--links lan,3g`: user i of the run gets the i-th profile, cycling), making one
request per Locust task against the verifier at `--server`. A worker's edges run in its edge host,
a process with one asyncio event loop (netsim.load.edgehost says why not in Locust's greenlets),
and come back here as Locust request events, one request type each:

    round    a committed round: response time = its time on the wire (round trip + the verifier's
             queue and pass; the emulated drafting is not in it), length = tokens it committed
             (cloud-only: each streamed step)
    ttft     a request's first commit: time to first token from its arrival
    request  a request that ended: response time = its time per output token (none with fewer than
             two commits, or when it failed: those count, outside the percentiles), length = the
             tokens it committed; a failure is named by its gRPC status
    goodput  a request that met the SLO (--slo-tpot-ms, --slo-ttft-ms): the same, for them only

Each type's name is the user's link profile (a run of several profiles reports ttft, request and
goodput also under "all links", so the CSV carries the run's own percentiles). Response times are
kept at three significant digits (Locust's default keeps two), so percentiles below a second are
whole milliseconds.

The master (or a local run) scrapes the verifier's Prometheus endpoint (`--metrics-url`) when the
test starts, when the window opens (`--warmup` after spawning, once every edge has committed a
token: events before it are not reported) and when it ends, takes each worker's CPU (its Locust
process, its edge host, its links) from their reports, and writes them to `<--csv>_netsim.json`,
which `netsim load --locust-csv PREFIX` reads with the CSV into `netsim load`'s report.
`--window S` ends the run S seconds after that: the window closes at one instant on both sides
(the master announces it half a second ahead, scrapes the verifier then, and the workers count the
events their edge hosts stamped before it; machines' clocks must agree, as NTP keeps them; with
--stop-timeout, instead, the users finish their requests, every round is reported, and the
verifier is scraped after), then each worker stops its users, reports their last events and
quits, and the master quits (with `--run-time`, Locust's master quits half a
second after telling the workers to, and a worker's last report can miss that).
"""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time

import gevent
import gevent.lock
from gevent.event import AsyncResult
from locust import User, constant, events, stats as locust_stats, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner

from netsim.load.config import ALL_LINKS, MODES, LoadConfig

log = logging.getLogger("netsim.locust")



def _three_digits(response_time: float) -> int:
    """Locust's histogram key for a response time (ms), at three significant digits."""
    if response_time < 1000:
        return round(response_time)
    digits = len(str(int(response_time))) - 3
    return int(round(response_time, -digits))


locust_stats.bucket_response_time = _three_digits   # Locust's documented hook for its histogram's resolution


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    group = parser.add_argument_group("netsim edges", "the emulated edges and the verifier they load")
    group.add_argument("--server", default="", help="HOST:PORT of the verifier (or a fleet's address)")
    group.add_argument("--metrics-url", default="", help="its Prometheus endpoint, scraped by the master")
    group.add_argument("--links", default="lan", help="link profile, or a comma-separated mix (user i gets the "
                                                      "i-th, cycling)")
    group.add_argument("--edge-mode", default="hybrid", choices=list(MODES), help="what every edge runs")
    group.add_argument("--synthetic", action="store_true", default=False, help="the synthetic drafter (the "
                       "verifier must be synthetic too)")
    group.add_argument("--drafter", default="gguf", choices=["gguf", "lookup"],
                       help="real target: a draft model per edge (gguf) or prompt lookup (lookup)")
    group.add_argument("--target", default="", help="the verifier's target GGUF (its tokenizer and chat template)")
    group.add_argument("--draft", default="", help="draft GGUF (--drafter gguf)")
    group.add_argument("--gamma", type=int, default=4, help="fixed γ of the hybrid mode")
    group.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    group.add_argument("--arrival-rate", type=float, default=0.0,
                       help="requests/s per edge, Poisson, queued on the device while it is busy (0: back to back)")
    group.add_argument("--draft-ms", type=float, default=2.0, help="emulated drafting cost per token (ms)")
    group.add_argument("--edge-seed", type=int, default=1, help="seed of the sampling, the arrivals and the links")
    group.add_argument("--slo-tpot-ms", type=float, default=150.0, help="SLO on time per output token (goodput)")
    group.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="SLO on time to first token (goodput)")
    group.add_argument("--warmup", type=float, default=0.0,
                       help="open the measured window this many seconds after spawning completes, once every edge "
                            "has committed a token (0: everything counts from the start); before it, nothing is "
                            "reported")
    group.add_argument("--window", type=float, default=0.0,
                       help="end the run this many seconds after the warm-up and every edge's first token, once "
                            "every worker has reported its last events (0: --run-time or by hand)")
    group.add_argument("--netsim-json", default="", help="where the master writes the scrapes and the harness's "
                                                         "CPU (default: <--csv>_netsim.json)")


def _profiles(options) -> list[str]:
    return [p.strip() for p in options.links.split(",") if p.strip()]


def load_config(options) -> LoadConfig:
    """The LoadConfig an edge host runs with, from this run's options."""
    return LoadConfig(edges=[0], profiles=_profiles(options), modes=[options.edge_mode], duration_s=0.0, out="",
                      synthetic=options.synthetic, server=options.server, gamma=options.gamma,
                      max_tokens=options.max_tokens, arrival_rate=options.arrival_rate, seed=options.edge_seed,
                      draft_ms=options.draft_ms, target=options.target or None, draft=options.draft or None,
                      drafter=options.drafter, slo_tpot_ms=options.slo_tpot_ms, slo_ttft_ms=options.slo_ttft_ms)


class GrpcStatus(Exception):
    """A request that failed, named by its gRPC status (Locust groups its failures by this text)."""


class _Pending:
    """A user's edge as the worker sees it, and what its user waits for (one thing at a time)."""
    __slots__ = ("result", "profile", "closing", "started")

    def __init__(self, profile: str) -> None:
        self.result, self.profile, self.closing, self.started = AsyncResult(), profile, False, False


class EdgeHostClient:
    """This worker's edge host process (netsim.load.edgehost) and the greenlet that turns its events
    into Locust request events."""

    def __init__(self, environment) -> None:
        options = environment.parsed_options
        if not options.server:
            raise StopUser("--server HOST:PORT is required (the verifier the edges load)")
        self.environment = environment
        self.profiles = _profiles(options)
        host, _, port = options.server.rpartition(":")
        first = dict(vars(load_config(options)), mode=options.edge_mode, upstream=[host, int(port)])
        self.process = subprocess.Popen([sys.executable, "-m", "netsim.load.edgehost"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE)
        self._send(first)
        self.edges: dict[int, _Pending] = {}
        self.next_index = 0
        self.warned: set[str] = set()
        self.started = 0                          # edges that have committed a token
        self.meter = (0.0, 0)                     # the edge host's seconds spent reporting, rounds reported
        # Events count inside the master's window, by when the edge host saw them (wall time): no
        # lag of this process's or a message's moves the window's edges.
        self.window = (-math.inf if not options.warmup > 0 else math.inf, math.inf)
        self.reader = gevent.spawn(self._read)

    def _send(self, command) -> None:
        self.process.stdin.write(json.dumps(command).encode() + b"\n")
        self.process.stdin.flush()

    # --- what users call -----------------------------------------------------------------------

    def open(self) -> int:
        """Start an edge (its link, drafter and channel: the edge host answers when it is ready, see
        `wait_open`); its index on this worker."""
        runner = self.environment.runner
        options = self.environment.parsed_options
        index, self.next_index = self.next_index, self.next_index + 1
        # Users are dealt to the workers in turn, so this worker's k-th edge is edge k * workers +
        # worker of the run: the profile netsim load would give edge i, profiles[i % len].
        worker = int(getattr(runner, "worker_index", 0) or 0)
        workers = max(1, int(getattr(options, "expect_workers", 1) or 1)) if isinstance(runner, WorkerRunner) else 1
        pending = self.edges[index] = _Pending(self.profiles[(index * workers + worker) % len(self.profiles)])
        # Its seeds (prompts, sampling, link) are its own across workers, whatever --expect-workers says.
        self._send(["open", index, worker * 1_000_003 + index, pending.profile])
        return index

    def wait_open(self, index: int) -> None:
        error = self.edges[index].result.get()
        if error:
            self.edges.pop(index, None)
            raise StopUser(f"edge {index} could not start: {error}")

    def request(self, index: int, number: int, arrival: float) -> str | None:
        """Run the edge's request `number`; its gRPC status name when it failed, else None."""
        pending = self.edges[index]
        pending.result = AsyncResult()
        self._send(["request", index, number, arrival])
        return pending.result.get()

    def close(self, index: int) -> None:
        """Cut the edge's request off and close it; returns once every event of it was fired."""
        pending = self.edges.get(index)
        if pending is None:
            return
        pending.result, pending.closing = AsyncResult(), True
        self._send(["close", index])
        pending.result.get()
        self.edges.pop(index, None)

    def stop(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(30)
        except Exception:   # already gone
            self.process.kill()
        self.reader.join(5)

    # --- events ------------------------------------------------------------------------------

    def _fire(self, kind: str, profile: str, ms, length: int, when: float, exception=None) -> None:
        if not self.window[0] <= when < self.window[1]:
            return
        fire = self.environment.events.request.fire
        fire(request_type=kind, name=profile, response_time=ms, response_length=length, exception=exception,
             context={})
        if kind != "round" and len(self.profiles) > 1:   # the run's figure over every link, for the CSV
            fire(request_type=kind, name=ALL_LINKS, response_time=ms, response_length=length, exception=exception,
                 context={})

    def _read(self) -> None:
        for line in self.process.stdout:
            event = json.loads(line)
            kind, index = event[0], event[1]
            if kind == "meter":
                self.meter = (event[2], event[3])
                continue
            pending = self.edges.get(index)
            if pending is None:
                continue
            if kind == "round":
                self._fire("round", pending.profile, event[2], event[3], event[4])
            elif kind == "ttft":
                if not pending.started:
                    pending.started = True
                    self.started += 1
                self._fire("ttft", pending.profile, event[2], event[3], event[4])
            elif kind == "done":
                _, _, tpot_ms, tokens, met, code, message, cut, when = event
                if code is not None:
                    if code not in self.warned:
                        self.warned.add(code)
                        log.warning("a request failed with %s: %s", code, message)
                    self._fire("request", pending.profile, None, tokens, when, GrpcStatus(code))
                else:
                    self._fire("request", pending.profile, tpot_ms, tokens, when)
                    if met:
                        self._fire("goodput", pending.profile, tpot_ms, tokens, when)
                if not pending.closing:
                    pending.result.set(code)
            elif kind == "opened" and not pending.closing:
                pending.result.set(event[2])
            elif kind == "closed":
                pending.result.set(None)
        for pending in list(self.edges.values()):   # the edge host is gone: nobody waits forever
            pending.result.set("the edge host exited")


_hosts: dict[int, EdgeHostClient] = {}
_hosts_lock = gevent.lock.Semaphore()


def edge_host(environment) -> EdgeHostClient:
    """This process's edge host (started with the test, before its users)."""
    with _hosts_lock:
        if id(environment) not in _hosts:
            _hosts[id(environment)] = EdgeHostClient(environment)
        return _hosts[id(environment)]


@events.test_start.add_listener
def _start_edge_host(environment, **_kw) -> None:
    if not isinstance(environment.runner, MasterRunner):
        host = edge_host(environment)
        # Another test on the same workers (the web UI's Start again): its own warm-up and edges.
        host.window = (-math.inf if not environment.parsed_options.warmup > 0 else math.inf, math.inf)
        host.started = 0


@events.init.add_listener
def _window_messages(environment, **_kw) -> None:
    if isinstance(environment.runner, WorkerRunner):
        def _open(environment, msg, **_kw) -> None:
            host = edge_host(environment)
            host.window = (msg.data["t"], host.window[1])

        def _close(environment, msg, **_kw) -> None:
            host = edge_host(environment)
            host.window = (host.window[0], msg.data["t"])
        environment.runner.register_message("netsim_open", _open)
        environment.runner.register_message("netsim_close", _close)


class EdgeUser(User):
    """One emulated edge: its requests one at a time (a Locust task each), back to back or as a
    Poisson process of --arrival-rate per edge."""

    wait_time = constant(0)

    def on_start(self) -> None:
        import numpy as np

        from netsim.load.edges import Arrivals
        self.host = edge_host(self.environment)
        self.index = self.host.open()
        self.host.wait_open(self.index)
        options = self.environment.parsed_options
        rng = np.random.default_rng([options.edge_seed, os.getpid(), self.index])
        self.arrivals = Arrivals(options.arrival_rate, rng, time.monotonic())
        self.number = 0

    @task
    def one_request(self) -> None:
        arrival = self.arrivals.next(time.monotonic())
        gevent.sleep(max(0.0, arrival - time.monotonic()))
        number, self.number = self.number, self.number + 1
        if self.host.request(self.index, number, arrival) is not None:
            gevent.sleep(0.1)   # as netsim load's edges do after a failed request

    def on_stop(self) -> None:
        if getattr(self, "index", None) is not None:
            self.host.close(self.index)


# --- the worker's CPU, for the master ----------------------------------------------------------

def _cpu_seconds(pid: int | None) -> float | None:
    import psutil
    try:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except (psutil.Error, TypeError):
        return None


def cpu_sample() -> dict:
    """This process's CPU seconds, its edge host's and its links' (the edge host's children), now."""
    import psutil
    host = next(iter(_hosts.values()), None)
    edges = links = None
    if host is not None:
        edges = _cpu_seconds(host.process.pid)
        try:
            links = sum(_cpu_seconds(c.pid) or 0.0 for c in psutil.Process(host.process.pid).children())
        except psutil.Error:
            pass
    return {"t": time.monotonic(), "worker": _cpu_seconds(os.getpid()), "edges": edges, "links": links,
            "report_s": host.meter[0] if host is not None else None,
            "rounds": host.meter[1] if host is not None else None}


@events.report_to_master.add_listener
def _report_cpu(client_id, data) -> None:
    data["netsim_cpu"] = cpu_sample()
    host = next(iter(_hosts.values()), None)
    data["netsim_started"] = host.started if host is not None else 0


@events.quitting.add_listener
def _stop_edge_hosts(environment, **_kw) -> None:
    host = _hosts.pop(id(environment), None)
    if host is not None:
        host.stop()


# --- the master: scrapes, the window, the sidecar ---------------------------------------------

class _Run:
    """What the master records around the test, for netsim's report."""

    def __init__(self, environment) -> None:
        self.environment = environment
        self.marks: dict[str, dict] = {}          # start / all_started / window_start / end: when, the verifier's metrics
        self.cpu: dict[str, list[dict]] = {}      # per worker: its reports' CPU samples (cpu_sample)
        self.peak_users = 0
        self.started: dict[str, int] = {}         # per worker: its edges that have committed a token
        self.users: dict[str, int] = {}           # per worker: its users, as it last reported
        self.ending, self.t_end = False, 0.0

    def mark(self, name: str, t: float | None = None) -> None:
        from netsim.load.metering import scrape
        options, runner = self.environment.parsed_options, self.environment.runner
        # A local run is its own worker; a master's own process counts in the harness too.
        self.cpu.setdefault("master" if isinstance(runner, MasterRunner) else "local", []).append(cpu_sample())
        self.marks[name] = {"t": time.monotonic() if t is None else t, "wall": time.time(),
                            "metrics": scrape(options.metrics_url or None)}

    def write(self) -> None:
        from hybridspec.machine import describe
        options = self.environment.parsed_options
        path = options.netsim_json or (f"{options.csv_prefix}_netsim.json" if options.csv_prefix else "")
        if not path:
            return
        keys = ("server", "metrics_url", "links", "edge_mode", "synthetic", "drafter", "target", "draft", "gamma",
                "max_tokens", "arrival_rate", "draft_ms", "edge_seed", "slo_tpot_ms", "slo_ttft_ms", "warmup",
                "window")
        record = {"config": {k: getattr(options, k) for k in keys}, "users": self.peak_users,
                  "workers": len([w for w in self.cpu if w not in ("local", "master")]) or 1, "marks": self.marks,
                  "cpu": self.cpu, "machine": describe(), "load_1min_at_end": os.getloadavg()[0]}
        with open(f"{path}.tmp", "w") as f:   # whole or not at all, for whoever reads it during the run
            json.dump(record, f, indent=1)
        os.replace(f"{path}.tmp", path)


_run: _Run | None = None


@events.init.add_listener
def _on_init(environment, **_kw) -> None:
    global _run
    if isinstance(environment.runner, WorkerRunner):
        return
    _run = run = _Run(environment)

    @environment.events.worker_report.add_listener
    def _cpu(client_id, data) -> None:
        if "netsim_cpu" in data:   # "t" on the worker's clock, "received" on this one's
            run.cpu.setdefault(client_id, []).append(dict(data["netsim_cpu"], received=time.monotonic()))
        if "netsim_started" in data:
            run.started[client_id] = data["netsim_started"]
        if "user_classes_count" in data:
            run.users[client_id] = sum(data["user_classes_count"].values())

    @environment.events.test_start.add_listener
    def _start(environment, **_kw) -> None:
        run.mark("start")

    @environment.events.spawning_complete.add_listener
    def _spawned(user_count) -> None:
        run.peak_users = max(run.peak_users, user_count)
        gevent.spawn(_open_window, environment, run, user_count)

    @environment.events.test_stop.add_listener
    def _stopped(environment, **_kw) -> None:
        # --window: the master stops once the last worker quit, after its last report
        if "end" not in run.marks:
            run.mark("end", t=run.t_end if run.ending else None)

    @environment.events.quitting.add_listener
    def _quitting(environment, **_kw) -> None:
        if "end" not in run.marks:
            run.mark("end", t=run.t_end if run.ending else None)
        run.write()


def _started(environment, run: _Run, target: int) -> tuple[int, int]:
    """(edges that have committed a token, edges expected to): the spawned users less those of
    workers gone missing (known from their reports)."""
    runner = environment.runner
    if isinstance(runner, MasterRunner):
        alive = {c.id for c in runner.clients.values() if c.state != "missing"}
        gone = sum(n for worker, n in run.users.items() if worker not in alive)
        return sum(run.started.get(w, 0) for w in alive), target - gone
    local = next(iter(_hosts.values()), None)
    return (local.started if local is not None else 0), target


def _open_window(environment, run: _Run, target: int) -> None:
    """After --warmup, once every edge has committed (at most two minutes more): with a warm-up,
    open the window (`_at`); end the run --window seconds later."""
    options = environment.parsed_options
    gevent.sleep(options.warmup)
    deadline = time.monotonic() + 120.0
    next_word = time.monotonic() + WAIT_WORD_S
    while time.monotonic() < deadline:
        started, expected = _started(environment, run, target)
        if started >= expected:
            break
        if time.monotonic() >= next_word:
            next_word += WAIT_WORD_S
            log.warning(_waiting(started, expected, options.metrics_url, run.marks.get("start", {}).get("metrics", {})))
        gevent.sleep(0.2)
    else:
        log.warning("some edges committed nothing %.0f s after spawning; measuring anyway", options.warmup + 120)
    run.mark("all_started")
    run.write()   # written again at the end; meanwhile it says the run is under way
    if options.warmup > 0:
        _at(environment, "netsim_open", run, "window_start")
    if options.window > 0:   # the close is announced WINDOW_LEAD_S ahead too
        gevent.spawn_later(max(0.0, options.window - WINDOW_LEAD_S), _end_window, environment, run)


WAIT_WORD_S = 10.0   # how often the master says why the window has not opened yet


def _waiting(started: int, expected: int, metrics_url: str, before: dict) -> str:
    """Why the window has not opened: the edges that have a first token, and what the verifier says
    (its sessions, and the opens it refused as full: one that holds fewer sessions than there are
    edges keeps the rest waiting, each asking again after the hint it was given)."""
    from netsim.load.metering import metric_delta, scrape
    words = f"window not open yet: {started} of {expected} edges have committed a token"
    now = scrape(metrics_url or None)
    if now:
        refused = metric_delta(before, now, 'hybridspec_request_errors_total{code="RESOURCE_EXHAUSTED"}')
        words += f"; the verifier holds {now.get('hybridspec_sessions', 0):.0f} sessions"
        if refused:
            words += (f" and refused {refused:.0f} requests as full (RESOURCE_EXHAUSTED): a verifier holds at most "
                      "--max-sessions sessions (default 8); start it with at least as many as the users")
    return words


WINDOW_LEAD_S = 0.5   # a window's edge is announced this long before it, for the message to reach every worker


def _at(environment, message: str, run: _Run, mark: str) -> None:
    """Open or close the window at a wall time a little ahead: tell the workers (they count the events
    their edge hosts stamped on the right side of it), then scrape the verifier at that time."""
    at = time.time() + WINDOW_LEAD_S
    if isinstance(environment.runner, MasterRunner):
        environment.runner.send_message(message, {"t": at})
    else:
        host = edge_host(environment)
        host.window = (at, host.window[1]) if message == "netsim_open" else (host.window[0], at)
    gevent.sleep(max(0.0, at - time.time()))
    run.mark(mark)


def _end_window(environment, run: _Run) -> None:
    """End the run. Without --stop-timeout the window closes at one instant on both sides (`_at`):
    a round in flight at either end of the window counts on one side at one end and on the other
    side at the other. With it, the users finish their requests and every round is counted on both
    sides: the verifier is scraped once the last worker reported. Then each worker stops its users,
    sends its last report and quits, and so does this."""
    runner = environment.runner
    run.ending, run.t_end = True, time.monotonic()
    if not environment.stop_timeout:
        _at(environment, "netsim_close", run, "end")
    if isinstance(runner, MasterRunner):
        runner.send_message("quit")   # Locust's own message: a worker reports its last statistics, then quits
        deadline = run.t_end + environment.stop_timeout + 30.0
        while runner.worker_count > 0 and time.monotonic() < deadline:
            gevent.sleep(0.1)
    else:
        runner.stop()
    if "end" not in run.marks:
        run.mark("end", t=run.t_end)   # the window's end; the metrics: after the last round was reported
    runner.quit()
