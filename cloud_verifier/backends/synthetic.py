"""A synthetic target (spec_core.synthetic) with a configurable per-pass cost, for fast sweeps
and for simulating a loaded cloud. Its distributions are exact, so tests can compare against them.

batching=True runs it behind the same continuous `Batcher` as the llama.cpp backend: waiting
rounds share a pass that costs step_ms + per_token_ms x (tokens in the pass), a simple model of
a batched target (the llama.cpp backend's measured cost per pass is in its metrics). Serial
(batching=False), one request a pass, in turns, prompts a chunk a pass (backends.turns).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from cloud_verifier import metrics
from cloud_verifier.backends.base import BackendInfo, Capabilities, LogitsBackend
from cloud_verifier.backends.batcher import Batcher, BatchStep
from cloud_verifier.backends.kvpark import (DEFAULT_KV_PARK_BYTES, DEFAULT_KV_SESSIONS, PlacePacker, SeqBook, SeqState,
                                            check_park_options)
from cloud_verifier.backends.turns import Turns
from spec_core.batchplan import PassItem
from llama_runtime import ParkedSeq
from spec_core.crossvocab import Vocabulary
from spec_core.kvpark import parked_capacity
from spec_core.kvreuse import reusable_prefix
from spec_core.synthetic import SyntheticLM, synthetic_fingerprint
from spec_core.tree import DraftTree


_BYTES_PER_TOKEN = 4   # a synthetic sequence's "KV cache" is its token ids, int32


def _observe_step(step: BatchStep) -> None:
    metrics.observe_batch(step.tokens, step.sessions, step.seconds)


class SyntheticBackend(LogitsBackend):
    def __init__(self, vocab: int = 64, seed: int = 0, order: int = 1, n_ctx: int = 4096,
                 step_ms: float = 0.0, per_token_ms: float = 0.0, eos_token_ids: Sequence[int] = (1,),
                 batching: bool = False, batch_tokens: int = 512, batch_window_ms: float = 0.0,
                 vocabulary: Vocabulary | None = None, tokenize: Callable[[bytes], list[int]] | None = None,
                 schedule: str = "fair", prefill_chunk: int | None = None, kv_tokens: int | None = None,
                 kv_park: bool = False, kv_park_bytes: int = DEFAULT_KV_PARK_BYTES, kv_park_order: str = "next-use"):
        """`vocabulary` (with `tokenize`, bytes -> ids): give the synthetic ids bytes, so that the
        backend serves GetVocabulary and text prompts (tests of drafting across tokenizers).

        Batching: `kv_tokens` bounds the sessions held at once to kv_tokens // n_ctx places, as the
        llama.cpp backend's KV cache does (None: no bound, but with `kv_park`, the llama.cpp
        default of DEFAULT_KV_SESSIONS); `kv_park` parks idle sessions when the places are short
        (cloud_verifier.backends.kvpark, the llama.cpp backend's own bookkeeping and policy). A
        parked synthetic session is its token ids (4 bytes a token), moved at no modelled cost."""
        check_park_options(kv_park, batching, kv_park_bytes, kv_park_order)
        self.lm = SyntheticLM(vocab, seed, order=order)
        self._vocabulary, self._tokenize = vocabulary, tokenize
        self.step_s, self.per_token_s = step_ms / 1000, per_token_ms / 1000
        fingerprint = vocabulary.fingerprint if vocabulary is not None else synthetic_fingerprint(vocab)
        self.info = BackendInfo("synthetic", f"synthetic-v{vocab}-s{seed}", vocab, n_ctx,
                                fingerprint, frozenset(eos_token_ids))
        self._forwarded = 0
        # Serial: the model in turns, prompts cut in chunks (a quarter of a pass while nobody is live;
        # beside live sessions the live-rounds-first rule's, unless prefill_chunk fixes it), as batched.
        self.turns = Turns(prefill_chunk or max(1, batch_tokens // 4), live_first=prefill_chunk is None,
                           pass_tokens=batch_tokens)
        self.batcher: Batcher | None = None
        self.book: SeqBook | None = None
        if batching:
            if kv_tokens is None and kv_park:
                kv_tokens = DEFAULT_KV_SESSIONS * n_ctx
            places = None if kv_tokens is None else kv_tokens // n_ctx
            if places is not None and places < 1:
                raise ValueError(f"--kv-tokens {kv_tokens} cannot hold one session of --n-ctx {n_ctx} tokens")
            n_ids = places + parked_capacity(kv_park_bytes, _BYTES_PER_TOKEN, n_ctx) if kv_park else places
            self.kv = _SyntheticKV(self, batch_tokens, n_ctx, places, n_ids)
            self.book = SeqBook(self.kv, None, park=kv_park, max_bytes=kv_park_bytes, order=kv_park_order,
                                bytes_per_token=_BYTES_PER_TOKEN)
            self.batcher = Batcher(PlacePacker(self.kv, self.book) if kv_park else self.kv, batch_window_ms / 1000,
                                   on_step=_observe_step, name="synthetic-batcher", schedule=schedule,
                                   prefill_chunk=prefill_chunk)
            self.book.batcher = self.batcher
        # max_states: sessions + Generate streams held at once: the places, and with parking as many
        # more as the parked bytes hold at their full context (None: no bound).
        self.caps = Capabilities(trees=True, batching=batching, vocabulary=vocabulary is not None and tokenize is not None,
                                 fuses=True, max_states=self.kv.n_ids if self.batcher is not None else None)

    def vocabulary(self):
        return self._vocabulary

    def prompt_ids(self, text, messages) -> list[int]:
        if self._tokenize is None:
            return super().prompt_ids(text, messages)
        if messages is not None:  # a plain stand-in for a template: "role: content" lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return [0] + self._tokenize(text.encode())
        return [0] + self._tokenize(text.encode())

    def chat_prompts(self) -> bool:
        return self._tokenize is not None

    def new_state(self):
        if self.book is not None:
            return self.book.new_state()
        return {"cached": 0}

    def release(self, state) -> None:
        if isinstance(state, SeqState):
            self.book.release(state)
        else:
            self.turns.forget(id(state))

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

    def _cost(self, new_tokens: int) -> None:
        cost = self.step_s + self.per_token_s * new_tokens
        if cost > 0:
            time.sleep(cost)

    def _serial_pass(self, state: dict, new: int, cached: int) -> None:
        """One pass of the serial target over `new` tokens, after which the state holds `cached`."""
        t0 = time.perf_counter()
        self._forwarded += new
        state["cached"] = cached
        self._cost(new)
        seconds = time.perf_counter() - t0
        self.turns.observe(new, seconds)
        _observe_step(BatchStep(new, 1, seconds))

    def _in_turns(self, state: dict, upto: int, fn):
        """Serial: fn() in a turn, after the state's missing tokens up to `upto` (a prompt, a
        replay), a chunk a turn (cloud_verifier.backends.turns)."""
        r = self.turns.run(fn, state["cached"], upto,
                            lambda n: self._serial_pass(state, n - state["cached"], n), key=id(state))
        return r.value, r.queue_s, r.model_s

    def target_logits(self, state: dict, tokens: Sequence[int], rows: int):
        if isinstance(state, SeqState):
            with self.book.round(state) as seq:
                return self.book.run(state, lambda: self.batcher.submit(seq, tokens, rows))

        def last_rows():
            out = np.stack([self.lm.logits(tokens[: len(tokens) - rows + 1 + i]) for i in range(rows)])
            self._serial_pass(state, max(rows, len(tokens) - state["cached"]), len(tokens))
            return out
        return self._in_turns(state, len(tokens) - rows, last_rows)

    def tree_logits(self, state: dict, committed: Sequence[int], tree: DraftTree):
        """One pass for the tree: costs step + per_token × (new committed tokens + nodes), like a
        backend that batches every node (a GPU's cost is nearly flat in the node count: per_token ≈ 0)."""
        if isinstance(state, SeqState):
            with self.book.round(state) as seq:
                return self.book.run(state, lambda: self.batcher.submit_tree(seq, committed, tree.tokens,
                                                                             tree.parents))
        committed = list(committed)

        def rows():
            ctxs = [committed] + [committed + [tree.tokens[j] for j in tree.path_to(i)] for i in range(len(tree))]
            out = np.stack([self.lm.logits(c) for c in ctxs])
            self._serial_pass(state, max(1, len(committed) - state["cached"]) + len(tree), len(committed))
            return out
        return self._in_turns(state, len(committed) - 1, rows)

    def keep_tree_path(self, state, committed, tree, path) -> None:
        if isinstance(state, SeqState):
            return  # the sequence holds `committed`; the kept path is evaluated with the next round
        state["cached"] = len(committed) + len(path)  # as a KV cache keeping the kept path would

    def forward_tokens(self) -> int:
        return self._forwarded

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()


class _SyntheticKV:
    """The batcher's view of the synthetic target, and the places of a KV cache as the llama.cpp
    backend's SharedKV has them (what SeqBook and PlacePacker use): per sequence, the tokens it
    holds; at most `n_seqs` unparked sequences (None: no bound) and `n_ids` ids in all."""

    def __init__(self, backend: SyntheticBackend, n_ubatch: int, seq_ctx: int, n_seqs: int | None,
                 n_ids: int | None):
        self.backend, self.n_ubatch, self.seq_ctx, self.n_seqs, self.n_ids = backend, n_ubatch, seq_ctx, n_seqs, n_ids
        self.held: dict[int, list[int]] = {}
        self.parked: set[int] = set()
        self._next = 0

    @property
    def free_places(self) -> int:
        if self.n_seqs is None:
            return 1 << 30
        return self.n_seqs - (len(self.held) - len(self.parked))

    def acquire(self) -> int | None:
        if self.free_places <= 0 or (self.n_ids is not None and len(self.held) >= self.n_ids):
            return None
        seq, self._next = self._next, self._next + 1
        self.held[seq] = []
        return seq

    def release(self, seq: int) -> None:
        self.held.pop(seq, None)
        self.parked.discard(seq)

    def park(self, seq: int) -> ParkedSeq:
        tokens, self.held[seq] = self.held[seq], []
        self.parked.add(seq)
        return ParkedSeq(tokens, np.asarray(tokens, dtype=np.int32).view(np.uint8))

    def restore(self, seq: int, parked: ParkedSeq) -> bool:
        if seq not in self.parked:
            raise ValueError(f"sequence {seq} is not parked")
        if self.free_places <= 0:
            return False
        self.parked.discard(seq)
        self.held[seq] = list(parked.tokens)
        return True

    def maintain(self) -> bool:
        return False   # nothing to compact

    def prepare(self, seq: int, tokens: Sequence[int], rows: int) -> list[PassItem]:
        tokens, held = list(tokens), self.held[seq]
        keep = reusable_prefix(held, tokens, rows)
        del held[keep:]
        return [PassItem(seq, pos, tokens[pos], pos >= len(tokens) - rows) for pos in range(keep, len(tokens))]

    def tree_job(self, seq: int, committed: Sequence[int], tokens: Sequence[int], parents: Sequence[int]):
        return _SyntheticTreeJob(self, seq, list(committed), list(tokens), list(parents))

    def decode(self, items: Sequence[PassItem]) -> list[np.ndarray]:
        out = []
        for item in items:
            if isinstance(item.seq, tuple):  # a tree node: ("node", job, index)
                _, job, node = item.seq
                out.append(self.backend.lm.logits(job.context(node)))
                continue
            held = self.held[item.seq]
            held.append(item.token)
            if item.want_logits:
                out.append(self.backend.lm.logits(held))
        self.backend._forwarded += len(items)
        self.backend._cost(len(items))
        return out


class _SyntheticTreeJob:
    """A tree round through the batcher, as llama_runtime.TreeJob does it: the sequence's missing
    committed tokens, then every node (each a token of the pass), rows for the last committed
    token and each node; the sequence keeps `committed` only."""

    def __init__(self, packer: _SyntheticKV, seq: int, committed: list[int], tokens: list[int],
                 parents: list[int]):
        self.packer, self.seq, self.committed, self.tokens, self.parents = packer, seq, committed, tokens, parents

    def context(self, node: int) -> list[int]:
        path = []
        while node != -1:
            path.append(self.tokens[node])
            node = self.parents[node]
        return self.committed + path[::-1]

    def prepare(self) -> list[PassItem]:
        held, c = self.packer.held[self.seq], len(self.committed)
        keep = reusable_prefix(held, self.committed, 1)
        del held[keep:]
        items = [PassItem(self.seq, pos, self.committed[pos], pos == c - 1) for pos in range(keep, c)]
        return items + [PassItem(("node", self, i), c + len(self.context(i)) - c - 1, tok, True)
                        for i, tok in enumerate(self.tokens)]

    def finish(self) -> None:
        pass
