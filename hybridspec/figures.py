"""The registry of measured figures: one result file per benchmark, rendered into the pages.

A figure that a page states (a ratio, tokens/s, a hit rate, a timing, a capacity) is written once,
by the benchmark that measured it, into ``bench/results/<name>.json`` together with the command
that produced it, the machine (CPU model and features, numpy's SIMD dispatch), the load and the
date. Pages never type the number: they carry a marked span that names it, and one render step
writes the number into the file (README.md and every page under docs/ alike, so the repository's
web view and the site show the same thing)::

    3g: <!-- fig:headline/3g-hybrid-over-per-token -->1.78×<!-- /fig --> per-token's tokens/s
    <!-- table:headline/by-profile -->  (a Markdown table, written between the markers)  <!-- /table -->
    <!-- source:headline -->`command` on machine, load, date<!-- /source -->

``python -m hybridspec.figures --render`` rewrites every span from the registry (and turns a
``{{ fig("<name>/<key>") }}`` placeholder into a span); ``--check`` says which files differ. So a
figure cannot differ between two pages, and re-running a benchmark then ``--render`` updates every
page that states it.

A wall-clock figure (tokens/s, a time, a ratio of either) recorded on a busy machine (the result's
load average above 0.5 per core at its start, or at its end less the run's own processes' mean CPU
use, ``load.own``) is refused unless its span says ``busy``,
``<!-- fig:headline/lan-cloud-only-tok-s busy -->``; the page then shows it marked "(busy)". A result
records which clock it ran on: ``"clock": "wall"`` (the default; a file without the field is wall),
``"virtual"`` (the virtual clock: costs charged from a cost table, the same on any machine) or
``"model"`` (an analytical model); only the wall clock depends on the load.

A result file::

    {
      "name": "weak-links",
      "command": "netsim experiment --modes ... --profiles 3g",
      "machine": {... hybridspec.machine.describe() ...},
      "load": {"start": [1.2, 0.9, 0.7], "end": [1.9, 1.1, 0.8]},
      "date": "2026-12-06",
      "clock": "wall",
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
import time
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hybridspec import machine as _machine

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
# A wall-clock figure is published as quiet when the 1-minute load average at the run's start and end
# was at most this per core (docs/benchmarks.md#quiet-and-busy-figures).
QUIET_LOAD_PER_CORE = 0.5
CLOCKS = ("wall", "virtual", "model")
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
    clock: str = "wall"      # "wall", "virtual" or "model": only the wall clock depends on the load

    def busy_load(self) -> float | None:
        """The load per core this wall-clock result was recorded at, where it was above
        QUIET_LOAD_PER_CORE at its start or end (the higher of the two; a result without any load
        reading counts as busy); None for a quiet result and for one that did not run on the wall clock."""
        if self.clock != "wall":
            return None
        cores = self.machine.get("cores") or 1
        start, end = self.load.get("start"), self.load.get("end")
        # The end reading less the run's own processes (`own`: their mean CPU use, in cores): the
        # machine's other load. A result recorded without `own` counts its end reading whole.
        ends = [x for x in (start[0] if start else None,
                            max(0.0, end[0] - (self.load.get("own") or 0.0)) if end else None) if x is not None]
        if not ends:
            return float("inf")
        worst = max(ends) / cores
        return worst if worst > QUIET_LOAD_PER_CORE else None

    def provenance(self) -> str:
        """One line for a page: command, machine, load, date."""
        ends = [x[0] for x in (self.load.get("start"), self.load.get("end")) if x]
        load_s = f", load average {' → '.join(f'{x:.1f}' for x in ends)}" if ends else ""
        if ends and self.load.get("own") is not None and self.load.get("end"):
            load_s += f" ({self.load['own']:.1f} of it the run's own)"
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


def own_load() -> float | None:
    """This run's own share of the end reading: the CPU time of this process and of the children it
    waited for (servers, workers, edge processes), over this process's life, in cores. The 1-minute
    load average at the end counts the run's own processes; what is left is the machine's other load."""
    try:
        t = os.times()
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        elapsed = time.time() - (boot + start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration, AttributeError):
        return None
    if elapsed <= 0:
        return None
    return round((t.user + t.system + t.children_user + t.children_system) / elapsed, 2)


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
                 results_dir: Path | None = None, clock: str = "wall") -> Path:
    """Write (replace) `bench/results/<name>.json`: the figures and tables of one benchmark run,
    with the command (default: this process's), the machine, the load at start (pass what
    `os.getloadavg()` gave when the run began) and at the end, today's date (UTC) and the clock the
    figures were measured on (`clock`: "wall", "virtual" or "model", see CLOCKS)."""
    if not _NAME.match(name):
        raise ValueError(f"result name {name!r}: lower-case letters, digits, '.', '_' and '-' only")
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r}: one of {', '.join(CLOCKS)}")
    out_dir = RESULTS if results_dir is None else results_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "name": name,
        "command": command or command_line(),
        "machine": _machine.describe(),
        "load": {"start": load_start, "end": _loadavg(), "own": own_load()},
        "date": _dt.datetime.now(_dt.timezone.utc).date().isoformat(),
        "clock": clock,
        "note": note,
        "figures": {k: {"value": f.value, "quantity": f.quantity, "setup": f.setup, "unit": f.unit,
                        "fmt": f.fmt} for k, f in (figures or {}).items()},
        "tables": {k: {"columns": t.columns, "rows": t.rows, "fmt": t.fmt} for k, t in (tables or {}).items()},
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    return path


def publish(name: str, *, figures: dict[str, Figure], tables: dict[str, Table], load_start: list[float] | None,
            note: str, show: list[str] | None = None, clock: str = "wall") -> Path:
    """A benchmark's last step: print its tables (`show`: these, else all), write its result with
    write_result, print where."""
    for key in (show if show is not None else list(tables)):
        print(Table.render(tables[key]))
    path = write_result(name, figures=figures, tables=tables, load_start=load_start, note=note, clock=clock)
    print(f"wrote {path}")
    return path


def read_result(path: Path) -> Result:
    doc = json.loads(Path(path).read_text())
    return Result(
        name=doc["name"], command=doc["command"], machine=doc.get("machine") or {},
        load=doc.get("load") or {}, date=doc["date"], note=doc.get("note", ""), clock=doc.get("clock") or "wall",
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


# --- Rendering: pages carry their figures in marked spans, written from the registry ---------------

# A span in any Markdown file: <!-- fig:NAME/KEY -->1.29×<!-- /fig -->, with " busy" after the name for a
# wall-clock figure recorded on a busy machine. Groups: kind, name, flag, body.
SPAN = re.compile(r"<!-- (fig|source|table):(\S+?)( busy)? -->(.*?)<!-- /\1 -->", re.S)
README_SPAN = SPAN
# The placeholder pages used before spans; `--render` turns each into a span.
TEMPLATE = re.compile(r'\{\{\s*(fig|table|source)\(\s*"([^"]+)"\s*\)\s*\}\}')
BUSY_MARK = " (busy)"
BUSY_TABLE_NOTE = ("*(busy) Recorded at a load of {load:.1f} per core: its tokens/s and times are noisy; "
                   "counts and side-by-side ratios of one run are not.*")

# What makes a figure wall-clock: its unit, or a quantity that is a rate or a time.
_TIMED_UNIT = re.compile(r"^(?:k?tok/s.*|tokens/s.*|ms|µs|s|min|h)$")
_TIMED_QUANTITY = re.compile(r"tok(?:en)?s?/s|\bTPOT\b|\bTTFT\b|\btime\b|latency|seconds|\bwall\b|goodput|"
                             r"throughput|\bstall|\bms\b|first token|\bgaps?\b|\bcapacity\b", re.I)


def timed(fig: Figure) -> bool:
    """Whether a figure is read off the wall clock (tokens/s, a time, a ratio or capacity of them);
    counts (passes, round trips, tokens per round, α, bytes) are not."""
    return bool(_TIMED_UNIT.match(fig.unit.strip()) or _TIMED_QUANTITY.search(fig.quantity))


def timed_table(tab: Table) -> bool:
    # A unit of time stands alone in a column's name ("TTFT s", "round (ms)"), not as "± s.e.".
    return any(_TIMED_QUANTITY.search(c) or re.search(r"(?:^|[\s(])(?:ms|s)(?:$|[\s)])|tok/s", c) for c in tab.columns)


class BusyFigure(RegistryError):
    """A wall-clock figure recorded on a busy machine, named by a span that does not say so."""


def _busy(registry: dict[str, Result], kind: str, ref: str) -> float | None:
    """The load per core of a busy wall-clock figure or table; None where the load does not matter."""
    if kind == "source":
        return None
    name, _ = _split(ref)
    if kind == "fig":
        wall = timed(figure(registry, ref))
    else:
        wall = timed_table(table(registry, ref))
    return registry[name].busy_load() if wall else None


def _render_one(registry: dict[str, Result], kind: str, ref: str, busy_ok: bool = False) -> str:
    if kind == "fig":
        body = figure(registry, ref).render()
    elif kind == "table":
        body = table(registry, ref).render()
    else:
        try:
            return registry[ref].provenance()
        except KeyError:
            raise RegistryError(f"no result {ref!r} in bench/results/ (source)") from None
    load_ = _busy(registry, kind, ref)
    if load_ is None:
        return body
    name, _ = _split(ref)
    if not busy_ok:
        raise BusyFigure(
            f"{ref}: a wall-clock {'figure' if kind == 'fig' else 'table'} recorded at a load of {load_:.1f} per "
            f"core (quiet is at most {QUIET_LOAD_PER_CORE}): re-run `{registry[name].command}` on a quiet machine, "
            f"or mark the span busy (<!-- {kind}:{ref} busy -->) so that the page says so")
    return body + BUSY_MARK if kind == "fig" else body + "\n\n" + BUSY_TABLE_NOTE.format(load=load_)


def _indent_of(text: str, pos: int) -> str:
    """The whitespace before `pos` on its line, when only whitespace precedes it (a block's indent)."""
    start = text.rfind("\n", 0, pos) + 1
    head = text[start:pos]
    return head if not head.strip() else ""


def _span(registry: dict[str, Result], kind: str, ref: str, busy_ok: bool, indent: str) -> str:
    body = _render_one(registry, kind, ref, busy_ok)
    flag = " busy" if _busy(registry, kind, ref) is not None else ""
    if kind == "table":
        lines = body.split("\n")
        body = "\n\n" + "\n".join(indent + line if line else line for line in lines) + "\n\n" + indent
    return f"<!-- {kind}:{ref}{flag} -->{body}<!-- /{kind} -->"


def render_spans(text: str, registry: dict[str, Result], mark_busy: bool = False) -> str:
    """A Markdown file with each marked span re-rendered from the registry, and each old placeholder
    (`{{ fig("...") }}`) turned into a span. A span's "busy" flag is kept while its figure is busy and
    dropped once a quiet run replaced it. RegistryError on a name the registry does not hold;
    BusyFigure on a busy wall-clock figure whose span (or placeholder) does not say busy, unless
    `mark_busy` (then the span is marked busy, and the page shows it so)."""
    def span(m: re.Match) -> str:
        return _span(registry, m.group(1), m.group(2), bool(m.group(3)) or mark_busy, _indent_of(text, m.start()))

    def placeholder(m: re.Match) -> str:
        return _span(registry, m.group(1), m.group(2), mark_busy, _indent_of(out, m.start()))

    out = SPAN.sub(span, text)
    return _no_line_begins_with_a_span(TEMPLATE.sub(placeholder, out))


# A line that begins with an HTML comment starts an HTML block in Markdown (CommonMark and
# Python-Markdown alike): the paragraph breaks there and the line's Markdown is not read. A figure or
# source span that begins a line is therefore joined to the line before it; one that begins a paragraph
# gets "Source:" in front of it (a figure there is refused: the page needs a word before it).
_LINE_BEGINS_WITH_SPAN = re.compile(r"(?:^|\n)([ \t]*)(?=<!-- (fig|source):)")
SOURCE_LEAD = "Source: "


def _no_line_begins_with_a_span(text: str) -> str:
    lines, out, fenced = text.split("\n"), [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else _LINE_BEGINS_WITH_SPAN.match("\n" + line)
        if m is None:
            out.append(line)
        elif out and out[-1].strip() and not out[-1].lstrip().startswith(("```", "#", "|", "<!--")):
            out[-1] += " " + line.lstrip()
        elif m.group(2) == "source":
            out.append(m.group(1) + SOURCE_LEAD + line.lstrip())
        else:
            raise RegistryError(f"a figure begins a paragraph ({line.strip()[:60]!r}): Markdown would read its span "
                                "as an HTML block; put a word in front of it")
    return "\n".join(out)


render_readme = render_spans     # README.md is rendered like every page


def stale_spans(text: str, registry: dict[str, Result]) -> list[str]:
    """What in a Markdown file differs from its rendering: each span whose content (or busy flag) is not
    what the registry renders, each span the registry refuses (with why), each `{{ fig(...) }}`
    placeholder left. Empty when the file equals its rendering."""
    out = []
    for m in SPAN.finditer(text):
        try:
            new = _span(registry, m.group(1), m.group(2), bool(m.group(3)), _indent_of(text, m.start()))
        except RegistryError as exc:
            out.append(str(exc))
            continue
        if new != m.group(0):
            out.append(f"{m.group(1)}:{m.group(2)} (stale)")
    out += [f'{m.group(0)} (a placeholder, not yet a span)' for m in TEMPLATE.finditer(text)]
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and _LINE_BEGINS_WITH_SPAN.match("\n" + line):
            out.append(f"a span begins a line: {line.strip()[:60]!r}")
    return out


def markdown_files(root: Path | None = None) -> list[Path]:
    """The Markdown files whose spans the render step writes: README.md and every page under docs/."""
    base = RESULTS.parents[1] if root is None else root
    return [base / "README.md", *sorted((base / "docs").rglob("*.md"))]


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
    what.add_argument("--render", "--readme", action="store_true",
                      help="write every marked figure, table and source of README.md and docs/**/*.md from the "
                           "registry (and turn {{ fig(...) }} placeholders into spans)")
    what.add_argument("--check", "--check-readme", action="store_true",
                      help="exit 1 when a Markdown file differs from its rendering (and say which)")
    what.add_argument("--duplicates", action="store_true",
                      help="list figures that claim the same quantity for the same set-up")
    parser.add_argument("--mark-busy", action="store_true",
                        help="with --render: mark each wall-clock figure recorded on a busy machine busy (the page "
                             "shows it as such) instead of refusing it")
    args = parser.parse_args(argv)
    registry = load()
    if args.duplicates:
        dups = duplicate_claims(registry)
        for a, b in dups:
            print(f"{a} and {b} claim the same quantity for the same set-up")
        return 1 if dups else 0
    root, failed, changed = RESULTS.parents[1], [], []
    for path in markdown_files():
        text = path.read_text(encoding="utf-8")
        try:
            rendered = render_spans(text, registry, mark_busy=args.mark_busy and args.render)
        except RegistryError as exc:
            failed.append(f"{path.relative_to(root)}: {exc}")
            continue
        if rendered != text:
            changed.append(str(path.relative_to(root)))
            if args.render:
                path.write_text(rendered, encoding="utf-8")
    for line in failed:
        print(line, file=sys.stderr)
    if args.check and changed:
        print("differ from their rendering (run python -m hybridspec.figures --render): " + ", ".join(changed))
    elif args.render and changed:
        print("rendered: " + ", ".join(changed))
    return 1 if failed or (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
