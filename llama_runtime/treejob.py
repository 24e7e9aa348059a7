"""A token tree's shape as a shared cache evaluates it (tree_leaves: leaves, the leaves below each
node, depths), and the error a tree gets when the cache has too few tree sequence ids now.
SharedKV.tree_job (llama_runtime.sharedkv.TreeJob) evaluates the tree."""
from __future__ import annotations

from typing import Sequence


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
