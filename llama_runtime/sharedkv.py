"""SharedKV: one llama.cpp context whose unified KV cache holds many sessions' sequences, decoded
together; token trees evaluated in it (TreeJob); parking a sequence's cells in host memory
(ParkedSeq) and the bytes that costs."""
from __future__ import annotations

import ctypes
import time
from typing import Callable, NamedTuple, Sequence

import llama_cpp
import numpy as np

from llama_runtime.invariance import INVARIANT_UBATCH, pad_decode
from llama_runtime.lowlevel import LoadedModel, context_params, fill_batch
from llama_runtime.treejob import TreeIdsBusy, tree_leaves
from spec_core.batchplan import PassItem
from spec_core.kvreuse import reusable_prefix


def _first_seq(item: PassItem) -> int:
    return item.seq[0] if isinstance(item.seq, tuple) else item.seq

class ParkedSeq(NamedTuple):
    """A sequence's KV cells in host memory (SharedKV.park / restore)."""
    tokens: list[int]     # what the cells hold, in order
    data: np.ndarray      # llama_state_seq_get_data's bytes  # [nbytes] uint8

    @property
    def nbytes(self) -> int:
        return int(self.data.size)


def kv_bytes_per_token(model: LoadedModel) -> int:
    """Bytes one token's K and V take in a cache (f16, every layer), plus llama.cpp's per-cell
    header in a saved sequence: an upper estimate of a parked session's bytes per token."""
    m = model.handle
    n_layer, n_head, n_head_kv = (int(f(m)) for f in (llama_cpp.llama_model_n_layer, llama_cpp.llama_model_n_head,
                                                      llama_cpp.llama_model_n_head_kv))
    arch = model.metadata("general.architecture") or "llama"
    head = int(llama_cpp.llama_model_n_embd(m)) // max(1, n_head)
    k_len = int(model.metadata(f"{arch}.attention.key_length") or head)
    v_len = int(model.metadata(f"{arch}.attention.value_length") or head)
    return n_layer * n_head_kv * (k_len + v_len) * 2 + 16


class SharedKV:
    """One llama.cpp context whose unified KV cache holds many sequences (like llama.cpp server's
    slots): a session is a sequence id, and one `decode` evaluates tokens of many sequences.

    Cells stay in position order. llama.cpp's CPU attention sums a row over the KV cells in cell
    order, so a sequence whose later tokens sit in cells before its earlier ones gets different
    logits (by more than a rounding error: docs/many-edges.md). llama.cpp puts a decode's tokens in the
    first free cells from its search head, in batch order; so SharedKV never leaves a free cell
    below a used one. A rollback or a release hands the cells over to a retired sequence that no
    token attends to (llama_memory_seq_cp + seq_rm, metadata only), the free cells are one block
    at the top, and a sequence's new tokens land above all its earlier ones. When that block runs
    out, `compact` copies each live sequence's cells out (llama_state_seq_get_data), clears the
    cache and copies them back at the bottom, in the same order and bit for bit: the retired cells
    are gone and every row is what it would have been without the move.

    Capacity is reserved, not guessed: each of `n_seqs` sequences may hold up to `seq_ctx` tokens,
    and the cache has room for all of them at once plus `slack` cells (by default an eighth more,
    at least a few passes), so a decode never fails for want of cells and a compaction frees at
    least `slack` cells. With `n_ids` > `n_seqs` there are more sequence ids than such places: a
    sequence whose cells are parked in host memory (`park`) keeps its id but no place, and takes
    a free one again when it is restored. Not thread-safe: one thread (the verifier's batcher)
    drives it.
    """

    def __init__(self, model: LoadedModel, n_seqs: int, seq_ctx: int, n_ubatch: int = INVARIANT_UBATCH,
                 invariant: bool = True, slack: int | None = None, tree_ids: int = 0,
                 on_compact: Callable[[float], None] | None = None, n_ids: int | None = None):
        # llama.cpp's LLAMA_MAX_SEQ is 256: sessions + the scratch and retired sequences + tree ids.
        # n_ids > n_seqs: more sequence ids than places in the cache, for parked sequences (`park`).
        n_ids = n_seqs if n_ids is None else n_ids
        if not 1 <= n_seqs <= n_ids <= 254 - tree_ids:
            raise ValueError(f"need 1 <= n_seqs ({n_seqs}) <= n_ids ({n_ids}) <= {254 - tree_ids} with {tree_ids} "
                             "tree ids")
        self.model, self.n_seqs, self.seq_ctx, self.invariant = model, n_seqs, seq_ctx, invariant
        self.n_ids = n_ids
        self.n_ubatch = min(n_ubatch, model.invariant_ubatch) if invariant else n_ubatch
        self.scratch = n_ids        # the padding sequence (see INVARIANT_UBATCH)
        self.retired = n_ids + 1    # cells nobody attends to, kept occupied until the next compaction
        self.tree_ids = tree_ids    # ids n_ids + 2 .. : one per leaf of the trees being evaluated
        self._tree_free = list(range(n_ids + 2 + tree_ids - 1, n_ids + 1, -1))
        self._trees: set["TreeJob"] = set()
        reserve = n_seqs * seq_ctx
        self.slack = max(4 * (self.n_ubatch + 1), reserve // 8) if slack is None else max(slack, self.n_ubatch + 1)
        self.n_cells = reserve + self.slack
        params = context_params(model, self.n_cells, self.n_ubatch + 1, n_ids + 2 + tree_ids, invariant)
        self._ctx = llama_cpp.llama_init_from_model(model.handle, params)
        if not self._ctx:
            raise MemoryError(f"llama.cpp could not create a KV cache of {n_seqs} x {seq_ctx} tokens")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_ubatch + 1, 0, 1 + tree_ids)
        self._free = list(range(n_ids - 1, -1, -1))
        self.held: dict[int, list[int]] = {}  # sequence id -> the tokens its cells hold, in order
        self.parked: set[int] = set()         # held ids whose cells are parked (in no place; held [])
        self.tokens_decoded = 0
        self._top = 0            # cells [0, _top) are taken (live or retired); the rest are free
        self._holes = False      # a failed decode may have freed cells below _top: compact first
        self.compactions = 0
        self.compaction_seconds = 0.0
        self.on_compact = on_compact   # called with each compaction's seconds (metrics)

    @property
    def free_seqs(self) -> int:
        """Sequences `acquire` can hand out now: free ids with a free place."""
        return min(len(self._free), self.free_places)

    @property
    def free_places(self) -> int:
        """Places (room for seq_ctx cells) not taken by an unparked sequence."""
        return self.n_seqs - (len(self.held) - len(self.parked))

    @property
    def live_cells(self) -> int:
        return sum(map(len, list(self.held.values())))  # a copy: metrics read it from other threads

    @property
    def used_cells(self) -> int:
        """Cells taken, live or retired (the rest are one free block at the top)."""
        return self._top

    def acquire(self) -> int | None:
        """A free sequence id with a place, or None when all are taken."""
        if not self._free or self.free_places <= 0:
            return None
        seq = self._free.pop()
        self.held[seq] = []
        return seq

    def release(self, seq: int) -> None:
        if self.held.pop(seq, None) is None:
            return
        if seq in self.parked:
            self.parked.discard(seq)
        else:
            self._retire(seq, 0)
        self._free.append(seq)

    def _retire(self, seq: int, p0: int) -> None:
        """Take positions p0.. away from `seq` without freeing their cells."""
        llama_cpp.llama_memory_seq_cp(self._mem, seq, self.retired, p0, -1)
        llama_cpp.llama_memory_seq_rm(self._mem, seq, p0, -1)

    def prepare(self, seq: int, tokens: Sequence[int], rows: int) -> list[PassItem]:
        """Roll `seq` back to the longest prefix of `tokens` it holds that leaves the last `rows`
        positions to compute, and return what must be decoded."""
        tokens = list(tokens)
        if seq in self.parked:
            raise RuntimeError(f"sequence {seq} is parked: restore it first")
        held = self.held[seq]
        keep = reusable_prefix(held, tokens, rows)
        if len(tokens) > self.seq_ctx:
            raise ValueError(f"{len(tokens)} tokens do not fit a context of {self.seq_ctx}")
        if keep < len(held):
            self._retire(seq, keep)
            del held[keep:]
        first_row = len(tokens) - rows
        return [PassItem(seq, pos, tokens[pos], pos >= first_row) for pos in range(keep, len(tokens))]

    def tree_job(self, seq: int, committed: Sequence[int], node_tokens: Sequence[int],
                 parents: Sequence[int]) -> "TreeJob":
        """A token tree after `committed` on `seq`, evaluated in passes like any other request:
        see TreeJob. Raises ValueError for a tree this cache cannot hold."""
        leaves, below, depth = tree_leaves(parents)
        if len(leaves) > self.tree_ids:
            raise ValueError(f"a tree with {len(leaves)} leaves needs {len(leaves)} tree ids; "
                             f"this cache has {self.tree_ids}")
        if len(committed) + (max(depth) + 1 if depth else 0) > self.seq_ctx:
            raise ValueError(f"{len(committed)} tokens + a tree of depth {max(depth) + 1} do not fit a context "
                             f"of {self.seq_ctx}")
        if not committed:
            raise ValueError("a tree needs at least one committed token before it")
        return TreeJob(self, seq, list(committed), list(node_tokens), list(parents), leaves, below, depth)

    def maintain(self) -> bool:
        """Between passes: compact if the next pass might not fit, or early, when retired cells
        are at least 256 and half the live ones (no tree in flight): attention runs over every
        cell up to the top, masked or not, so retired cells slow each pass, while a compaction
        costs a copy of each live cell once (both measured on docs/benchmarks.md). True when it compacted (tree jobs in flight
        lost their node cells and must be prepared again)."""
        live = self.live_cells
        if (self._holes or self._top + self.n_ubatch + 1 > self.n_cells
                or (not self._trees and self._top - live >= max(256, live // 2))):
            self.compact()
            return True
        return False

    def compact(self) -> None:
        """Free the retired cells: copy every live sequence out, clear the cache, copy them back.
        Tree jobs in flight lose their node cells (prepare them again)."""
        t0 = time.perf_counter()
        saved = []
        for seq, held in self.held.items():
            if not held:
                continue
            data = self._seq_bytes(seq)
            saved.append((seq, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), data.size, data))
        llama_cpp.llama_memory_clear(self._mem, False)
        self._top, self._holes = 0, False
        lost = []
        for seq, buf, size, _data in saved:
            if llama_cpp.llama_state_seq_set_data(self._ctx, buf, size, seq) != size:
                lost.append(seq)
                llama_cpp.llama_memory_seq_rm(self._mem, seq, 0, -1)
                self._holes = True
                continue
            self._top += len(self.held[seq])
        seconds = time.perf_counter() - t0
        self.compactions += 1
        self.compaction_seconds += seconds
        if self.on_compact is not None:
            self.on_compact(seconds)
        if lost:
            for seq in lost:
                self.held[seq].clear()   # their next request evaluates them from the start
            raise RuntimeError(f"llama.cpp could not copy back the KV cells of sequences {lost}")

    def _seq_bytes(self, seq: int) -> np.ndarray:
        """A copy of `seq`'s cells (llama_state_seq_get_data)  # [bytes] uint8."""
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)
        data = np.empty(size, dtype=np.uint8)  # not zero-filled: llama.cpp writes all of it
        buf = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, seq) != size:
            raise RuntimeError(f"llama.cpp could not copy out the KV cells of sequence {seq}")
        return data

    def park(self, seq: int) -> "ParkedSeq":
        """Copy `seq`'s cells to host memory and give up its place: its cells are retired, it keeps
        its id and holds nothing until `restore` brings the cells back bit for bit. Between passes
        only, with no tree job on `seq`. On failure (RuntimeError) the cells are lost just the
        same, and `seq` holds nothing."""
        if any(job.seq == seq for job in self._trees):
            raise RuntimeError(f"sequence {seq} has a tree in flight")
        tokens = self.held[seq]
        try:
            data = self._seq_bytes(seq) if tokens else np.empty(0, dtype=np.uint8)
        finally:
            self._retire(seq, 0)
            self.held[seq] = []
            self.parked.add(seq)
        return ParkedSeq(list(tokens), data)

    def snapshot(self, seq: int) -> "ParkedSeq":
        """A copy of `seq`'s cells and the tokens they hold, leaving them in place (a checkpoint,
        cloud_verifier.backends.kvstore). Between passes only."""
        tokens = self.held[seq]
        if seq in self.parked or not tokens:
            return ParkedSeq([], np.empty(0, dtype=np.uint8))
        return ParkedSeq(list(tokens), self._seq_bytes(seq))

    def restore(self, seq: int, parked: "ParkedSeq") -> bool:
        """Put parked cells back into `seq` (parked, or holding nothing yet: a checkpoint loaded
        into a new sequence); False when no place is free, or when the cells fit only after a
        compaction and a tree is in flight (compacting would drop its node cells: try again after
        the pass, when it has finished); `seq` is then as it was. The cells land
        above every used cell, in the order they were saved (position order), as a compaction
        puts them back: every row is what it would have been without the move. RuntimeError when
        llama.cpp refuses the bytes: `seq` then has its place and holds nothing."""
        if seq in self.parked:
            if self.free_places <= 0:
                return False
        elif self.held.get(seq) != []:
            raise ValueError(f"sequence {seq} is neither parked nor empty")
        n = len(parked.tokens)
        if self._holes or self._top + n + self.n_ubatch + 1 > self.n_cells:
            if self._trees:
                return False
            self.compact()
        self.parked.discard(seq)
        if not n:
            return True
        buf = parked.data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_set_data(self._ctx, buf, parked.data.size, seq) != parked.data.size:
            llama_cpp.llama_memory_seq_rm(self._mem, seq, 0, -1)
            self._holes = True   # whatever it wrote is gone: compact before the next pass
            raise RuntimeError(f"llama.cpp could not restore {n} parked KV cells")
        self.held[seq] = list(parked.tokens)
        self._top += n
        return True

    def decode(self, items: Sequence[PassItem]) -> list[np.ndarray]:
        """Evaluate up to `n_ubatch` tokens of any sequences in one llama_decode; each sequence's
        tokens must continue what it holds, in order. Returns the wanted rows, in item order
        # each [n_vocab] float32 copy. On failure every sequence is rolled back to what it held."""
        items = list(items)
        if not 1 <= len(items) <= self.n_ubatch:
            raise ValueError(f"a decode takes 1..{self.n_ubatch} tokens, got {len(items)}")
        if self.invariant:
            items = pad_decode(items, self.scratch)
        if self._holes or self._top + len(items) > self.n_cells:
            if self._trees:
                raise RuntimeError("the KV cache needs compacting while trees are in flight: call maintain() "
                                   "between passes")
            self.compact()
        if self.invariant:
            self._retire(self.scratch, 0)  # last pass's padding cell
        fill_batch(self._batch, items)
        rc = llama_cpp.llama_decode(self._ctx, self._batch)
        if rc != 0:
            for seq in {_first_seq(it) for it in items} & self.held.keys():
                llama_cpp.llama_memory_seq_rm(self._mem, seq, len(self.held[seq]), -1)
            llama_cpp.llama_memory_seq_rm(self._mem, self.scratch, 0, -1)
            self._holes = True   # the next maintain() compacts, and tree jobs start over
            raise RuntimeError(f"llama_decode failed with code {rc}")
        self._top += len(items)
        out = []
        for i, item in enumerate(items):
            if item.seq == self.scratch:
                continue
            held = self.held.get(_first_seq(item))
            if held is not None:   # a session's token (a tree node's first id is a tree id)
                held.append(item.token)
            if item.want_logits:
                ptr = llama_cpp.llama_get_logits_ith(self._ctx, i)
                out.append(np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy())
        self.tokens_decoded += sum(1 for it in items if it.seq != self.scratch)
        return out

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class TreeJob:
    """A token tree evaluated in a SharedKV, in one or more passes shared with other sessions.

    Leaf j of the tree gets a tree sequence id of its own (from the cache's pool), added to the
    session's cells (llama_memory_seq_cp: metadata only). The session's uncached committed tokens
    are evaluated on the session and every leaf id at once; a node carries the ids of the leaves
    below it, so it attends to the committed tokens and its ancestors, in position order, as in a
    chain: with batch-invariant evaluation its row is bit for bit the row a chain through it
    would get. Rows: the last committed token's, then every node's, in node order.

    The session's sequence ends holding exactly `committed` (the kept path is evaluated again as
    part of the next round, as KVContext.keep_tree_path does in invariant mode). `finish` hands
    the node cells to the retired sequence and the ids back to the pool; a compaction in between
    drops the node cells, and `prepare` (called again by the batcher) starts the job over.
    """

    def __init__(self, kv: SharedKV, seq: int, committed: list[int], node_tokens: list[int], parents: list[int],
                 leaves: list[int], below: list[list[int]], depth: list[int]):
        self.kv, self.seq, self.committed, self.node_tokens, self.parents = kv, seq, committed, node_tokens, parents
        self.leaves, self.below, self.depth = leaves, below, depth
        self.ids: list[int] | None = None

    def prepare(self) -> list[PassItem]:
        """Take tree ids (TreeIdsBusy when the pool has too few now), roll the session back, and
        list the items to evaluate."""
        kv, c = self.kv, len(self.committed)
        if self.seq in kv.parked:
            raise RuntimeError(f"sequence {self.seq} is parked: restore it first")
        if self.ids is None:
            if len(self.leaves) > len(kv._tree_free):
                raise TreeIdsBusy(f"{len(self.leaves)} tree ids wanted, {len(kv._tree_free)} free")
            self.ids = [kv._tree_free.pop() for _ in self.leaves]
            kv._trees.add(self)
        # (prepared again after a compaction, the job keeps its ids: the clear left them empty)
        held = kv.held[self.seq]
        keep = reusable_prefix(held, self.committed, 1)
        if keep < len(held):
            kv._retire(self.seq, keep)
            del held[keep:]
        for lid in self.ids:
            llama_cpp.llama_memory_seq_cp(kv._mem, self.seq, lid, -1, -1)
        every = (self.seq, *self.ids)
        items = [PassItem(every, pos, self.committed[pos], pos == c - 1) for pos in range(keep, c)]
        items += [PassItem(tuple(self.ids[j] for j in self.below[i]), c + self.depth[i], tok, True)
                  for i, tok in enumerate(self.node_tokens)]
        return items

    def finish(self) -> None:
        """Retire the node cells, take the tree ids off the session's cells, free the ids."""
        kv, c = self.kv, len(self.committed)
        if self.ids is None:
            return
        # A node cell carries every leaf below it: copy each cell to the retired sequence once,
        # from the first leaf that holds it (leaf j's own nodes are those below no earlier leaf,
        # a suffix of its path, from depth `shared + 1` on).
        for j, lid in enumerate(self.ids):
            node, shared = self.leaves[j], -1
            while node != -1:
                if min(self.below[node]) < j:
                    shared = max(shared, self.depth[node])
                node = self.parents[node]
            llama_cpp.llama_memory_seq_cp(kv._mem, lid, kv.retired, c + shared + 1, -1)
        for lid in self.ids:
            llama_cpp.llama_memory_seq_rm(kv._mem, lid, -1, -1)
        kv._tree_free.extend(self.ids)
        kv._trees.discard(self)
        self.ids = None
