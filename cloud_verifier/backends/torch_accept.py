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

With the gumbel coupling (settings.coupling "gumbel", spec_core.gumbel has the rule and the proof)
a round reads no q and no uniform: at every row it owns, y = argmax(log p + g), p the row's processed
distribution (step 1 below, the same warping) and g the noise of (the session's seed, the absolute
position the row predicts: `PassRound.position` for row 0), computed here from the same 52-bit
integers as spec_core.gumbel (`gumbel_noise_bits`); only the rows' y cross to the host, where the walk
moves to the child carrying y (spec_core.tree.gumbel_walk), y at the row it stops at being the
corrected or bonus token. Rounds of both couplings share a pass.

What runs, per pass (the rejection coupling):
  1. warping, per row and vectorised over rows with equal settings kinds: temperature, then top-k
     (ties at the k-th value kept), then top-p over the stable descending order (ties: lower id
     first), as spec_core.warping. A row is summarised by (max, kept boundary, normaliser), so
     p(t) = [t kept] exp(s_t - max) / Z is read at any token without building the row.
  2. accept tests: node c with draft token x and q is kept when u_c < p(x) / q(x), p being the
     parent's row (for a later sibling: the residual left by the rejected earlier siblings).
     Chains are decided on the device (leading accepts); trees walk the sparse residual on the
     host (spec_core.acceptance.sparse_after_rejection) from p read at the children and the q
     supports of all but the last (spec_core.tree.tree_tokens_needed): a few numbers per node cross,
     never a row.
  3. one draw per round from the row it ended at: that row's p, minus each rejected child's q in
     turn (spec_core.acceptance.after_rejection: p kept when the residual is rounding noise), by
     inverse CDF with the round's last uniform, in float64, in ascending token order as
     spec_core.warping.sample; over the row's kept tokens alone where the warping listed them
     (greedy, top-k, top-p rows keeping at most _SUPPORT_CAP tokens: p and so the residual are 0
     elsewhere), else over the whole row.

torch is imported here at the top: only code that runs where torch is installed (the vLLM
environment, a GPU node) imports this module; spec_core and the main environment never do.

Where the numbers differ from spec_core's numpy kernels (the outcome distribution does not):
  - exp and the sum over a whole row (the normaliser) run in float32 (numpy: float64; a float64
    sum costs ~10x on CPU torch), the top-p cumulative sums and the drawn rows' CDF in float64; a
    probability differs by about 1e-6 relative at most, so an accept test or a draw can differ
    only when its uniform lies that close to the decision boundary;
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

# top-p without top-k first looks at this many of a row's largest entries (then 16x as many): on
# peaked rows the kept set is far smaller, and a bounded topk is cheaper than sorting the row.
_TOP_P_CANDIDATES = 64


@dataclass(frozen=True)
class PassRound:
    """One round of a pass."""

    first_row: int                                  # its row 0 in the pass's logits
    tree: DraftTree                                 # [n] drafts (a chain: parents i - 1)
    draft_probs: Sequence[EncodedQ | None] | None   # [n] q per node, or None: point masses
    settings: SamplingSettings
    uniforms: np.ndarray                            # [n + 1] in [0, 1): round_uniforms (gumbel: unread)
    position: int | None = None                     # gumbel: the absolute position row 0 predicts


def round_uniforms(n_nodes: int, rng: np.random.Generator) -> np.ndarray:
    """The uniforms a round of n nodes uses, from the session's generator  # [n + 1]: one per
    node's accept test, then one for the corrected or bonus draw."""
    return rng.random(n_nodes + 1)


@dataclass(frozen=True)
class RowWarp:
    """Each row's processed distribution in summary: p(t) = [kept(t)] exp(s_t - top) / norm with
    s = logits / temperature; kept(t) = s_t > last_value or (s_t == last_value and t <= last_id).
    s is recomputed by the same float32 division wherever it is read, so kept() sees the very
    values the boundary was taken from. Rows truncated to a few tokens (greedy, top-k, top-p) also
    list them, so a draw from such a row never touches the vocabulary."""

    temperature: torch.Tensor  # [rows] float32 (1 for greedy rows)
    top: torch.Tensor          # [rows] max of s
    last_value: torch.Tensor   # [rows] s of the last kept token in the stable descending order
    last_id: torch.Tensor      # [rows] its id (vocab when every tie at last_value is kept)
    norm: torch.Tensor         # [rows] sum of exp(s - top) over the kept tokens (float64 tensor)
    support: torch.Tensor      # [rows, m] the kept ids ascending, padded with vocab
    support_len: torch.Tensor  # [rows] how many; 0: the row is not listed (read it whole)

    def probs_at(self, logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """p at (rows[j], tokens[j])  # [m] (any shape, rows broadcast against tokens) float64;
        a token id of vocab (padding) reads 0."""
        rows = rows.expand_as(tokens)
        vocab = logits.shape[1]
        s = logits[rows, tokens.clamp(max=vocab - 1)].float() / self.temperature[rows]
        kept = (s > self.last_value[rows]) | ((s == self.last_value[rows]) & (tokens <= self.last_id[rows]))
        e = torch.exp(s - self.top[rows]).double()
        return torch.where(kept & (tokens < vocab), e / self.norm[rows], torch.zeros_like(e))

    def rows_probs(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Whole processed rows  # [len(rows), vocab] float64."""
        s = logits[rows].float() / self.temperature[rows, None]
        ids = torch.arange(s.shape[1], device=s.device)
        kept = (s > self.last_value[rows, None]) | ((s == self.last_value[rows, None]) & (ids <= self.last_id[rows, None]))
        e = torch.exp(s - self.top[rows, None]).double()
        return torch.where(kept, e / self.norm[rows, None], torch.zeros_like(e))


# A truncated row is listed (RowWarp.support) when it keeps at most this many tokens.
_SUPPORT_CAP = 4096


class _Warping:
    """warp_rows' working state: the summary under construction, one settings group at a time."""

    def __init__(self, logits: torch.Tensor, temperature: np.ndarray):
        self.logits = logits
        rows, self.vocab = logits.shape
        dev = self.dev = logits.device
        self.t = torch.as_tensor(temperature.astype(np.float32), device=dev)
        self.top = torch.empty(rows, device=dev)
        self.last_value = torch.full((rows,), -torch.inf, device=dev)
        self.last_id = torch.full((rows,), self.vocab, dtype=torch.long, device=dev)
        self.norm = torch.ones(rows, dtype=torch.float64, device=dev)
        self.supports: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, ids, lens)

    def rows(self, idx: np.ndarray, scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(row indices, their s  # [len(idx), vocab] float32); scaled False: the raw logits
        (greedy rows, temperature 1: the same numbers without a copy when the pass is all greedy)."""
        r = torch.as_tensor(idx, device=self.dev)
        sub = self.logits if len(idx) == self.logits.shape[0] else self.logits[r]
        return r, (sub.float() / self.t[r, None] if scaled else sub.float())

    def listed(self, r: torch.Tensor, ids: torch.Tensor, lens: torch.Tensor) -> None:
        """Rows r keep ids[:, :lens] (any order); lens 0: not listed."""
        lens = torch.where(lens <= min(ids.shape[1], _SUPPORT_CAP), lens, torch.zeros_like(lens))
        width = max(1, int(lens.max())) if len(lens) else 1
        ids = ids[:, :width]
        pos = torch.arange(width, device=self.dev)[None, :]
        ids = torch.where(pos < lens[:, None], ids, torch.full_like(ids, self.vocab)).sort(dim=-1).values
        self.supports.append((r, ids, lens))

    def done(self) -> RowWarp:
        rows = self.logits.shape[0]
        m = max([ids.shape[1] for _, ids, _ in self.supports] + [1])
        support = torch.full((rows, m), self.vocab, dtype=torch.long, device=self.dev)
        support_len = torch.zeros(rows, dtype=torch.long, device=self.dev)
        for r, ids, lens in self.supports:
            support[r, :ids.shape[1]] = ids
            support_len[r] = lens
        return RowWarp(self.t, self.top, self.last_value, self.last_id, self.norm, support, support_len)


def warp_rows(logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> RowWarp:
    """RowWarp of every row  # logits: [rows, vocab]; settings per row: [rows] each (temperature 0:
    greedy; top_k 0 or >= vocab: off; top_p 1: off)."""
    vocab = logits.shape[1]
    greedy = temperature <= 0.0
    w = _Warping(logits, np.where(greedy, 1.0, temperature))
    k = np.where((top_k > 0) & (top_k < vocab) & ~greedy, top_k, 0).astype(np.int64)
    p = np.where((top_p > 0.0) & (top_p < 1.0) & ~greedy, top_p, 1.0)
    g = np.flatnonzero(greedy)
    if len(g):  # a point mass on the first argmax
        r, s = w.rows(g, scaled=False)
        top, arg = s.max(dim=-1)
        w.top[r], w.last_value[r], w.last_id[r] = top, top, arg
        w.listed(r, arg[:, None], torch.ones_like(arg))
    plain = np.flatnonzero(~greedy & (k == 0) & (p >= 1.0))
    if len(plain):
        r, s = w.rows(plain)
        top = s.max(dim=-1).values
        w.top[r] = top
        w.norm[r] = torch.exp(s - top[:, None]).sum(dim=-1).double()
    by_k = np.flatnonzero(k > 0)
    if len(by_k):
        _warp_top_k(w, by_k, k[by_k], p[by_k])
    p_only = np.flatnonzero((k == 0) & (p < 1.0))
    if len(p_only):
        _warp_top_p(w, p_only, p[p_only])
    return w.done()


def _stable_desc(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) from topk (values descending) ordered with ties by id ascending  # [rows, m]
    each. Without ties (float32 logits, mostly) topk's order is already that one."""
    if values.shape[1] < 2:
        return values, ids
    tied = torch.nonzero((values[:, 1:] == values[:, :-1]).any(dim=-1))[:, 0]
    if not len(tied):
        return values, ids
    v, i = values[tied], ids[tied]
    by_id = i.argsort(dim=-1)
    v, i = v.gather(-1, by_id), i.gather(-1, by_id)
    order = v.argsort(dim=-1, descending=True, stable=True)
    values, ids = values.clone(), ids.clone()
    values[tied], ids[tied] = v.gather(-1, order), i.gather(-1, order)
    return values, ids


def _top_p_cut(values: torch.Tensor, ids: torch.Tensor, top: torch.Tensor, norm: torch.Tensor,
               valid: torch.Tensor, top_p: torch.Tensor):
    """Apply top-p to candidates in stable descending order  # values, ids, valid: [rows, m]; norm:
    [rows] float64 mass of the set they are cut from. Returns (last value, last id, kept mass,
    how many kept  # [rows] each)."""
    e = torch.where(valid, torch.exp(values - top[:, None]).double(), torch.zeros((), dtype=torch.float64,
                                                                                   device=values.device))
    cum = e.cumsum(dim=-1)
    keep = valid & ((cum - e) / norm[:, None] < top_p[:, None])
    n_keep = keep.sum(dim=-1).clamp(min=1)   # the top token is always kept
    last = (n_keep - 1)[:, None]
    return values.gather(-1, last)[:, 0], ids.gather(-1, last)[:, 0], cum.gather(-1, last)[:, 0], n_keep


def _warp_top_k(w: _Warping, rows_np, k_np, p_np) -> None:
    """Rows with top-k (and maybe top-p after it)."""
    dev = w.dev
    r, s = w.rows(rows_np)                               # [m, vocab]
    k = torch.as_tensor(k_np, device=dev)
    kmax = int(k_np.max())
    vals, ids = s.topk(min(kmax + 1, w.vocab), dim=-1)   # sorted descending; one more to see ties
    top = vals[:, 0]
    kth = vals.gather(-1, (k - 1)[:, None])[:, 0]        # the k-th largest scaled logit
    # Ties at the k-th value are kept too: counted (over the row) only where the next value ties.
    n_kept = k.clone()
    tied = np.flatnonzero((vals.gather(-1, k[:, None])[:, 0] == kth).cpu().numpy())
    if len(tied):
        t_ = torch.as_tensor(tied, device=dev)
        n_kept[t_] = (s[t_] >= kth[t_, None]).sum(dim=-1)
    vals, ids = vals[:, :kmax], ids[:, :kmax]
    # Their mass from the top-k values alone: a token tied beyond the k-th has the k-th's value.
    e = torch.exp(vals - top[:, None]).double()
    e = torch.where(torch.arange(kmax, device=dev)[None, :] < k[:, None], e, torch.zeros((), dtype=e.dtype, device=dev))
    mass = e.sum(dim=-1) + (n_kept - k) * torch.exp(kth - top).double()
    w.top[r], w.last_value[r], w.last_id[r], w.norm[r] = top, kth, w.vocab, mass
    cut = np.flatnonzero(p_np < 1.0)
    whole = np.flatnonzero(p_np >= 1.0)
    if len(whole):
        h = torch.as_tensor(whole, device=dev)
        # Listed only without ties past the k-th (then the kept set is the top-k ids).
        w.listed(r[h], ids[h], torch.where(n_kept[h] == k[h], k[h], torch.zeros_like(k[h])))
    if not len(cut):
        return
    c = torch.as_tensor(cut, device=dev)
    m = int(n_kept[c].max())                             # ties may make it more than k
    cv, ci = (vals[c], ids[c]) if m <= kmax else s[c].topk(m, dim=-1)
    cv, ci = _stable_desc(cv[:, :m], ci[:, :m])
    valid = torch.arange(m, device=dev)[None, :] < n_kept[c, None]
    lv, li, kept_mass, n_keep = _top_p_cut(cv, ci, top[c], mass[c], valid,
                                           torch.as_tensor(p_np[cut], dtype=torch.float64, device=dev))
    w.last_value[r[c]], w.last_id[r[c]], w.norm[r[c]] = lv, li, kept_mass
    w.listed(r[c], ci, n_keep)


def _warp_top_p(w: _Warping, rows_np, p_np) -> None:
    """Rows with top-p alone: the largest entries first, more only where they do not decide."""
    dev, vocab = w.dev, w.vocab
    r, s = w.rows(rows_np)
    top = s.max(dim=-1).values
    w.top[r] = top
    mass = torch.exp(s - top[:, None]).sum(dim=-1).double()
    p = torch.as_tensor(p_np, dtype=torch.float64, device=dev)
    todo = torch.arange(len(rows_np), device=dev)
    m = min(vocab, _TOP_P_CANDIDATES)
    while len(todo):
        cv, ci = (s if len(todo) == len(rows_np) else s[todo]).topk(m, dim=-1)
        cv, ci = _stable_desc(cv, ci)
        valid = torch.ones_like(cv, dtype=torch.bool)
        lv, li, kept_mass, n_keep = _top_p_cut(cv, ci, top[todo], mass[todo], valid, p[todo])
        # Decided when the last kept value is above the smallest candidate: that candidate is not
        # kept, and every entry outside the candidates comes after it in the order. (topk may cut
        # inside a tie at the smallest candidate value, so a cut there is not trusted.)
        done = (cv[:, -1] < lv) | (m == vocab)
        d = todo[done]
        w.last_value[r[d]], w.last_id[r[d]], w.norm[r[d]] = lv[done], li[done], kept_mass[done]
        w.listed(r[d], ci[done], n_keep[done])
        todo = todo[~done]
        m = min(vocab, 16 * m)


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
    docstring: where the float order differs); rounds whose settings say gumbel, gumbel_walk's."""
    if not rounds:
        return []
    for rd in rounds:
        if rd.settings.gumbel:
            assert rd.settings.seed is not None and rd.position is not None, "the gumbel coupling needs seed and position"
        else:
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
    out: list[TreeResult | None] = [None] * len(rounds)
    gumbel = [j for j, rd in enumerate(rounds) if rd.settings.gumbel]
    rejection = [j for j, rd in enumerate(rounds) if not rd.settings.gumbel]
    for part, decide in ((gumbel, _gumbel_results), (rejection, _rejection_results)):
        if part:
            for j, result in zip(part, decide(rows_logits, warp, [rounds[j] for j in part], local)):
                out[j] = result
    return out


def _rejection_results(rows_logits, warp, rounds: Sequence[PassRound], local) -> list[TreeResult]:
    """Rounds of the rejection coupling: accept tests (chains on the device, trees walked on the host),
    then one draw per round (module docstring)."""
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
            rejected, here = [], kids.get(node, [])
            for c in here:
                x = rd.tree.tokens[c]
                q = None if rd.draft_probs is None else rd.draft_probs[c]
                if rd.uniforms[c] * draft_prob(q, x) < cur[x]:
                    node = c
                    path.append(c)
                    break
                rejected.append(c)
                if c != here[-1]:   # the next sibling is tested against the residual
                    cur, _ = sparse_after_rejection(cur, q, x)
            else:
                out.append(_End(path, node, rejected))
                break
    return out


def _draw(logits, warp, rounds, ends, local) -> list[int]:
    """Each round's corrected or bonus token: its end row's p with the rejected children's q taken
    out in turn (after_rejection), drawn by inverse CDF with the round's last uniform. Rows the
    warping listed are drawn over their kept ids alone (p and so the residual are 0 elsewhere)."""
    dev = logits.device
    end_rows = torch.as_tensor(np.array([local[rd.first_row + end.node + 1] for rd, end in zip(rounds, ends)]),
                               device=dev)
    listed = (warp.support_len[end_rows] > 0).cpu().numpy()
    tokens = np.empty(len(rounds), dtype=np.int64)
    for part in (np.flatnonzero(listed), np.flatnonzero(~listed)):
        if len(part):
            tokens[part] = _draw_part(logits, warp, [rounds[j] for j in part], [ends[j] for j in part],
                                      end_rows[torch.as_tensor(part, device=dev)], bool(listed[part[0]]))
    return tokens.tolist()


def _draw_part(logits, warp, rounds, ends, rows, listed: bool) -> np.ndarray:
    """_draw for rounds whose end rows are all listed (over their ids) or all not (whole rows)."""
    dev, vocab = logits.device, logits.shape[1]
    if listed:
        ids = warp.support[rows]                                          # [R, m] ascending, vocab-padded
        probs = warp.probs_at(logits, rows[:, None], ids)                 # [R, m] float64
    else:
        ids = None
        probs = warp.rows_probs(logits, rows)                             # [R, vocab] float64
    for step in range(max(len(end.rejected) for end in ends)):
        live = [j for j, end in enumerate(ends) if len(end.rejected) > step]
        q_ids, q_w = _packed_q([(rounds[j], ends[j].rejected[step]) for j in live], dev)   # [L, kq] each
        live_t = torch.as_tensor(live, device=dev)
        if ids is None:
            pos, match = q_ids.clamp(min=0), q_ids >= 0
        else:
            row_ids = ids[live_t].contiguous()
            pos = torch.searchsorted(row_ids, q_ids).clamp(max=row_ids.shape[1] - 1)
            match = row_ids.gather(-1, pos) == q_ids
        q = torch.zeros((len(live), probs.shape[1]), dtype=torch.float64, device=dev)
        q.scatter_add_(1, pos, torch.where(match, q_w, torch.zeros_like(q_w)))
        residual = (probs[live_t] - q).clamp(min=0.0)
        total = residual.sum(dim=-1, keepdim=True)
        # A residual of rounding noise (p and q agree): p stays (spec_core.acceptance.after_rejection).
        probs[live_t] = torch.where(total > RESIDUAL_EPS, residual / total, probs[live_t])
    cdf = probs.cumsum(dim=-1)
    u = torch.as_tensor(np.array([rd.uniforms[-1] for rd in rounds]), dtype=torch.float64, device=dev)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u < 1 keeps the target below the total; rounding may still land past the last nonzero entry.
    last_nonzero = probs.shape[1] - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    idx = torch.minimum(idx, last_nonzero)
    out = idx if ids is None else ids.gather(-1, idx[:, None])[:, 0]
    return out.cpu().numpy()


def _packed_q(nodes, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The q of each (round, node) as padded ids and float64 probabilities  # [len(nodes), kq] each;
    ids -1 pad. A point mass is its own token with 1; q is the codec's weights / sum."""
    id_rows, w_rows = [], []
    for rd, c in nodes:
        q = None if rd.draft_probs is None else rd.draft_probs[c]
        if q is None:
            id_rows.append(np.array([rd.tree.tokens[c]], dtype=np.int64))
            w_rows.append(np.ones(1))
            continue
        weights = np.asarray(q.weights, dtype=np.float64)
        ids = np.flatnonzero(weights) if q.token_ids is None else q.token_ids.astype(np.int64)
        id_rows.append(ids)
        w_rows.append((weights[ids] if q.token_ids is None else weights) / weights.sum())
    kq = max(len(i) for i in id_rows)
    q_ids = np.full((len(nodes), kq), -1, dtype=np.int64)
    q_w = np.zeros((len(nodes), kq))
    for k, (i, w_) in enumerate(zip(id_rows, w_rows)):
        q_ids[k, :len(i)], q_w[k, :len(w_)] = i, w_
    return torch.as_tensor(q_ids, device=dev), torch.as_tensor(q_w, device=dev)


# --- the gumbel coupling, on the device ---------------------------------------------------------------

_M16, _M32 = 0xFFFF, 0xFFFFFFFF
# Whole rows (T > 0 without a listed support) are scored this many (row, token) entries at a time.
_GUMBEL_CHUNK = 1 << 22


def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x < 2^32 without a product beyond 2^49 (no signed overflow)."""
    lo = (x & _M16) * c
    hi = ((x >> 16) * c) & _M16
    return (lo + (hi << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _noise_bits(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The 52-bit integers of spec_core.gumbel.noise_bits, each row with its own lane keys
    # keys: [R, 4] int64 (position_keys), ids: [R, m] int64 -> [R, m] int64."""
    v = ids.to(torch.int64)
    hi = _mix32(_mix32(v ^ keys[:, 0:1]) ^ keys[:, 1:2])
    lo = _mix32(_mix32(v ^ keys[:, 2:3]) ^ keys[:, 3:4])
    return (hi << 20) | (lo >> 12)


def _noise_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """g = -log(-log u), u = (n + 1/2) / 2^52 exact in float64."""
    u = (bits.to(torch.float64) + 0.5) * 2.0 ** -52
    return -torch.log(-torch.log(u))


def _keys(seed: int, positions, dev) -> torch.Tensor:
    """[len(positions), 4] int64: the lane keys of (seed, position) per row."""
    from spec_core.gumbel import position_keys
    return torch.as_tensor(np.array([position_keys(seed, int(p)) for p in positions], dtype=np.int64).reshape(-1, 4),
                           device=dev)


def gumbel_noise_bits(seed: int, position: int, ids: torch.Tensor) -> torch.Tensor:
    """spec_core.gumbel.noise_bits in torch (int64 lanes, masked): the same 52-bit integers, bit for
    bit, on any device  # ids: [n] int64 -> [n] int64. So the vLLM path reads the noise the edge
    reads; spec_core.gumbel says what the noise is."""
    return _noise_bits(_keys(seed, [position], ids.device), ids[None, :])[0]


def gumbel_noise(seed: int, position: int, ids: torch.Tensor) -> torch.Tensor:
    """g at `ids`  # [n] -> [n] float64."""
    return _noise_from_bits(gumbel_noise_bits(seed, position, ids))


def _gumbel_results(logits, warp: RowWarp, rounds: Sequence[PassRound], local) -> list[TreeResult]:
    """Rounds of the gumbel coupling: y = argmax(log p + g) at every row they own, in one batch
    (listed rows over their kept ids, the others over the whole row, a chunk of rows at a time), ties
    to the lowest id as spec_core.gumbel.gumbel_argmax; then each round's walk on the host: move to the
    child carrying y, else y is the corrected token (at a leaf, the bonus)."""
    dev, vocab = logits.device, logits.shape[1]
    rows, keys = [], []
    for rd in rounds:
        positions = [rd.position] + [rd.position + d for d in rd.tree.depths()]   # row i + 1: after node i
        rows.append(local[np.arange(rd.first_row, rd.first_row + len(rd.tree) + 1)])
        keys.append(_keys(rd.settings.seed, positions, dev))
    rows_t = torch.as_tensor(np.concatenate(rows), device=dev)
    keys_t = torch.cat(keys)
    y = torch.empty(len(rows_t), dtype=torch.int64, device=dev)
    listed = warp.support_len[rows_t] > 0
    part = torch.nonzero(listed)[:, 0]
    if len(part):
        r = rows_t[part]
        ids = warp.support[r]                                      # [L, m] ascending, vocab-padded
        scores = torch.log(warp.probs_at(logits, r[:, None], ids)) + _noise_from_bits(_noise_bits(keys_t[part], ids))
        y[part] = ids.gather(-1, scores.argmax(dim=-1, keepdim=True))[:, 0]
    rest = torch.nonzero(~listed)[:, 0]
    step = max(1, _GUMBEL_CHUNK // vocab)
    ids = torch.arange(vocab, device=dev)[None, :]
    for a in range(0, len(rest), step):
        part = rest[a:a + step]
        r = rows_t[part]
        scores = torch.log(warp.rows_probs(logits, r)) + _noise_from_bits(_noise_bits(keys_t[part], ids.expand(len(r), -1)))
        y[part] = scores.argmax(dim=-1)
    y_host = y.cpu().numpy()
    out, at = [], 0
    for rd in rounds:
        ys = y_host[at:at + len(rd.tree) + 1]   # [n + 1]: row 0, then after each node
        at += len(rd.tree) + 1
        children = rd.tree.children()
        node, path = ROOT, []
        while True:
            target = int(ys[node + 1])
            child = next((c for c in children.get(node, []) if rd.tree.tokens[c] == target), None)
            if child is None:
                out.append(TreeResult(path, target))
                break
            node = child
            path.append(child)
    return out
