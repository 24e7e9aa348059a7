"""The embedded default: a GGUF target on llama.cpp (CPU), one KV cache per session."""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from cloud_verifier.backends.base import Backend, BackendInfo
from llama_runtime import GGUFModel, KVContext
from spec_core.tree import DraftTree


class LlamaCppBackend(Backend):
    def __init__(self, model: str, n_ctx: int = 2048, n_threads: int | None = None, n_batch: int = 512,
                 max_tree_leaves: int = 64):
        self.model = GGUFModel(model, n_threads=n_threads)
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.info = BackendInfo("llama.cpp", self.model.name, self.model.n_vocab, n_ctx,
                                self.model.fingerprint, self.model.eog_ids)
        self._forwarded = 0  # tokens pushed through the target, all sessions
        self.n_seq_max = max_tree_leaves + 1  # sequence 0 + a scratch id per tree leaf

    def new_state(self) -> KVContext:
        return self.model.new_context(self.n_ctx, self.n_batch, self.n_seq_max)

    def release(self, state: KVContext) -> None:
        with self.model.lock:  # never free a context while a decode runs on this model
            state.close()

    def target_logits(self, state: KVContext, tokens: Sequence[int], rows: int) -> tuple[np.ndarray, float, float]:
        t0 = time.perf_counter()
        with self.model.lock:
            t1 = time.perf_counter()
            before = state.tokens_decoded
            logits = state.logits(tokens, rows)
            self._forwarded += state.tokens_decoded - before
            t2 = time.perf_counter()
        return logits, t1 - t0, t2 - t1

    def tree_logits(self, state: KVContext, committed: Sequence[int], tree: DraftTree):
        """The whole tree in one target pass (KVContext.tree_logits)."""
        t0 = time.perf_counter()
        with self.model.lock:
            t1 = time.perf_counter()
            before = state.tokens_decoded
            logits = state.tree_logits(committed, tree.tokens, tree.parents)
            self._forwarded += state.tokens_decoded - before
            t2 = time.perf_counter()
        return logits, t1 - t0, t2 - t1

    def keep_tree_path(self, state: KVContext, committed, tree: DraftTree, path) -> None:
        with self.model.lock:
            state.keep_tree_path(path, [tree.tokens[i] for i in path])

    def close(self) -> None:
        with self.model.lock:
            self.model.close()

    def forward_tokens(self) -> int:
        return self._forwarded
