"""make-draft: build a draft GGUF from a target GGUF, and record how it was made.

Methods:
  copy            the target itself, byte for byte. A STAND-IN for tests and demos, not a draft:
                  it is exactly as slow as the target.
  requant         the target requantized to a cheaper type (quantize.py).
  skip            the target without some blocks (layers.py).
  skip+requant    both: blocks dropped first, then requantized.
  search          blocks chosen by greedy search on measured agreement (search.py).
  search+requant  the searched subset, then requantized.
Every output is loaded once and its tokenizer fingerprint compared with the target's; the
provenance (method, blocks, type, search log) goes to OUT.json next to the file.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from edge_client.draftmaker.evaluate import Progress
from edge_client.draftmaker.quantize import requantize

log = logging.getLogger(__name__)

METHODS = ("copy", "requant", "skip", "skip+requant", "search", "search+requant")


@dataclass
class DraftSpec:
    method: str = "requant"
    ftype: str = "Q4_0"                 # requant methods
    embd_type: str | None = None        # requant methods: token embedding / output head type
    drop: Sequence[int] = ()            # skip methods: original block ids to drop
    search_blocks: int | None = None    # search: stop at this many blocks (default: n_blocks - 4)
    min_agreement: float = 0.5          # search: never go below this calibration agreement
    search_candidates: Sequence[int] | None = None  # search: blocks it may drop (default: all)
    search_shortlist: int = 8           # search: blocks tried per step after the first (0 = all)
    calib_prompts: int = 3
    calib_tokens: int = 32
    threads: int = 1
    extra: dict = field(default_factory=dict)


def sidecar_path(out: str | os.PathLike) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".json")


def make_draft(target: str | os.PathLike, out: str | os.PathLike, spec: DraftSpec,
               progress: Progress | None = None) -> dict:
    """Build `out` from `target` as `spec` says; returns (and writes to OUT.json) the provenance."""
    from llama_runtime import GGUFModel

    from edge_client.draftmaker.layers import GGUFSource, format_blocks  # gguf: the `draft` extra

    if spec.method not in METHODS:
        raise ValueError(f"unknown method {spec.method!r}; choose one of {', '.join(METHODS)}")
    note = progress or (lambda msg: log.info("%s", msg))
    target, out = Path(target), Path(out)
    if not target.is_file():
        raise FileNotFoundError(f"no target GGUF at {target}")
    if out.resolve() == target.resolve():
        raise ValueError("--out must not be the target file")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    info: dict = {"method": spec.method, "target": str(target), "out": str(out)}
    requant = spec.method.endswith("+requant") or spec.method == "requant"

    with tempfile.TemporaryDirectory(prefix="make-draft-", dir=out.parent) as tmp:
        stage = target
        if spec.method == "copy":
            note("copying the target (a stand-in, not a cheaper draft)")
            info["note"] = "stand-in: a byte copy of the target; as slow as the target, not a real draft"
            shutil.copyfile(target, out)
            stage = out
        elif spec.method.startswith(("skip", "search")):
            note("reading the target's GGUF metadata")
            source = GGUFSource(target)
            info["blocks_before"] = source.n_blocks
            if spec.method.startswith("skip"):
                drop = sorted(set(spec.drop))
                if not drop:
                    raise ValueError("method skip needs the blocks to drop (--drop 4-7)")
                if drop[-1] >= source.n_blocks:
                    raise ValueError(f"block {drop[-1]} does not exist: {target.name} has blocks "
                                     f"0-{source.n_blocks - 1}")
                keep = [b for b in range(source.n_blocks) if b not in set(drop)]
                if not keep:
                    raise ValueError("that drops every block")
            else:
                from edge_client.draftmaker.search import greedy_skip_search
                target_blocks = spec.search_blocks or max(1, source.n_blocks - 4)
                result = greedy_skip_search(source, target_blocks=target_blocks, min_agreement=spec.min_agreement,
                                            candidates=spec.search_candidates, n_prompts=spec.calib_prompts,
                                            n_tokens=spec.calib_tokens, threads=spec.threads,
                                            shortlist=spec.search_shortlist, progress=note)
                info["search"] = result.to_json()
                keep = result.kept
            info["kept_blocks"] = format_blocks(keep)
            info["dropped_blocks"] = format_blocks(set(range(source.n_blocks)) - set(keep))
            info["blocks"] = len(keep)
            stage = Path(tmp) / "skip.gguf" if requant else out
            note(f"writing {len(keep)} of {source.n_blocks} blocks")
            source.write_subset(stage, keep)
        if requant:
            note(f"requantizing to {spec.ftype}" + (f" (embeddings {spec.embd_type})" if spec.embd_type else ""))
            requantize(stage, out, spec.ftype, spec.embd_type, n_threads=spec.threads)
            info["ftype"] = spec.ftype
            info["embd_type"] = spec.embd_type

    note("checking the draft loads and shares the target's tokenizer")
    draft_model = GGUFModel(out, n_threads=1)
    target_vocab = GGUFModel(target, vocab_only=True)
    try:
        if draft_model.fingerprint != target_vocab.fingerprint:
            raise RuntimeError(f"{out.name}: tokenizer fingerprint differs from the target's; this is a bug")
        info["fingerprint"] = draft_model.fingerprint
        block_count = draft_model.metadata(f"{draft_model.metadata('general.architecture')}.block_count")
        info["blocks"] = int(block_count) if block_count else info.get("blocks")
    finally:
        draft_model.close()
        target_vocab.close()
    info["bytes"] = out.stat().st_size
    info["target_bytes"] = target.stat().st_size
    info["elapsed_s"] = time.perf_counter() - t0
    info.update(spec.extra)
    sidecar_path(out).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info
