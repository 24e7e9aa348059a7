"""The README's headline figures come from the benchmarks page, and no page says where it was built.

Each number in the "figure" column of the README's headline table must appear on
docs/benchmarks.md: in the section the row links to when it links there, else anywhere on the
page. So a figure cannot be changed in the README alone, and a section cannot be re-measured
without the README following. Numbers are compared as numbers written on the page (thousands
separators ignored), not as floats: "0.38" does not match "0.380".

Pages are the project's, not a lab notebook: no page may carry a build machine's path or words
about who measured or what else ran on the machine.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.,])\d+(?:\.\d+)?(?![\w])")
LINK = re.compile(r"\]\(docs/benchmarks\.md(?:#([^)\s]+))?\)")
HEADLINE = "## Headline figures"

# A build machine's paths, and words about who measured or who else was on the machine.
FORBIDDEN = [
    (re.compile(r"(?<![\w.~])/(?:work|tmp|root|home)/"), "a build machine's path"),
    (re.compile(r"\bhelpers?\b(?!\.py)", re.I), "who measured (a helper)"),
    (re.compile(r"\bthis session\b|\bother sessions'? (?:tests|test runs|builds|benchmarks)", re.I),
     "who measured (a session)"),
    (re.compile(r"bench\.lock|\bflock\b|\bunder the (?:bench )?lock\b", re.I), "a build machine's lock file"),
    (re.compile(r"\bissue \d+|\bthe issue's\b", re.I), "an internal issue number"),
]


def numbers(text: str) -> set[str]:
    """The numbers written in text, thousands separators removed ("1,469.2" -> "1469.2")."""
    return {m.group(0).replace(",", "") for m in NUMBER.finditer(text)}


def _slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (as tests/test_docs.py computes it)."""
    import unicodedata
    text = re.sub(r"`|\*\*|\*", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def sections(page: str) -> dict[str, str]:
    """Each heading's anchor -> its text up to the next heading of the same or a higher level."""
    lines = page.splitlines()
    heads, fenced = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced  # a "# comment" in a code block is not a heading
        elif not fenced and (m := re.match(r"^(#+)\s+(.+?)\s*$", line)):
            heads.append((i, len(m.group(1)), m.group(2)))
    out = {}
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
        out[_slug(title)] = "\n".join(lines[i:end])
    return out


def headline_rows(readme: str) -> list[tuple[str, str, str]]:
    """(what, figure, details) for each row of the README's headline table."""
    text = readme[readme.index(HEADLINE):]
    text = text[:text.index("\n## ", len(HEADLINE))]
    rows = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith("| what ") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, f"a headline row without 3 cells: {line}"
        rows.append((cells[0], cells[1], cells[2]))
    return rows


def missing_figures(figure: str, where: str) -> set[str]:
    return numbers(figure) - numbers(where)


def test_the_number_reader():
    assert numbers("1,469.2 vs 117.6 tok/s; 61–72%; 2.20× (median of 3)") == {
        "1469.2", "117.6", "61", "72", "2.20", "3"}
    assert numbers("H200 fleet, 10^6 edges, Q4_0, γ=4") >= {"10", "6", "4"}
    assert "200" not in numbers("H200") and "0" not in numbers("Q4_0")


def test_headline_table_is_read():
    rows = headline_rows(README.read_text(encoding="utf-8"))
    assert len(rows) >= 10, "the README's headline table was not found or has too few rows"
    assert sum(bool(numbers(fig)) for _, fig, _ in rows) >= 10


def test_every_headline_figure_is_on_the_benchmarks_page():
    readme = README.read_text(encoding="utf-8")
    page = BENCHMARKS.read_text(encoding="utf-8")
    anchors = sections(page)
    problems = []
    for what, figure, details in headline_rows(readme):
        link = LINK.search(details)
        if link and link.group(1):
            assert link.group(1) in anchors, f"{what!r} links to benchmarks.md#{link.group(1)}: no such section"
            where, place = anchors[link.group(1)], f"section #{link.group(1)}"
        else:
            where, place = page, "the page"
        if missing := missing_figures(figure, where):
            problems.append(f"{what!r}: {sorted(missing)} not in {place} of docs/benchmarks.md")
    assert not problems, "README headline figures missing from docs/benchmarks.md:\n" + "\n".join(problems)


def test_a_figure_changed_in_the_readme_alone_is_caught():
    """Negative control: a figure not on the page is reported, one on the page is not."""
    page = BENCHMARKS.read_text(encoding="utf-8")
    section = sections(page)["the-netsim-experiment"]
    assert missing_figures("0.31 vs 1.00", section) == set()
    assert missing_figures("0.37 vs 1.00", section) == {"0.37"}
    assert missing_figures("1,469.2 tok/s", section) == {"1469.2"}  # on the page, in another section
    assert missing_figures("1,469.2 tok/s", page) == set()
    assert missing_figures("987.65 tok/s", page) == {"987.65"}


def test_no_page_says_where_it_was_built_or_who_measured():
    problems = []
    for path in PAGES:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for pattern, what in FORBIDDEN:
                if m := pattern.search(line):
                    problems.append(f"{path.relative_to(ROOT)}:{n}: {what}: {m.group(0)!r}")
    assert not problems, "pages that say where they were built or who measured:\n" + "\n".join(problems)


def test_the_forbidden_words_are_caught():
    """Negative control for the check above."""
    caught = lambda line: [what for pattern, what in FORBIDDEN if pattern.search(line)]  # noqa: E731
    assert caught("run under `flock /work/wt/bench.lock`")
    assert caught("shared with other helpers' test runs")
    assert caught("the verifier steers (issue 18, item 2)")
    assert caught("cached in /tmp/x")
    assert not caught("tests/helpers.py holds the batcher")
    assert not caught("other sessions carry on; ~/.cache/hybridspec/vocab")
