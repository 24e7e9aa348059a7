"""The backend interface: per-session state and the target's logits at the rows a round needs.

A backend supplies raw target logits; the engine turns them into p with spec_core.warping and
runs spec_core.verify, so exactness lives in one place. A backend that cannot return full
logits cheaply (vLLM) overrides `verify` / `sample_next` with its own exact mechanism.
Methods are synchronous and called from a worker thread; a backend serialises its own model.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from spec_core.qcodec import EncodedQ
from spec_core.verify import RoundResult, verify_round_on_logits
from spec_core.warping import SamplingSettings, processed_probs, sample


@dataclass(frozen=True)
class BackendInfo:
    name: str                 # "llama.cpp", "vllm", "synthetic"
    model: str                # file or folder name
    n_vocab: int
    n_ctx: int                # context window per session
    fingerprint: str          # spec_core.fingerprint of the target tokenizer
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)


class NoFreeState(Exception):
    """`new_state` found no room (every KV slot is held); the engine may evict an idle session."""


class Backend(abc.ABC):
    info: BackendInfo
    # Sessions + Generate streams the backend can hold at once; None: only the engine's limits.
    max_states: int | None = None

    @abc.abstractmethod
    def new_state(self) -> object:
        """Per-session state (a KV cache); may be created lazily and is released with `release`."""

    def release(self, state: object) -> None:
        """Free what `new_state` made."""

    @abc.abstractmethod
    def target_logits(self, state: object, tokens: Sequence[int], rows: int) -> tuple[np.ndarray, float, float]:
        """Raw logits predicting tokens[-rows+1:] and the next one  # [rows, vocab].

        Returns (logits, queue_s, model_s): time spent waiting for the model and in it.
        """

    def verify(self, state: object, committed: Sequence[int], draft_tokens: Sequence[int],
               draft_probs: Sequence[EncodedQ | None] | None, settings: SamplingSettings,
               rng: np.random.Generator) -> tuple[RoundResult, float, float]:
        gamma = len(draft_tokens)
        logits, queue_s, model_s = self.target_logits(state, list(committed) + list(draft_tokens), gamma + 1)
        # p is warped row by row as the round reaches it (rows after a rejection are not needed).
        return verify_round_on_logits(logits, settings, draft_tokens, draft_probs, rng), queue_s, model_s

    def sample_next(self, state: object, tokens: Sequence[int], settings: SamplingSettings,
                    rng: np.random.Generator) -> tuple[int, float, float]:
        logits, queue_s, model_s = self.target_logits(state, tokens, 1)
        probs = processed_probs(logits[0], settings.temperature, settings.top_k, settings.top_p)
        return sample(probs, rng), queue_s, model_s

    def forward_tokens(self) -> int:
        """Tokens pushed through the target so far (for cost-per-token figures)."""
        return 0

    def close(self) -> None:
        pass
