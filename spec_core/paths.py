"""Where hybridspec keeps what it can rebuild (cached vocabularies, probed model properties, converted
models): $HYBRIDSPEC_CACHE, else $XDG_CACHE_HOME/hybridspec, else ~/.cache/hybridspec. The one rule
for every package (scripts/llama_build.py, which runs before the project is installed, repeats it
for its wheel cache)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("HYBRIDSPEC_CACHE"):
        return Path(os.environ["HYBRIDSPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridspec"
