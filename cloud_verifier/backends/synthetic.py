"""A synthetic target (spec_core.synthetic) with a configurable per-forward cost, for fast sweeps
and for simulating a loaded cloud. Its distributions are exact, so tests can compare against them."""
from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np

from cloud_verifier.backends.base import Backend, BackendInfo
from spec_core.synthetic import SyntheticLM, synthetic_fingerprint
from spec_core.tree import DraftTree


class SyntheticBackend(Backend):
    def __init__(self, vocab: int = 64, seed: int = 0, order: int = 1, n_ctx: int = 4096,
                 step_ms: float = 0.0, per_token_ms: float = 0.0, eos_token_ids: Sequence[int] = (1,)):
        self.lm = SyntheticLM(vocab, seed, order=order)
        self.step_s, self.per_token_s = step_ms / 1000, per_token_ms / 1000
        self.info = BackendInfo("synthetic", f"synthetic-v{vocab}-s{seed}", vocab, n_ctx,
                                synthetic_fingerprint(vocab), frozenset(eos_token_ids))
        self._lock = threading.Lock()
        self._forwarded = 0

    def new_state(self) -> dict:
        return {"cached": 0}

    def target_logits(self, state: dict, tokens: Sequence[int], rows: int):
        t0 = time.perf_counter()
        with self._lock:
            t1 = time.perf_counter()
            new = max(rows, len(tokens) - state["cached"])
            self._forwarded += new
            out = np.stack([self.lm.logits(tokens[: len(tokens) - rows + 1 + i]) for i in range(rows)])
            state["cached"] = len(tokens)
            cost = self.step_s + self.per_token_s * new
            if cost > 0:
                time.sleep(cost)
            t2 = time.perf_counter()
        return out, t1 - t0, t2 - t1

    def tree_logits(self, state: dict, committed: Sequence[int], tree: DraftTree):
        """One pass for the tree: costs step + per_token × (new committed tokens + nodes), like a
        backend that batches every node (a GPU's cost is nearly flat in the node count: per_token ≈ 0)."""
        t0 = time.perf_counter()
        with self._lock:
            t1 = time.perf_counter()
            committed = list(committed)
            new = max(1, len(committed) - state["cached"]) + len(tree)
            self._forwarded += new
            ctxs = [committed] + [committed + [tree.tokens[j] for j in tree.path_to(i)] for i in range(len(tree))]
            out = np.stack([self.lm.logits(c) for c in ctxs])
            state["cached"] = len(committed)
            cost = self.step_s + self.per_token_s * new
            if cost > 0:
                time.sleep(cost)
            t2 = time.perf_counter()
        return out, t1 - t0, t2 - t1

    def keep_tree_path(self, state: dict, committed, tree, path) -> None:
        state["cached"] = len(committed) + len(path)  # as a KV cache keeping the kept path would

    def forward_tokens(self) -> int:
        return self._forwarded
