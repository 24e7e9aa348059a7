"""The embedded default: a GGUF target on llama.cpp (CPU).

batching=False (the default): the serial verifier, one context per session and one round at
a time. batching=True: one llama.cpp context whose KV cache holds every session as a sequence
id; rounds and Generate steps of different sessions are evaluated together by a continuous
`Batcher`. The number of sessions is bounded by KV memory: `kv_tokens` cells, each session
reserving `n_ctx` of them.

Both evaluate the target batch-invariantly (llama_runtime.model.INVARIANT_UBATCH, cut per model by
GGUFModel.invariant_ubatch: 32 tokens a decode for SmolLM2, 6 for Gemma 3): a session's
logits do not depend on how its cache was built (rounds, single tokens, or a replay after a
restart) nor on which sessions share a pass; in the shared cache because SharedKV keeps every
session's cells in position order (it retires freed cells and compacts).

Token trees (tree_logits / keep_tree_path): in the serial verifier one pass per tree on scratch
sequences of the session's own context; with batching a llama_runtime.TreeJob, whose nodes go
through the batcher like any other tokens, on tree sequence ids lent for the round (one per leaf;
`max_tree_leaves` of them in all, shared by the sessions' trees in flight).

With batching, `cloud_verifier.backends.kvpark.SeqBook` keeps each session's place in the cache,
counts the time its KV sits idle between rounds, and with `kv_park` parks idle sessions' cells
in host memory (at most `kv_park_bytes`) when the cache is short: the cache then holds more
sessions than it has places for (`max_states`). With `kv_store` (a folder) every session's cells
are checkpointed there, and a replay restores the longest stored prefix of its tokens instead of
prefilling it (cloud_verifier.backends.kvstore; docs/operations.md).
"""
from __future__ import annotations

import functools
import time
from typing import Sequence

import numpy as np

from cloud_verifier import metrics
from cloud_verifier.backends.base import (MAX_FUSED_NODES, BackendInfo, Capabilities, LogitsBackend, NoChatTemplate,
                                          NoFreeState)
from cloud_verifier.backends.batcher import Batcher, BatchStep
from cloud_verifier.backends.kvpark import (DEFAULT_KV_PARK_BYTES, DEFAULT_KV_SESSIONS, PlacePacker, SeqBook, SeqState,
                                            check_park_options)
from cloud_verifier.backends.kvstore import (DEFAULT_EVERY_S, DEFAULT_STORE_BYTES, Checkpoints, KVStore,
                                             store_fingerprint)
from cloud_verifier.backends.turns import Turns
from llama_runtime import GGUFModel, KVContext, SharedKV, kv_bytes_per_token
from spec_core.kvpark import parked_capacity
from spec_core.kvreuse import reusable_prefix
from spec_core.tree import DraftTree


class LlamaCppBackend(LogitsBackend):
    def __init__(self, model: str, n_ctx: int = 2048, n_threads: int | None = None, n_batch: int = 512,
                 batching: bool = False, kv_tokens: int | None = None, batch_window_ms: float = 0.0,
                 invariant: bool = True, max_tree_leaves: int = 64, schedule: str = "fair",
                 prefill_chunk: int | None = None, kv_park: bool = False,
                 kv_park_bytes: int = DEFAULT_KV_PARK_BYTES, kv_park_order: str = "next-use",
                 kv_store: str | None = None, kv_store_every_s: float = DEFAULT_EVERY_S,
                 kv_store_bytes: int = DEFAULT_STORE_BYTES, kv_store_max_age_s: float = 600.0):
        check_park_options(kv_park, batching, kv_park_bytes, kv_park_order)
        if kv_store and not batching:
            raise ValueError("--kv-store needs --batching on: checkpoints are taken from the shared KV cache")
        self.model = GGUFModel(model, n_threads=n_threads)
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.invariant = invariant
        self.info = BackendInfo("llama.cpp", self.model.name, self.model.n_vocab, n_ctx,
                                self.model.fingerprint, self.model.eog_ids)
        self._forwarded = 0  # tokens pushed through the target, all sessions (serial mode)
        # Serial mode: sequence 0 + a scratch id per tree leaf. Batching: a pool of as many tree
        # ids, lent to each tree round for its leaves.
        self.n_seq_max = max_tree_leaves + 1
        self.kv: SharedKV | None = None
        # Serial: the model in turns, prompts a chunk a turn (one decode of the context while nobody
        # is live; beside live sessions the live-rounds-first rule's, unless --prefill-chunk fixes it).
        self.turns = Turns(prefill_chunk or (self.model.invariant_ubatch if invariant else n_batch),
                           live_first=prefill_chunk is None, pass_tokens=n_batch)
        self.batcher: Batcher | None = None
        self.book: SeqBook | None = None
        self.checkpoints: Checkpoints | None = None
        if batching:
            kv_tokens = kv_tokens or DEFAULT_KV_SESSIONS * n_ctx
            n_seqs = kv_tokens // n_ctx
            if n_seqs < 1:
                raise ValueError(f"--kv-tokens {kv_tokens} cannot hold one session of --n-ctx {n_ctx} tokens")
            places = min(n_seqs, 254 - max_tree_leaves)
            bytes_per_token = kv_bytes_per_token(self.model)
            # Parked sessions keep their sequence ids: as many ids as the parked bytes hold sessions.
            n_ids = min(254 - max_tree_leaves, places + parked_capacity(kv_park_bytes, bytes_per_token, n_ctx)) \
                if kv_park else places
            self.kv = SharedKV(self.model, places, n_ctx, invariant=invariant, tree_ids=max_tree_leaves,
                               on_compact=metrics.observe_compaction, n_ids=n_ids)
            metrics.track_kv(self.kv)
            self.book = SeqBook(self.kv, None, park=kv_park, max_bytes=kv_park_bytes, order=kv_park_order,
                                bytes_per_token=bytes_per_token)
            # Compactions happen between passes (Batcher -> SharedKV.maintain), outside the pass times.
            self.batcher = Batcher(PlacePacker(self.kv, self.book) if kv_park else self.kv, batch_window_ms / 1000,
                                   on_step=_observe_step, name="llama-batcher", schedule=schedule,
                                   prefill_chunk=prefill_chunk)
            self.book.batcher = self.batcher
            if kv_store:
                store = KVStore(kv_store, store_fingerprint(self.model, n_ctx, self.kv.n_ubatch, invariant),
                                kv_store_bytes, kv_store_max_age_s)
                self.checkpoints = Checkpoints(store, self.kv, self.batcher, self.book, kv_store_every_s)
        # max_states: sessions + Generate streams the KV cache holds at once (None: unbounded here);
        # with parking, also as many as the parked bytes hold at their full context.
        self.caps = Capabilities(trees=True, batching=batching, vocabulary=True, fuses=True,
                                 max_tree_leaves=max_tree_leaves,   # a fused round's tree too
                                 max_fused_nodes=min(MAX_FUSED_NODES, n_batch - 1),   # a serial tree pass is one batch
                                 max_states=self.kv.n_ids if self.kv is not None else None)

    def new_state(self):
        if self.kv is None:
            return self.model.new_context(self.n_ctx, self.n_batch, invariant=self.invariant,
                                          n_seq_max=self.n_seq_max)
        state = self.book.new_state()
        if self.checkpoints is not None:
            self.checkpoints.opened(state)
        return state

    def release(self, state) -> None:
        if isinstance(state, SeqState):
            self.book.release(state)
            if self.checkpoints is not None:
                self.checkpoints.released(state)
            return
        self.turns.forget(id(state))
        with self.model.lock:  # never free a context while a decode runs on this model
            state.close()

    def release_frees_room(self, state) -> bool:
        return self.book.frees_room(state) if isinstance(state, SeqState) else True

    def set_deadline(self, state, deadline: float | None) -> None:
        if isinstance(state, SeqState) and state.seq is not None:
            self.batcher.set_deadline(state.seq, deadline)

    def pass_cost(self) -> tuple[float, float] | None:
        return self.batcher.cost.line() if self.batcher is not None else None

    def note_open(self, state, replay: bool, tpot_s: float | None) -> None:   # live rounds first
        if isinstance(state, SeqState):
            if state.seq is not None:
                self.batcher.note_open(state.seq, replay, tpot_s)
        else:
            self.turns.note_open(id(state), tpot_s)

    def prefill_rate(self) -> float | None:   # first tokens predicted (cloud_verifier.first_token)
        return self.batcher.prefill_rate() if self.batcher is not None else self.turns.prefill_rate()

    def target_logits(self, state, tokens: Sequence[int], rows: int) -> tuple[np.ndarray, float, float]:
        if isinstance(state, SeqState):
            return self._shared_round(state, tokens, rows,
                                      lambda seq, before: self.batcher.submit(seq, tokens, rows, before))
        tokens = list(tokens)
        return self._in_turns(state, tokens, rows, lambda: state.logits(tokens, rows))

    def tree_logits(self, state, committed: Sequence[int], tree: DraftTree):
        """Serial: the whole tree in one target pass (KVContext.tree_logits). Batching: the tree's
        nodes share passes with other sessions' tokens (SharedKV.tree_job)."""
        if isinstance(state, SeqState):
            return self._shared_round(state, committed, 1, lambda seq, before: self.batcher.submit_tree(
                seq, committed, tree.tokens, tree.parents, before))
        committed = list(committed)
        return self._in_turns(state, committed, 1, lambda: state.tree_logits(committed, tree.tokens, tree.parents))

    def _shared_round(self, state: SeqState, tokens: Sequence[int], rows: int, submit):
        """A round in the shared cache: a replay's first round restores what the KV store holds of
        `tokens` first; the round's cells are checkpointed every so often after it."""
        before = self.checkpoints.before_round(state, tokens, rows) if self.checkpoints is not None else None
        with self.book.round(state) as seq:
            out = self.book.run(state, lambda: submit(seq, before))
        if self.checkpoints is not None:
            self.checkpoints.after_round(state)
        return out

    def checkpoint(self, state) -> None:
        if self.checkpoints is not None and isinstance(state, SeqState):
            self.checkpoints.checkpoint(state)

    def checkpoint_all(self, states=None) -> None:
        if self.checkpoints is not None:
            self.checkpoints.checkpoint_all(None if states is None else [s for s in states if isinstance(s, SeqState)])

    def _in_turns(self, state, tokens: list[int], rows: int, fn):
        """Serial: fn() in a turn of the model, after the uncached part of tokens[:-rows] (a
        prompt, a replay) a chunk a turn (cloud_verifier.backends.turns)."""
        def decode(call):
            with self.model.lock:
                before = state.tokens_decoded
                t0 = time.perf_counter()
                out = call()
                decoded = state.tokens_decoded - before
                self._forwarded += decoded
            seconds = time.perf_counter() - t0
            self.turns.observe(decoded, seconds)
            _observe_step(BatchStep(decoded, 1, seconds))
            return out
        r = self.turns.run(lambda: decode(fn), reusable_prefix(state.tokens, tokens, rows), len(tokens) - rows,
                           lambda n: decode(lambda: state.logits(tokens[:n], 1)), key=id(state))
        return r.value, r.queue_s, r.model_s

    def keep_tree_path(self, state, committed, tree: DraftTree, path) -> None:
        if isinstance(state, SeqState):
            return  # the session holds `committed`; the kept path is evaluated with the next round
        with self.model.lock:
            state.keep_tree_path(path, [tree.tokens[i] for i in path])

    def vocabulary(self):
        return self.model.vocabulary

    @functools.lru_cache(maxsize=1)
    def chat_prompts(self) -> bool:
        from llama_runtime.chat import has_chat_template
        return has_chat_template(self.model)

    def prompt_ids(self, text, messages) -> list[int]:
        if messages is None:
            return self.model.tokenize(text, add_special=True, parse_special=True)
        import jinja2
        from llama_runtime.chat import render_messages
        if not self.chat_prompts():
            raise NoChatTemplate(f"{self.model.name} has no chat template (in its GGUF metadata or built into "
                                 "llama.cpp for its architecture); send prompt_text instead")
        try:
            return render_messages(self.model, list(messages))
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template refused these messages: {e}") from None

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
        with self.model.lock:
            if self.kv is not None:
                self.kv.close()
            self.model.close()

    def forward_tokens(self) -> int:
        return self.kv.tokens_decoded if self.kv is not None else self._forwarded


def _observe_step(step: BatchStep) -> None:
    metrics.observe_batch(step.tokens, step.sessions, step.seconds)
