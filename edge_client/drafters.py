"""Drafters: the two-method contract (propose a draft; learn from the round's result).

A drafter proposes γ tokens after the committed sequence and, per token, the q it was sampled
from (spec_core.drafting.draft_step does the encode-then-sample), or None for point masses.
"""
from __future__ import annotations

import abc
import os
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from spec_core.drafting import QMode, draft_step
from spec_core.qcodec import EncodedQ
from spec_core.warping import SamplingSettings

# Where scripts/setup.sh puts the default draft (built from the bundled target; never committed).
DEFAULT_DRAFT = Path(os.environ.get("HYBRIDSPEC_MODELS", "models")) / "smollm2-draft.gguf"


@dataclass
class Draft:
    tokens: list[int]                   # [gamma]
    qs: list[EncodedQ] | None           # [gamma], or None: point-mass drafts (no q on the wire)
    seconds: float                      # time spent drafting


class Drafter(abc.ABC):
    name: str = "drafter"
    fingerprint: str | None = None      # tokenizer fingerprint, checked by the verifier

    @abc.abstractmethod
    def propose(self, committed: Sequence[int], gamma: int, settings: SamplingSettings, qmode: QMode,
                rng: np.random.Generator) -> Draft:
        """Up to `gamma` draft tokens following `committed`."""

    def observe(self, committed: Sequence[int], num_accepted: int) -> None:
        """Learn from a round's result (committed now holds the round's tokens)."""

    def close(self) -> None:
        pass


def _collect(tokens: list[int], qs: list[EncodedQ | None]) -> list[EncodedQ] | None:
    # A round's q payload is all-or-nothing: point masses everywhere or q everywhere.
    return None if not qs or any(q is None for q in qs) else qs  # type: ignore[return-value]


class GGUFDrafter(Drafter):
    """A small GGUF model on llama.cpp. Its KV cache is reused across rounds and rolled back to
    the committed prefix; only the last row's logits are computed per step (no logits_all)."""

    name = "gguf"

    def __init__(self, path, n_threads: int | None = None, n_ctx: int = 2048):
        """`path`: a GGUF file, or a GGUFModel already loaded that several drafters share (each
        has its own KV cache; the caller keeps the model and closes it)."""
        from llama_runtime import GGUFModel
        self._owns_model = not isinstance(path, GGUFModel)
        self.model = GGUFModel(path, n_threads=n_threads) if self._owns_model else path
        self.ctx = self.model.new_context(n_ctx)
        self.fingerprint = self.model.fingerprint
        self.tokens_decoded = 0

    def propose(self, committed, gamma, settings, qmode, rng) -> Draft:
        t0 = time.perf_counter()
        seq = list(committed)
        gamma = min(gamma, self.ctx.n_ctx - len(seq))
        tokens, qs = [], []
        for _ in range(gamma):
            logits = self.ctx.logits(seq, 1)[0]
            tok, q = draft_step(logits, settings, qmode, rng)
            tokens.append(tok)
            qs.append(q)
            seq.append(tok)
        return Draft(tokens, _collect(tokens, qs), time.perf_counter() - t0)

    def close(self) -> None:
        self.ctx.close()
        if self._owns_model:
            self.model.close()


class PromptLookupDrafter(Drafter):
    """No model: propose the tokens that followed the latest earlier occurrence of the longest
    suffix n-gram (prompt lookup decoding). Drafts are point masses, which is exact."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, fingerprint: str | None = None):
        self.max_ngram, self.min_ngram, self.fingerprint = max_ngram, min_ngram, fingerprint

    def propose(self, committed, gamma, settings, qmode, rng) -> Draft:
        t0 = time.perf_counter()
        seq = list(committed)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start: start + n] == tail:
                    follow = seq[start + n: start + n + gamma]
                    return Draft(follow, None, time.perf_counter() - t0)
        return Draft([], None, time.perf_counter() - t0)


class SyntheticDrafter(Drafter):
    """The draft half of spec_core.synthetic's pair, with an optional per-token cost (sleep)."""

    name = "synthetic"

    def __init__(self, vocab: int = 64, seed: int = 0, noise: float = 1.0, order: int = 1,
                 per_token_ms: float = 0.0):
        from spec_core.synthetic import synthetic_fingerprint, synthetic_pair
        _, self.lm = synthetic_pair(vocab, seed, noise, order)
        self.per_token_s = per_token_ms / 1000
        self.fingerprint = synthetic_fingerprint(vocab)

    def propose(self, committed, gamma, settings, qmode, rng) -> Draft:
        t0 = time.perf_counter()
        seq = list(committed)
        tokens, qs = [], []
        for _ in range(gamma):
            tok, q = draft_step(self.lm.logits(seq), settings, qmode, rng)
            tokens.append(tok)
            qs.append(q)
            seq.append(tok)
        if self.per_token_s:
            time.sleep(self.per_token_s * gamma)
        return Draft(tokens, _collect(tokens, qs), time.perf_counter() - t0)
