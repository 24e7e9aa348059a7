"""Choose which blocks to skip by greedy search on measured agreement (Draft & Verify style).

Draft & Verify (Zhang et al. 2023, arXiv 2309.08168) picks the layers a self-draft skips by
Bayesian optimisation on the acceptance it measures. With 30 blocks and a few minutes on two
cores, a greedy backward elimination is the affordable version: start from all blocks; in each
step try removing every remaining block, keep the removal that loses the least teacher-forced
greedy agreement with the full model on a small calibration set (ties broken by the T = 1
acceptance), and stop at the requested block count or before agreement would fall below the
threshold. To stay within a few minutes, only the first step tries every block; each later step
tries the `shortlist` blocks whose removal did least harm when last tried (a block that hurt a lot
alone rarely becomes harmless once another is gone). shortlist = 0 tries every block in every step.

The calibration prompts (edge_client/prompts/calibration.jsonl) are not the eval-draft prompts,
so eval-draft does not score a draft on the text it was chosen on.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from edge_client.draftmaker.evaluate import (CALIBRATION_PROMPTS, Progress, Prompt, load_prompts, prompt_ids,
                                             target_continuation, teacher_forced_logits)
from edge_client.draftmaker.layers import GGUFSource, format_blocks
from spec_core.warping import processed_probs

log = logging.getLogger(__name__)


@dataclass
class SearchStep:
    removed: int            # original block id dropped in this step
    blocks_left: int
    agreement: float        # teacher-forced greedy agreement after the removal
    alpha_t1: float         # mean sum_x min(p, q) at T = 1 after the removal
    candidates: int         # removals tried in this step
    seconds: float
    tried: list[int] = field(default_factory=list)  # the blocks tried, least harmful first


@dataclass
class SearchResult:
    kept: list[int]
    skipped: list[int]
    steps: list[SearchStep] = field(default_factory=list)
    stopped: str = ""       # why the search ended
    calibration: dict = field(default_factory=dict)
    candidates_evaluated: int = 0
    elapsed_s: float = 0.0

    def to_json(self) -> dict:
        out = asdict(self)
        out["kept_spec"] = format_blocks(self.kept)
        out["skipped_spec"] = format_blocks(self.skipped)
        return out


def _scratch_dir() -> str | None:
    # Candidate files are written and deleted ~100 times: keep that off the disk when tmpfs exists.
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


class _Calibration:
    """The full model's greedy continuations and teacher-forced distributions, computed once."""

    def __init__(self, target_path, prompts: Sequence[Prompt], n_tokens: int, threads: int):
        from llama_runtime import GGUFModel
        model = GGUFModel(target_path, n_threads=threads)
        try:
            ctx = model.new_context(n_ctx=2048)
            self.items = []  # (prompt ids, continuation, target argmax [rows], target probs at T=1 [rows, vocab])
            for prompt in prompts:
                ids = prompt_ids(model, prompt)
                cont = target_continuation(ctx, ids, n_tokens, 0.0, np.random.default_rng(0), model.eog_ids)
                logits = teacher_forced_logits(ctx, ids, cont)
                self.items.append((ids, cont, np.argmax(logits, axis=-1), processed_probs(logits, 1.0)))
            ctx.close()
        finally:
            model.close()
        self.positions = sum(len(c) for _, c, _, _ in self.items)

    def score(self, path: str | os.PathLike, threads: int) -> tuple[float, float]:
        """(greedy agreement, T=1 acceptance) of the draft at `path`, pooled over positions."""
        from llama_runtime import GGUFModel
        model = GGUFModel(path, n_threads=threads)
        try:
            ctx = model.new_context(n_ctx=2048)
            agree = soft = 0.0
            for ids, cont, target_argmax, target_probs in self.items:
                logits = teacher_forced_logits(ctx, ids, cont)
                agree += float((np.argmax(logits, axis=-1) == target_argmax).sum())
                soft += float(np.minimum(processed_probs(logits, 1.0), target_probs).sum())
            ctx.close()
        finally:
            model.close()
        return agree / self.positions, soft / self.positions


def greedy_skip_search(source: GGUFSource, *, target_blocks: int, min_agreement: float = 0.0,
                       candidates: Sequence[int] | None = None, prompts: Sequence[Prompt] | None = None,
                       n_prompts: int = 3, n_tokens: int = 32, threads: int = 1, shortlist: int = 8,
                       progress: Progress | None = None) -> SearchResult:
    """Backward elimination of blocks; returns the kept set and a log of every step.

    candidates: the blocks that may be removed (default: all).
    shortlist: blocks tried per step after the first (0 = all).
    """
    note = progress or (lambda msg: log.info("%s", msg))
    t0 = time.perf_counter()
    if not 1 <= target_blocks <= source.n_blocks:
        raise ValueError(f"target block count must be in 1..{source.n_blocks}, got {target_blocks}")
    prompts = list(prompts if prompts is not None else load_prompts(CALIBRATION_PROMPTS))[:n_prompts]
    removable = set(range(source.n_blocks) if candidates is None else candidates)
    note(f"calibration: target decodes {len(prompts)} x {n_tokens} greedy tokens")
    calib = _Calibration(source.path, prompts, n_tokens, threads)
    kept = list(range(source.n_blocks))
    result = SearchResult(kept=kept, skipped=[], calibration={
        "prompts": [p.text for p in prompts], "tokens_per_prompt": n_tokens, "positions": calib.positions,
        "target_blocks": target_blocks, "min_agreement": min_agreement, "shortlist": shortlist})
    known: dict[int, tuple[float, float]] = {}  # block -> (agreement, alpha_t1) when last tried without it
    with tempfile.TemporaryDirectory(prefix="draft-search-", dir=_scratch_dir()) as tmp:
        cand_path = Path(tmp) / "candidate.gguf"
        while len(kept) > target_blocks:
            step_t0 = time.perf_counter()
            tried = [b for b in kept if b in removable]
            if known and shortlist > 0:
                tried = sorted(tried, key=known.__getitem__, reverse=True)[:shortlist]
            if not tried:
                result.stopped = "no removable blocks left"
                break
            scores: dict[int, tuple[float, float]] = {}  # block -> (agreement, alpha_t1) without it
            for n, block in enumerate(tried, 1):
                source.write_subset(cand_path, [b for b in kept if b != block])
                scores[block] = calib.score(cand_path, threads)
                result.candidates_evaluated += 1
                lead = max(scores, key=scores.__getitem__)
                note(f"{len(kept)} blocks: tried dropping {n}/{len(tried)}; best so far block {lead} "
                     f"(agreement {scores[lead][0]:.3f})")
            known.update(scores)
            ranking = sorted(scores, key=scores.__getitem__, reverse=True)
            block = ranking[0]
            agreement, alpha_t1 = scores[block]
            if agreement < min_agreement:
                result.stopped = (f"dropping one more block (best: {block}) would give agreement {agreement:.3f} "
                                  f"< {min_agreement}")
                break
            kept = [b for b in kept if b != block]
            result.steps.append(SearchStep(block, len(kept), agreement, alpha_t1, len(tried),
                                           time.perf_counter() - step_t0, ranking))
            log.info("search: dropped block %d -> %d blocks, agreement %.3f", block, len(kept), agreement)
        else:
            result.stopped = f"reached {target_blocks} blocks"
    result.kept = kept
    result.skipped = sorted(set(range(source.n_blocks)) - set(kept))
    result.elapsed_s = time.perf_counter() - t0
    return result
