"""`netsim load --clock virtual` (netsim.virtual.load): the load test's edges and the shipped verifier
on the virtual clock. A lone cloud-only edge gets one token a pass plus the link, as the table says;
many edges share the verifier's passes (its batching rule), so they get several times one edge's
tokens/s; the same seed gives the same load.json bytes beside two CPU burners; what the virtual
clock cannot run is refused by name. Synthetic pair, a few virtual seconds per run (a few seconds
of real time each)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridspec.virtual import make_verifier
from netsim.load import LoadConfig
from netsim.virtual.load import check, load_table, run_virtual_load

STEP_S = 0.020   # the synthetic verifier's pass


def config(tmp_path: Path, **kw) -> LoadConfig:
    base = dict(edges=[1], profiles=["lan"], modes=["cloud-only"], duration_s=3.0, out=tmp_path, synthetic=True,
                synthetic_step_ms=STEP_S * 1e3, draft_ms=2.0, max_tokens=32, warmup_s=0.5, seed=3)
    return LoadConfig(**{**base, **kw})


def run(cfg: LoadConfig) -> dict:
    return run_virtual_load(cfg, load_table(cfg, None), make_verifier)


def test_a_lone_cloud_only_edge_gets_a_token_a_pass_and_many_share_the_passes(tmp_path):
    result = run(config(tmp_path, edges=[1, 8]))
    one, eight = (r["committed_tokens_per_s"] for r in result["runs"])
    # One token per 20 ms pass, plus the lan link's 1 ms and the prompts' passes between requests.
    assert 0.75 / STEP_S <= one <= 1.0 / STEP_S, one
    # Eight sessions' steps share a pass (the batcher's rule): several times one edge's tokens/s.
    assert eight >= 5 * one, (one, eight)
    assert all(r["errors"] == {} for r in result["runs"])
    assert result["clock"] == "virtual" and result["cost_table"]["name"].startswith("synthetic")


def test_hybrid_rounds_commit_more_than_a_token_a_pass(tmp_path):
    (r,) = run(config(tmp_path, modes=["hybrid"], edges=[2]))["runs"]
    assert r["verify_rounds"] > 0 and r["committed_tokens"] > 0
    assert r["target_forward_passes_per_committed_token"] < 1.0   # the drafts' accepted tokens


def test_the_same_seed_gives_the_same_bytes_beside_two_cpu_burners(tmp_path):
    cfg = config(tmp_path, edges=[4], modes=["hybrid", "cloud-only"], profiles=["lan", "3g"])
    first = json.dumps(run(cfg), sort_keys=True)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        second = json.dumps(run(cfg), sort_keys=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert first == second
    # Negative control: another seed draws other links and samples.
    assert json.dumps(run(config(tmp_path, edges=[4], modes=["hybrid", "cloud-only"], profiles=["lan", "3g"], seed=4)),
                      sort_keys=True) != first


def test_what_the_virtual_clock_cannot_run_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="--server 127.0.0.1:5000"):
        check(config(tmp_path, server="127.0.0.1:5000"))
    with pytest.raises(ValueError, match="batching"):
        check(config(tmp_path, verifier_args=["--batching", "off"]))
    out = subprocess.run([sys.executable, "-m", "netsim", "load", "--clock", "virtual", "--synthetic", "--locust",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--clock virtual" in out.stderr and "--locust" in out.stderr
    out = subprocess.run([sys.executable, "-m", "netsim", "load", "--synthetic", "--costs", "flat-gpu",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--costs is for --clock virtual" in out.stderr


def test_the_command_writes_a_report_that_says_its_clock(tmp_path):
    out = subprocess.run([sys.executable, "-m", "netsim", "load", "--clock", "virtual", "--synthetic", "--edges", "2",
                          "--mode", "hybrid", "--duration", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = (tmp_path / "load.md").read_text()
    assert "virtual clock" in report and "Clock: virtual" in report and "Machine:" not in report
    record = json.loads((tmp_path / "load.json").read_text())
    assert record["clock"] == "virtual" and record["runs"][0]["verifier_cpu_cores"] is None
    assert json.loads((tmp_path / "run.json").read_text())["machine"]   # where it ran: beside, not in, the results
