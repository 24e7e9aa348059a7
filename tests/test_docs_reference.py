"""The command-line reference: every option is documented, and the pages name only options that exist.

The reference pages (docs/reference/PROGRAM.md in the built site) are rendered from the argparse
parsers by docs/hooks/cli_reference.py. These tests check that the hook covers every command a
user runs, that each option of each command is on its page, and that the hand-written pages
(README.md, docs/*.md) name no option that the command they show does not take: a renamed or
removed option fails here, not in a newcomer's terminal.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# The commands issue 26 names, and the others a user runs: each must have its section.
MUST_HAVE = ("edge-client generate", "edge-client serve", "edge-client info", "edge-client make-draft",
             "edge-client eval-draft", "cloud-verifier serve", "cloud-verifier new-token", "cloud-verifier hash-token",
             "netsim experiment", "netsim load", "netsim fleet", "netsim proxy", "netsim profiles", "hybridspec demo")

# Options of other tools that the pages show (pip, pytest, mkdocs, docker, kubectl, git, curl...),
# and the word "--" itself. Our own scripts' options are read from the scripts (_script_options).
OTHER_TOOLS = {
    "--require-hashes", "--no-deps", "--upgrade", "--strict", "--site-dir", "--timeout", "--build",
    "--rm", "--network", "--name", "--gpus", "--env", "--privileged", "--cap-add", "--dry-run", "--namespace",
    "--from-literal", "--from-file", "--generate-hashes", "--format", "--output-file", "--extra", "--all-extras",
    "--index-url",
    "--no-index", "--find-links", "--python", "--universal", "--help", "--version", "--target", "--json",
    "--shm-size",
    # Locust (docs/many-edges.md: the load test's edges across machines)
    "--master", "--worker", "--master-host", "--headless", "--expect-workers", "--users", "--spawn-rate", "--csv",
    "--run-time", "--stop-timeout",
}


def _load_hook():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOK = _load_hook()
REFERENCE_PYTHON = (3, 11)   # the Python docs/reference/ was rendered with (argparse layout)


@lru_cache(maxsize=None)
def _commands() -> dict[str, object]:
    """'edge-client generate' -> its parser, for every program and subcommand."""
    return {c.path: c.parser for program in HOOK.PROGRAMS for c in HOOK.commands(program)}


@lru_cache(maxsize=None)
def _rendered() -> dict[str, str]:
    return {program.name: HOOK.render(program) for program in HOOK.PROGRAMS}


def _section(page: str, path: str) -> str:
    """The part of a rendered page about one command (up to the next command's heading)."""
    start = page.index(f"## `{path}`")
    end = page.find("\n## ", start + 1)
    return page[start:] if end < 0 else page[start:end]


def test_every_command_a_user_runs_has_a_reference_section():
    missing = [c for c in MUST_HAVE if c not in _commands()]
    assert not missing, f"no reference section for {missing}: add the program to PROGRAMS in docs/hooks/cli_reference.py"
    for path in _commands():
        program, _, sub = path.partition(" ")
        if sub:
            assert f"## `{path}`" in _rendered()[program]


def test_every_option_is_on_its_reference_page():
    undocumented = []
    for path, parser in _commands().items():
        program, _, sub = path.partition(" ")
        page = _rendered()[program]
        text = _section(page, path) if sub else page
        undocumented += [f"{path} {opt}" for opt in HOOK.options(parser) if f"`{opt}" not in text]
    assert not undocumented, f"options not rendered on their reference page: {undocumented}"


def test_a_new_option_appears_on_its_page_without_a_hand_edit():
    """The negative control of the test above: an option added to a parser is rendered."""
    program = next(p for p in HOOK.PROGRAMS if p.name == "cloud-verifier")
    parser = HOOK.build_parser(program)
    serve = next(c.parser for c in HOOK.commands(program, parser) if c.path == "cloud-verifier serve")
    assert "--an-option-nobody-wrote-up" not in HOOK.render(program, parser)
    serve.add_argument("--an-option-nobody-wrote-up", help="made up for this test")
    page = _section(HOOK.render(program, parser), "cloud-verifier serve")
    assert "`--an-option-nobody-wrote-up" in page and "made up for this test" in page


# --- the hand-written pages name only options that exist ---------------------------------------

FLAG = re.compile(r"(?<![\w/=-])--[a-z][a-z0-9-]*")
INVOCATION = re.compile(r"(?:(?:^|[\s;&|(/])(edge-client|cloud-verifier|netsim|hybridspec)"
                        r"|-m (edge_client|cloud_verifier|netsim|hybridspec)(?:\.cli)?)\s+([a-z][\w-]*)")
SOURCE_DIRS = ("scripts", "bench", "hybridspec", "llama_runtime", "spec_core", "edge_client", "cloud_verifier", "netsim")
MODULE_TO_PROGRAM = {"edge_client": "edge-client", "cloud_verifier": "cloud-verifier"}


@lru_cache(maxsize=None)
def _script_options() -> set[str]:
    """Options our scripts, benchmarks, `python -m` modules and pytest take: argparse calls, case labels in *.sh."""
    found: set[str] = set()
    for path in [ROOT / "tests" / "conftest.py", *(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))]:
        text = path.read_text(encoding="utf-8")
        found |= set(re.findall(r"""(?:add_argument|addoption)\(\s*["'](--[\w-]+)""", text))
        found |= set(re.findall(r"""["'](--[\w-]+)["']\s+in\s+(?:sys\.)?argv""", text))
    for path in [*ROOT.glob("scripts/*.sh"), *ROOT.glob("bench/*.sh")]:
        found |= set(re.findall(r"^\s*(--[\w-]+)(?:=\*)?\)", path.read_text(encoding="utf-8"), flags=re.M))
        found |= set(re.findall(r"^\s*(--[\w-]+)\|", path.read_text(encoding="utf-8"), flags=re.M))
    return found


@lru_cache(maxsize=None)
def _all_options() -> set[str]:
    return {opt for parser in _commands().values() for opt in HOOK.options(parser)} | _script_options() | OTHER_TOOLS


def _code_lines(text: str) -> list[str]:
    """Lines of fenced blocks (continuations joined) and inline code spans, where commands are shown."""
    lines = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
        lines += re.sub(r"\\\n\s*", " ", block).splitlines()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    lines += re.findall(r"`([^`\n]+)`", prose)
    return lines


def _invocation_problems(line: str) -> list[str]:
    """Options on a command line that its command does not take (or a command that does not exist)."""
    problems = []
    line = re.split(r"\s#", line, maxsplit=1)[0]
    for m in INVOCATION.finditer(line):
        program = m.group(1) or MODULE_TO_PROGRAM.get(m.group(2), m.group(2))
        path = f"{program} {m.group(3)}"
        if path not in _commands():
            problems.append(f"{path!r}: no such command")
            continue
        rest = re.split(r"\s(?:\||&&|;|>)\s", line[m.end():], maxsplit=1)[0]
        takes = set(HOOK.options(_commands()[path])) | set(HOOK.options(_commands()[program]))
        problems += [f"{path} {flag}" for flag in FLAG.findall(rest) if flag not in takes]
    return problems


def _page_problems(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    problems = [f"{page.name}: {p}" for line in _code_lines(text) for p in _invocation_problems(line)]
    unknown = sorted(set(FLAG.findall(text)) - _all_options())
    problems += [f"{page.name}: {flag} is no option of ours (nor a listed other tool's)" for flag in unknown]
    return problems


def test_hand_written_pages_name_only_options_that_exist():
    problems = [p for page in PAGES for p in _page_problems(page)]
    assert not problems, "pages name options that do not exist:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("line, expected", [
    (".venv/bin/edge-client generate --server 127.0.0.1:50051 --gamma adaptive", []),
    (".venv/bin/edge-client generate --server X --gama 4", ["edge-client generate --gama"]),
    ("cloud-verifier serve --kv-park on --top-k 3   # a comment --not-checked", ["cloud-verifier serve --top-k"]),
    ("python -m edge_client.cli generate --verbose --tree auto", []),
    ("netsim load --edges 4 --verifier-arg=--batching --verifier-arg=off | tee x --y", []),
    ("netsim experment --profiles 3g", ["'netsim experment': no such command"]),
])
def test_the_page_check_catches_a_wrong_option(line, expected):
    """The check above on made-up lines: a misspelt or misplaced option, a misspelt command."""
    assert _invocation_problems(line) == expected


def test_every_option_says_what_it_does():
    """An option without a help text would be a bare name on its reference page."""
    silent = [f"{c.path} {a.option_strings[0]}" for program in HOOK.PROGRAMS for c in HOOK.commands(program)
              for a in HOOK._own_actions(c.parser) if a.option_strings and not (a.help or "").strip()]
    assert not silent, f"options without a help text: {silent}"


def test_the_reference_renders_with_only_the_docs_dependencies():
    """The docs site is built with requirements/docs.txt (mkdocs, and the core's numpy, grpc, protobuf):
    each build_parser() must import none of the parts' own dependencies (llama.cpp, rich, FastAPI...)."""
    import subprocess
    import sys
    parts_only = ["llama_cpp", "rich", "gguf", "prometheus_client", "fastapi", "uvicorn", "psutil", "matplotlib",
                  "scipy", "grpc_health", "pydantic", "openai", "cryptography", "vllm", "torch"]
    code = f"""
import importlib.abc, importlib.util, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {parts_only!r}:
            raise ImportError("not in requirements/docs.txt: " + name)
sys.meta_path.insert(0, Missing())
spec = importlib.util.spec_from_file_location("cli_reference", {str(ROOT / "docs" / "hooks" / "cli_reference.py")!r})
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)
for program in hook.PROGRAMS:
    assert hook.render(program)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


def stale_pages(docs_dir: Path) -> list[str]:
    """Reference pages under docs_dir that are missing or differ from what the parsers render."""
    return [HOOK.page_path(p) for p in HOOK.PROGRAMS
            if not (docs_dir / HOOK.page_path(p)).is_file()
            or (docs_dir / HOOK.page_path(p)).read_text(encoding="utf-8") != HOOK.render(p)]


def test_the_committed_reference_pages_are_what_the_parsers_render():
    """docs/reference/ is committed (every option readable and greppable in the repository) and must
    be what the parsers render now (the site renders them again at build time). argparse lays out
    usage lines differently from one Python minor version to another: the pages are written with the
    Python set-up uses on CI (3.11), and the check runs there."""
    if sys.version_info[:2] != REFERENCE_PYTHON:
        pytest.skip(f"docs/reference/ is rendered with Python {REFERENCE_PYTHON[0]}.{REFERENCE_PYTHON[1]}; "
                    f"this is {sys.version_info[0]}.{sys.version_info[1]}")
    stale = stale_pages(ROOT / "docs")
    assert not stale, f"{stale} missing or stale: run python docs/hooks/cli_reference.py --write"


def test_a_stale_committed_page_is_caught(tmp_path):
    """Negative control: fresh pages pass, one changed page is reported, a missing one too."""
    HOOK.write_pages(tmp_path)
    assert stale_pages(tmp_path) == []
    first, second = (HOOK.page_path(p) for p in HOOK.PROGRAMS[:2])
    (tmp_path / first).write_text(HOOK.render(HOOK.PROGRAMS[0]).replace("--", "-", 1), encoding="utf-8")
    (tmp_path / second).unlink()
    assert stale_pages(tmp_path) == [first, second]
