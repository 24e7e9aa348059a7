"""The two programs as a user runs them: separate processes, real ports, JSON at the end."""
import json
import os
import subprocess
import sys

import pytest

from cloud_verifier.process import spawn_verifier


def test_help_of_both_programs():
    for mod in ("cloud_verifier", "edge_client"):
        r = subprocess.run([sys.executable, "-m", mod, "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "usage" in r.stdout


@pytest.fixture
def verifier(tiny_models):
    proc, address = spawn_verifier(["--model", str(tiny_models["target"]), "--n-ctx", "512", "--threads", "1"])
    yield address
    proc.terminate()
    assert proc.wait(20) == 0  # graceful shutdown on SIGTERM


def test_generate_streams_text_and_ends_with_json(verifier, tiny_models):
    r = subprocess.run([sys.executable, "-m", "edge_client", "generate", "--server", verifier,
                        "--draft", str(tiny_models["draft"]), "--prompt", "hello world", "--max-tokens", "24",
                        "--temperature", "0.7", "--top-p", "0.95", "--gamma", "5", "--seed", "1", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    *text, last = r.stdout.rstrip("\n").split("\n")
    stats = json.loads(last)
    for key in ("text", "tokens", "rounds", "drafted", "accepted", "acceptance_rate", "tokens_per_round",
                "wall_s", "bytes_up", "bytes_down", "gamma"):
        assert key in stats
    assert stats["tokens"] == 24 and stats["gamma"] == 5
    assert "\n".join(text) == stats["text"]


@pytest.mark.parametrize("extra", [["--tree", "auto", "--proactive"], ["--tree", "budget=8,depth=3", "--pipeline"],
                                   ["--tree", "budget=8,depth=3", "--window", "3"]],
                         ids=["tree-auto-proactive", "tree-shape-pipeline", "tree-shape-window"])
def test_generate_with_trees_and_rounds_in_flight(verifier, tiny_models, extra):
    r = subprocess.run([sys.executable, "-m", "edge_client", "generate", "--server", verifier,
                        "--draft", str(tiny_models["draft"]), "--prompt", "hello world", "--max-tokens", "24",
                        "--temperature", "0", "--gamma", "4", "--json", *extra],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout.rstrip("\n").split("\n")[-1])
    assert stats["tokens"] == 24 and stats["tree_rounds"] > 0 and stats["nodes_per_round"] > 1
    for key in ("reused_drafts", "discarded_rounds", "pipelined_rounds", "plans", "continuations_sent",
                "continuation_hits", "window_depth"):
        assert key in stats


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_generate_drafts_across_tokenizers_without_an_option(verifier, tiny_models, tmp_path, chat):
    """A draft with another tokenizer: no option needed (the edge fetches the target's vocabulary,
    caches it, and drafts across vocabularies); greedy output is the target's own."""
    env = {**os.environ, "HYBRIDSPEC_CACHE": str(tmp_path)}
    runs = []
    for draft in (tiny_models["other_vocab"], tiny_models["draft"]):
        r = subprocess.run([sys.executable, "-m", "edge_client", "generate", "--server", verifier, "--draft", str(draft),
                            "--prompt", "hello world", "--max-tokens", "12", "--temperature", "0", "--json",
                            *(["--chat"] if chat else [])], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(json.loads(r.stdout.rstrip("\n").split("\n")[-1]))
    assert runs[0]["token_ids"] == runs[1]["token_ids"] and runs[0]["tokens"] > 0
    assert list((tmp_path / "vocab").glob("*.pb"))   # the target's vocabulary, cached by fingerprint


def test_generate_reports_a_refusal_plainly(verifier, tiny_models):
    r = subprocess.run([sys.executable, "-m", "edge_client", "generate", "--server", verifier,
                        "--draft", str(tiny_models["other_vocab"]), "--prompt", "hi", "--max-tokens", "4",
                        "--strict-tokenizer"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "tokenizer mismatch" in r.stderr and "Traceback" not in r.stderr


def test_info(verifier):
    r = subprocess.run([sys.executable, "-m", "edge_client", "info", "--server", verifier],
                       capture_output=True, text=True, timeout=60)
    info = json.loads(r.stdout)
    assert info["backend"] == "llama.cpp" and info["n_vocab"] == 299


def test_demo_runs_verifier_edge_and_baseline(tiny_models):
    r = subprocess.run([sys.executable, "-m", "hybridspec", "demo", "--target", str(tiny_models["target"]),
                        "--draft", str(tiny_models["draft"]), "--max-tokens", "12", "--json"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    stats = json.loads(r.stdout.rstrip("\n").split("\n")[-1])
    assert stats["tokens"] >= 1 and stats["rounds"] >= 1
    assert stats["cloud_only"]["tokens"] >= 1 and stats["cloud_only"]["wall_s"] > 0
    assert "[demo] hybrid:" in r.stderr and "[demo] cloud-only:" in r.stderr
    # The planner (the default) says in one line which shapes it sent and why.
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("[demo] planner: "))
    assert " g" in line and "because: " in line and sum(stats["shapes"].values()) >= stats["rounds"] - \
        stats["fused_hits"]


def test_demo_over_a_3g_link_prints_three_rows_of_passes_and_round_trips(tiny_models):
    """`hybridspec demo --link 3g`: cloud-only, per-token and hybrid side by side, each counted by the
    verifier. The target drafts for itself at temperature 0 (a pair that agrees): a hybrid round of
    γ = 5 commits several tokens in one pass, so it needs fewer passes per token than per-token
    serving (γ = 1), which needs fewer than cloud-only's one per token. Counts only, no timings. The
    planner is pinned off (the fixed chain of 5): what it chooses follows measured times, and rounds it
    sends ahead and does not keep are round trips too."""
    target = str(tiny_models["target"])
    r = subprocess.run([sys.executable, "-m", "hybridspec", "demo", "--target", target, "--draft", target,
                        "--link", "3g", "--max-tokens", "12", "--prompt", "hello world", "--temperature", "0",
                        "--plan", "off", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout.rstrip("\n").split("\n")[-1])["rows"]
    assert list(rows) == ["cloud-only", "per-token", "hybrid"]
    cloud, per_token, hybrid = rows["cloud-only"], rows["per-token"], rows["hybrid"]
    assert all(row["tokens"] == 12 for row in rows.values())
    # Cloud-only: the verifier ran one pass per token (its prompt's prefill chunks aside), one stream.
    assert cloud["passes"] == 12 and cloud["passes_per_token"] == 1.0 and cloud["round_trips"] == 1
    assert hybrid["passes_per_token"] < per_token["passes_per_token"] < 1.0
    assert hybrid["round_trips"] < per_token["round_trips"] <= 12
    table = [line for line in r.stderr.splitlines() if line.startswith(("[demo] cloud-only:", "[demo] per-token:",
                                                                          "[demo] hybrid:"))]
    assert [line.split(":")[0] for line in table[-3:]] == ["[demo] cloud-only", "[demo] per-token", "[demo] hybrid"]
    assert table[-3].split()[3] == "1.00"   # the passes/token column of cloud-only's row
    assert "fewer round trips than per-token serving" in r.stderr


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], "--top-p"),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--prompt", "hi", "--seed", "-3"], "--seed"),
    (["generate", "--prompt", "hi", "--gamma", "-2"], "--gamma"),
    (["generate", "--prompt", "hi", "--tree", "budget=lots"], "--tree"),
    (["generate", "--prompt", "hi", "--q", "fixed:x"], "--q"),
    (["serve", "--gamma", "many"], "--gamma"),
    (["serve", "--max-gamma", "0"], "--max-gamma"),
    (["serve", "--deadline", "0"], "--deadline"),
])
def test_bad_values_are_refused_before_any_model_loads(argv, flag, capsys, tmp_path):
    """An argparse error naming the option; the draft (a file that does not exist) is never loaded."""
    from edge_client.cli import main
    with pytest.raises(SystemExit) as e:
        main([*argv, "--draft", str(tmp_path / "missing.gguf"), "--server", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}:" in err and "usage:" in err


def test_demo_refuses_a_bad_value_before_it_starts_a_verifier(capsys):
    from hybridspec.cli import main
    with pytest.raises(SystemExit) as e:
        main(["demo", "--temperature", "-1", "--target", "/nonexistent/target.gguf"])
    assert e.value.code == 2 and "argument --temperature:" in capsys.readouterr().err


def test_serve_honours_trees_and_rounds_in_flight():
    """`edge-client serve` took --tree, --proactive and --pipeline and dropped them."""
    from edge_client.cli import build_parser
    from edge_client.serve import service_from_args
    args = build_parser().parse_args(["serve", "--drafter", "synthetic", "--gamma", "adaptive", "--tree", "auto",
                                      "--proactive", "--pipeline", "--max-tree-nodes", "16"])
    service = service_from_args(args)
    try:
        spec = service.options.speculation
        assert (spec.gamma, spec.tree, spec.max_tree_nodes, spec.proactive, spec.pipeline) == \
            ("adaptive", "auto", 16, True, True)
    finally:
        service.pool.executor.shutdown()
