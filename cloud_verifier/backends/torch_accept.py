"""Warping and acceptance for every round of a pass in one batched call, where the logits are.

Terms as in spec_core/verify.py and spec_core/tree.py (target_probs p, draft_probs q, accepted,
corrected, bonus, node, kept path). The rule is spec_core.acceptance's; this module runs it on a
torch tensor holding the target logits of a whole pass (the engine's device: the GPU on a GPU
node, the CPU elsewhere) instead of one numpy row at a time, and hands back only each round's kept
path and its corrected or bonus token.

A pass holds many rounds (`PassRound`); round r owns len(tree) + 1 consecutive rows of `logits`
from `first_row`: row 0 predicts the root's children, row i + 1 the children of node i (the layout
of Backend.tree_logits; a chain of gamma drafts is gamma + 1 rows). Each round brings its own
sampling settings, its drafts (a chain is a tree with one path), their q (none, point mass,
sparse, dense) and its uniforms, drawn on the host from the session's own generator
(`round_uniforms`): one for each node's accept test and one for the corrected or bonus draw. So a
seeded session is reproducible on this path whatever else shares the pass.

What runs, per pass:
  1. warping, per row and vectorised over rows with equal settings kinds: temperature, then top-k
     (ties at the k-th value kept), then top-p over the stable descending order (ties: lower id
     first), as spec_core.warping. A row is summarised by (max, kept boundary, normaliser), so
     p(t) = [t kept] exp(s_t - max) / Z is read at any token without building the row.
  2. accept tests: node c with draft token x and q is kept when u_c < p(x) / q(x), p being the
     parent's row (for a later sibling: the residual left by the rejected earlier siblings).
     Chains are decided on the device (leading accepts); trees walk the sparse residual on the
     host (spec_core.acceptance.sparse_after_rejection) from p read at the children and their q
     supports: a few numbers per node cross, never a row.
  3. one draw per round from the row it ended at: that row's p, minus each rejected child's q in
     turn (spec_core.acceptance.after_rejection: p kept when the residual is rounding noise), by
     inverse CDF with the round's last uniform, in float64.

Where the numbers differ from spec_core's numpy kernels (the outcome distribution does not):
  - exp runs in float32 (numpy: float64), sums and the sampled rows' CDF accumulate in float64; a
    probability differs by about 1e-7 relative, so an accept test or a draw can differ only when
    its uniform lies that close to the decision boundary;
  - the top-p boundary token is decided on float64 sums of float32 exps: it can differ from
    numpy's when the mass before it is within ~1e-6 of top_p;
  - the uniforms are drawn up front (n + 1 a round), where the numpy kernels draw lazily (only for
    uncertain coins), so a seeded session's ids differ between the two paths, each reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from spec_core.acceptance import RESIDUAL_EPS, draft_prob, sparse_after_rejection
from spec_core.qcodec import EncodedQ
from spec_core.tree import ROOT, DraftTree, TreeResult, tree_tokens_needed
from spec_core.warping import SamplingSettings

# top-p without top-k first looks at this many of a row's largest entries (then doubles): on
# peaked rows the kept set is far smaller, and a bounded topk is cheaper than sorting the row.
_TOP_P_CANDIDATES = 1024


@dataclass(frozen=True)
class PassRound:
    """One round of a pass."""

    first_row: int                                  # its row 0 in the pass's logits
    tree: DraftTree                                 # [n] drafts (a chain: parents i - 1)
    draft_probs: Sequence[EncodedQ | None] | None   # [n] q per node, or None: point masses
    settings: SamplingSettings
    uniforms: np.ndarray                            # [n + 1] in [0, 1): round_uniforms


def round_uniforms(n_nodes: int, rng: np.random.Generator) -> np.ndarray:
    """The uniforms a round of n nodes uses, from the session's generator  # [n + 1]: one per
    node's accept test, then one for the corrected or bonus draw."""
    return rng.random(n_nodes + 1)


@dataclass(frozen=True)
class RowWarp:
    """Each row's processed distribution in summary: p(t) = [kept(t)] exp(s_t - top) / norm with
    s = logits / temperature; kept(t) = s_t > last_value or (s_t == last_value and t <= last_id).
    s is recomputed by the same float32 division wherever it is read, so kept() sees the very
    values the boundary was taken from."""

    temperature: torch.Tensor  # [rows] float32 (1 for greedy rows)
    top: torch.Tensor         # [rows] max of s
    last_value: torch.Tensor  # [rows] s of the last kept token in the stable descending order
    last_id: torch.Tensor     # [rows] its id (vocab when every tie at last_value is kept)
    norm: torch.Tensor        # [rows] float64 sum of exp(s - top) over the kept tokens

    def probs_at(self, logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """p at (rows[j], tokens[j])  # [m] float64."""
        s = logits[rows, tokens].float() / self.temperature[rows]
        kept = (s > self.last_value[rows]) | ((s == self.last_value[rows]) & (tokens <= self.last_id[rows]))
        e = torch.exp(s - self.top[rows]).double()
        return torch.where(kept, e / self.norm[rows], torch.zeros_like(e))

    def rows_probs(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Whole processed rows  # [len(rows), vocab] float64."""
        s = logits[rows].float() / self.temperature[rows, None]
        ids = torch.arange(s.shape[1], device=s.device)
        kept = (s > self.last_value[rows, None]) | ((s == self.last_value[rows, None]) & (ids <= self.last_id[rows, None]))
        e = torch.exp(s - self.top[rows, None]).double()
        return torch.where(kept, e / self.norm[rows, None], torch.zeros_like(e))


def warp_rows(logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> RowWarp:
    """RowWarp of every row  # logits: [rows, vocab]; settings per row: [rows] each (temperature 0:
    greedy; top_k 0 or >= vocab: off; top_p 1: off)."""
    rows, vocab = logits.shape
    dev = logits.device
    greedy = temperature <= 0.0
    t = torch.as_tensor(np.where(greedy, 1.0, temperature), dtype=torch.float32, device=dev)
    s = logits.float() / t[:, None]              # [rows, vocab] (a copy; float32)
    top, arg = s.max(dim=-1)
    last_value = torch.full((rows,), -torch.inf, device=dev)
    last_id = torch.full((rows,), vocab, dtype=torch.long, device=dev)
    norm = torch.ones(rows, dtype=torch.float64, device=dev)

    k = np.where((top_k > 0) & (top_k < vocab) & ~greedy, top_k, 0).astype(np.int64)
    p = np.where((top_p > 0.0) & (top_p < 1.0) & ~greedy, top_p, 1.0)
    plain = np.flatnonzero(~greedy & (k == 0) & (p >= 1.0))
    by_k = np.flatnonzero(k > 0)
    p_only = np.flatnonzero((k == 0) & (p < 1.0))

    g = torch.as_tensor(np.flatnonzero(greedy), device=dev)
    if len(g):  # a point mass on the first argmax
        last_value[g], last_id[g] = top[g], arg[g]
    if len(plain):
        r = torch.as_tensor(plain, device=dev)
        norm[r] = torch.exp(s[r] - top[r, None]).sum(dim=-1, dtype=torch.float64)
    if len(by_k):
        _warp_top_k(s, top, by_k, k[by_k], p[by_k], last_value, last_id, norm)
    if len(p_only):
        _warp_top_p(s, top, p_only, p[p_only], last_value, last_id, norm)
    return RowWarp(t, top, last_value, last_id, norm)


def _stable_desc(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) ordered by value descending, ties by id ascending  # [rows, m] each."""
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    order = values.argsort(dim=-1, descending=True, stable=True)
    return values.gather(-1, order), ids.gather(-1, order)


def _top_p_cut(values: torch.Tensor, ids: torch.Tensor, top: torch.Tensor, norm: torch.Tensor,
               valid: torch.Tensor, top_p: torch.Tensor):
    """Apply top-p to candidates in stable descending order  # values, ids, valid: [rows, m]; norm:
    [rows] float64 mass of the set they are cut from. Returns (last value, last id, kept mass  #
    [rows] each)."""
    e = torch.where(valid, torch.exp(values - top[:, None]).double(), torch.zeros((), dtype=torch.float64,
                                                                                   device=values.device))
    cum = e.cumsum(dim=-1)
    keep = valid & ((cum - e) / norm[:, None] < top_p[:, None])
    n_keep = keep.sum(dim=-1).clamp(min=1)   # the top token is always kept
    last = (n_keep - 1)[:, None]
    return values.gather(-1, last)[:, 0], ids.gather(-1, last)[:, 0], cum.gather(-1, last)[:, 0]


def _warp_top_k(s, top, rows_np, k_np, p_np, last_value, last_id, norm) -> None:
    """Rows with top-k (and maybe top-p after it)."""
    dev = s.device
    r = torch.as_tensor(rows_np, device=dev)
    k = torch.as_tensor(k_np, device=dev)
    sr = s[r]                                            # [m, vocab]
    kmax = int(k_np.max())
    vals, _ = sr.topk(kmax, dim=-1)                      # sorted descending
    kth = vals.gather(-1, (k - 1)[:, None])[:, 0]        # the k-th largest scaled logit
    n_kept = (sr >= kth[:, None]).sum(dim=-1)           # ties at the k-th value are kept too
    # Their mass from the top-k values alone: a token tied beyond the k-th has the k-th's value.
    e = torch.exp(vals - top[r, None]).double()
    e = torch.where(torch.arange(kmax, device=dev)[None, :] < k[:, None], e, torch.zeros((), dtype=e.dtype, device=dev))
    mass = e.sum(dim=-1) + (n_kept - k) * torch.exp(kth - top[r]).double()
    last_value[r], last_id[r], norm[r] = kth, s.shape[1], mass
    cut = np.flatnonzero(p_np < 1.0)
    if not len(cut):
        return
    c = torch.as_tensor(cut, device=dev)
    m = int(n_kept[c].max())                             # ties may make it more than k
    cv, ci = sr[c].topk(m, dim=-1)
    cv, ci = _stable_desc(cv, ci)
    valid = torch.arange(m, device=dev)[None, :] < n_kept[c, None]
    lv, li, kept_mass = _top_p_cut(cv, ci, top[r[c]], mass[c], valid,
                                      torch.as_tensor(p_np[cut], dtype=torch.float64, device=dev))
    last_value[r[c]], last_id[r[c]], norm[r[c]] = lv, li, kept_mass


def _warp_top_p(s, top, rows_np, p_np, last_value, last_id, norm) -> None:
    """Rows with top-p alone: the largest entries first, more only where they do not decide."""
    dev = s.device
    vocab = s.shape[1]
    r = torch.as_tensor(rows_np, device=dev)
    sr = s[r]
    mass = torch.exp(sr - top[r, None]).sum(dim=-1, dtype=torch.float64)
    p = torch.as_tensor(p_np, dtype=torch.float64, device=dev)
    todo = torch.arange(len(rows_np), device=dev)
    m = min(vocab, _TOP_P_CANDIDATES)
    while len(todo):
        cv, ci = sr[todo].topk(m, dim=-1)
        cv, ci = _stable_desc(cv, ci)
        valid = torch.ones_like(cv, dtype=torch.bool)
        lv, li, kept_mass = _top_p_cut(cv, ci, top[r[todo]], mass[todo], valid, p[todo])
        # Decided when the last kept value is above the smallest candidate: that candidate is not
        # kept, and every entry outside the candidates comes after it in the order. (topk may cut
        # inside a tie at the smallest candidate value, so a cut there is not trusted.)
        done = (cv[:, -1] < lv) | (m == vocab)
        d = todo[done]
        last_value[r[d]], last_id[r[d]], norm[r[d]] = lv[done], li[done], kept_mass[done]
        todo = todo[~done]
        m = min(vocab, 4 * m)


class _Nodes:
    """Every node of the pass, flattened; host arrays."""

    def __init__(self, rounds: Sequence[PassRound]):
        parent_row, token, q_at, u = [], [], [], []
        for rd in rounds:
            tree = rd.tree
            for i, (x, par) in enumerate(zip(tree.tokens, tree.parents)):
                parent_row.append(rd.first_row + par + 1)
                token.append(x)
                q = None if rd.draft_probs is None else rd.draft_probs[i]
                q_at.append(draft_prob(q, x))
                u.append(rd.uniforms[i])
        self.parent_row = np.asarray(parent_row, dtype=np.int64)
        self.token = np.asarray(token, dtype=np.int64)
        self.q_at = np.asarray(q_at, dtype=np.float64)   # q(x) at each node's own token
        self.u = np.asarray(u, dtype=np.float64)


def accept_pass(logits: torch.Tensor, rounds: Sequence[PassRound]) -> list[TreeResult]:
    """The kept path and the corrected or bonus token of every round of a pass.

    logits  # [rows, vocab] on any device (float32, bf16 or float16); each round reads its
    len(tree) + 1 rows from first_row. Exactly spec_core.verify / spec_core.tree's rule (module
    docstring: where the float order differs)."""
    if not rounds:
        return []
    for rd in rounds:
        assert len(rd.uniforms) == len(rd.tree) + 1, (len(rd.uniforms), len(rd.tree))
        assert rd.first_row + len(rd.tree) + 1 <= logits.shape[0], (rd.first_row, len(rd.tree), logits.shape)
    dev = logits.device
    # Only the rows the rounds own are warped (a pass may hold rows of other requests).
    own = np.concatenate([np.arange(rd.first_row, rd.first_row + len(rd.tree) + 1) for rd in rounds])
    local = np.full(logits.shape[0], -1, dtype=np.int64)
    local[own] = np.arange(len(own))
    whole = len(own) == logits.shape[0] and bool(np.all(own == np.arange(len(own))))
    rows_logits = logits if whole else logits[torch.as_tensor(own, device=dev)]
    per_row = np.repeat(np.arange(len(rounds)), [len(rd.tree) + 1 for rd in rounds])
    warp = warp_rows(rows_logits,
                     np.array([rd.settings.temperature for rd in rounds])[per_row],
                     np.array([rd.settings.top_k for rd in rounds])[per_row],
                     np.array([rd.settings.top_p for rd in rounds])[per_row])
    nodes = _Nodes(rounds)
    chains = [j for j, rd in enumerate(rounds) if rd.tree.is_chain]
    trees = [j for j, rd in enumerate(rounds) if not rd.tree.is_chain]
    ends: list[_End | None] = [None] * len(rounds)
    starts = np.cumsum([0] + [len(rd.tree) for rd in rounds])   # each round's first node
    if chains:
        for j, end in zip(chains, _chain_ends(rows_logits, warp, rounds, chains, nodes, starts, local)):
            ends[j] = end
    if trees:
        for j, end in zip(trees, _tree_ends(rows_logits, warp, rounds, trees, local)):
            ends[j] = end
    tokens = _draw(rows_logits, warp, rounds, ends, local)
    return [TreeResult(end.path, tok) for end, tok in zip(ends, tokens)]


@dataclass(frozen=True)
class _End:
    """Where a round stopped: its kept path, the node whose row the last token is drawn from, and
    the children of that node rejected there, in test order."""

    path: list[int]
    node: int
    rejected: list[int]


def _chain_ends(logits, warp, rounds, chains, nodes, starts, local) -> list[_End]:
    """Chains on the device: node i is kept when every node before it was and u_i < p_i(x_i)/q_i(x_i)."""
    dev = logits.device
    idx = np.concatenate([np.arange(starts[j], starts[j + 1]) for j in chains]) if chains else np.array([], int)
    gammas = np.array([len(rounds[j].tree) for j in chains])
    counts = np.zeros(len(chains), dtype=np.int64)
    if len(idx):
        p_x = warp.probs_at(logits, torch.as_tensor(local[nodes.parent_row[idx]], device=dev),
                            torch.as_tensor(nodes.token[idx], device=dev))
        ok = torch.as_tensor(nodes.u[idx], device=dev) * torch.as_tensor(nodes.q_at[idx], device=dev) < p_x
        gmax = int(gammas.max())
        grid = torch.zeros((len(chains), gmax), dtype=torch.bool, device=dev)
        mask = np.arange(gmax)[None, :] < gammas[:, None]
        grid[torch.as_tensor(mask, device=dev)] = ok
        counts = grid.to(torch.int64).cumprod(dim=-1).sum(dim=-1).cpu().numpy()
    out = []
    for j, c in zip(chains, counts):
        c = int(c)
        gamma = len(rounds[j].tree)
        out.append(_End(list(range(c)), c - 1, [c] if c < gamma else []))
    return out


def _tree_ends(logits, warp, rounds, trees, local) -> list[_End]:
    """Trees: p at every node's children and their q supports, in one gather; the walk with the
    sparse residual (spec_core.tree.verify_tree_from_scores' rule) on the host."""
    dev = logits.device
    gather_rows, gather_tokens, where = [], [], []   # where[k]: (tree j, node, tokens)
    for j in trees:
        rd = rounds[j]
        kids = rd.tree.children()
        for node in [ROOT] + list(range(len(rd.tree))):
            if not kids.get(node):
                continue
            need = tree_tokens_needed(rd.tree, rd.draft_probs, node)
            if need is None:   # a dense q: its support is every token with weight
                need = sorted({rd.tree.tokens[c] for c in kids[node]} | {
                    int(t) for c in kids[node] for t in np.flatnonzero(rd.draft_probs[c].weights)})
            row = local[rd.first_row + node + 1]
            gather_rows += [row] * len(need)
            gather_tokens += need
            where.append((j, node, need))
    values = warp.probs_at(logits, torch.as_tensor(np.asarray(gather_rows, dtype=np.int64), device=dev),
                           torch.as_tensor(np.asarray(gather_tokens, dtype=np.int64), device=dev)).cpu().numpy()
    known: dict[tuple[int, int], dict[int, float]] = {}
    at = 0
    for j, node, need in where:
        known[j, node] = dict(zip(need, values[at:at + len(need)].tolist()))
        at += len(need)
    out = []
    for j in trees:
        rd = rounds[j]
        kids = rd.tree.children()
        node, path = ROOT, []
        while True:
            cur = known.get((j, node), {})
            rejected = []
            for c in kids.get(node, []):
                x = rd.tree.tokens[c]
                q = None if rd.draft_probs is None else rd.draft_probs[c]
                if rd.uniforms[c] * draft_prob(q, x) < cur[x]:
                    node = c
                    path.append(c)
                    break
                rejected.append(c)
                cur, _ = sparse_after_rejection(cur, q, x)
            else:
                out.append(_End(path, node, rejected))
                break
    return out


def _draw(logits, warp, rounds, ends, local) -> list[int]:
    """Each round's corrected or bonus token: its end row's p with the rejected children's q taken
    out in turn (after_rejection), drawn by inverse CDF with the round's last uniform."""
    dev = logits.device
    vocab = logits.shape[1]
    rows = torch.as_tensor(np.array([local[rd.first_row + end.node + 1] for rd, end in zip(rounds, ends)]), device=dev)
    probs = warp.rows_probs(logits, rows)                  # [R, vocab] float64
    steps = max(len(end.rejected) for end in ends)
    for step in range(steps):
        live = [j for j, end in enumerate(ends) if len(end.rejected) > step]
        q = torch.zeros((len(live), vocab), dtype=torch.float64, device=dev)
        for k, j in enumerate(live):
            rd, c = rounds[j], ends[j].rejected[step]
            _add_q(q[k], None if rd.draft_probs is None else rd.draft_probs[c], rd.tree.tokens[c])
        live_t = torch.as_tensor(live, device=dev)
        residual = (probs[live_t] - q).clamp(min=0.0)
        total = residual.sum(dim=-1, keepdim=True)
        # A residual of rounding noise (p and q agree): p stays (spec_core.acceptance.after_rejection).
        probs[live_t] = torch.where(total > RESIDUAL_EPS, residual / total, probs[live_t])
    cdf = probs.cumsum(dim=-1)
    u = torch.as_tensor(np.array([rd.uniforms[-1] for rd in rounds]), dtype=torch.float64, device=dev)
    target = (u * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    # u < 1 keeps target below the total; rounding may still land past the last nonzero entry.
    last_nonzero = vocab - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.minimum(idx, last_nonzero).cpu().tolist()


def _add_q(out: torch.Tensor, q: EncodedQ | None, token: int) -> None:
    """q as a float64 row into `out`  # [vocab] (a point mass when q is None)."""
    if q is None:
        out[token] = 1.0
        return
    if q.token_ids is None:
        w = torch.as_tensor(np.asarray(q.weights, dtype=np.float64), device=out.device)
        out[: len(w)] = w / w.sum()
        return
    w = torch.as_tensor(np.asarray(q.weights, dtype=np.float64), device=out.device)
    ids = torch.as_tensor(q.token_ids.astype(np.int64), device=out.device)
    out.index_put_((ids,), w / w.sum(), accumulate=True)   # q as the codec defines it: weights / sum
