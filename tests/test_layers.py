"""Which package may import which: the house rules, read from the source with `ast`.

  spec_core        imports nothing of ours but spec_core (pure: both ends import it), and no
                   generated protobuf code (spec_core.proto) outside that package itself.
  edge_client      never imports cloud_verifier; its draftmaker never imports netsim.
  netsim           never imports cloud_verifier (it starts verifiers through hybridspec.launch).
  llama_runtime    never imports cloud_verifier, edge_client or netsim.
  hybridspec.launch  imports nothing of ours (everyone may import it).
  bench            never imports tests/ and never puts tests/ on sys.path.

Every import counts, at module level or inside a function, absolute or relative. A failure lists
each offending import as file:line.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, NamedTuple

from safe_ast import parse

ROOT = Path(__file__).resolve().parents[1]
OURS = {"spec_core", "edge_client", "cloud_verifier", "netsim", "llama_runtime", "hybridspec", "tests", "bench"}
# Modules of tests/ that its files import by bare name (tests/ is on sys.path when pytest runs).
TEST_MODULES = {p.stem for p in (ROOT / "tests").rglob("*.py")}


class Import(NamedTuple):
    file: str     # relative to the repository root
    line: int
    module: str   # absolute dotted name ("" for `from . import x` at the top)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_in(source: str, path: Path) -> Iterator[Import]:
    """Every import statement in `source` (functions and branches included), made absolute."""
    rel = str(path.relative_to(ROOT))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(parse(source, rel)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(rel, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield Import(rel, node.lineno, module)
            for alias in node.names:  # `from pkg import module` imports pkg.module
                yield Import(rel, node.lineno, f"{module}.{alias.name}")


def sys_path_edits(source: str, path: Path) -> Iterator[Import]:
    """sys.path.insert/append/extend calls and sys.path assignments, with their argument as text."""
    rel = str(path.relative_to(ROOT))
    for node in ast.walk(parse(source, rel)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and ast.unparse(node.func.value) == "sys.path":
            yield Import(rel, node.lineno, " ".join(ast.unparse(a) for a in node.args))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t) == "sys.path" for t in targets):
                yield Import(rel, node.lineno, ast.unparse(node.value))


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def all_imports(*folders: str) -> list[Import]:
    return [imp for path in python_files(*folders) for imp in imports_in(path.read_text(), path)]


def top(module: str) -> str:
    return module.split(".")[0]


def report(bad: list[Import], rule: str) -> str:
    lines = {(b.file, b.line): b.module for b in reversed(bad)}  # one line per statement: its first name
    return f"{rule}:\n" + "\n".join(f"  {file}:{line}: {module}" for (file, line), module in sorted(lines.items()))


def test_the_collector_sees_imports_in_functions_and_relative_ones():
    # The rules below are only as good as this: a hidden import must be seen.
    path = ROOT / "netsim" / "example.py"
    source = ("import os\n"
              "def f():\n"
              "    from cloud_verifier.process import spawn_verifier\n"
              "from .profiles import get_profile\n"
              "from . import link\n"
              "import sys; sys.path.insert(0, str(ROOT / 'tests'))\n")
    found = {(i.line, i.module) for i in imports_in(source, path)}
    assert {(1, "os"), (3, "cloud_verifier.process"), (4, "netsim.profiles"), (5, "netsim.link")} <= found
    assert [(i.line, "tests" in i.module) for i in sys_path_edits(source, path)] == [(6, True)]


def test_spec_core_imports_only_itself():
    bad = [i for i in all_imports("spec_core") if top(i.module) in OURS - {"spec_core"}]
    assert not bad, report(bad, "spec_core must import nothing of ours but spec_core")


def is_wire_code(module: str) -> bool:
    return module == "spec_core.proto" or module.startswith("spec_core.proto.")


# Modules that still import the wire code, each with why; the list may only shrink (it is empty: the q
# payload's codec lives beside the stubs, spec_core/proto/qpayload.py).
WIRE_IMPORTS_LEFT: dict[str, str] = {}


def test_spec_core_is_free_of_generated_protobuf_code():
    # The pure core's records are plain (e.g. spec_core.verify.FinishReason); the ends map them to the wire.
    found = [i for i in all_imports("spec_core") if is_wire_code(i.module) and not i.file.startswith("spec_core/proto/")]
    bad = [i for i in found if i.file not in WIRE_IMPORTS_LEFT]
    assert not bad, report(bad, "spec_core must not import spec_core.proto (generated wire code) outside the proto "
                                "package: keep the record plain and map it to the wire in cloud_verifier / edge_client")
    gone = set(WIRE_IMPORTS_LEFT) - {i.file for i in found}
    assert not gone, f"{sorted(gone)} no longer import spec_core.proto: take them off WIRE_IMPORTS_LEFT"


def test_the_wire_code_rule_sees_an_import_of_the_proto_package():
    path = ROOT / "spec_core" / "example.py"
    source = "from spec_core.proto import verifier_pb2 as pb\nimport spec_core.proto.verifier_pb2\nfrom spec_core import qcodec\n"
    found = [i.line for i in imports_in(source, path) if is_wire_code(i.module)]
    assert sorted(set(found)) == [1, 2]


def test_edge_client_and_netsim_never_import_cloud_verifier():
    bad = [i for i in all_imports("edge_client", "netsim") if top(i.module) == "cloud_verifier"]
    assert not bad, report(bad, "edge_client and netsim must not import cloud_verifier")


def test_the_draftmaker_does_not_import_netsim():
    bad = [i for i in all_imports("edge_client/draftmaker") if top(i.module) == "netsim"]
    assert not bad, report(bad, "edge_client/draftmaker must not import netsim (its CLI passes LinkFigures)")


def test_llama_runtime_imports_no_end():
    bad = [i for i in all_imports("llama_runtime") if top(i.module) in {"cloud_verifier", "edge_client", "netsim"}]
    assert not bad, report(bad, "llama_runtime must not import cloud_verifier, edge_client or netsim")


def test_the_launcher_imports_nothing_of_ours():
    path = ROOT / "hybridspec" / "launch.py"
    bad = [i for i in imports_in(path.read_text(), path) if top(i.module) in OURS]
    assert not bad, report(bad, "hybridspec/launch.py must import nothing of ours")


def test_bench_never_imports_tests():
    bad = [i for i in all_imports("bench") if top(i.module) == "tests" or i.module in TEST_MODULES]
    assert not bad, report(bad, "bench must not import tests/ (move what it needs into a package, e.g. "
                                "hybridspec.testing)")
    edits = [e for path in python_files("bench") for e in sys_path_edits(path.read_text(), path)
             if "tests" in e.module]
    assert not edits, report(edits, "bench must not put tests/ on sys.path")


def test_the_launcher_ready_lines_are_the_servers():
    # edge_client.cli prints its own copy of the ready line; the launcher waits for this one.
    from edge_client.cli import SERVE_READY
    from hybridspec.launch import EDGE_SERVER_READY
    assert SERVE_READY == EDGE_SERVER_READY


# --- no import circles --------------------------------------------------------------------------

CIRCLE_PACKAGES = ("spec_core", "llama_runtime", "edge_client", "cloud_verifier", "netsim", "hybridspec")
# Circles still there, each with why; the list may only shrink (a circle gone must leave it).
CIRCLES_LEFT: dict[tuple[str, ...], str] = {}   # circles known and being taken apart: none


def import_graph(packages: tuple[str, ...] = CIRCLE_PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports, every import counted (functions and
    TYPE_CHECKING too). An import names the longest module it reaches; a package's __init__ is not a
    node of its own (it re-exports; `from pkg import name` is an edge to the module defining it only
    when it names that module)."""
    paths = {module_name(p): p for p in python_files(*packages)
             if "proto" not in p.relative_to(ROOT).parts[:-1] and "_pb2" not in p.name}
    modules = {m for m, p in paths.items() if p.name != "__init__.py"}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m in modules:
        for imp in imports_in(paths[m].read_text(), paths[m]):
            target = imp.module
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target in modules and target != m:
                graph[m].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_circle_finder_sees_a_circle_through_a_function_level_and_a_type_checking_import():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}, "b.u": {"b.v"}, "b.v": set()}
    assert circles(graph) == [("a.x", "a.y", "a.z")]
    path = ROOT / "cloud_verifier" / "example.py"
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from cloud_verifier.engine import VerifierEngine\n"
              "def f():\n    from cloud_verifier import rounds\n")
    assert {"cloud_verifier.engine", "cloud_verifier.rounds"} <= {i.module for i in imports_in(source, path)}


def test_no_import_circles():
    found = circles(import_graph())
    new = [c for c in found if c not in CIRCLES_LEFT]
    assert not new, "import circles (every import counts, in functions and under TYPE_CHECKING too):\n" + \
        "\n".join("  " + " <-> ".join(c) for c in new)
    gone = set(CIRCLES_LEFT) - set(found)
    assert not gone, f"{sorted(gone)} are no longer circles: take them off CIRCLES_LEFT"
