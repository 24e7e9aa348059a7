"""`netsim load` on the synthetic pair: a short real run, and the metrics scraping on canned text."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from netsim.load import (LoadConfig, Request, capacity_at_slo, histogram_delta, metric_delta, saturation, scrape,
                         verifier_args, verifier_threads)

REPO_ROOT = Path(__file__).resolve().parents[2]

FIELDS = ("edges", "mode", "committed_tokens_per_s", "tpot_p50_s", "tpot_p95_s", "tpot_p99_s", "ttft_p50_s",
          "ttft_p99_s", "target_tokens_per_committed_token", "errors")


def _netsim_load(out: Path, *args: str) -> dict:
    """`netsim load --synthetic --edges 4` with 24-token requests and a 5 ms pass, as a process."""
    pytest.importorskip("psutil")
    command = [sys.executable, "-m", "netsim", "load", "--synthetic", "--edges", "4", "--warmup", "0.5",
               "--max-tokens", "24", "--synthetic-step-ms", "5", *args, "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "load.json").read_text())


def test_load_run_on_the_synthetic_pair(tmp_path):
    out = tmp_path / "load"
    result = _netsim_load(out, "--profile", "lan,cable", "--mode", "hybrid,cloud-only", "--duration", "3",
                          "--verifier-arg=--session-ttl", "--verifier-arg=300")
    runs = {run["mode"]: run for run in result["runs"]}
    assert set(runs) == {"hybrid", "cloud-only"}
    for mode, run in runs.items():
        for name in FIELDS:
            assert name in run, (mode, name)
        assert run["edges"] == 4
        assert run["errors"] == {}, run["errors"]
        assert run["committed_tokens_per_s"] > 0
        assert 0 < run["tpot_p50_s"] <= run["tpot_p95_s"] <= run["tpot_p99_s"] < 5.0
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] < 5.0
        assert run["verifier_cpu_cores"] is not None and run["verifier_peak_rss_mb"] > 0
        assert run["edges_cpu_cores"] > 0 and run["proxy_cpu_cores"] > 0   # the harness drafted and carried bytes
        assert set(run["tpot_per_edge_mean_s"]) == {"0", "1", "2", "3"}   # every edge was measured
    # The verifier batches by default (and says so): 4 cloud-only streams share passes, so fewer
    # passes than tokens; hybrid: fewer passes (γ+1 tokens each) than tokens.
    assert result["server"]["batching"] is True and result["server"]["backend"] == "synthetic"
    assert runs["cloud-only"]["target_forward_passes_per_committed_token"] < 0.9
    assert runs["hybrid"]["target_forward_passes_per_committed_token"] < 1.0
    assert runs["hybrid"]["target_tokens_per_committed_token"] > 1.0
    assert runs["hybrid"]["session_replays"] == 0   # a session per edge (--max-sessions >= edges)
    assert (out / "load.md").read_text().count("| 4 |") == 2
    # The machine it ran on, and whether the harness saturated it, travel with the figures.
    assert result["machine"]["cores"] == os.cpu_count() and result["machine"]["cpu_model"]
    assert all("not_representative" in run for run in runs.values())
    assert "Machine: " in (out / "load.md").read_text()
    # Goodput is the part of the throughput whose requests met the SLO (defaults: 150 ms, 2 s).
    for run in runs.values():
        assert 0 <= run["goodput_tokens_per_s"] <= run["committed_tokens_per_s"] + 1e-9
        assert run["slo_met_share"] is not None and 0 <= run["slo_met_share"] <= 1
    assert set(result["capacity"]) == {"hybrid", "cloud-only"}
    assert "Capacity at the SLO" in (out / "load.md").read_text()
    assert (out / "throughput_vs_edges.png").stat().st_size > 0
    assert (out / "latency_vs_edges.png").stat().st_size > 0


def test_load_run_against_the_serial_verifier(tmp_path):
    """--verifier-arg=--batching --verifier-arg=off: the serial verifier, one session per pass and
    a pass per cloud-only token (plus the prompts' prefill passes; how many of those fall in a short
    window depends on the machine's speed, so the ratio is bounded below, not pinned)."""
    result = _netsim_load(tmp_path / "load", "--profile", "lan", "--mode", "cloud-only", "--duration", "2",
                          "--verifier-arg=--batching", "--verifier-arg=off")
    assert result["server"]["batching"] is False
    run = result["runs"][0]
    sessions = run["batch_histograms"]["hybridspec_batch_sessions"]
    assert sessions["count"] > 0 and sessions["sum"] == sessions["count"]   # never two sessions in a pass
    assert run["committed_tokens"] > 0
    assert run["target_forward_passes_per_committed_token"] >= 0.9   # window edges: a pass or two either way


PROMETHEUS_TEXT = """\
# HELP hybridspec_verify_rounds_total Verify rounds completed
# TYPE hybridspec_verify_rounds_total counter
hybridspec_verify_rounds_total 130.0
hybridspec_request_errors_total{code="RESOURCE_EXHAUSTED"} 2.0
hybridspec_batch_tokens_bucket{le="8.0"} 10.0
hybridspec_batch_tokens_bucket{le="+Inf"} 12.0
hybridspec_batch_tokens_count 12.0
hybridspec_batch_tokens_sum 77.0
"""


def test_scrape_reads_counters_and_histograms(tmp_path):
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = PROMETHEUS_TEXT.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        after = scrape(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    finally:
        server.shutdown()
        server.server_close()
    before = {"hybridspec_verify_rounds_total": 100.0, "hybridspec_batch_tokens_count": 2.0,
              "hybridspec_batch_tokens_sum": 7.0, 'hybridspec_batch_tokens_bucket{le="8.0"}': 1.0}
    assert metric_delta(before, after, "hybridspec_verify_rounds_total") == 30.0
    assert after['hybridspec_request_errors_total{code="RESOURCE_EXHAUSTED"}'] == 2.0
    histogram = histogram_delta(before, after, "hybridspec_batch_tokens")
    assert histogram["count"] == 10.0 and histogram["sum"] == 70.0
    assert histogram["buckets"] == {"8.0": 9.0, "+Inf": 12.0}
    assert histogram_delta(before, after, "hybridspec_batch_seconds") is None
    assert scrape(None) == {}


def test_verifier_args_pass_through():
    cfg = LoadConfig(edges=[16], profiles=["lan"], modes=["hybrid"], duration_s=1, out=Path("x"), synthetic=True,
                     verifier_args=["--batching", "on", "--kv-tokens", "65536"], synthetic_step_ms=7)
    args = verifier_args(cfg, 9100, 16)
    assert args[-4:] == ["--batching", "on", "--kv-tokens", "65536"]   # last, so they win over ours
    assert args[args.index("--max-sessions") + 1] == "16"             # a session per edge by default
    assert args[args.index("--metrics-port") + 1] == "9100"
    assert args[args.index("--synthetic-step-ms") + 1] == "7"
    own = LoadConfig(edges=[16], profiles=["lan"], modes=["hybrid"], duration_s=1, out=Path("x"), synthetic=True,
                     verifier_args=["--max-sessions=2"])
    assert "--max-sessions" not in verifier_args(own, 9100, 16)          # the user's bound is kept


def test_verifier_args_leave_kv_room_for_every_edge():
    """The real target: 512-token contexts and KV cells for max(8, edges) sessions of them,
    unless the user says otherwise (then their context length sizes the cache)."""
    real = LoadConfig(edges=[1, 64], profiles=["lan"], modes=["hybrid"], duration_s=1, out=Path("x"),
                      target="t.gguf")
    args = verifier_args(real, 9100, 64)
    assert args[args.index("--n-ctx") + 1] == "512"
    assert args[args.index("--kv-tokens") + 1] == str(64 * 512)
    small = LoadConfig(edges=[4], profiles=["lan"], modes=["hybrid"], duration_s=1, out=Path("x"), target="t.gguf",
                       verifier_args=["--n-ctx", "256"])
    args = verifier_args(small, 9100, 4)
    assert args.count("--n-ctx") == 1 and args[args.index("--kv-tokens") + 1] == str(8 * 256)
    mine = LoadConfig(edges=[4], profiles=["lan"], modes=["hybrid"], duration_s=1, out=Path("x"), target="t.gguf",
                      verifier_args=["--kv-tokens=1024"])
    assert verifier_args(mine, 9100, 4).count("--kv-tokens") == 0


def test_the_verifier_we_start_leaves_cores_to_the_edges():
    """llama.cpp's threads spin-wait: a verifier on every core stalls against the edges on the same
    machine. The one netsim load starts gets half the cores (at least one) unless told otherwise."""
    assert [verifier_threads(c) for c in (1, 2, 3, 16)] == [1, 1, 1, 8]
    real = LoadConfig(edges=[16], profiles=["lan"], modes=["hybrid"], duration_s=1, out=Path("x"), target="t.gguf")
    args = verifier_args(real, 9100, 16)
    assert args[args.index("--threads") + 1] == str(verifier_threads())
    mine = LoadConfig(edges=[16], profiles=["lan"], modes=["hybrid"], duration_s=1, out=Path("x"), target="t.gguf",
                      verifier_args=["--threads=2"])
    assert verifier_args(mine, 9100, 16).count("--threads") == 0 and "--threads=2" in verifier_args(mine, 9100, 16)


def test_a_run_whose_harness_saturated_the_cpu_is_flagged():
    """2 cores, a verifier on 1 thread: the edges and proxies have 1 core; using 0.9 of it (or the
    edges' one event loop near a full core) flags the run; a light harness does not."""
    light = {"edges_cpu_cores": 0.3, "proxy_cpu_cores": 0.2, "verifier_cpu_cores": 1.0}
    assert saturation(light, cores=2, verifier_threads=1) is None
    busy = {"edges_cpu_cores": 0.6, "proxy_cpu_cores": 0.35, "verifier_cpu_cores": 1.0}
    assert "0.95 of the 1 cores" in saturation(busy, cores=2, verifier_threads=1)
    loop = {"edges_cpu_cores": 0.95, "proxy_cpu_cores": 0.1, "verifier_cpu_cores": 0.5}
    assert "event loop" in saturation(loop, cores=16, verifier_threads=8)
    assert saturation(busy, cores=16, verifier_threads=8) is None   # 8 cores left: plenty
    assert saturation({"edges_cpu_cores": None}, cores=2, verifier_threads=1) is None


def test_a_request_meets_the_slo_on_what_the_window_saw():
    """TPOT over the commits inside the window; TTFT only when the request arrived inside it."""
    r = Request(edge=0, arrival_s=10.0, token_times=[(10.5, 1), (10.6, 2), (10.7, 3)])   # TTFT 0.5 s, TPOT 0.1 s
    assert r.meets(10.0, 20.0, slo_tpot_s=0.15, slo_ttft_s=2.0) is True
    assert r.meets(10.0, 20.0, slo_tpot_s=0.05, slo_ttft_s=2.0) is False   # too slow per token
    assert r.meets(10.0, 20.0, slo_tpot_s=0.15, slo_ttft_s=0.2) is False   # too slow to start
    assert r.meets(10.55, 20.0, slo_tpot_s=0.15, slo_ttft_s=0.2) is True   # arrived before the window: TPOT only
    assert r.meets(10.65, 20.0, slo_tpot_s=0.15, slo_ttft_s=2.0) is None   # one commit seen: nothing to judge


def test_capacity_is_the_most_edges_whose_p95_met_the_slo():
    runs = [{"edges": n, "mode": m, "tpot_p95_s": t, "ttft_p95_s": f, "goodput_tokens_per_s": g}
            for n, m, t, f, g in [(1, "hybrid", 0.05, 0.3, 20.0), (4, "hybrid", 0.12, 0.5, 70.0),
                                  (16, "hybrid", 0.40, 0.9, 30.0), (1, "cloud-only", 0.03, 0.2, 30.0),
                                  (4, "cloud-only", 0.09, 2.5, 90.0), (16, "cloud-only", 0.30, 3.0, 10.0)]]
    cap = capacity_at_slo(runs, slo_tpot_s=0.15, slo_ttft_s=2.0)
    assert cap["hybrid"]["edges"] == 4 and cap["hybrid"]["goodput_tokens_per_s"] == 70.0
    assert cap["cloud-only"]["edges"] == 1   # 4 edges kept TPOT but not TTFT
    assert capacity_at_slo(runs, slo_tpot_s=0.01, slo_ttft_s=2.0)["hybrid"]["edges"] == 0


def test_goodput_can_be_judged_again_at_another_slo():
    from netsim.load import goodput_at
    run = {"duration_s": 10.0, "per_request": [[0.10, 0.5, 40], [0.30, None, 30], [None, 3.0, 0], [None, None, 5]]}
    assert goodput_at(run, slo_tpot_s=0.15, slo_ttft_s=2.0) == 4.0    # the first only
    assert goodput_at(run, slo_tpot_s=0.35, slo_ttft_s=2.0) == 7.0    # both with a TPOT
    assert goodput_at(run, slo_tpot_s=0.05, slo_ttft_s=2.0) == 0.0    # nobody; the unjudged never count


def test_the_emulated_drafter_owes_its_cost_for_trees_too_and_refuses_cross_vocabulary():
    """EmulatedDrafter passes the drafter contract on by name: a tree owes per draft forward row as
    a chain owes per token (a tree used to reach the inner drafter around the cost), and drafting
    across vocabularies, which would draft through next_logits around the cost, is refused."""
    import numpy as np

    from edge_client.drafters import SyntheticDrafter
    from netsim.load import DraftCost, EmulatedDrafter
    from spec_core.drafting import QMode
    from spec_core.tree import TreeShape
    from spec_core.warping import SamplingSettings

    cost = DraftCost()
    drafter = EmulatedDrafter(SyntheticDrafter(64, 0, 1.0), 0.01, cost)
    settings = SamplingSettings(temperature=1.0, seed=1)
    chain = drafter.propose([0, 5], 4, settings, QMode("float", 16), np.random.default_rng(0))
    assert cost.owed_s == pytest.approx(0.01 * len(chain.tokens)) and chain.seconds >= cost.owed_s
    owed = cost.owed_s
    assert drafter.supports_trees
    tree = drafter.propose_tree([0, 5], TreeShape(budget=6, depth=3), settings, QMode("float", 16),
                                np.random.default_rng(0))
    assert tree.rows > 0 and cost.owed_s - owed == pytest.approx(0.01 * tree.rows)
    assert tree.seconds >= 0.01 * tree.rows
    assert not drafter.supports_cross_vocab
    with pytest.raises(NotImplementedError):
        drafter.next_logits([0, 5])
