"""MkDocs hook: every measured figure on a page is rendered from the registry (bench/results/).

A page names a figure instead of typing it: `{{ fig("<result>/<key>") }}` becomes the number as its
result file formats it, `{{ table("<result>/<key>") }}` a Markdown table, and `{{ source("<result>") }}`
the line that says which command, machine and date produced it. A name the registry does not hold
stops the build with a message that names the page. The rendering itself lives in
`hybridspec.figures.render`, which README.md's rendering (`python -m hybridspec.figures --readme`)
shares.

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


def on_config(config):
    global _registry
    _registry = figures.load()
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "changelog.md":
        # Links in CHANGELOG.md point from the repository root (docs/x.md); on the site they are x.md.
        markdown = re.sub(r"\]\(docs/", "](", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"))
    try:
        return figures.render(markdown, _registry if _registry is not None else figures.load())
    except figures.RegistryError as exc:
        raise PluginError(f"{page.file.src_uri}: {exc}") from None
