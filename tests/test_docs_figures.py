"""Figures a reader can trust: every measured figure a page states comes from the registry.

The registry (`hybridspec.figures`, one result file per benchmark in bench/results/) holds each
measured number with its command, machine and date. README.md and every docs page carry marked spans,
`<!-- fig:<result>/<key> -->1.78×<!-- /fig -->`, that `python -m hybridspec.figures --render` writes
from the registry, so the files (the repository's web view) and the site (docs/hooks/figures.py only
checks) show the same numbers. So:

(a) a page that types a measured ratio or rate by hand (a number with ×, tok/s, tokens/s, ms, s, %,
    bytes, tokens per round or passes per token, outside code and outside the registry's spans) fails, unless the number is a design constant
    on the small allow-list below (an input such as an SLO threshold or a profile's round trip,
    not a measurement);
    A bare ratio set against something ("1.18 the chain") counts as typed too;
(b) no two registry entries claim the same quantity for the same set-up;
(c) README.md and every page equal their rendering from the registry, no Markdown file holds a
    `{{ ... }}` placeholder, and a wall-clock figure recorded on a busy machine (load above 0.5 per
    core) is shown only where its span says busy;
(d) every result file is one a benchmark wrote: its command names a script, module or console
    script of the repository, and it records the machine (CPU model and features, numpy's
    dispatch), the load and the date; each figure is one number (a numeric value, a format with one
    placeholder and no number of its own, a key that names the quantity, not the value).

Each check has a control: a synthetic page with a hand-typed ratio fails, two entries with the
same claim fail, a span edited by hand fails, a busy figure unmarked fails, and a result file without its machine, load,
date or an existing command, or with a format that carries a second number, fails.

Pages are the project's, not a lab notebook: no build machine's path, no clock times, no "we",
no commit hashes, no "before/after this change" or "replaced", no issue numbers. History lives in
CHANGELOG.md, which these checks leave alone.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from hybridspec import figures

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "changelog.md")]
# The command-line reference is rendered from the parsers' help (docs/hooks/cli_reference.py): the
# numbers there are option defaults, inputs that tests/test_docs_reference.py keeps true to the code.
PAGES_WITH_FIGURES = [p for p in PAGES if "reference" not in p.relative_to(ROOT).parts]

MEASURED, ALLOWED, hand_typed = figures.MEASURED, figures.ALLOWED, figures.hand_typed
CONTROL_PAGE_RATIO = "On 3g the hybrid is 1.42× faster than per-token, at 7.3 tok/s."


def test_every_page_states_figures_from_the_registry():
    problems = [f"{path.relative_to(ROOT)}: {hit}" for path in PAGES_WITH_FIGURES
                for hit in hand_typed(path.read_text(encoding="utf-8"))]
    assert not problems, ("figures typed by hand (name them: {{ fig(\"<result>/<key>\") }}, see "
                          "hybridspec/figures.py):\n" + "\n".join(problems))


def test_a_hand_typed_ratio_is_caught():
    """Control for the check above: typed figures fail, named figures and design constants pass."""
    assert len(hand_typed(CONTROL_PAGE_RATIO)) == 2
    assert hand_typed("KV idle 61–72% between rounds")
    assert hand_typed("p95 TPOT 57 vs 939 ms")
    assert hand_typed("hybrid 0.07× cloud-only per GPU")
    assert len(hand_typed("γ = 4: 2.51 tokens/round, 156 B up; 64 sessions in 1.15–1.24 GB")) == 3
    assert not hand_typed('On 3g the hybrid is {{ fig("weak-links/x") }} faster than per-token.')
    assert not hand_typed("capacity at p95 TPOT ≤ 150 ms on 3g (300 ms RTT), γ = 5, 2^16 weights")
    assert not hand_typed("```bash\nnetsim load --slo-ms 150  # 1.42× here\n```")
    assert not hand_typed("<!-- fig:weak-links/x -->1.42×<!-- /fig --> on 3g")
    assert not hand_typed("H200, Q4_0, 16 edges, 5 profiles × 7 modes")
    # Bare ratios set against something are figures too; a setting or a version is not.
    assert hand_typed("continuations gave 1.18 the chain on 3g")
    assert hand_typed("α was 0.712 against 0.690 for the layer-skipped draft")
    assert not hand_typed("the hybrid at α 0.85 against vLLM at α 0.5; vLLM 0.32; Python ≥ 3.11")


def _references(text: str) -> list[tuple[str, str]]:
    return ([(m.group(1), m.group(2)) for m in figures.TEMPLATE.finditer(text)]
            + [(m.group(1), m.group(2)) for m in figures.README_SPAN.finditer(text)])


def test_every_page_equals_its_rendering():
    """README.md and every page under docs/ carry the registry's figures: each span as rendered (a
    name the registry holds, its current value, busy where the figure is busy), no placeholder left."""
    registry = figures.load()
    problems = [f"{path.relative_to(ROOT)}: {p}" for path in figures.markdown_files(ROOT)
                for p in figures.stale_spans(path.read_text(encoding="utf-8"), registry)]
    assert not problems, ("pages that differ from the registry (run `python -m hybridspec.figures --render`):\n"
                          + "\n".join(problems))


def _markdown_in_the_repository() -> list[Path]:
    """Every Markdown file git tracks (every one under the checkout, less ignored folders, without git)."""
    try:
        out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]
    except OSError:
        pass
    skip = {".venv", ".venv-vllm", "build", "results", "node_modules", ".git"}
    return [p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts)]


def test_no_markdown_file_holds_a_placeholder():
    """The repository's web view shows numbers, not `{{ fig(...) }}`: no committed Markdown file has a
    `{{ ... }}` (the render step turns a figure's placeholder into a span)."""
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for p in _markdown_in_the_repository()
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\{\{.*?\}\}", line)]
    assert not found, "placeholders in Markdown files:\n" + "\n".join(found)


def test_every_result_says_what_it_claims_and_where_it_came_from():
    registry = figures.load()
    assert registry, "bench/results/ holds no result file"
    problems = [f"{name}: {p}" for name, result in registry.items() for p in provenance_problems(result)]
    assert not problems, "result files a benchmark did not write (see hybridspec.figures.write_result):\n" + \
        "\n".join(problems)


# A result names the command that wrote it: a script of the repository, a module run with `python -m`, or
# one of the package's console scripts.
CONSOLE_SCRIPTS = {"netsim", "cloud-verifier", "edge-client", "hybridspec"}
_PYTHON = re.compile(r"^(?:\S*/)?python3?$")


def command_exists(command: str) -> bool:
    """Whether the command's program is in this repository (`bench/x.py`, `python -m netsim ...`, `netsim ...`)."""
    words = [w for w in command.split() if "=" not in w or w.startswith("-")]     # drop VAR=value prefixes
    for i, word in enumerate(words):
        if _PYTHON.match(word):
            if i + 2 < len(words) + 1 and i + 1 < len(words) and words[i + 1] == "-m" and i + 2 < len(words):
                module = ROOT / words[i + 2].replace(".", "/")
                return module.with_suffix(".py").is_file() or (module / "__main__.py").is_file()
            continue
        if word in ("bash", "sh", "nice", "timeout") or word.startswith("-") or word.isdigit():
            continue
        name = word.rsplit("/", 1)[-1]
        return (ROOT / word).is_file() if word.endswith((".py", ".sh")) else name in CONSOLE_SCRIPTS
    return False


def provenance_problems(result: figures.Result) -> list[str]:
    """What a result file lacks: the command (one the repository has), the machine (CPU model and
    features, numpy's dispatch), the load, the date; figures that are numbers with one placeholder."""
    out = []
    if not command_exists(result.command):
        out.append(f"command {result.command[:80]!r} names no script, module or console script of the repository")
    m = result.machine
    if not m.get("cpu_model") or not m.get("cpu_features"):
        out.append("no machine (CPU model and features)")
    if not (m.get("numpy_simd") or {}).get("dispatched") and not (m.get("numpy_simd") or {}).get("baseline"):
        out.append("no numpy dispatch")
    load = [x for x in (result.load.get("start"), result.load.get("end")) if x]
    if not load or not all(isinstance(v, (int, float)) for x in load for v in x):
        out.append("no load average")
    if not re.fullmatch(r"20\d\d-\d\d-\d\d", result.date or ""):
        out.append(f"date {result.date!r} is not YYYY-MM-DD")
    for key, fig in result.figures.items():
        if not (fig.quantity.strip() and fig.setup.strip()):
            out.append(f"{key}: no quantity or set-up")
        out += [f"{key}: {p}" for p in figure_problems(key, fig)]
    return out



def figure_problems(key: str, fig: figures.Figure) -> list[str]:
    """A figure is one number: a numeric value, a format with one placeholder and no other number, a key
    that does not spell a value (`ms-per-pass-up-1-52`)."""
    out = []
    if isinstance(fig.value, bool) or not isinstance(fig.value, (int, float)):
        out.append(f"value {fig.value!r} is not a number")
    fields = re.findall(r"\{[^{}]*\}", fig.fmt)
    if len(fields) != 1:
        out.append(f"format {fig.fmt!r} has {len(fields)} placeholders, not one")
    if re.search(r"\d", re.sub(r"\{[^{}]*\}", "", fig.fmt)):
        out.append(f"format {fig.fmt!r} carries a number of its own")
    if re.search(r"\d-\d", key):
        out.append("key spells a number (name what it measures)")
    if not fig.render() or not re.search(r"\d", fig.render()):
        out.append("renders no number")
    return out


def _control_result(tmp_path, **overrides) -> figures.Result:
    fig = figures.Figure(1.42, "tokens/s, hybrid γ 4 over per-token", "3g, bundled pair", "x", "{:.2f}×")
    path = figures.write_result("control", figures={"ratio": fig}, command="bench/headline.py --profiles 3g",
                                load_start=[0.5, 0.5, 0.5], results_dir=tmp_path)
    doc = json.loads(path.read_text())
    for k, v in overrides.items():
        if k.startswith("figure_"):
            doc["figures"]["ratio"][k.removeprefix("figure_")] = v
        else:
            doc[k] = v
    path.write_text(json.dumps(doc))
    return figures.read_result(path)


def test_a_result_without_its_provenance_is_caught(tmp_path):
    """Control for the check above: a file write_result wrote passes; each thing it lacks fails."""
    assert provenance_problems(_control_result(tmp_path)) == []
    assert provenance_problems(_control_result(tmp_path, machine={"as_stated": "2-vCPU VM, busy"}))
    assert provenance_problems(_control_result(tmp_path, load={"start": None, "end": None}))
    assert provenance_problems(_control_result(tmp_path, date="not recorded"))
    assert provenance_problems(_control_result(tmp_path, command="bench/no_such_bench.py --quick"))
    assert provenance_problems(_control_result(tmp_path, command="the section's first command block"))
    assert provenance_problems(_control_result(tmp_path, figure_fmt="{:.2f} and 6.09 tok/s"))
    assert provenance_problems(_control_result(tmp_path, figure_value="2.49 / 2.20 / 1.76×"))
    assert provenance_problems(_control_result(tmp_path, figure_fmt="{:.2f}× ({:.2f}×)"))
    for command in ("python -m netsim fleet --calibrate x", ".venv/bin/netsim experiment --profiles 3g",
                    "PYTHONPATH=. python bench/headline.py", "bash bench/netsim_fleet.sh"):
        assert command_exists(command), command
    assert not figure_problems("ms-per-pass-up-1-52", figures.Figure(1.52, "q", "s", "x", "{:.2f}×")) == []


def test_one_claim_one_number():
    dups = figures.duplicate_claims(figures.load())
    assert not dups, "figures that claim the same quantity for the same set-up:\n" + "\n".join(
        f"{a} and {b}" for a, b in dups)


def test_two_entries_with_one_claim_are_caught(tmp_path):
    """Control for the check above: the same claim in two result files is reported, case aside."""
    claim = dict(quantity="tokens/s, hybrid γ 4 over per-token", setup="3g, bundled pair, T 0.7")
    figures.write_result("run-a", figures={"ratio": figures.Figure(1.29, **claim)},
                         command="netsim experiment a", results_dir=tmp_path)
    figures.write_result("run-b", figures={"ratio": figures.Figure(1.54, **claim)},
                         command="netsim experiment b", results_dir=tmp_path)
    figures.write_result("run-c", figures={"ratio": figures.Figure(
        1.11, quantity="tokens/s, hybrid γ 4 over per-token", setup="3g, bundled pair, T 0")},
        command="netsim experiment c", results_dir=tmp_path)
    assert figures.duplicate_claims(figures.load(tmp_path)) == [("run-a/ratio", "run-b/ratio")]


def test_the_readme_carries_figures_and_a_span_edited_by_hand_is_caught():
    """Control for the page check: a span's value edited by hand is stale, and --render restores it."""
    text = README.read_text(encoding="utf-8")
    m = figures.SPAN.search(text)
    assert m, "README.md names no figure from the registry"
    edited = text[:m.start(4)] + "9.99×" + text[m.end(4):]
    registry = figures.load()
    assert figures.stale_spans(edited, registry)
    assert figures.render_spans(edited, registry) == text
    placeholder = text[:m.start()] + f'{{{{ {m.group(1)}("{m.group(2)}") }}}}' + text[m.end():]
    assert figures.stale_spans(placeholder, registry)
    assert figures.render_spans(placeholder, registry, mark_busy=bool(m.group(3))) == text


def test_an_unknown_name_is_refused():
    registry = figures.load()
    for page in ('{{ fig("no-such-result/x") }}', '{{ table("no-such-result/x") }}', '{{ source("nope") }}',
                 '<!-- fig:no-such-result/x -->1<!-- /fig -->'):
        try:
            figures.render_spans(page, registry)
        except figures.RegistryError:
            continue
        raise AssertionError(f"{page} rendered without a registry entry")


def _busy_registry(tmp_path, load: float, clock: str | None = "wall"):
    tok_s = figures.Figure(9.34, "tokens/s, cloud-only", "lan, control", "tok/s", "{:.1f} tok/s")
    passes = figures.Figure(0.31, "target passes per committed token, hybrid", "control", "", "{:.2f}")
    tab = figures.Table(["mode", "tok/s"], [["hybrid", 8.8]], {"tok/s": "{:.1f}"})
    path = figures.write_result("run", figures={"tok-s": tok_s, "passes": passes}, tables={"t": tab},
                                command="bench/headline.py", load_start=[load, load, load], results_dir=tmp_path)
    doc = json.loads(path.read_text())
    doc["load"]["end"] = [load, load, load]
    doc["machine"]["cores"] = 2
    if clock is None:
        del doc["clock"]
    else:
        doc["clock"] = clock
    path.write_text(json.dumps(doc))
    return figures.load(tmp_path)


def test_a_busy_wall_clock_figure_is_refused_unless_the_page_says_busy(tmp_path):
    """Load 3 on 2 cores (1.5 per core): tokens/s is refused unmarked and shown "(busy)" marked; a
    count from the same run, and the same figure on the virtual clock or quiet, render as they are."""
    busy = _busy_registry(tmp_path, 3.0)
    for page in ("x <!-- fig:run/tok-s -->9.3 tok/s<!-- /fig -->", 'x {{ fig("run/tok-s") }}',
                 "<!-- table:run/t -->x<!-- /table -->"):
        try:
            figures.render_spans(page, busy)
        except figures.BusyFigure as exc:
            assert "run/" in str(exc) and "1.5 per core" in str(exc) and "bench/headline.py" in str(exc)
        else:
            raise AssertionError(f"{page}: a busy wall-clock figure rendered unmarked")
    marked = "x <!-- fig:run/tok-s busy -->?<!-- /fig -->"
    assert figures.render_spans(marked, busy) == "x <!-- fig:run/tok-s busy -->9.3 tok/s (busy)<!-- /fig -->"
    assert "(busy) Recorded at a load of 1.5 per core" in figures.render_spans(
        "<!-- table:run/t busy --><!-- /table -->", busy)
    assert figures.render_spans("x <!-- fig:run/passes -->?<!-- /fig -->", busy) == \
        "x <!-- fig:run/passes -->0.31<!-- /fig -->"
    assert not figures.stale_spans("x <!-- fig:run/tok-s busy -->9.3 tok/s (busy)<!-- /fig -->", busy)
    assert figures.stale_spans("x <!-- fig:run/tok-s -->9.3 tok/s<!-- /fig -->", busy)
    # A file without the clock field is wall-clock; the virtual clock and a model do not depend on load.
    assert _busy_registry(tmp_path, 3.0, clock=None)["run"].busy_load() == 1.5
    for clock in ("virtual", "model"):
        assert figures.render_spans(marked, _busy_registry(tmp_path, 3.0, clock)) == \
            "x <!-- fig:run/tok-s -->9.3 tok/s<!-- /fig -->"
    # Quiet (0.8 on 2 cores = 0.4 per core): the busy flag is dropped by the render step.
    quiet = _busy_registry(tmp_path, 0.8)
    assert figures.render_spans(marked, quiet) == "x <!-- fig:run/tok-s -->9.3 tok/s<!-- /fig -->"
    assert figures.stale_spans(marked, quiet)


def test_a_span_never_begins_a_line():
    """A line that begins with an HTML comment breaks its paragraph (CommonMark, Python-Markdown): the render
    joins such a line to the one before, puts "Source:" before a source that begins a paragraph, and
    refuses a figure that does."""
    registry = figures.load()
    ref = next(f"{n}/{k}" for n, r in registry.items() for k in r.figures if figures._busy(registry, "fig", f"{n}/{k}") is None)
    value = figures.figure(registry, ref).render()
    assert figures.render_spans(f'it beats\n{{{{ fig("{ref}") }}}} cells', registry) == \
        f"it beats <!-- fig:{ref} -->{value}<!-- /fig --> cells"
    assert figures.stale_spans(f"it beats\n<!-- fig:{ref} -->{value}<!-- /fig --> cells", registry)
    assert figures.render_spans('Runs:\n\n{{ source("headline") }}\n', registry).startswith("Runs:\n\nSource: <!-- source:")
    try:
        figures.render_spans(f'Runs:\n\n{{{{ fig("{ref}") }}}} cells', registry)
    except figures.RegistryError as exc:
        assert "begins a paragraph" in str(exc)
    else:
        raise AssertionError("a figure that begins a paragraph was rendered")


# --- Wording: the pages are about today -----------------------------------------------------------

FORBIDDEN = [
    (re.compile(r"(?<![\w.~])/(?:work|tmp|root|home)/"), "a build machine's path"),
    (re.compile(r"\bhelpers?\b(?!\.py)", re.I), "who measured (a helper)"),
    (re.compile(r"\bthis session\b|\bother sessions'? (?:tests|test runs|builds|benchmarks)", re.I),
     "who measured (a session)"),
    (re.compile(r"\bother jobs\b", re.I), "what else ran on the machine"),
    (re.compile(r"bench\.lock|\bflock\b|\bunder the (?:bench )?lock\b", re.I), "a build machine's lock file"),
    (re.compile(r"\bissue \d+|\bthe issue's\b", re.I), "an internal issue number"),
    (re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})? ?UTC\b"), "a clock time"),
    (re.compile(r"\bwe\b", re.I), "'we' as the subject (say what the code does, or what a command prints)"),
    (re.compile(r"\bcommit(?:s|ted)?\b\W{0,3}(?:\w+\W+){0,3}`?(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b|\b(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}`?\W{0,3}commit", re.I),
     "a commit hash"),
    (re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"), "a commit hash (hex with letters and digits)"),
    (re.compile(r"\b(?:before|after) this change\b|\bwhat changed\b|\b(?:goals?|targets?) set\b|"
                r"\b(?:tables?|figures?|runs?|numbers?|measurements?)\b[^.]{0,60}\breplaced\b|"
                r"\breplaced\b[^.]{0,30}\b(?:tables?|figures?|runs?|ones above|ones below)\b|"
                r"\bsince this change\b|\bthis change\b", re.I), "history (it goes to CHANGELOG.md)"),
]
CONTROL_PAGE_WORDING = """\
# Window
Measured at 04:12 UTC, before this change (commit 4f2a9c1): we measured 1.19× on 3g.
The goals set for this work are below; the table replaced the earlier one.
"""


def wording_problems(text: str) -> list[str]:
    return [f"{n}: {what}: {m.group(0)!r}" for n, line in enumerate(text.splitlines(), 1)
            for pattern, what in FORBIDDEN if (m := pattern.search(line))]


def test_no_page_reads_like_a_lab_notebook():
    problems = [f"{path.relative_to(ROOT)}:{p}" for path in PAGES
                for p in wording_problems(path.read_text(encoding="utf-8"))]
    assert not problems, "pages that say who measured, when, or what changed:\n" + "\n".join(problems)


def test_the_forbidden_words_are_caught():
    """Control for the check above: each kind of lab-notebook line is caught, plain prose is not."""
    found = {what for line in CONTROL_PAGE_WORDING.splitlines() for pattern, what in FORBIDDEN
             if pattern.search(line)}
    assert {"a clock time", "a commit hash", "history (it goes to CHANGELOG.md)"} <= found
    assert any(w.startswith("'we'") for w in found)
    caught = lambda line: [what for pattern, what in FORBIDDEN if pattern.search(line)]  # noqa: E731
    assert caught("run under `flock /work/wt/bench.lock`")
    assert caught("shared with other helpers' test runs")
    assert caught("the verifier steers (issue 18, item 2)")
    assert caught("cached in /tmp/x")
    assert caught("We ran it on a Zen 4 VM")
    assert caught("see commit a4ff610 for the numbers")
    assert caught("old proxy at dd70c89 and the new one")
    assert caught("Against the targets set for this work: not reached")
    assert not caught("tests/helpers.py holds the batcher")
    assert not caught("other sessions carry on; ~/.cache/hybridspec/vocab")
    assert not caught("the edge commits 5 tokens at 12:30 a.m. western time; a web page")
    assert not caught("the committed length 1234567 is checked")
    assert not caught("otherwise replaced by a draw from p without x")


def _hook():
    import importlib.util
    spec = importlib.util.spec_from_file_location("figures_hook", ROOT / "docs" / "hooks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Page:
    def __init__(self, src_uri: str):
        self.file = type("File", (), {"src_uri": src_uri})()


def test_the_docs_hook_checks_and_stops_the_build_on_a_stale_or_unknown_figure():
    from mkdocs.exceptions import PluginError
    hook = _hook()
    hook.on_config({})
    registry = figures.load()
    ref = next(f"{n}/{k}" for n, r in registry.items() for k, f in r.figures.items()
               if figures._busy(registry, "fig", f"{n}/{k}") is None)
    current = figures.render_spans(f"x <!-- fig:{ref} -->?<!-- /fig --> y", registry)
    assert hook.on_page_markdown(current, _Page("x.md"), {}, None) == current
    for bad in (f"x <!-- fig:{ref} -->9.99<!-- /fig --> y", f'x {{{{ fig("{ref}") }}}} y',
                "<!-- fig:no-such-result/key -->1<!-- /fig -->"):
        try:
            hook.on_page_markdown(bad, _Page("bad.md"), {}, None)
        except PluginError as exc:
            assert "bad.md" in str(exc) and "--render" in str(exc)
        else:
            raise AssertionError(f"{bad!r} did not stop the build")
    changelog = hook.on_page_markdown("", _Page("changelog.md"), {}, None)
    assert changelog.startswith("# Changelog") and "](docs/" not in changelog


def test_a_runs_own_processes_do_not_make_it_busy():
    """The end reading less the run's own processes' mean CPU use (`load.own`) is the machine's other
    load: a benchmark that keeps both cores busy on a quiet machine is quiet; the same end reading
    with little of it the run's own, or recorded without `own`, is busy; a busy start stays busy."""
    def result(start: float, end: float, own: float | None) -> figures.Result:
        load = {"start": [start, start, start], "end": [end, end, end]} | ({} if own is None else {"own": own})
        return figures.Result("run", "bench/x.py", {"cores": 2}, load, "2026-12-07", {}, {})
    assert result(0.3, 2.1, 1.9).busy_load() is None
    assert result(0.3, 2.1, 0.4).busy_load() == pytest.approx(0.85)
    assert result(0.3, 2.1, None).busy_load() == pytest.approx(1.05)
    assert result(1.6, 2.1, 2.0).busy_load() == pytest.approx(0.8)
    assert "(1.9 of it the run's own)" in result(0.3, 2.1, 1.9).provenance()
