"""KVContext: one sequence's KV cache with rollback, logits for the rows a caller needs, and
token trees in scratch sequences (the verifier's tree pass, the drafter's draft tree)."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import llama_cpp
import numpy as np

from llama_runtime.invariance import pad_decode
from llama_runtime.lowlevel import LoadedModel, context_params, fill_batch
from spec_core.batchplan import PassItem
from spec_core.kvreuse import reusable_prefix


class _TreeState(NamedTuple):
    """What a KVContext's tree pass (or draft tree) left in the cache until it is kept or dropped."""
    n_committed: int             # tokens of sequence 0 before the tree
    seqs: list[list[int]]        # per node, the scratch sequence ids it carries
    scratch: list[int]           # every scratch sequence in use


class KVContext:
    """One sequence's KV cache. `logits(tokens, rows)` brings the cache to hold exactly `tokens`,
    reusing the longest common prefix and rolling back the rest, and returns raw logits for the
    last `rows` positions only  # [rows, n_vocab] float32 copy.

    invariant=True evaluates in the batch-invariant way described at INVARIANT_UBATCH, so logits
    do not depend on how the cache was built (token by token, in rounds, or replayed at once).

    n_seq_max > 1 gives scratch sequences 1..n_seq_max-1 for token trees (tree_logits; the
    drafter's draft_tree_*). Without `invariant`, flash attention is off in such a context: on CPU
    it accumulates in cell order, and a tree round leaves the kept path's cells out of order, which
    moved next-round logits by ~1e-3. With `invariant`, a tree round never leaves tree cells in
    sequence 0 at all: the kept path is decoded in order as part of the next round (keep_tree_path),
    so the cache is the one a chain would have built."""

    def __init__(self, model: LoadedModel, n_ctx: int, n_batch: int, invariant: bool = False, n_seq_max: int = 1):
        self.model = model
        self.invariant = invariant
        self.n_seq_max = n_seq_max   # sequence 0 + tree scratch sequences
        self._pad_seq = n_seq_max    # the padding sequence of an invariant context
        self.tree_batch = n_batch    # the most tokens one tree pass may hold
        if invariant:
            n_batch = min(n_batch, model.invariant_ubatch)
        params = context_params(model, n_ctx + (1 if invariant else 0), n_batch + (1 if invariant else 0),
                                 n_seq_max + (1 if invariant else 0), invariant)
        if n_seq_max > 1:
            params.n_batch = max(params.n_batch, self.tree_batch)  # a tree pass may span several ubatches
            if not invariant:
                params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._tree_batch = None
        self._tree_state: _TreeState | None = None
        self._ctx = llama_cpp.llama_init_from_model(model.handle, params)
        if not self._ctx:
            raise MemoryError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self.n_ctx = n_ctx if invariant else int(llama_cpp.llama_n_ctx(self._ctx))
        self.n_batch = n_batch
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(n_batch + 1, 0, 1)
        self.tokens: list[int] = []  # what the KV cache holds, in order
        self.tokens_decoded = 0      # forward-pass token count, for stats

    def logits(self, tokens: Sequence[int], rows: int) -> np.ndarray:
        tokens = list(tokens)
        keep = reusable_prefix(self.tokens, tokens, rows)
        if len(tokens) > self.n_ctx:
            raise ValueError(f"{len(tokens)} tokens do not fit a context of {self.n_ctx}")
        if keep < len(self.tokens):
            llama_cpp.llama_memory_seq_rm(self._mem, 0, keep, -1)
            del self.tokens[keep:]
        out = np.empty((rows, self.model.n_vocab), dtype=np.float32)
        first_row = len(tokens) - rows
        pos = keep
        while pos < len(tokens):
            chunk = tokens[pos: pos + self.n_batch]
            items = [PassItem(0, pos + i, tok, pos + i >= first_row) for i, tok in enumerate(chunk)]
            if self.invariant:
                llama_cpp.llama_memory_seq_rm(self._mem, self._pad_seq, 0, -1)
                items = pad_decode(items, self._pad_seq)
            fill_batch(self._batch, items)
            rc = llama_cpp.llama_decode(self._ctx, self._batch)
            if rc != 0:
                # Leave the cache consistent with what we know it holds.
                llama_cpp.llama_memory_seq_rm(self._mem, 0, pos, -1)
                raise RuntimeError(f"llama_decode failed with code {rc}")
            for i in range(len(chunk)):
                if pos + i >= first_row:
                    ptr = llama_cpp.llama_get_logits_ith(self._ctx, i)
                    out[pos + i - first_row] = np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))
            self.tokens.extend(chunk)
            self.tokens_decoded += len(chunk)
            pos += len(chunk)
        return out

    def tree_logits(self, committed: Sequence[int], node_tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Raw logits after `committed` and after each tree node, in one llama_decode  # [n + 1, n_vocab].

        Row 0 predicts the root's children, row i + 1 node i's children. Leaf j owns scratch sequence
        id j + 1; a node carries the ids of every leaf below it (several ids for a token on several
        branches), and the committed tokens carry all of them, so each node attends to exactly its
        ancestors, as in a chain. Call `keep_tree_path` next: it leaves committed + the kept path in
        sequence 0 and drops the rest. parents[i] is -1 (the committed sequence) or an index < i.
        """
        committed, n = list(committed), len(node_tokens)
        has_child = set(parents)
        leaves = [i for i in range(n) if i not in has_child]
        if len(leaves) + 1 > self.n_seq_max:
            raise ValueError(f"a tree with {len(leaves)} leaves needs n_seq_max >= {len(leaves) + 1}, "
                             f"this context has {self.n_seq_max}")
        if len(committed) + n > self.n_ctx:
            raise ValueError(f"{len(committed)} tokens + {n} nodes do not fit a context of {self.n_ctx}")
        if n + 1 > self.tree_batch:
            raise ValueError(f"a tree of {n} nodes does not fit a batch of {self.tree_batch}")
        seqs: list[list[int]] = [[] for _ in range(n)]
        for j, leaf in enumerate(leaves):
            node = leaf
            while node != -1:
                seqs[node].append(j + 1)
                node = parents[node]
        depth = []
        for p in parents:
            depth.append(0 if p == -1 else depth[p] + 1)
        scratch = list(range(1, len(leaves) + 1))
        self._drop_scratch()
        row0 = None
        if self.invariant:
            # Sequence 0 is built only by the batch-invariant chain path: it holds `committed`
            # exactly, and the row after it comes from there; the tree pass adds the nodes alone.
            row0 = self.logits(committed, 1)[0]
            keep = len(committed)
        else:
            keep = self._tree_prefix(committed, n)
        if keep < len(self.tokens):
            llama_cpp.llama_memory_seq_rm(self._mem, 0, keep, -1)
            del self.tokens[keep:]
        for s in scratch:
            llama_cpp.llama_memory_seq_cp(self._mem, 0, s, -1, -1)
        if self._tree_batch is None:
            self._tree_batch = llama_cpp.llama_batch_init(self.tree_batch, 0, self.n_seq_max)
        b = self._tree_batch
        tail = committed[keep:]
        i = 0
        for k, tok in enumerate(tail):
            b.token[i], b.pos[i], b.logits[i] = tok, keep + k, k == len(tail) - 1
            ids = [0] + scratch
            b.n_seq_id[i] = len(ids)
            for m, s in enumerate(ids):
                b.seq_id[i][m] = s
            i += 1
        for node, tok in enumerate(node_tokens):
            b.token[i], b.pos[i], b.logits[i] = tok, len(committed) + depth[node], True
            b.n_seq_id[i] = len(seqs[node])
            for m, s in enumerate(seqs[node]):
                b.seq_id[i][m] = s
            i += 1
        b.n_tokens = i
        rc = llama_cpp.llama_decode(self._ctx, b)
        if rc != 0:
            llama_cpp.llama_memory_seq_rm(self._mem, 0, keep, -1)
            del self.tokens[keep:]
            self._drop_scratch(scratch)
            raise RuntimeError(f"llama_decode failed with code {rc} on a tree of {n} nodes")
        self.tokens.extend(tail)
        self.tokens_decoded += i
        self._tree_state = _TreeState(len(committed), seqs, scratch)
        out = np.empty((n + 1, self.model.n_vocab), dtype=np.float32)
        first = 0
        if row0 is not None:
            out[0], first = row0, 1
        for row, idx in enumerate(range(len(tail) - 1 + first, i), start=first):
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, idx)
            out[row] = np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))
        return out

    def _tree_prefix(self, committed: list[int], n: int) -> int:
        """Bring sequence 0 to committed[:-1] (or less); what is left of committed goes in the tree pass."""
        keep = reusable_prefix(self.tokens, committed, 1)
        if len(committed) - keep + n > self.tree_batch:
            self.logits(committed[:-1], 1)  # a long uncached tail (first round): decode it on its own
            keep = len(committed) - 1
        return keep

    def keep_tree_path(self, path: Sequence[int], path_tokens: Sequence[int]) -> None:
        """After `tree_logits`: sequence 0 gains the kept path's cells (node indices `path`, root
        first, with their tokens); every scratch sequence is dropped, freeing the other branches."""
        assert self._tree_state is not None, "keep_tree_path without tree_logits"
        n_committed, seqs, scratch = self._tree_state
        if self.invariant:
            # Leave no tree cell in sequence 0: the next round decodes the kept path in order, in
            # the invariant shapes, exactly as a chain would have (no extra pass: the path tokens
            # join that round's decode).
            self._drop_scratch(scratch)
            return
        if path:
            leaf_seq = seqs[path[-1]][0]  # a branch through the last kept node holds the whole path
            llama_cpp.llama_memory_seq_cp(self._mem, leaf_seq, 0, n_committed, n_committed + len(path))
            self.tokens.extend(path_tokens)
        self._drop_scratch(scratch)

    def draft_tree_begin(self, committed: Sequence[int]) -> np.ndarray:
        """Start growing a draft tree after `committed`: raw logits after it  # [n_vocab].
        Then `draft_tree_extend` decodes nodes level by level, each node once, in one batch per
        call: node k owns scratch sequence k + 1, copied from its parent's (metadata only), so it
        sees exactly committed + its ancestors. `draft_tree_end` drops the scratch sequences."""
        self._drop_scratch()
        row = self.logits(committed, 1)[0]
        self._tree_state = _TreeState(len(committed), [], [])
        self._draft_depth: dict[int, int] = {}
        return row

    def draft_tree_extend(self, nodes: Sequence[tuple[int, int, int]]) -> np.ndarray:
        """nodes: (node id, parent id or -1, token); returns raw logits after each  # [len(nodes), n_vocab]."""
        assert self._tree_state is not None, "draft_tree_extend without draft_tree_begin"
        n_committed, _, scratch = self._tree_state
        if len(nodes) > self.tree_batch:
            raise ValueError(f"{len(nodes)} nodes do not fit a batch of {self.tree_batch}")
        if self._tree_batch is None:
            self._tree_batch = llama_cpp.llama_batch_init(self.tree_batch, 0, self.n_seq_max)
        b = self._tree_batch
        for i, (node, parent, tok) in enumerate(nodes):
            seq = node + 1
            if seq >= self.n_seq_max:
                raise ValueError(f"node {node} needs n_seq_max > {seq}; this context has {self.n_seq_max}")
            depth = 0 if parent == -1 else self._draft_depth[parent] + 1
            if n_committed + depth >= self.n_ctx:
                raise ValueError(f"node {node} at depth {depth + 1} does not fit a context of {self.n_ctx}")
            self._draft_depth[node] = depth
            llama_cpp.llama_memory_seq_cp(self._mem, 0 if parent == -1 else parent + 1, seq, -1, -1)
            scratch.append(seq)
            b.token[i], b.pos[i], b.logits[i] = tok, n_committed + depth, True
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
        b.n_tokens = len(nodes)
        rc = llama_cpp.llama_decode(self._ctx, b)
        if rc != 0:
            self._drop_scratch()
            raise RuntimeError(f"llama_decode failed with code {rc} on {len(nodes)} draft tree nodes")
        self.tokens_decoded += len(nodes)
        out = np.empty((len(nodes), self.model.n_vocab), dtype=np.float32)
        for i in range(len(nodes)):
            out[i] = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, i), shape=(self.model.n_vocab,))
        return out

    def draft_tree_end(self) -> None:
        self._drop_scratch()

    def _drop_scratch(self, scratch: Sequence[int] | None = None) -> None:
        if scratch is None:
            scratch = self._tree_state.scratch if self._tree_state else []
        for s in scratch:
            llama_cpp.llama_memory_seq_rm(self._mem, s, -1, -1)
        self._tree_state = None

    def reset(self) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)
        self.tokens.clear()

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            llama_cpp.llama_batch_free(self._batch)
            if self._tree_batch is not None:
                llama_cpp.llama_batch_free(self._tree_batch)
            llama_cpp.llama_free(self._ctx)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
