"""Long work says what it is doing: make-draft, eval-draft and netsim experiment report each step
(a line per step on standard error when it is not a terminal, a progress bar or spinner on one)."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
from tiny_gguf import write_tiny_llama

from edge_client.draftmaker.evaluate import Prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("progress")
    return write_tiny_llama(d / "target.gguf", seed=3, n_layer=2)


def test_make_and_eval_draft_print_a_line_per_step_when_not_on_a_terminal(tiny, tmp_path, capsys):
    from edge_client.cli import main
    out = tmp_path / "draft.gguf"
    assert main(["make-draft", "--target", str(tiny), "--out", str(out), "--method", "copy", "--json"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith(f"making {out}: started")
    assert any("checking the draft loads" in line for line in err), err
    assert all(re.match(r"\[\s*\d+ s\] making ", line) for line in err), err

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": p.category, "prompt": p.text}) + "\n"
                               for p in (Prompt("code", "def list"), Prompt("chat", "hello world"))))
    assert main(["eval-draft", "--target", str(tiny), "--draft", str(out), "--prompts", str(prompts),
                 "--tokens", "4", "--no-speed", "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)                          # the report alone on standard output
    steps = [line for line in captured.err.splitlines() if "eval-draft: " in line]
    assert [s.split("eval-draft: ", 1)[1] for s in steps] == ["started", "prompt 1/2 (code)", "prompt 2/2 (chat)"]


class RecordingProgress:
    """rich.progress.Progress's part that the experiment uses, recording what it is told."""

    def __init__(self):
        self.events: list[tuple[str, object]] = []

    def add_task(self, description, total=None):
        self.events.append(("describe", description))
        return 0

    def update(self, task, description=None, total=None):
        if description is not None:
            self.events.append(("describe", description))
        if total is not None:
            self.events.append(("total", total))

    def advance(self, task):
        self.events.append(("advance", 1))


def test_experiment_says_it_starts_the_verifier_before_the_first_measurement(tmp_path):
    from netsim.experiment import ExperimentConfig, run_experiment
    cfg = ExperimentConfig(profiles=["lan"], modes=["cloud-only"], out=tmp_path, workloads=["chat"], max_tokens=4,
                           synthetic=True, synthetic_step_ms=0.0, crossover=False)
    progress = RecordingProgress()
    result = asyncio.run(run_experiment(cfg, progress))
    assert len(result["rows"]) == 1
    described = [value for kind, value in progress.events if kind == "describe"]
    first_advance = progress.events.index(("advance", 1))
    before = [value for kind, value in progress.events[:first_advance] if kind == "describe"]
    assert before[0] == "setting up the synthetic pair" and before[1].startswith("starting the verifier")
    assert before[-1] == "lan cloud-only chat" and ("total", 1) in progress.events[:first_advance]
    assert described[-1] == "lan cloud-only chat"


@pytest.mark.parametrize("extra, steps", [([], 5), (["--with", "gemma"], 6)], ids=["default", "with-gemma"])
def test_set_up_prints_a_line_per_step(tmp_path, extra, steps):
    """scripts/setup.sh with every tool it calls stubbed out (pip, python, edge-client): the steps alone."""
    import os
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    for tool in ("python", "pip", "edge-client"):
        (venv_bin / tool).write_text("#!/bin/sh\nexit 0\n")
        (venv_bin / tool).chmod(0o755)
    r = subprocess.run(["bash", str(root / "scripts" / "setup.sh"), *extra], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "VENV": str(tmp_path / "venv"), "PYTHON": str(venv_bin / "python"),
                                        "HYBRIDSPEC_MODELS": str(tmp_path / "models"), "HYBRIDSPEC_WITH": ""})
    assert r.returncode == 0, r.stderr
    numbered = re.findall(r"^\[setup\] \d\d:\d\d:\d\d step (\d+)/(\d+): (.+)$", r.stderr, flags=re.M)
    assert [(int(n), int(total)) for n, total, _ in numbered] == [(i, steps) for i in range(1, steps + 1)]
    assert "the default draft" in numbered[4][2] and r.stderr.rstrip().endswith(f"ready: {tmp_path / 'venv'}")


def test_load_says_it_starts_the_verifier_before_the_first_run(tmp_path):
    from netsim.load import LoadConfig, run_load
    cfg = LoadConfig(edges=[1], profiles=["lan"], modes=["cloud-only"], duration_s=0.5, out=tmp_path, synthetic=True,
                     warmup_s=0.2, max_tokens=4, synthetic_step_ms=1.0)
    progress = RecordingProgress()
    result = asyncio.run(run_load(cfg, progress))
    assert len(result["runs"]) == 1
    first_advance = progress.events.index(("advance", 1))
    before = [value for kind, value in progress.events[:first_advance] if kind == "describe"]
    assert before == ["loading the edges' models", "starting the verifier", "1 edges, cloud-only (0.7 s)"]


def test_the_invariance_probe_says_what_it_does_and_what_it_found(tiny, tmp_path, monkeypatch, caplog):
    """The verifier's first start on a model probes batch invariance (up to a minute on a busy
    machine): it says so at INFO, which `cloud-verifier serve` shows, and says nothing when cached."""
    import logging
    from llama_runtime import GGUFModel
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="llama_runtime.model"):
        cut = GGUFModel(tiny, n_threads=1).invariant_ubatch
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        assert GGUFModel(tiny, n_threads=1).invariant_ubatch == cut
    assert "checking how many tokens one decode may hold and stay batch-invariant" in first[0]
    assert f"batch-invariant up to {cut} tokens per decode" in first[1]
    assert caplog.records == []          # the second model found the answer in the cache
