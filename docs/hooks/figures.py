"""MkDocs hook: the site shows the figures the files carry, and stops when a file is out of date.

Every measured figure is written into the Markdown files themselves, as a marked span
(`<!-- fig:<result>/<key> -->1.78×<!-- /fig -->`, tables and sources likewise), by
`python -m hybridspec.figures --render` (hybridspec/figures.py), so the repository's web view and the
site agree. This hook substitutes nothing: it checks that each page equals its rendering from the
registry (bench/results/) and stops the build with the page's name and the command that fixes it when
a span is stale, names a figure the registry does not hold, shows a busy wall-clock figure unmarked, or
when a `{{ fig(...) }}` placeholder is left.

The changelog page (docs/changelog.md) is the repository's CHANGELOG.md, read at build time, so the
history has one file.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:          # mkdocs run from a checkout without the package installed
    sys.path.insert(0, str(ROOT))

from hybridspec import figures  # noqa: E402

_registry: dict | None = None
FIX = "run `python -m hybridspec.figures --render` (hybridspec/figures.py)"


def on_config(config):
    global _registry
    _registry = figures.load()
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "changelog.md":
        # Links in CHANGELOG.md point from the repository root (docs/x.md); on the site they are x.md.
        markdown = re.sub(r"\]\(docs/", "](", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"))
    problems = figures.stale_spans(markdown, _registry if _registry is not None else figures.load())
    if problems:
        raise PluginError(f"{page.file.src_uri}: the file differs from the registry: {'; '.join(problems[:5])}"
                          f"{' …' if len(problems) > 5 else ''}. {FIX}")
    return markdown
