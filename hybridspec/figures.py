"""The registry of measured figures: one result file per benchmark, rendered into the pages.

A figure that a page states (a ratio, tokens/s, a hit rate, a timing, a capacity) is written once,
by the benchmark that measured it, into ``bench/results/<name>.json`` together with the command
that produced it, the machine (CPU model and features, numpy's SIMD dispatch), the load and the
date. Pages never type the number: they name it, ``{{ fig("<name>/<key>") }}`` or
``{{ table("<name>/<key>") }}``, and the docs build renders it from the file
(``docs/hooks/figures.py``). So a figure cannot differ between two pages, and re-running a
benchmark updates every page that states it.

A result file::

    {
      "name": "weak-links",
      "command": "netsim experiment --modes ... --profiles 3g",
      "machine": {... hybridspec.machine.describe() ...},
      "load": {"start": [1.2, 0.9, 0.7], "end": [1.9, 1.1, 0.8]},
      "date": "2026-12-06",
      "note": "shared 2-core VM",
      "figures": {
        "auto-vs-per-token-3g": {"value": 2.04, "unit": "x", "fmt": "{:.2f}×",
                                  "quantity": "tokens/s, auto over per-token",
                                  "setup": "3g, bundled pair, T 0.7, chat"}
      },
      "tables": {"by-profile": {"columns": ["profile", "mode", "tok/s"], "rows": [["3g", "auto", 7.1]]}}
    }

``quantity`` + ``setup`` say what a figure claims; two entries of the registry may not claim the same
quantity for the same set-up (``duplicate_claims``), so one claim has one current number.

Standard library only: imported by bench scripts, netsim, the docs hook and the tests.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hybridspec import machine as _machine

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


@dataclass(frozen=True)
class Figure:
    """One measured number and what it claims."""
    value: float | int | str
    quantity: str            # what is measured, e.g. "tokens/s, auto over per-token"
    setup: str               # the conditions that make it this figure, e.g. "3g, bundled pair, T 0.7"
    unit: str = ""           # "x", "tok/s", "ms", "s", "", ...
    fmt: str = "{}"          # how a page shows it: "{:.2f}×", "{:,.0f} tok/s"

    def render(self) -> str:
        try:
            return self.fmt.format(self.value)
        except (ValueError, TypeError, IndexError, KeyError):
            return str(self.value)


@dataclass(frozen=True)
class Table:
    """Rows of figures measured together, shown as one Markdown table."""
    columns: list[str]
    rows: list[list]
    fmt: dict[str, str] = field(default_factory=dict)   # column -> format, e.g. {"tok/s": "{:.1f}"}

    def render(self) -> str:
        def cell(col: str, v) -> str:
            if v is None:
                return "—"
            f = self.fmt.get(col)
            if f is not None:
                try:
                    return f.format(v)
                except (ValueError, TypeError):
                    pass
            return str(v)
        head = "| " + " | ".join(self.columns) + " |"
        rule = "|" + "|".join("---" for _ in self.columns) + "|"
        body = ["| " + " | ".join(cell(c, v) for c, v in zip(self.columns, row)) + " |" for row in self.rows]
        return "\n".join([head, rule, *body])


@dataclass(frozen=True)
class Result:
    """One benchmark's result file."""
    name: str
    command: str
    machine: dict
    load: dict
    date: str
    figures: dict[str, Figure]
    tables: dict[str, Table]
    note: str = ""

    def provenance(self) -> str:
        """One line for a page: command, machine, load, date."""
        ends = [x[0] for x in (self.load.get("start"), self.load.get("end")) if x]
        load_s = f", load average {' → '.join(f'{x:.1f}' for x in ends)}" if ends else ""
        machine = _machine.summary(self.machine)
        return (f"`{self.command}` on {machine}{load_s}, {self.date}"
                + (f" ({self.note})" if self.note else ""))


class RegistryError(LookupError):
    """A page names a figure the registry does not hold."""


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it: `python -m pkg.mod args` for a module, else the script."""
    argv = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = f"python -m {spec.name.removesuffix('.__main__')}" if spec and spec.name else (
        os.path.relpath(argv[0]) if argv and argv[0] else "python")
    return " ".join([head, *map(shlex.quote, argv[1:])])


def write_result(name: str, *, figures: dict[str, Figure] | None = None,
                 tables: dict[str, Table] | None = None, command: str | None = None,
                 load_start: list[float] | None = None, note: str = "",
                 results_dir: Path | None = None) -> Path:
    """Write (replace) `bench/results/<name>.json`: the figures and tables of one benchmark run,
    with the command (default: this process's), the machine, the load at start (pass what
    `os.getloadavg()` gave when the run began) and at the end, and today's date (UTC)."""
    if not _NAME.match(name):
        raise ValueError(f"result name {name!r}: lower-case letters, digits, '.', '_' and '-' only")
    out_dir = RESULTS if results_dir is None else results_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "name": name,
        "command": command or command_line(),
        "machine": _machine.describe(),
        "load": {"start": load_start, "end": _loadavg()},
        "date": _dt.datetime.now(_dt.timezone.utc).date().isoformat(),
        "note": note,
        "figures": {k: {"value": f.value, "quantity": f.quantity, "setup": f.setup, "unit": f.unit,
                        "fmt": f.fmt} for k, f in (figures or {}).items()},
        "tables": {k: {"columns": t.columns, "rows": t.rows, "fmt": t.fmt} for k, t in (tables or {}).items()},
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    return path


def publish(name: str, *, figures: dict[str, Figure], tables: dict[str, Table], load_start: list[float] | None,
            note: str, show: list[str] | None = None) -> Path:
    """A benchmark's last step: print its tables (`show`: these, else all), write its result with
    write_result, print where."""
    for key in (show if show is not None else list(tables)):
        print(Table.render(tables[key]))
    path = write_result(name, figures=figures, tables=tables, load_start=load_start, note=note)
    print(f"wrote {path}")
    return path


def read_result(path: Path) -> Result:
    doc = json.loads(Path(path).read_text())
    return Result(
        name=doc["name"], command=doc["command"], machine=doc.get("machine") or {},
        load=doc.get("load") or {}, date=doc["date"], note=doc.get("note", ""),
        figures={k: Figure(**v) for k, v in (doc.get("figures") or {}).items()},
        tables={k: Table(columns=v["columns"], rows=v["rows"], fmt=v.get("fmt") or {})
                for k, v in (doc.get("tables") or {}).items()},
    )


def load(results_dir: Path | None = None) -> dict[str, Result]:
    """Every result file of the registry, by name."""
    base = RESULTS if results_dir is None else results_dir
    out = {}
    for path in sorted(base.glob("*.json")):
        r = read_result(path)
        if r.name != path.stem:
            raise ValueError(f"{path}: its name field {r.name!r} differs from the file name")
        out[r.name] = r
    return out


def _split(ref: str) -> tuple[str, str]:
    name, sep, key = ref.partition("/")
    if not sep or not name or not key:
        raise RegistryError(f"{ref!r}: a figure is named '<result>/<key>'")
    return name, key


def figure(registry: dict[str, Result], ref: str) -> Figure:
    name, key = _split(ref)
    try:
        return registry[name].figures[key]
    except KeyError:
        raise RegistryError(f"no figure {ref!r} in bench/results/ (results: {sorted(registry)})") from None


def table(registry: dict[str, Result], ref: str) -> Table:
    name, key = _split(ref)
    try:
        return registry[name].tables[key]
    except KeyError:
        raise RegistryError(f"no table {ref!r} in bench/results/") from None


def duplicate_claims(registry: dict[str, Result]) -> list[tuple[str, str]]:
    """Pairs of figures that claim the same quantity for the same set-up: one claim, one number."""
    seen: dict[tuple[str, str], str] = {}
    dups = []
    for name, r in registry.items():
        for key, f in r.figures.items():
            claim = (f.quantity.strip().lower(), f.setup.strip().lower())
            ref = f"{name}/{key}"
            if claim in seen:
                dups.append((seen[claim], ref))
            else:
                seen[claim] = ref
    return dups


# --- Rendering: pages name figures, the registry fills them in ------------------------------------

# In a docs page (rendered by docs/hooks/figures.py at build time).
TEMPLATE = re.compile(r'\{\{\s*(fig|table|source)\(\s*"([^"]+)"\s*\)\s*\}\}')
# In README.md, which MkDocs does not build: a marked span or block holds its rendering, rewritten by
# `python -m hybridspec.figures --readme`:  <!-- fig:NAME/KEY -->1.29×<!-- /fig -->
README_SPAN = re.compile(r"<!-- (fig|source|table):(\S+?) -->(.*?)<!-- /\1 -->", re.S)


def _render_one(registry: dict[str, Result], kind: str, ref: str) -> str:
    if kind == "fig":
        return figure(registry, ref).render()
    if kind == "table":
        return table(registry, ref).render()
    try:
        return registry[ref].provenance()
    except KeyError:
        raise RegistryError(f"no result {ref!r} in bench/results/ (source)") from None


def render(text: str, registry: dict[str, Result]) -> str:
    """A page with every `{{ fig("...") }}`, `{{ table("...") }}` and `{{ source("...") }}` filled in;
    RegistryError on a name the registry does not hold."""
    return TEMPLATE.sub(lambda m: _render_one(registry, m.group(1), m.group(2)), text)


def render_readme(text: str, registry: dict[str, Result]) -> str:
    """README.md with each marked span or block re-rendered from the registry."""
    def one(m: re.Match) -> str:
        kind, ref = m.group(1), m.group(2)
        body = _render_one(registry, kind, ref)
        if kind == "table":
            body = f"\n{body}\n"
        return f"<!-- {kind}:{ref} -->{body}<!-- /{kind} -->"
    return README_SPAN.sub(one, text)


# --- What a page may not type: a measured figure outside the registry --------------------------

# A measured ratio or rate as a page would type it: "1.29×", "7.21 tok/s", "61–72%", "939 ms".
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
MEASURED = re.compile(
    rf"(?<![\w.^=]){_NUM}(?:\s?(?:[–-]|/|vs\.?|and|to|or|,(?=\s))\s?{_NUM})*"
    r"(?:×|x\b|\s?k?\s?(?:tok/s|tokens/s|tokens per second)|\s?(?:ms|µs|%)(?![\w/])|\s?s\b(?![/'’])"
    r"|\s?(?:B up|B down|GB|MB|kB)\b|\s(?:tokens/round|tokens per round|(?:target )?passes/token|target passes per token)\b)")

# A bare ratio as a page would type it: a number with two or three decimals set against something
# ("1.18 the chain", "0.92 against 1.00"); a page names such a figure too.
BARE_RATIO = re.compile(r"(?<![\w.^=/-])\d+\.\d{2,3}(?![\w.%×/])")
_COMPARED = re.compile(r"\b(?:against|vs\.?|than|over|per-token(?:'s)?|cloud-only(?:'s)?|the chain(?:'s)?|faster|slower)\b|÷")

# Design constants: inputs a page may type (each pattern matches the constant with its context).
ALLOWED = [
    (re.compile(r"(?:≤|<=|<|under|within|at most|budget of|SLO of|target of)\s*\d+(?:\.\d+)?\s?(?:ms|s|%)"),
     "a threshold (an SLO, a limit, a budget): an input"),
    (re.compile(r"\d+(?:[–-]\d+)?\s?ms\s+(?:links?|RTT|round trip|one way|one-way|of delay|delay|a pass|per pass|pass|jitter|"
                r"propagation|each way|timeout|deadline|ping)"), "a profile's or a synthetic model's setting"),
    (re.compile(r"(?:RTT|round trip|delay|jitter|timeout|deadline|--[\w-]+(?:[ =]))\s*(?:of\s*)?\d+(?:\.\d+)?\s?(?:ms|s)\b"),
     "a profile's or an option's setting"),
    (re.compile(r"\d+(?:\.\d+)?\s?(?:ms|s)\s*(?:\+|−|-|×|/)\s*\d|\d\s*(?:\+|−|×|/)\s*\d+(?:\.\d+)?\s?(?:ms|s)\b"),
     "arithmetic in a worked example"),
    (re.compile(r"\b100\s?%"), "all of them (a definition, not a measurement)"),
    (re.compile(r"(?:α|T|top-p|temperature)\s*(?:=|≈)?\s*\d+(?:\.\d+)?"), "a sampling setting or an assumed α"),
    (re.compile(r"\d+(?:\.\d+)?\s?(?:ms|s)\s+(?:p95\s+)?(?:TPOT\s+|TTFT\s+)?SLO"), "an SLO: an input"),
    (re.compile(r"\d+(?:\.\d+)?\s?(?:ms|s)\s+(?:p95\s+)?gap"), "an SLO on the gap between tokens: an input"),
    (re.compile(r"(?:≥|>=|at least|reach(?:es|ed)?|reaching|does not reach|below)\s*\*{0,2}\d+(?:\.\d+)?×"),
     "a threshold ratio (≥ 2×): a yardstick, not a measurement"),
]


def _masked(line: str) -> str:
    """One line as a reader sees its prose: code, registry spans, link targets and comments blanked
    out (same length, so positions still point into the line)."""
    blank = lambda m: " " * len(m.group(0))  # noqa: E731
    for pattern in (README_SPAN, re.compile(r"<!--.*?-->"), TEMPLATE, re.compile(r"`[^`]*`"),
                    re.compile(r"\]\([^)\s]*\)")):
        line = pattern.sub(blank, line)
    return line


def measured_spans(line: str) -> list[tuple[int, int]]:
    """Where a line of prose types a measured figure by hand (not a design constant of ALLOWED): a
    number with a unit (MEASURED), or a bare ratio set against something (BARE_RATIO)."""
    prose = _masked(line)
    allowed = [m.span() for pattern, _ in ALLOWED for m in pattern.finditer(prose)]
    spans = [m.span() for m in MEASURED.finditer(prose)]
    spans += [m.span() for m in BARE_RATIO.finditer(prose)
              if _COMPARED.search(prose[max(0, m.start() - 25):m.end() + 25])
              and not any(a <= m.start() < b for a, b in spans)]
    return sorted(s for s in spans if not any(a <= s[0] and s[1] <= b for a, b in allowed))


def prose_lines(text: str):
    """(line number, line) for each line outside fenced code blocks and HTML comment blocks."""
    fenced = comment = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and README_SPAN.search(line) is None and "<!--" in line and "-->" not in line:
            comment = True
        if not fenced and not comment:
            yield n, line
        if comment and "-->" in line:
            comment = False


def hand_typed(text: str) -> list[str]:
    """The measured figures typed into a page by hand (not from the registry, not allowed constants)."""
    text = README_SPAN.sub(" ", text)          # a README block spans lines
    return [f"line {n}: {line[a:b]!r} in: {line.strip()[:120]}"
            for n, line in prose_lines(text) for a, b in measured_spans(line)]


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m hybridspec.figures",
                                     description="The registry of measured figures (bench/results/).")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--readme", action="store_true",
                      help="re-render the marked figures and tables of README.md from the registry")
    what.add_argument("--check-readme", action="store_true",
                      help="exit 1 when README.md differs from its rendering")
    what.add_argument("--duplicates", action="store_true",
                      help="list figures that claim the same quantity for the same set-up")
    args = parser.parse_args(argv)
    registry = load()
    if args.duplicates:
        dups = duplicate_claims(registry)
        for a, b in dups:
            print(f"{a} and {b} claim the same quantity for the same set-up")
        return 1 if dups else 0
    readme = RESULTS.parents[1] / "README.md"
    text = readme.read_text(encoding="utf-8")
    rendered = render_readme(text, registry)
    if args.check_readme:
        if rendered != text:
            print("README.md differs from its rendering: run python -m hybridspec.figures --readme")
            return 1
        return 0
    if rendered != text:
        readme.write_text(rendered, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
