"""Pictures a reader can trust: each picture on a page is drawn from the current result files, by a
script in the repository, with its command under it.

`python -m hybridspec.plots` draws every picture of `hybridspec.plots.PICTURES` into docs/img/ and
records in each SVG's metadata the SHA-256 of every result file it read (git keeps no file times,
so content decides whether a picture is older than its data). So:

(a) no picture is older than a result file it is drawn from, and every picture exists;
(b) every image a page shows (README.md, docs/**) is one of those pictures, and the line under it
    gives the command that draws it;
(c) the pages show at least five of them.

Control: a picture whose recorded hash differs from its result file's is reported stale. Cheap: it
hashes a few JSON files and reads the SVGs' first lines (no drawing).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from hybridspec import figures, plots

ROOT = Path(__file__).resolve().parents[1]
PAGES = figures.markdown_files(ROOT)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _shown() -> list[tuple[Path, int, str]]:
    """(page, line number, picture name) for each image a page shows."""
    out = []
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for target in IMAGE.findall(line):
                out.append((page, n, (page.parent / target).resolve()))
    return out


def test_every_picture_is_drawn_from_the_current_result_files():
    problems = [p for pic in plots.PICTURES for p in plots.stale(pic)]
    assert not problems, ("pictures older than their data (run `python -m hybridspec.plots`):\n" + "\n".join(problems))


def test_every_image_on_a_page_is_a_drawn_picture_with_its_command_under_it():
    known = {pic.path.resolve(): pic for pic in plots.PICTURES}
    problems = []
    for page, n, target in _shown():
        where = f"{page.relative_to(ROOT)}:{n}"
        if target not in known:
            problems.append(f"{where}: {target} is not drawn by hybridspec.plots (add it to PICTURES)")
            continue
        lines = page.read_text(encoding="utf-8").splitlines()
        after = " ".join(lines[n - 1:n + 2])
        if plots.COMMAND not in after:
            problems.append(f"{where}: the line under {target.name} does not give `{plots.COMMAND}`")
    assert not problems, "\n".join(problems)


def test_the_pages_show_at_least_five_pictures():
    shown = {target for _, _, target in _shown()}
    assert len(shown) >= 5, f"the pages show {len(shown)} pictures: {sorted(p.name for p in shown)}"


def test_a_picture_older_than_its_result_is_caught(tmp_path, monkeypatch):
    """Control for (a): the same picture against a result file whose content changed is stale."""
    pic = next(p for p in plots.PICTURES if p.sources)
    results = tmp_path / "results"
    results.mkdir()
    for name in pic.sources:
        shutil.copy(figures.RESULTS / f"{name}.json", results / f"{name}.json")
    assert plots.stale(pic, results) == []
    doc = json.loads((results / f"{pic.sources[0]}.json").read_text())
    doc["date"] = "2099-01-01"
    (results / f"{pic.sources[0]}.json").write_text(json.dumps(doc))
    assert plots.stale(pic, results), "a picture drawn from an older result file was not caught"
    monkeypatch.setattr(plots, "IMG", tmp_path / "img")
    assert any("missing" in s for s in plots.stale(pic, results))
