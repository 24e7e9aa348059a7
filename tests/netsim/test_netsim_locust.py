"""`netsim load`'s edges as Locust users, for real: a master and two worker processes on this
machine against a synthetic verifier, edges on two link profiles (each worker's on one of them).

Counts only, no wall-clock bounds: what Locust's merged statistics say the edges committed equals
what the verifier's own counters say it committed, round for round and token for token (the run
counts from its start and lets every request finish at its end, so no round is in flight at either
edge of what is counted); and a worker killed mid-run, with its edge host and links, costs the
verifier nothing: its sessions time out, the other worker's edges finish without an error.
"""
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from netsim.load import LoadConfig, free_port, scrape
from netsim.load.locustrun import LocustRun, read_locust, read_stats_csv

# Locust runs in the processes this test starts. Never import it here: importing locust
# monkey-patches this process for gevent (threads become greenlets), and grpc.aio then hangs.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust is not installed")

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def verifier():
    from hybridspec.launch import spawn_verifier
    metrics_port = free_port()
    proc, address = spawn_verifier(["--backend", "synthetic", "--synthetic-vocab", "64", "--synthetic-step-ms", "5",
                                    "--metrics-port", str(metrics_port), "--max-sessions", "32",
                                    "--session-ttl", "3"])
    try:
        yield address, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        proc.terminate()
        proc.wait(30)


def _config(out: Path, window_s: float) -> LoadConfig:
    # warmup 0: Locust counts from the test's start, when the master scrapes the verifier first
    return LoadConfig(edges=[6], profiles=["lan", "cable"], modes=["hybrid"], duration_s=window_s, out=out,
                      synthetic=True, max_tokens=24, warmup_s=0.0)


def _probe(address: str) -> None:
    """One short request of a fresh edge, straight to the verifier (it makes the verifier expire
    the sessions idle past their TTL: expiry runs when sessions are used)."""
    import asyncio

    from netsim.load.edges import DraftCost, Edge, Edges, Request

    async def one() -> None:
        edges = Edges(LoadConfig(edges=[1], profiles=["lan"], modes=["hybrid"], duration_s=0.0, out=Path("."),
                                 synthetic=True, max_tokens=4))
        cost = DraftCost()
        async with Edge(edges, "hybrid", 999, int(address.rsplit(":", 1)[1]), cost, edges.drafter(cost, 999)) as edge:
            await edge.request(Request(999, 0.0), 0)
    asyncio.run(asyncio.wait_for(one(), 60))


def test_merged_counts_equal_the_verifiers_own(verifier, tmp_path):
    address, url = verifier
    cfg = _config(tmp_path, window_s=3.0)
    with LocustRun(cfg, "hybrid", users=6, workers=2, server=address, metrics_url=url, prefix=tmp_path / "run",
                   extra_master_args=["--stop-timeout", "60"]) as run:   # every request finishes at the end
        assert run.wait(240) == 0, run.log_tail()
    record = read_locust(tmp_path / "run")
    print(json.dumps({k: record[k] for k in ("edges", "workers", "edge_rounds", "verify_rounds", "committed_tokens",
                                             "verifier_committed_tokens", "errors")}))
    assert record["edges"] == 6 and record["workers"] == 2
    assert record["errors"] == {}
    assert set(record["profiles"]) == {"lan", "cable"}   # both links, each a worker's
    assert record["edge_rounds"] > 100
    assert record["edge_rounds"] == record["verify_rounds"]
    assert record["committed_tokens"] == record["verifier_committed_tokens"]
    assert record["tpot_p95_s"] is not None and record["ttft_p95_s"] is not None
    sidecar = json.loads((tmp_path / "run_netsim.json").read_text())
    assert len([w for w in sidecar["cpu"] if w != "master"]) == 2   # both workers reported their processes' CPU


def test_a_worker_killed_mid_run_leaves_the_verifier_whole(verifier, tmp_path):
    address, url = verifier
    cfg = _config(tmp_path, window_s=6.0)
    with LocustRun(cfg, "hybrid", users=6, workers=2, server=address, metrics_url=url, prefix=tmp_path / "run",
                   extra_master_args=["--stop-timeout", "60"]) as run:
        # Once every edge has committed a token and the master knows it (the workers' reports said
        # so: the master writes run_netsim.json then), take worker 1 down with its edge host and
        # links (SIGKILL: nothing of it closes a session; its edges' requests, back to back, stop
        # mid-round).
        sidecar = tmp_path / "run_netsim.json"
        deadline = time.monotonic() + 180
        while not (sidecar.exists() and "all_started" in json.loads(sidecar.read_text() or "{}").get("marks", {})):
            assert run.master.poll() is None, run.log_tail()
            assert time.monotonic() < deadline, run.log_tail()
            time.sleep(0.2)
        run.kill_worker(1)
        assert run.wait(240) == 0, run.log_tail()   # the master ends the run with the worker left
    record = read_locust(tmp_path / "run")
    assert record["errors"] == {}                # worker 0's edges never failed
    assert record["edge_rounds"] > 0 and record["requests_completed"] > 0
    rows = read_stats_csv(tmp_path / "run_stats.csv")
    assert rows[("round", "cable")]["Request Count"] > 0   # worker 1's edges (all on cable) had been running
    after = scrape(url)
    assert after.get("hybridspec_inflight_rounds", 0) == 0
    assert after.get('hybridspec_request_errors_total{code="NOT_FOUND"}', 0) == 0   # no edge lost its session
    # Worker 1's sessions are held until their TTL (3 s) runs out, then expire like any idle session
    # (expiry runs as sessions are opened): a probe's request more than a TTL after the last one leaves
    # the verifier holding the probe's session only.
    for attempt in range(20):
        time.sleep(3.5)
        _probe(address)
        held = scrape(url).get("hybridspec_sessions", 0)
        if held <= 1:
            break
    assert held <= 1, f"the verifier still holds {held} sessions"


STATS_CSV = """\
Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,Min Response Time,Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,99.9%,99.99%,100%
request,all links,10,1,40,42.0,20,90,20.0,1.0,0.1,40,45,50,55,60,80,85,90,90,90,90
goodput,all links,6,0,35,36.0,20,50,22.0,0.6,0.0,35,40,45,45,50,50,50,50,50,50,50
ttft,all links,9,0,300,310.0,200,900,2.0,0.9,0.0,300,320,340,350,400,700,900,900,900,900,900
round,lan,40,0,20,21.5,5,60,2.5,4.0,0.0,20,22,25,26,30,40,50,60,60,60,60
round,3g,20,0,250,260.0,200,400,5.0,2.0,0.0,250,260,270,280,300,350,400,400,400,400,400
request,lan,6,0,30,30.0,20,40,20.0,0.6,0.0,30,30,30,30,40,40,40,40,40,40,40
,Aggregated,85,1,30,70.0,5,900,5.0,8.5,0.1,30,40,50,60,250,300,400,700,900,900,900
"""
FAILURES_CSV = """\
Method,Name,Error,Occurrences
request,3g,GrpcStatus('RESOURCE_EXHAUSTED'),1
request,all links,GrpcStatus('RESOURCE_EXHAUSTED'),1
"""


def test_the_report_reads_a_merged_locust_csv(tmp_path):
    """Tokens are the rounds' lengths over both links (40 x 2.5 + 20 x 5 = 200), percentiles the
    'all links' rows' (not the lan row's), errors by gRPC status counted once per failure (the
    'all links' copy of a mixed run's failure is not a second one), the verifier's side from the
    scrapes around the window."""
    (tmp_path / "run_stats.csv").write_text(STATS_CSV)
    (tmp_path / "run_failures.csv").write_text(FAILURES_CSV)
    metrics = lambda rounds, tokens: {"hybridspec_verify_rounds_total": rounds,   # noqa: E731
                                      "hybridspec_committed_tokens_total": tokens}
    (tmp_path / "run_netsim.json").write_text(json.dumps({
        "config": {"edge_mode": "hybrid", "warmup": 1.0, "synthetic": True, "gamma": 4, "draft_ms": 2.0},
        "users": 4, "workers": 2, "cpu": {},
        "marks": {"start": {"t": 0.0, "metrics": metrics(0, 0)},
                  "window_start": {"t": 10.0, "metrics": metrics(100, 250)},
                  "end": {"t": 20.0, "metrics": metrics(161, 452)}}}))
    run = read_locust(tmp_path / "run")
    assert run["committed_tokens"] == 200 and run["committed_tokens_per_s"] == 20.0
    assert run["edge_rounds"] == 60 and run["verify_rounds"] == 61
    assert run["verifier_committed_tokens"] == 202
    assert run["tpot_p95_s"] == 0.080 and run["ttft_p50_s"] == 0.300
    assert run["goodput_tokens_per_s"] == pytest.approx(20.0 * (6 * 22.0) / (10 * 20.0))   # tok/s x the met share
    assert run["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert run["profiles"] == ["3g", "lan"] and run["edges"] == 4


def test_the_report_refuses_an_slo_other_than_the_one_the_runs_judged_by(tmp_path, capsys):
    """Goodput is judged while a Locust run goes, by the master's --slo-tpot-ms: `netsim load
    --locust-csv` with another SLO is refused with both values named (it used to be ignored
    silently); the same SLO, or none, makes the report."""
    from netsim.cli import main
    (tmp_path / "run_stats.csv").write_text(STATS_CSV)
    (tmp_path / "run_failures.csv").write_text(FAILURES_CSV)
    (tmp_path / "run_netsim.json").write_text(json.dumps({
        "config": {"edge_mode": "hybrid", "synthetic": True, "gamma": 4, "slo_tpot_ms": 150.0, "slo_ttft_ms": 2000.0},
        "users": 4, "workers": 2, "cpu": {}, "marks": {}}))
    prefix = str(tmp_path / "run")
    with pytest.raises(SystemExit) as refused:
        main(["load", "--locust-csv", prefix, "--slo-tpot-ms", "300", "--out", str(tmp_path / "a")])
    assert "--slo-tpot-ms 300 differs from the 150 ms" in str(refused.value)
    for extra in ([], ["--slo-tpot-ms", "150"]):
        assert main(["load", "--locust-csv", prefix, *extra, "--out", str(tmp_path / "b")]) == 0
    assert "p95 TPOT ≤ 150 ms" in capsys.readouterr().out
