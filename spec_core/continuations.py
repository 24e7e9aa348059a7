"""Continuations: next rounds drafted for several outcomes of the round in flight.

Glossary (adds to spec_core/verify.py's and spec_core/tree.py's):
  outcome        what round r may commit: its first j drafts (or a tree path) and one more token
                 (the corrected token at a rejection, the bonus after the last draft).
  continuation   a round r + 1 drafted, while round r travels, after one outcome: the committed
                 sequence the edge knew (base) + that outcome's tokens (its key, `assumed_tokens`).
  hit            the verifier committed exactly a continuation's key: that continuation is round r + 1.

The rule (verifier): once round r is committed, round r + 1 runs the one alternative whose key is
exactly the tokens round r committed (`pick_continuation`: same length, same ids); none matching
means no model pass and no commit (`base_mismatch`), and the edge drafts round r + 1 afresh.

Why it is exact. The round rule (spec_core.verify, spec_core.tree) gives tokens distributed as the
target after a committed prefix P for any draft whose tokens were sampled from the q shipped with
them (or are point masses), independently of the verifier's uniforms for that round. A
continuation keyed by K was drafted after base + K by the draft model and the edge's own random
stream, with the q its tokens were sampled from; it was drafted before round r was verified, so it
depends on round r's drafts and the edge's randomness, never on the verifier's uniforms of round
r or r + 1. The verifier runs it only when round r committed exactly K, that is when P = base + K:
then it is a draft for P, made by the draft model after P, and the round rule applies unchanged
with fresh verifier uniforms. Which continuations exist (the ranking, how many fit in the round
trip) is a function of round r's draft and the edge's measurements only; conditioning on "the
continuation for P exists" therefore conditions on nothing the verifier's uniforms of round r + 1
touch. When none matches, round r + 1 is a fresh draft after P: the ordinary round. By the chain
rule over rounds the output follows the target, for chains and trees alike (a continuation may be
a tree; round r may be a tree, its outcomes are then kept paths plus one token).

What would break it, and what the tests' negative control does: running a continuation against a
prefix other than its key while keeping its target rows computed after the key (a fused pass that
attends to the assumed tokens, or a key matched by length only): then the tokens after P follow
p(. | base + K), not p(. | P). tests/test_continuations.py checks the rule above with chi-square
tests and shows that this control fails them.

Fused: continuations verified in round r's own pass (`fuse_tree`). Round r's request may carry
continuations for its own outcomes (drafted before it was sent), and a pipelined round r + 1 that
is waiting when round r's pass starts lends its alternatives the same way. The verifier then builds
one tree: round r's nodes (indices unchanged), then for each continuation keyed by K = (a kept path
of round r, then one more token y) a node for y under that path's last node, and the continuation's
nodes under it. One target pass gives every row. Round r's rule runs on round r's rows only (row 0
and its nodes'), with round r's uniforms: those rows are exactly what an unfused pass computes, a
row depends on its own ancestors alone (the tree attention mask), and the extra nodes only add
rows nobody reads; so round r's outcome has the law it has unfused. If round r committed exactly
K (`pick_continuation`, uncut by a stop token, the length or the context), that continuation's rule
runs on the rows of y's node and of its own nodes: the target's logits after base + K and after
base + K + each path, i.e. after P = the committed prefix, exactly the rows a separate round r + 1
would read; and it draws fresh verifier uniforms (the stream round r + 1 would use: seeded, keyed
by the committed length; unseeded, the session's generator after round r's draws), never round
r's. The continuation was drafted before round r was verified, from the edge's randomness only, so
the argument above applies unchanged: given P it is a valid draft after P, the round rule is
exact, and the chain rule over rounds gives the target's law. Which keys get a node depends on
round r's tree and the keys only (a key whose y is a child of the path's last node, or whose path
is not round r's, can never be committed and gets none); which continuations fit the pass (node,
leaf and context limits, taken in the order sent) depends on sizes only; neither looks at any
uniform. A continuation that was not fused, or did not hit, costs nothing and commits nothing.

What would break fusion, and tests/test_fused.py's negative controls: running the continuation on
the rows of another key of the same length (rows computed after a key other than what committed),
or reusing round r's uniforms for it (the same draws decide both rounds: correlated, biased).

The edge's estimate of each outcome's probability (`chain_outcomes`) is the draft's own: the
geometric model with the measured per-token acceptance α for the rejection point, the draft's q
without the rejected token (renormalised) for the corrected token that the verifier draws from
norm(max(0, p − q)), and the draft's q after the last draft for the bonus. It only ranks what to
draft; it never enters the verifier's rule, so a bad estimate costs hits, never exactness.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from spec_core.tree import ROOT, DraftTree

MAX_CONTINUATIONS = 16        # alternatives a pipelined round may carry beyond its own draft (wire limit)
MAX_CONTINUATION_NODES = 256  # draft tokens (chain) or nodes (tree) over all continuations of a round


class Outcome(NamedTuple):
    """One thing round r may commit, with the draft's estimate of its probability."""

    tokens: tuple[int, ...]   # what round r commits: kept drafts, then the corrected or bonus token
    prob: float               # the draft's estimate


def chain_outcomes(drafts: Sequence[int], alpha: float,
                   corrected: Sequence[Sequence[tuple[int, float]]],
                   bonus: Sequence[tuple[int, float]], limit: int) -> list[Outcome]:
    """The `limit` most probable outcomes of a chain round, most probable first.

    drafts      # [γ] the round's draft tokens
    alpha       the per-token acceptance estimate (geometric model: P(reject at j) = α^j (1 − α))
    corrected   # [γ] per position, (token, prob) candidates for the corrected token there (the
                  draft's estimate: its q without the draft token, renormalised)
    bonus       (token, prob) candidates for the token after all γ drafts (the draft's q there)
    """
    alpha = min(max(alpha, 0.0), 1.0)
    gamma = len(drafts)
    out: list[Outcome] = []
    for j in range(gamma):
        reach = alpha ** j * (1.0 - alpha)
        for tok, prob in corrected[j]:
            if tok != drafts[j] and prob > 0:
                out.append(Outcome(tuple(drafts[:j]) + (int(tok),), reach * prob))
    for tok, prob in bonus:
        if prob > 0:
            out.append(Outcome(tuple(drafts) + (int(tok),), alpha ** gamma * prob))
    out.sort(key=lambda o: (-o.prob, len(o.tokens), o.tokens))
    seen, ranked = set(), []
    for o in out:
        if o.tokens not in seen:
            seen.add(o.tokens)
            ranked.append(o)
    return ranked[:limit]


def pick_continuation(committed: Sequence[int], base_length: int, keys: Sequence[Sequence[int]]) -> int | None:
    """The index of the key that is exactly what was committed after `base_length` tokens (the
    continuation drafted after that prefix), or None. Keys are distinct (the wire refuses
    duplicates), so at most one matches."""
    tail = list(committed[base_length:])
    for i, key in enumerate(keys):
        if len(key) == len(tail) and list(key) == tail:
            return i
    return None


def worth_drafting(prob: float, covered: float, gain_s: float, cost_s: float) -> bool:
    """Whether one more continuation pays: a hit saves `gain_s` (the round trip and the fresh
    draft it replaces, less what drafting so far has delayed the pipelined round), and drafting
    plus uploading it (`cost_s`) delays every hit, whose probability is `covered` + `prob`."""
    return prob * gain_s > (covered + prob) * cost_s


class Placement(NamedTuple):
    """Where one continuation sits in a fused tree."""

    key_node: int   # the node carrying its key's last token: its row is the target after base + key
    offset: int     # index of the continuation's first node; its node j is offset + j


@dataclass(frozen=True)
class FusedTree:
    """Round r's tree and its continuations as one tree for one target pass.

    tree        round r's nodes first (same indices), then per placed continuation its key node
                (under the key's kept path) and its own nodes (their roots under the key node)
    placements  # [k] per continuation, or None: its key is no outcome of round r (never placed)
    """

    tree: DraftTree
    round_nodes: int
    placements: tuple[Placement | None, ...]

    def continuation_rows(self, i: int, n_nodes: int) -> list[int]:
        """Rows of the fused pass (0: after the committed sequence, j + 1: after node j) that
        continuation i's own round reads  # [n_nodes + 1]: its root row, then one per node."""
        at = self.placements[i]
        assert at is not None, i
        return [at.key_node + 1] + [at.offset + j + 1 for j in range(n_nodes)]


def key_parent(tree: DraftTree, key: Sequence[int]) -> int | None:
    """The node a key's last token follows, when the key is an outcome round r can commit: its
    tokens but the last are a kept path of `tree` (root first; ROOT when empty), and the last is
    no child of that path's end (a tested child is either kept or, rejected, has no residual mass
    left: it is never the corrected token). None otherwise."""
    if not key:
        return None
    children, node = tree.children(), ROOT
    for tok in key[:-1]:
        node = next((c for c in children.get(node, []) if tree.tokens[c] == tok), None)
        if node is None:
            return None
    if any(tree.tokens[c] == key[-1] for c in children.get(node, [])):
        return None
    return node


def fuse_tree(round_tree: DraftTree, keys: Sequence[Sequence[int]], continuations: Sequence[DraftTree],
              fits=lambda tree: True) -> FusedTree:
    """One tree for round r and its continuations (keys[i]: what continuation i assumes round r
    commits). Continuations are placed in the order given while `fits(tree so far)` holds (a
    backend's node and leaf limits); one that does not fit, or whose key is no outcome, is not."""
    tokens, parents = list(round_tree.tokens), list(round_tree.parents)
    placements: list[Placement | None] = []
    for key, cont in zip(keys, continuations):
        parent = key_parent(round_tree, key)
        if parent is None:
            placements.append(None)
            continue
        key_node, offset = len(tokens), len(tokens) + 1
        grown = DraftTree(tuple(tokens + [int(key[-1])] + list(cont.tokens)),
                          tuple(parents + [parent] + [key_node if p == ROOT else offset + p for p in cont.parents]))
        if not fits(grown):
            placements.append(None)
            continue
        tokens, parents = list(grown.tokens), list(grown.parents)
        placements.append(Placement(key_node, offset))
    return FusedTree(DraftTree(tuple(tokens), tuple(parents)), len(round_tree), tuple(placements))
