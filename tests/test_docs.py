"""The documentation: the README is a newcomer's first screen, and the docs site builds cleanly.

`mkdocs build --strict` fails on a broken link, a missing anchor or a page left out of the nav
(mkdocs.yml's `validation` section), so a renamed heading or a moved page is caught here. mkdocs
and mkdocs-material are development dependencies: when they are missing the test fails and says
how to get them, rather than skipping.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 300
FIRST_SCREEN_LINES = 60
# The two commands, exactly as a newcomer types them.
TWO_COMMANDS = ("scripts/demo.sh", "scripts/test.sh")


def _mkdocs_command() -> list[str]:
    """mkdocs from this interpreter's environment (the venv the tests run in), else from PATH."""
    try:
        import mkdocs  # noqa: F401
        import material  # noqa: F401  (the theme mkdocs.yml names)
    except ImportError as exc:
        if shutil.which("mkdocs") is None:
            pytest.fail(f"mkdocs or mkdocs-material is not installed ({exc}); they are development "
                        "dependencies: run scripts/setup.sh (or pip install -e '.[docs]')", pytrace=False)
        return ["mkdocs"]
    return [sys.executable, "-m", "mkdocs"]


def test_docs_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run([*_mkdocs_command(), "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # Material's banner
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (site / "index.html").is_file()
    assert (site / "benchmarks" / "index.html").is_file()


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/")


def test_readme_first_screen_has_the_two_commands():
    first_screen = README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN_LINES]
    for command in TWO_COMMANDS:
        assert any(line.lstrip().startswith(command) for line in first_screen), (
            f"{command!r} is not in the first {FIRST_SCREEN_LINES} lines of README.md")


def _slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading; GitHub agrees for ASCII headings."""
    text = re.sub(r"`|\*\*|\*", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_readme_links_into_docs_resolve():
    """README.md is outside the site, so mkdocs does not check its links: check them here."""
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", README.read_text(encoding="utf-8"))
    assert links, "README.md links to no page in docs/"
    for page, anchor in links:
        path = ROOT / page
        assert path.is_file(), f"README.md links to {page}, which does not exist"
        if anchor:
            text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
            headings = re.findall(r"^#+\s+(.+?)\s*$", text, flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"README.md links to {page}#{anchor}: no such heading"


def _nav_pages() -> list[str]:
    """Every page in mkdocs.yml's nav, as its path under docs/."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:", 1)[1]
    return re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, flags=re.M)


def unreachable(pages: list[str], text: str, prefix: str) -> list[str]:
    """The pages a list of links (README's list, docs/index.md's table) does not link to."""
    linked = set(re.findall(r"\]\(" + re.escape(prefix) + r"([\w/.-]+\.md)(?:#[^)\s]*)?\)", text))
    return [p for p in pages if p not in linked and p != "index.md"]


def test_every_page_is_reachable_from_the_readme_and_the_index():
    pages = _nav_pages()
    assert len(pages) >= 20 and "benchmarks.md" in pages and "reference/netsim.md" in pages
    readme = README.read_text(encoding="utf-8")
    readme_list = readme[readme.index("## Documentation"):]
    assert not unreachable([p for p in pages if p != "changelog.md"], readme_list, "docs/"), (
        "pages the README's documentation list does not link")
    assert "](CHANGELOG.md)" in readme_list, "the README's list does not link CHANGELOG.md"
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert not unreachable(pages, index, ""), "pages docs/index.md does not link"


def test_an_unlinked_page_is_caught():
    """Control for the check above."""
    assert unreachable(["a.md", "b.md", "sub/c.md"], "[A](docs/a.md#x) and [C](docs/sub/c.md)", "docs/") == ["b.md"]
