"""Token trees: several draft candidates per position, verified exactly in one round.

Glossary (adds to spec_core/verify.py's):
  node          one draft token; node i follows its parent (parents[i], or the committed
                sequence when parents[i] == -1, "the root"). Parents come before children.
  siblings      the children of one node, tested in index order (the order they were drawn in).
  kept path     the accepted nodes, root first: they are committed, then one more token.
  corrected     a token drawn from what is left of p once every child of the last kept node was
                rejected; at a leaf nothing is rejected and it is the bonus token, drawn from p.

The rule: recursive rejection sampling (Jeon et al. 2024, arXiv 2402.14160; SpecInfer's
multi-round rule, Miao et al. 2023, arXiv 2305.09781, uses the same residual update). At the
current node, p_1 = p(. | path). For its children c_1..c_k in index order, child c_i drawn from
q_i (its shipped q, or a point mass on c_i when none was sent):
    accept c_i with probability min(1, p_i(c_i) / q_i(c_i)): move to c_i and start again there;
    else p_{i+1} = norm(max(0, p_i - q_i)).
If no child is accepted, emit y ~ p_{k+1} (a leaf has k = 0: y ~ p is the bonus).

Why it is exact. Claim: the token that leaves a node (the accepted child's token, or the emitted
y) is distributed as p_1, for any q_i, provided c_i ~ q_i given c_1..c_{i-1} (q_i may depend on
them, and whether a child i + 1 exists may depend on c_1..c_i), independently of the verifier's
uniforms. By induction on the children left: with none left, y ~ p_i. Otherwise
    P(out = y) = q_i(y) min(1, p_i(y)/q_i(y)) + sum_x q_i(x) (1 - min(1, p_i(x)/q_i(x))) P(rest = y | c_i = x rejected)
               = min(p_i(y), q_i(y)) + (1 - sum_x min(p_i(x), q_i(x))) p_{i+1}(y)      (induction: rest ~ p_{i+1}
               = min(p_i(y), q_i(y)) + max(0, p_i(y) - q_i(y)) = p_i(y).                  whatever x was)
The subtree under the accepted child was drafted from that child's token and the draft's own
randomness, never from the verifier's uniforms, so given the path so far the next node is again a
node with valid drafts: by the chain rule the whole sequence follows the target (stop and length
cuts as in spec_core.verify.commit_round).

Special cases. A point mass q_i = 1[c_i] accepts with p_i(c_i) and otherwise removes c_i from p:
for point-mass children the rule is "draw y ~ p; move to the child carrying y, else y is the
corrected token" (deterministic trees: children chosen, not sampled). Greedy p is one-hot: follow
the argmax child, else emit the argmax. A chain (parents[i] = i - 1) is the tree with one path:
the same walk is the chain round (Leviathan et al.'s rule), one driver for both.
After c_i is rejected p_{i+1}(c_i) = 0, so a later sibling with the same token could never win:
the edge draws siblings without replacement (zeroing earlier siblings' weights in the shipped q,
then sampling), and the wire refuses duplicate siblings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np

from spec_core.acceptance import (RESIDUAL_EPS, accepts, after_rejection, corrected_probs, keeps_sample,
                                  sparse_after_rejection)
from spec_core.gumbel import draft_choices, target_token
from spec_core.qcodec import EncodedQ
from spec_core.warping import SamplingSettings, processed_probs, sample

ROOT = -1


class TreeError(ValueError):
    """A tree the verifier refuses; the message names the node and what is wrong."""


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]   # [n] node token ids
    parents: tuple[int, ...]  # [n] parent index, ROOT (-1) = follows the committed sequence

    def __post_init__(self):
        assert len(self.tokens) == len(self.parents)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "DraftTree":
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self) -> dict[int, list[int]]:
        """node (ROOT for the root) -> its children in index order."""
        out: dict[int, list[int]] = {ROOT: []}
        for i, p in enumerate(self.parents):
            out.setdefault(i, [])
            out[p].append(i)
        return out

    def depths(self) -> list[int]:
        """Nodes on the path from the root to each node (1 for the root's children)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p == ROOT else d[p] + 1)
        return d

    def path_to(self, node: int) -> list[int]:
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        has_child = set(self.parents)
        return [i for i in range(len(self)) if i not in has_child]

    def subtree(self, keep: Sequence[int]) -> "DraftTree":
        """The nodes `keep` (sorted, parents included), reindexed."""
        index = {old: new for new, old in enumerate(keep)}
        return DraftTree(tuple(self.tokens[i] for i in keep),
                         tuple(ROOT if self.parents[i] == ROOT else index[self.parents[i]] for i in keep))


def validate_tree(tokens: Sequence[int], parents: Sequence[int], vocab: int, max_nodes: int, max_depth: int,
                  max_branching: int) -> DraftTree:
    """Check a tree from the wire; raises TreeError with a message a person can act on."""
    n = len(tokens)
    if len(parents) != n:
        raise TreeError(f"draft_parents has {len(parents)} entries but draft_token_ids has {n}")
    if n > max_nodes:
        raise TreeError(f"the tree has {n} nodes; this server verifies at most {max_nodes}")
    depth: list[int] = []
    seen: dict[tuple[int, int], int] = {}
    n_children: dict[int, int] = {}
    for i, (tok, p) in enumerate(zip(tokens, parents)):
        if not 0 <= tok < vocab:
            raise TreeError(f"draft_token_ids[{i}] = {tok} is outside the vocabulary (n_vocab = {vocab})")
        if p < ROOT:
            raise TreeError(f"draft_parents[{i}] = {p}; use -1 for a node that follows the committed sequence")
        if p >= i:
            raise TreeError(f"draft_parents[{i}] = {p} is not before node {i}: parents must come before their "
                            "children (this also rules out cycles)")
        if (p, tok) in seen:
            raise TreeError(f"nodes {seen[p, tok]} and {i} are siblings with the same token {tok}; draw siblings "
                            "without replacement")
        seen[p, tok] = i
        n_children[p] = n_children.get(p, 0) + 1
        if n_children[p] > max_branching:
            raise TreeError(f"node {p} has more than {max_branching} children (this server's limit)")
        depth.append(1 if p == ROOT else depth[p] + 1)
        if depth[i] > max_depth:
            raise TreeError(f"node {i} is at depth {depth[i]}; this server's limit is {max_depth} (max_gamma)")
    return DraftTree(tuple(int(t) for t in tokens), tuple(int(p) for p in parents))


def prune_to_fit(tree: DraftTree, room: int) -> list[int]:
    """Indices of the nodes kept when only `room` more tokens fit the context: nodes no deeper than
    `room`, then the first `room` of them in index order. Both cuts keep parents with their
    children and never keep a later sibling without the earlier ones, so the rest is still a
    valid draft tree (a chain is cut to its first `room` drafts, as before)."""
    depths = tree.depths()
    return [i for i in range(len(tree)) if depths[i] <= room][:max(room, 0)]


@dataclass(frozen=True)
class TreeResult:
    path: list[int]   # kept nodes, root first
    next_token: int   # corrected (some child of the last kept node was tested) or bonus (a leaf)

    @property
    def num_accepted(self) -> int:
        """Drafts kept (for spec_core.verify.commit_round, as a chain's accepted prefix)."""
        return len(self.path)


def verify_tree(target_probs: np.ndarray, tree: DraftTree, draft_probs: Sequence[EncodedQ | None] | None,
                rng: np.random.Generator) -> TreeResult:
    """target_probs  # [n + 1, vocab]: row 0 after the committed sequence, row i + 1 after node i.
    draft_probs  # [n] (None at a node, or None for all: point masses). A chain is the tree with
    one path (DraftTree.chain)."""
    assert target_probs.shape[0] == len(tree) + 1, (target_probs.shape, len(tree))
    return _walk(target_probs.__getitem__, tree, draft_probs, rng)


def verify_tree_on_logits(target_logits: np.ndarray, settings: SamplingSettings, tree: DraftTree,
                          draft_probs: Sequence[EncodedQ | None] | None, rng: np.random.Generator,
                          position: int | None = None) -> TreeResult:
    """verify_tree(processed_probs(target_logits, ...), ...), warping only the rows the walk reaches
    (a chain: the rows up to its first rejection; a tree: the rows of its kept path's nodes). A row's
    p is the same warped alone or with the others, and the draws come in the same order, so the
    result (and the generator's state) is the same.  # target_logits: [n + 1, vocab]
    With settings.coupling "gumbel" the walk is gumbel_walk's (q and rng unread): `position` is the
    absolute position row 0 predicts (the committed length)."""
    assert target_logits.shape[0] == len(tree) + 1, (target_logits.shape, len(tree))

    def row(i: int) -> np.ndarray:  # [vocab]
        return processed_probs(target_logits[i], settings.temperature, settings.top_k, settings.top_p)

    if settings.gumbel:
        return gumbel_walk(row, tree, settings.seed, position)
    return _walk(row, tree, draft_probs, rng)


def gumbel_walk(target_row: Callable[[int], np.ndarray], tree: DraftTree, seed: int | None,
                position: int | None) -> TreeResult:
    """The gumbel coupling's walk (spec_core.gumbel has the proof): at a node whose row predicts
    absolute position i, y = argmax(log p + g_i); move to the child carrying y, else y is the
    corrected token (at a leaf, the bonus). A chain keeps its drafts while they equal y. No q and no
    uniform is read.  # target_row(node + 1): [vocab] processed p; position: what row 0 predicts."""
    if seed is None or position is None:
        raise ValueError("the gumbel coupling needs the session's seed and the round's position")
    children = tree.children()
    node, path = ROOT, []
    while True:
        y = target_token(target_row(node + 1), seed, position + len(path))
        child = next((c for c in children[node] if tree.tokens[c] == y), None)
        if child is None:
            return TreeResult(path, y)
        node = child
        path.append(child)


def _walk(target_row: Callable[[int], np.ndarray], tree: DraftTree, draft_probs: Sequence[EncodedQ | None] | None,
          rng: np.random.Generator) -> TreeResult:
    """The one walk down a tree, given p one row at a time  # target_row(node + 1): [vocab] float64.
    At a node the children are tested in index order against p, each rejection leaving the
    residual for the next sibling (after_rejection); when none is kept, the corrected token is
    drawn from what the last rejection left (corrected_probs: the same distribution, unnormalised,
    as a chain's corrected draw); at a leaf the bonus is drawn from p."""
    children = tree.children()
    node, path = ROOT, []
    while True:
        probs = target_row(node + 1)  # p at this node; replaced by residuals as children fail
        kids = children[node]
        for k, c in enumerate(kids):
            x = tree.tokens[c]
            q_c = None if draft_probs is None else draft_probs[c]
            if accepts(float(probs[x]), q_c, x, rng):
                node = c
                path.append(c)
                break
            probs = corrected_probs(probs, q_c, x) if k == len(kids) - 1 else after_rejection(probs, q_c, x)
        else:
            return TreeResult(path, sample(probs, rng))


# --- the same rule from scores (the vLLM backend: p at a few tokens per node, not full rows) ----

@dataclass(frozen=True)
class NodeScore:
    """What the target tells about the position after a tree node (or the root) without a full row."""

    sample: int                  # y ~ p, drawn by the target's own sampler
    sample_prob: float           # p(y)
    probs: dict[int, float]      # p(t) for every token the tree rule may need here (tree_tokens_needed)


def tree_tokens_needed(tree: DraftTree, draft_probs: Sequence[EncodedQ | None] | None, node: int) -> list[int] | None:
    """Tokens whose p the rule may read after `node`: its children, and the q supports of every
    child but the last (a rejection's residual step is read by the next sibling; the last child's
    rejection only decides the corrected token, from p at the target's sample: keeps_sample). A
    chain reads one token per node. None when such a q is dense (then the whole processed row is
    needed for that node)."""
    kids = tree.children().get(node, [])
    need: set[int] = {tree.tokens[c] for c in kids}
    for c in kids[:-1]:
        q = None if draft_probs is None else draft_probs[c]
        if q is not None:
            if q.token_ids is None:
                return None
            need.update(int(t) for t in q.token_ids)
    return sorted(need)


def verify_tree_from_scores(tree: DraftTree, draft_probs: Sequence[EncodedQ | None] | None,
                            scores: Sequence[NodeScore], full_row: Callable[[int], np.ndarray],
                            rng: np.random.Generator) -> tuple[TreeResult, bool]:
    """verify_tree's rule from per-node scores instead of full rows (a chain is the tree with one path).

    At a node, p is known on T (tree_tokens_needed: the children and the q supports of all but the
    last); every residual step p_{i+1} = norm(max(0, p_i - q_i)) changes only tokens in q_i's support
    (a subset of T) and divides the rest by r_i = 1 - sum_{t in supp q_i} min(p_i(t), q_i(t)), so
    outside T p_{k}(t) = p(t) / prod_{i<k} r_i (spec_core.acceptance.sparse_after_rejection). The
    accept tests read p_i at the children (in T). The corrected token once the last child k was
    rejected: keep the target's y ~ p with probability a(y) = p_{k+1}(y) prod_{i<=k} r_i / p(y) (<= 1),
    else draw from p_{k+1} built from the full row:
        P(out = t) = p(t) a(t) + (1 - prod r) p_{k+1}(t) = prod r p_{k+1}(t) + (1 - prod r) p_{k+1}(t).
    With p_{k+1}(y) r_k = max(0, p_k(y) - q_k(y)), a(y) needs p_k only at y (keeps_sample), and it is
    1 off T and off q_k's support: the full row is needed only when y lands on a child or a q support.
    scores  # [n + 1]: index 0 the root, i + 1 node i. full_row(node) -> processed p  # [vocab].
    Returns (result, whether full_row was needed).
    """
    children = tree.children()
    node, path = ROOT, []
    while True:
        s = scores[node + 1]
        cur = dict(s.probs)   # p_i on T, kept normalised
        scale = 1.0           # p_i(t) = p(t) * scale outside T
        kids = children.get(node, [])
        for k, c in enumerate(kids):
            x = tree.tokens[c]
            q = None if draft_probs is None else draft_probs[c]
            if accepts(cur[x], q, x, rng):
                node = c
                path.append(c)
                break
            if k + 1 < len(kids):   # the next sibling is tested against the residual
                cur, r = sparse_after_rejection(cur, q, x)
                scale /= r
        else:
            if not kids:   # a leaf (or a node without children): y ~ p is the bonus
                return TreeResult(path, s.sample), False
            last = kids[-1]
            q_last = None if draft_probs is None else draft_probs[last]
            y = s.sample
            if keeps_sample(y, s.sample_prob, q_last, tree.tokens[last], rng, cur.get(y), scale):
                return TreeResult(path, y), False
            probs = full_row(node)  # [vocab]
            for k, c in enumerate(kids):
                q = None if draft_probs is None else draft_probs[c]
                probs = (corrected_probs if k == len(kids) - 1 else after_rejection)(probs, q, tree.tokens[c])
            return TreeResult(path, sample(probs, rng)), True


def without_tokens(q: EncodedQ, tokens: Sequence[int]) -> EncodedQ:
    """q with `tokens` given zero weight: the distribution of the next sibling drawn without
    replacement. Exact on the integers (FIXED) or floats (FLOAT32) that ship: q' = weights' / sum."""
    if not tokens:
        return q
    if q.token_ids is None:
        weights = q.weights.copy()
        weights[np.asarray(list(tokens), dtype=np.int64)] = 0
        return EncodedQ(None, weights, q.fixed)
    keep = ~np.isin(q.token_ids, np.asarray(list(tokens), dtype=q.token_ids.dtype))
    return EncodedQ(q.token_ids[keep], q.weights[keep], q.fixed)


def remaining_mass(q: EncodedQ, tokens: Sequence[int]) -> float:
    """q's mass outside `tokens` (0 when they cover its support: no further sibling can be drawn)."""
    return 1.0 - sum(q.prob_of(t) for t in tokens)


# --- building a tree on the edge --------------------------------------------------------------

@dataclass(frozen=True)
class TreeShape:
    """How the edge grows a tree: at most `budget` nodes, `depth` levels, `branching` children per
    node; at each level only the `width` most probable frontier nodes are expanded (best-first)."""

    budget: int = 16
    depth: int = 4
    branching: int = 2
    width: int = 4

    def __post_init__(self):
        if min(self.budget, self.depth, self.branching, self.width) < 1:
            raise ValueError(f"tree shape needs budget, depth, branching, width >= 1: {self}")

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """'budget=16,depth=4,branching=2,width=4' (any subset; the rest default)."""
        fields = {}
        for part in filter(None, text.split(",")):
            key, _, value = part.partition("=")
            if key not in ("budget", "depth", "branching", "width"):
                raise ValueError(f"unknown tree option {key!r}: use budget, depth, branching, width")
            fields[key] = int(value)
        return cls(**fields)


SAMPLED_KEEP = 0.6  # assumed chance that a sampled child is kept, for ranking which nodes to expand


@dataclass
class GrownTree:
    tree: DraftTree
    qs: list[EncodedQ] | None    # [n] each node's shipped q, or None: point masses
    path_probs: list[float]      # [n] the draft's probability of the path to each node
    draft_rows: int              # draft forward rows computed (for the cost model)


class _FrontierNode(NamedTuple):
    path_prob: float        # the draft's probability of the path to this node
    node: int               # its index in the tree (ROOT: the committed sequence)
    path: list[int]         # the tokens on the path


class _Candidate(NamedTuple):
    path_prob: float        # the path's probability, the ranking key
    order: int              # the expanded parent's rank this level (parents before children)
    parent: int
    token: int
    q: EncodedQ | None      # the q it was drawn from (None: a point-mass child)
    path: list[int]         # the parent's path


def grow_tree(next_probs, shape: TreeShape, rng: np.random.Generator, encode=None, noise=None) -> GrownTree:
    """Grow a draft tree level by level, expanding the most probable frontier nodes.

    next_probs(nodes, tokens, parents) -> [len(nodes), vocab]: the draft's distribution after each
        node in `nodes` (ROOT = after the committed sequence) of the tree grown so far (tokens,
        parents), computed in one batch; used to pick children (and, with `encode`, to make q).
    encode(probs) -> EncodedQ, or None: deterministic children (the most likely tokens, point masses).
        With `encode`, children are sampled without replacement from the encoded q, and how many
        children a node gets is fixed before any is drawn (a rule that kept or dropped a child after
        seeing its token would change the distribution it was drawn from).
    noise(depth) -> the gumbel coupling's noise at the position `depth` tokens after the committed
        sequence (spec_core.gumbel), or None: with `encode`, a node's children are then the first of
        q's support ranked by log q + g (Gumbel-top-k: draws without replacement from q, the first
        being the token the target's own sample is compared with); none is drawn from `rng`.
    """
    tokens: list[int] = []
    parents: list[int] = []
    qs: list[EncodedQ] = []
    path_probs: list[float] = []
    frontier = [_FrontierNode(1.0, ROOT, [])]
    rows = 0
    for _ in range(shape.depth):
        left = shape.budget - len(tokens)
        if left <= 0 or not frontier:
            break
        frontier.sort(key=lambda f: -f.path_prob)
        expand = frontier[: min(shape.width, left)]
        probs = next_probs([f.node for f in expand], tokens, parents)  # [len(expand), vocab]
        rows += len(expand)
        candidates: list[_Candidate] = []
        for order, ((pp, node, path), row) in enumerate(zip(expand, probs)):
            if encode is None:
                k = min(shape.branching, int(np.count_nonzero(row)))
                top = np.argpartition(-row, k - 1)[:k]
                top = top[np.argsort(-row[top], kind="stable")]
                candidates += [_Candidate(pp * float(row[t]), order, node, int(t), None, path) for t in top]
            else:
                q = encode(row)
                # Children of this node are fixed in number up front: its share of the budget.
                n_children = min(shape.branching, left - len(candidates))
                ranked = None if noise is None else draft_choices(q, noise(len(path)), n_children)
                drawn: list[int] = []
                for _k in range(n_children):
                    if remaining_mass(q, drawn) <= RESIDUAL_EPS:  # the rest of q is rounding noise
                        break
                    q_i = without_tokens(q, drawn)
                    if ranked is not None and _k >= len(ranked):
                        break
                    tok = q_i.sample(rng) if ranked is None else ranked[_k]
                    # Given the drawn siblings, the first is tested first and kept with min(1, p/q) (most
                    # of the time when the draft is good); a later one only gets a chance after every
                    # earlier one failed. Rank by that (a guess of 0.6 acceptance), not by q(token).
                    candidates.append(_Candidate(pp * SAMPLED_KEEP * (1 - SAMPLED_KEEP) ** len(drawn), order, node,
                                                 tok, q_i, path))
                    drawn.append(tok)
        if encode is None:
            # Point-mass children may be kept or dropped by any rule: keep the most probable.
            candidates.sort(key=lambda c: -c.path_prob)
        candidates = candidates[:left]
        # Parents before children: emit in (expanded node, sibling) order.
        candidates.sort(key=lambda c: c.order)
        frontier = []
        for c in candidates:
            tokens.append(c.token)
            parents.append(c.parent)
            path_probs.append(c.path_prob)
            if c.q is not None:
                qs.append(c.q)
            frontier.append(_FrontierNode(c.path_prob, len(tokens) - 1, c.path + [c.token]))
    tree = DraftTree(tuple(tokens), tuple(parents))
    return GrownTree(tree, qs if encode is not None and qs else None, path_probs, rows)


def tree_sampling(settings, qmode):
    """(to_probs(logits) -> probs, encode or None) for growing a tree with these settings.

    Greedy or q mode 'none' gives deterministic children (point masses): ranked by the draft's
    softmax (at temperature 1 when greedy, where the processed p is one-hot and would rank nothing).
    Otherwise children are sampled without replacement from the encoded q (quantize, then sample).
    """
    from spec_core.qcodec import encode_fixed as _fixed, encode_float as _float
    from spec_core.warping import processed_probs

    if settings.greedy or qmode.kind == "none":
        temperature = 1.0 if settings.greedy else settings.temperature
        top_k, top_p = (0, 1.0) if settings.greedy else (settings.top_k, settings.top_p)
        return (lambda logits: processed_probs(logits, temperature, top_k, top_p)), None
    to_probs = lambda logits: processed_probs(logits, settings.temperature, settings.top_k, settings.top_p)  # noqa: E731
    if qmode.kind == "fixed":
        return to_probs, lambda probs: _fixed(probs, qmode.top_k, qmode.scale_bits)
    return to_probs, lambda probs: _float(probs, qmode.top_k)
