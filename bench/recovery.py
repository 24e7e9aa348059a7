"""Recovery after verifier faults, measured: N edges generate against a verifier that is killed
(SIGKILL) and restarted on the same port, or against two replicas restarted one after the other
(SIGTERM: drain, then a fresh process on the same port). Each run is compared with a fault-free run
of the same requests.

    PYTHONPATH=$PWD python bench/recovery.py --edges 8 --synthetic --kill-at 0.3,0.6
    PYTHONPATH=$PWD python bench/recovery.py --edges 64 --max-tokens 96 --kill-at 0.3,0.6 \
        --verifier-arg=--threads=1            # the bundled SmolLM2 target, prompt-lookup drafts
    PYTHONPATH=$PWD python bench/recovery.py --edges 64 --rolling-at 0.3,0.6 --verifier-arg=--threads=1
    ... --kv-store /dev/shm/hybridspec-kv   # the verifiers checkpoint sessions' KV cells there and
                                            # restore them on replays (emptied before each run)
    ... --kv-store off                      # no KV store (without --kv-store: the verifiers' default,
                                            # a folder per address on /dev/shm where it is a tmpfs)

Faults come when a share of all requested tokens is committed (0.3: 30 %), so that they hit the
edges mid-generation however fast this machine is.

Half the edges are greedy, half sample at T = 0.7 with a seed, so every output is reproducible and
the fault run's outputs must equal the fault-free run's token for token. Printed per run: tokens
lost (requested minus committed), outputs equal, wall time, the edges' replays, retries and
back-offs; per fault: when the verifier was ready again, when the first edge and when every edge
hit by it committed again (seconds after the fault); per edge: the longest gap between two commits.
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge_client import EdgeClient  # noqa: E402
from edge_client.options import EdgeOptions, Speculation, Transport  # noqa: E402
from edge_client.transport import replica_targets  # noqa: E402
from hybridspec.figures import Figure, Table, write_result  # noqa: E402
from hybridspec.launch import spawn_verifier  # noqa: E402
from cloud_verifier.cli import build_parser as verifier_parser  # noqa: E402
from cloud_verifier.kvstore_choice import address_folder, choose_store  # noqa: E402
from netsim.load import DraftCost, Edges, LoadConfig, free_port  # noqa: E402
from spec_core.warping import SamplingSettings  # noqa: E402

log = logging.getLogger("recovery")
EDGE = contextvars.ContextVar("edge", default=-1)   # the edge a log line comes from (--log-dir)


class _EdgeTag(logging.Filter):
    """Tag a log record with its edge and the seconds since the run began."""

    t0 = time.time()   # reset as each run begins

    def filter(self, record: logging.LogRecord) -> bool:
        record.edge, record.t = EDGE.get(), record.created - self.t0
        return True


@dataclass
class EdgeTrace:
    """One edge's generation: when each round committed, and how it got there."""

    edge: int
    greedy: bool
    commits: list[float] = field(default_factory=list)   # perf_counter time of each committed round
    replicas: list[int] = field(default_factory=list)    # the replica whose channel it used then (0, 1)
    tokens: int = 0                                        # committed so far
    token_ids: list[int] = field(default_factory=list)
    replays: int = 0
    retries: int = 0
    backoffs: int = 0
    backoff_s: float = 0.0
    error: str | None = None

    def first_commit_after(self, t: float) -> float | None:
        return next((c for c in self.commits if c > t), None)

    def max_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.commits, self.commits[1:])), default=0.0)


@dataclass
class Fault:
    kind: str                       # "kill" (SIGKILL + restart) or "drain" (SIGTERM of one replica + restart)
    share: float                    # of all requested tokens committed when it comes
    at_s: float | None = None       # after the run's start
    exited_s: float | None = None   # the process had exited (after the fault; a drain: handed back, port closed)
    ready_s: float | None = None    # the restarted verifier printed its ready line (after the fault)
    first_commit_s: float | None = None   # the first commit by any edge after the fault
    all_commit_s: float | None = None     # every edge still generating at the fault has committed again
    edges_hit: int = 0


class Replica:
    """A verifier process on a fixed port, restartable."""

    def __init__(self, args: list[str], metrics: bool = False, log_dir: Path | None = None, name: str = "replica"):
        self.log_dir, self.name, self.starts = log_dir, name, 0
        self.port = free_port()
        self.metrics_port = free_port() if metrics else None
        self.args = args
        self.proc = None
        self.counted: dict[str, float] = {}   # its KV store counters when this run began (or it started)

    def start(self) -> None:
        extra = ["--metrics-port", str(self.metrics_port)] if self.metrics_port else []
        stderr = subprocess.DEVNULL
        if self.log_dir is not None:
            self.starts += 1
            stderr = open(self.log_dir / f"{self.name}-{self.starts}.log", "w")   # noqa: SIM115 - the child holds it
        self.proc = spawn_verifier([*self.args, "--port", str(self.port), *extra], stderr=stderr).proc
        self.counted = {}

    def store_counters(self) -> dict[str, float]:
        """Its KV store's restore counters (by outcome) and restored tokens, from its metrics."""
        if self.metrics_port is None:
            return {}
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("hybridspec_kv_checkpoint_restores_total{"):
                out[line.split('"')[1]] = float(line.split()[-1])
            elif line.startswith("hybridspec_kv_checkpoint_restored_tokens_total "):
                out["tokens"] = float(line.split()[-1])
            elif line.startswith("hybridspec_kv_checkpoint_copy_seconds_total "):
                out["copy_ms"] = 1000 * float(line.split()[-1])
            elif line.startswith('hybridspec_kv_checkpoints_total{event="written"}'):
                out["written"] = float(line.split()[-1])
        return out

    def take_counted(self, into: dict[str, float]) -> None:
        """Add what its counters gained since `counted` to `into`."""
        try:
            now = self.store_counters()
        except OSError as e:   # not listening (the edges finished while it drained or restarted)
            log.warning("%s's metrics are not there (%s): its store counters since the last read are not counted",
                        self.name, e)
            return
        for k, v in now.items():
            into[k] = into.get(k, 0.0) + v - self.counted.get(k, 0.0)
        self.counted = now

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def drain(self) -> None:
        self.proc.terminate()
        try:   # its --drain-timeout (60 s) and --grace (5 s), and its own exit
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit within 120 s of SIGTERM: killed", self.name)
            self.kill()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def store_folders(kv_store: str | None, replicas: list[Replica]) -> list[str]:
    """The KV store folders of the replicas: --kv-store DIR, none (off), or each one's default."""
    if kv_store == "off":
        return []
    return [kv_store] if kv_store else [str(address_folder("127.0.0.1", r.port)) for r in replicas]


async def run(edges: Edges, cfg: argparse.Namespace, replicas: list[Replica], faults: list[Fault]) -> dict:
    loop = asyncio.get_running_loop()
    traces = [EdgeTrace(i, greedy=i % 2 == 0) for i in range(cfg.edges)]
    server = ",".join(r.address for r in replicas)
    servers = replica_targets(server)
    for folder in store_folders(cfg.kv_store, replicas):   # a run never restores what the run before stored
        shutil.rmtree(folder, ignore_errors=True)
    store: dict[str, float] = {}
    for r in replicas:
        r.take_counted({})
    t0 = time.perf_counter()
    _EdgeTag.t0 = time.time()   # the edges' log lines count from here
    logging.getLogger("edge_client.recovery").info("run begins: %d faults", len(faults))

    def committed(trace: EdgeTrace, tokens: int, client: EdgeClient) -> None:
        trace.commits.append(time.perf_counter())
        trace.tokens += tokens
        v = client.verifier   # its channel k lists replica (first + k) first; pick_first may have gone on
        first = trace.edge % len(servers) if cfg.spread else 0
        trace.replicas.append((first + v.channels.index(v.channel)) % len(servers) if v.channel in v.channels else -1)

    async def edge(trace: EdgeTrace) -> None:
        EDGE.set(trace.edge)
        settings = SamplingSettings(temperature=0.0 if trace.greedy else 0.7, top_p=1.0 if trace.greedy else 0.95,
                                    max_new_tokens=cfg.max_tokens, seed=1000 + trace.edge, ignore_eos=True)
        # Spread: edge k lists the replicas from replica k on (pick_first takes the first that answers),
        # so each replica serves its share; else every edge starts on replica 1.
        first = servers[trace.edge % len(servers)] if cfg.spread else server
        options = EdgeOptions(Transport(first, deadline_s=cfg.deadline), Speculation(plan="off", gamma=cfg.gamma))
        # The drafter itself (prompt lookup, or the synthetic one), without an emulated drafting
        # cost: that needs a shared channel with an interceptor, and the edge's own channels (one
        # per replica) are what is measured.
        drafter = edges.drafter(DraftCost(), trace.edge).inner
        client = EdgeClient(options, drafter, edges.tokenizer,
                            on_round=lambda e: committed(trace, e.tokens, client))
        async with client:
            gen = client.generate(edges.prompt(trace.edge, 0), settings)
            try:
                async for _ in gen:
                    pass
            except Exception as e:   # noqa: BLE001 - recorded: a fault run must show none
                trace.error = f"{type(e).__name__}: {e}"
            st = gen.stats
            trace.token_ids = list(st.token_ids)
            trace.replays, trace.retries, trace.backoffs, trace.backoff_s = st.replays, st.retries, st.backoffs, \
                st.backoff_s

    fault_times: dict[int, float] = {}

    async def inject() -> None:
        """The faults in turn: each when its share of the requested tokens is committed."""
        for k, fault in enumerate(faults):
            while sum(t.tokens for t in traces) < fault.share * cfg.edges * cfg.max_tokens:
                await asyncio.sleep(0.01)
            replica = replicas[k % len(replicas)]
            await loop.run_in_executor(None, replica.take_counted, store)   # a killed process's counters go
            t_fault = fault_times[k] = time.perf_counter()
            fault.at_s = t_fault - t0
            marks = logging.getLogger("edge_client.recovery")   # in --log-dir's edges.log, among the edges' lines
            marks.info("fault %d: %s %s", k + 1, fault.kind, replica.name)
            await loop.run_in_executor(None, replica.kill if fault.kind == "kill" else replica.drain)
            fault.exited_s = time.perf_counter() - t_fault
            marks.info("fault %d: %s exited", k + 1, replica.name)
            await asyncio.sleep(cfg.restart_delay)
            await loop.run_in_executor(None, replica.start)
            fault.ready_s = time.perf_counter() - t_fault
            marks.info("fault %d: %s ready again", k + 1, replica.name)

    injecting = asyncio.ensure_future(inject())
    await asyncio.gather(*(edge(t) for t in traces))
    if not injecting.done():
        log.warning("the edges finished before every fault came: %d of %d injected", len(fault_times), len(faults))
        injecting.cancel()
    await asyncio.gather(injecting, return_exceptions=True)
    wall = time.perf_counter() - t0
    for r in replicas:
        r.take_counted(store)
    for k, f in enumerate(faults):
        t = fault_times.get(k)
        if t is None:
            continue
        # Hit: every edge still generating when the fault came (whether or not it had committed yet).
        hit = [tr for tr in traces if tr.commits and tr.commits[-1] > t]
        after = [tr.first_commit_after(t) for tr in hit]
        f.edges_hit = len(hit)
        f.first_commit_s = min((a - t for a in after if a), default=None)
        f.all_commit_s = max((a - t for a in after if a), default=None)
    return {"wall_s": wall, "traces": traces, "faults": faults, "t0": t0, "kv_store": store}


def summary(result: dict, reference: dict | None, requested: int) -> dict:
    traces = result["traces"]
    gaps = [t.max_gap_s() for t in traces]
    firsts = [t.commits[0] - result["t0"] for t in traces if t.commits]
    out = {
        "wall_s": round(result["wall_s"], 2),
        "tokens_lost": sum(requested - len(t.token_ids) for t in traces),
        "errors": sum(t.error is not None for t in traces),
        "replays": sum(t.replays for t in traces), "retries": sum(t.retries for t in traces),
        "backoffs": sum(t.backoffs for t in traces), "backoff_s": round(sum(t.backoff_s for t in traces), 2),
        "max_gap_s": round(max(gaps), 2), "median_max_gap_s": round(statistics.median(gaps), 2),
        "first_commit_s": {"median": round(statistics.median(firsts), 2), "max": round(max(firsts), 2)} if firsts else None,
        "per_edge_commits_s": [[round(c - result["t0"], 3) for c in t.commits] for t in traces],
        "per_edge_replicas": [t.replicas for t in traces],   # the replica (index) each commit's round went to
        "faults": [asdict(f) for f in result["faults"]],
    }
    if result["kv_store"]:
        out["kv_store"] = {k: int(v) for k, v in sorted(result["kv_store"].items())}
    if reference is not None:
        out["outputs_equal"] = sum(a.token_ids == b.token_ids for a, b in zip(traces, reference["traces"]))
    first_error = next((t.error for t in traces if t.error), None)
    if first_error:
        out["first_error"] = first_error
    return out


def write_registry(args: argparse.Namespace, report: dict, load_start: list[float]) -> None:
    """The run's figures as a registry result: a row per fault (when the verifier was back, when the
    first and the last edge hit by it committed again), and the run's losses, equal outputs and
    KV store restores beside the fault-free run's first commits."""
    faulty, free = report.get("faults") or {}, report.get("fault_free") or {}
    store = faulty.get("kv_store") or {}
    rows = [[k + 1, f["kind"], f["share"], f["exited_s"], f["ready_s"], f["edges_hit"], f["first_commit_s"],
             f["all_commit_s"]] for k, f in enumerate(faulty.get("faults", []))]
    table = Table(["fault", "kind", "at share", "exited s", "ready s", "edges hit", "first commit s",
                   "every edge s"], rows, {"exited s": "{:.2f}", "ready s": "{:.2f}", "first commit s": "{:.2f}",
                                           "every edge s": "{:.2f}"})
    run = Table(["edges", "tokens lost", "errors", "outputs equal", "replays", "restored", "restore none",
                 "max gap s", "fault-free max gap s", "fault-free last first commit s", "KV store"],
                [[args.edges, faulty.get("tokens_lost"), faulty.get("errors"), faulty.get("outputs_equal"),
                  faulty.get("replays"), store.get("restored"), store.get("none"), faulty.get("max_gap_s"),
                  free.get("max_gap_s"), (free.get("first_commit_s") or {}).get("max"),
                  args.kv_store or ("default" if report.get("kv_store_folder", "").startswith("/") else "none")]],
                {"max gap s": "{:.2f}", "fault-free max gap s": "{:.2f}", "fault-free last first commit s": "{:.2f}"})
    setup = f"{args.edges} edges, KV store {run.rows[0][-1]}"
    write_result(args.result, figures=fault_figures(faulty.get("faults", []), setup) | run_figures(faulty, free, setup),
                 tables={"faults": table, "run": run}, load_start=load_start, note=args.note)


def run_figures(faulty: dict, free: dict, setup: str) -> dict[str, Figure]:
    """The fault run's losses, replays, equal outputs and worst wait (beside the fault-free run's), for prose."""
    setup = f"bench/recovery.py, {setup}"
    out = {"tokens-lost": Figure(faulty.get("tokens_lost"), "tokens lost (requested minus committed) in the fault run",
                                 setup, "", "{}"),
           "replays": Figure(faulty.get("replays"), "replays by the edges in the fault run", setup, "", "{}")}
    if faulty.get("outputs_equal") is not None:
        out["outputs-equal"] = Figure(faulty["outputs_equal"], "outputs equal to the fault-free run's", setup, "", "{}")
    if faulty.get("max_gap_s") is not None:
        out["worst-wait-s"] = Figure(round(faulty["max_gap_s"], 2), "longest wait between two commits, worst edge, "
                                     "fault run", setup, "s", "{:.1f} s")
    if free.get("max_gap_s") is not None:
        out["worst-wait-fault-free-s"] = Figure(round(free["max_gap_s"], 2), "longest wait between two commits, worst "
                                                "edge, fault-free run", setup, "s", "{:.1f} s")
    return out


def fault_figures(faults: list[dict], setup: str) -> dict[str, Figure]:
    """The first fault's times, for pages' prose: back up, first and every edge's next commit."""
    if not faults or faults[0]["all_commit_s"] is None:
        return {}
    f = faults[0]
    setup = f"bench/recovery.py, {setup}, {f['kind']} at {f['share']:.0%} of the tokens"
    seconds = {"ready-s": ("the verifier was ready again after the fault", f["ready_s"]),
               "first-commit-s": ("the first edge committed again after the fault", f["first_commit_s"]),
               "every-edge-s": ("every edge hit by the fault committed again after it", f["all_commit_s"]),
               "after-ready-s": ("... counted from the restarted verifier's ready line",
                                 f["all_commit_s"] - f["ready_s"])}
    out = {k: Figure(round(v, 2), q, setup, "s", "{:.1f} s") for k, (q, v) in seconds.items()}
    out["edges-hit"] = Figure(f["edges_hit"], "edges still generating when the fault came", setup, "edges", "{:d}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--edges", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--synthetic", action="store_true", help="synthetic target and drafter (no model)")
    p.add_argument("--kill-at", default="", help="SIGKILL and restart the verifier when these shares of all requested "
                                                 "tokens are committed (comma list, e.g. 0.3,0.6)")
    p.add_argument("--rolling-at", default="", help="drain (SIGTERM) and restart replica 1, 2, 1, ... at these shares "
                                                    "(two replicas; the edges get both addresses)")
    p.add_argument("--no-spread", dest="spread", action="store_false",
                   help="every edge lists the replicas in the same order (all start on replica 1); by default edge k "
                        "lists them from replica k (mod the replicas) on")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the fault-free run (a quicker look at a fault run; outputs are not compared)")
    p.add_argument("--restart-delay", type=float, default=0.0,
                   help="seconds between a fault and the restart (a slow start, a node replaced)")
    p.add_argument("--verifier-arg", action="append", default=[], help="extra `cloud-verifier serve` argument")
    p.add_argument("--deadline", type=float, default=120.0, help="the edges' deadline per call (s), as netsim load's")
    p.add_argument("--kv-store", help="give the verifiers --kv-store this folder, or off (none); unset: their "
                                      "default (a folder per address on /dev/shm where it is a tmpfs). The folder is "
                                      "emptied before each run; the replays' restores are counted from the metrics")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--result", metavar="NAME", help="also write bench/results/NAME.json (hybridspec.figures): a "
                                                    "row per fault, and the run's losses, outputs and store")
    p.add_argument("--note", default="shared 2-core VM", help="(with --result) what the result's note says")
    p.add_argument("--log-dir", type=Path, help="keep the logs here: each verifier process's, and the edges' "
                                                "(edges.log: each line with its edge and seconds into the run)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    load_start = list(os.getloadavg())
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    kills = [float(x) for x in args.kill_at.split(",") if x]
    rolls = [float(x) for x in args.rolling_at.split(",") if x]
    cfg = LoadConfig(edges=[args.edges], profiles=["lan"], modes=["hybrid"], duration_s=0, out=Path("."),
                     synthetic=args.synthetic, drafter="lookup", max_tokens=args.max_tokens)
    edges = Edges(cfg)
    vargs = (["--backend", "synthetic", "--synthetic-vocab", "64", "--synthetic-step-ms", "20"] if args.synthetic
             else ["--n-ctx", "512", "--kv-tokens", str(max(8, args.edges) * 512)])
    vargs += ["--max-sessions", str(max(8, args.edges)), *args.verifier_arg]
    if args.kv_store:
        vargs += ["--kv-store", args.kv_store]
    n_replicas = 2 if rolls else 1
    if args.log_dir:
        for h in logging.getLogger().handlers:   # the edges' INFO lines go to the file only
            h.setLevel(logging.getLogger().level)
        args.log_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(args.log_dir / "edges.log", mode="w")
        handler.addFilter(_EdgeTag())
        handler.setFormatter(logging.Formatter("%(t)8.3f edge %(edge)2d %(name)s: %(message)s"))
        handler.setLevel(logging.INFO)
        logging.getLogger("edge_client").addHandler(handler)
        logging.getLogger("edge_client").setLevel(logging.INFO)
    stored = not args.synthetic and args.kv_store != "off"
    replicas = [Replica(vargs, metrics=stored, log_dir=args.log_dir, name=f"replica{k + 1}") for k in range(n_replicas)]
    for r in replicas:
        r.start()
    report = {"config": vars(args)}
    # What the verifiers' start-up log says of their KV store: the folder, or why none.
    served = verifier_parser().parse_args(["serve", *vargs, "--port", str(replicas[0].port)])
    report["kv_store_folder"] = choose_store(served.kv_store, backend=served.backend, batching=served.batching == "on",
                                             host=served.host, port=served.port, max_bytes=served.kv_store_bytes,
                                             max_age_s=served.session_ttl).why
    # A SIGTERM (timeout, kill) stops the verifiers too: raised as KeyboardInterrupt, so `finally` runs.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        reference = None
        if args.reference:
            reference = asyncio.run(run(edges, args, replicas, []))
            report["fault_free"] = summary(reference, None, args.max_tokens)
        faults = [Fault("kill", t) for t in kills] or [Fault("drain", t) for t in rolls]
        if faults:
            faulty = asyncio.run(run(edges, args, replicas, faults))
            report["faults"] = summary(faulty, reference, args.max_tokens)
    finally:
        for r in replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.terminate()
                r.proc.wait(30)
    brief = {k: ({kk: vv for kk, vv in v.items() if not kk.startswith("per_edge")} if isinstance(v, dict) and k != "config"
                 else v) for k, v in report.items()}
    print(json.dumps(brief, indent=1, default=str))
    if args.result:
        write_registry(args, report, load_start)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
