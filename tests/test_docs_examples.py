"""The docs' examples run: every ```bash and ```python block of README.md and docs/*.md that is
meant to run is executed, against a verifier on the bundled model that this test starts.

How a block runs (whatever the pages say, so that the pages can change freely):
- A block whose first line is `# fragment` is a piece of a command, not a command: skipped.
- A block that needs what a test run does not have (vLLM, Docker, Kubernetes, network namespaces,
  the optional Gemma model, the network, minutes of set-up or benchmarking) is skipped with the
  reason in SKIPS below; a block with placeholders (HOST:PORT, TARGET.gguf, `...`) is skipped the
  same way, and should be marked `# fragment`.
- Servers are the test's own: `cloud-verifier serve` and `edge-client serve` lines are not started
  again; their options are parsed by the command's own parser (a wrong option fails), and the
  ports the pages use (50051 for the verifier, 8080 for the edge's HTTP API, 9100/9101 for
  metrics) are rewritten to the test's servers, bound on 127.0.0.1:0.
- Every other line runs with bash in a scratch folder where `models/` is the checkout's and
  `.venv/bin/` holds this interpreter's edge-client, cloud-verifier, netsim, hybridspec and python
  (so the code under test is the checkout's); it must exit 0. A python block runs as a file and
  must exit 0 and print something.

Slow: the bundled SmolLM2 target and the set-up's draft (models/smollm2-draft.gguf).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from hybridspec.launch import spawn_edge_server, spawn_verifier

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "# fragment"
COMMAND_TIMEOUT_S = 600
PROGRAMS = {"edge-client": "edge_client", "cloud-verifier": "cloud_verifier", "netsim": "netsim",
            "hybridspec": "hybridspec"}

# (pattern in the block, why a test run cannot run it). The first that matches is the reason.
SKIPS = [
    (r"scripts/(demo|test|setup|setup_vllm|test_vllm|lock)\.sh",
     "sets up .venv, compiles llama.cpp or runs the whole suite (minutes; CI runs these itself)"),
    (r"vllm", "needs vLLM (scripts/setup_vllm.sh; tests/test_vllm_backend.py covers it)"),
    (r"\b(docker|kubectl|helm|podman)\b", "needs Docker or Kubernetes (tests/test_deploy.py validates deploy/)"),
    (r"ip netns|\btc qdisc|\bnetem\b", "needs network namespaces or kernel netem"),
    (r"gemma", "needs the optional Gemma model (scripts/setup.sh --with gemma)"),
    (r"\bbench/", "a benchmark: minutes of measurement (bench/ prints figures, tests do not time)"),
    (r"mkdocs serve", "serves until stopped (tests/test_docs.py builds the site)"),
    (r"\bpip install|-m venv|\buv (pip|lock)", "installs packages (needs the network)"),
    (r"\bflock\b", "waits on a lock of another machine"),
    (r"netsim (experiment|load|fleet)", "an experiment or load test: minutes (tests/netsim/ runs small ones)"),
    (r"(make|eval)-draft", "minutes of model work, and it rewrites the set-up's draft (tests/test_draftmaker.py "
                           "runs both on tiny models)"),
    (r"HOST:PORT|TARGET\.gguf|DRAFT\.gguf|(^|\s)\.\.\.(\s|$)|\"\.\.\.\"",
     "has placeholders: mark it `# fragment`"),
]


class Block(NamedTuple):
    page: str     # path relative to the checkout
    line: int     # line of the opening fence
    lang: str     # "bash" or "python"
    text: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"^```(bash|python)[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
            found.append(Block(str(page.relative_to(ROOT)), text[:m.start()].count("\n") + 1, m.group(1), m.group(2)))
    return found


def skip_reason(block: Block) -> str | None:
    if block.text.lstrip().startswith(FRAGMENT):
        return "a fragment"
    code = "\n".join(commands(block.text)) if block.lang == "bash" else block.text   # not the comments
    for pattern, reason in SKIPS:
        if re.search(pattern, code, flags=re.M):
            return reason
    return None


def commands(text: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        code = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if code:
            out.append(code)
    return out


def served_by_the_test(command: str) -> tuple[str, list[str]] | None:
    """(program, its arguments) when the command starts a server the test stands in for."""
    words = shlex.split(command)
    if len(words) >= 2 and Path(words[0]).name in ("cloud-verifier", "edge-client") and words[1] == "serve":
        return Path(words[0]).name, words[1:]
    return None


# --- the servers and the scratch folder --------------------------------------------------------

@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The test's verifier (bundled target) and edge API (the set-up's draft), and the port map."""
    from edge_client.drafters import DEFAULT_DRAFT
    draft = DEFAULT_DRAFT.resolve()
    if not draft.is_file():
        pytest.fail(f"no draft at {draft}: scripts/setup.sh makes it", pytrace=False)
    verifier = spawn_verifier(["--threads", "1", "--n-ctx", "2048"])
    edge = None
    try:
        ports = {"50051": verifier.address.rpartition(":")[2], "9100": _free_port(), "9101": _free_port()}
        if any("8080" in b.text for b in ALL_BLOCKS if not skip_reason(b)):   # a block talks to the edge's API
            edge = spawn_edge_server(["--server", verifier.address, "--draft", str(draft), "--threads", "1"])
            ports["8080"] = edge.base_url.split(":")[-1].split("/")[0]
        yield ports
    finally:
        for proc in (edge.proc if edge else None, verifier.proc):
            if proc is not None:
                proc.terminate()
                proc.wait(30)


def _free_port() -> str:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder to run blocks in: models/ is the checkout's, .venv/bin/ runs the checkout's code."""
    work = tmp_path_factory.mktemp("docs-examples")
    bin_dir = work / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, module in {**PROGRAMS, "python": None, "python3": None}.items():
        run = f'exec "{sys.executable}" -m {module} "$@"' if module else f'exec "{sys.executable}" "$@"'
        (bin_dir / name).write_text(f"#!/bin/sh\n{run}\n")
        (bin_dir / name).chmod(0o755)
    models = Path(os.environ.get("HYBRIDSPEC_MODELS", ROOT / "models")).resolve()
    (work / "models").mkdir()      # the checkout's files, but what a block writes stays here
    for model in models.iterdir():
        (work / "models" / model.name).symlink_to(model)
    for folder in ("scripts", "bench", "tests"):
        (work / folder).symlink_to(ROOT / folder)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "HYBRIDSPEC_MODELS": str(work / "models")}
    return work, env


def with_ports(text: str, ports: dict[str, str]) -> str:
    return re.sub(r"\b(" + "|".join(ports) + r")\b", lambda m: ports[m.group(1)], text)


# --- the test --------------------------------------------------------------------------------

ALL_BLOCKS = blocks()


@pytest.mark.slow
@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_docs_example_runs(block, servers, scratch):
    reason = skip_reason(block)
    if reason:
        pytest.skip(reason)
    work, env = scratch
    if block.lang == "python":
        script = work / f"example_{block.line}.py"
        script.write_text(with_ports(block.text, servers))
        r = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT_S)
        assert r.returncode == 0, f"{block.id} failed:\n{r.stderr[-3000:]}"
        assert r.stdout.strip(), f"{block.id} printed nothing"
        return
    for command in commands(block.text):
        command = with_ports(command, servers)
        server = served_by_the_test(command)
        if server:
            _check_parses(block, *server)
            continue
        r = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT_S)
        assert r.returncode == 0, f"{block.id}: `{command}` exited {r.returncode}:\n{r.stderr[-3000:]}"


def _check_parses(block: Block, program: str, argv: list[str]) -> None:
    """A server line the test stands in for: its options must be ones the command takes."""
    import importlib
    parser = importlib.import_module(f"{PROGRAMS[program]}.cli").build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{block.id}: `{program} {shlex.join(argv)}` is refused by its parser (exit {e.code})")


# --- the runner's own rules, without models ----------------------------------------------------

def test_the_runner_reads_blocks_as_the_pages_write_them():
    text = ".venv/bin/edge-client generate --server 127.0.0.1:50051 \\\n    --max-tokens 8   # comment\n# only a comment\n"
    assert commands(text) == [".venv/bin/edge-client generate --server 127.0.0.1:50051 --max-tokens 8"]
    assert with_ports("curl http://127.0.0.1:8080/v1 ; x 150051", {"8080": "1234", "50051": "9"}) == \
        "curl http://127.0.0.1:1234/v1 ; x 150051"
    assert served_by_the_test(".venv/bin/cloud-verifier serve --port 50051") == ("cloud-verifier", ["serve", "--port",
                                                                                                    "50051"])
    assert served_by_the_test("edge-client generate --prompt hi") is None
    assert skip_reason(Block("x.md", 1, "bash", "# fragment\nedge-client generate ...")) == "a fragment"
    assert skip_reason(Block("x.md", 1, "bash", "edge-client generate --server HOST:PORT")) is not None
    assert skip_reason(Block("x.md", 1, "bash", "edge-client generate --prompt hi")) is None
