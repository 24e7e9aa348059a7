"""TreeJob: a token tree evaluated in a SharedKV, one tree sequence id per leaf, in passes shared
with other sessions; and the tree's shape (tree_leaves)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import llama_cpp

from spec_core.batchplan import PassItem
from spec_core.kvreuse import reusable_prefix

if TYPE_CHECKING:
    from llama_runtime.sharedkv import SharedKV


class TreeIdsBusy(RuntimeError):
    """Not enough free tree sequence ids for this tree now; try again after a pass."""
    retry_after_pass = True


def tree_leaves(parents: Sequence[int]) -> tuple[list[int], list[list[int]], list[int]]:
    """(leaves, leaf indices below each node, depth of each node) of a tree given by parents."""
    n = len(parents)
    has_child = set(parents)
    leaves = [i for i in range(n) if i not in has_child]
    below: list[list[int]] = [[] for _ in range(n)]
    for j, leaf in enumerate(leaves):
        node = leaf
        while node != -1:
            below[node].append(j)
            node = parents[node]
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p == -1 else depth[p] + 1)
    return leaves, below, depth

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
