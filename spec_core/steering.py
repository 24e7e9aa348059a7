"""The verifier steers speculation: the draft budget that pays at its current load.

Glossary:
  *pass cost line*  seconds of one batched target pass = base + per_token · tokens (least squares
                    over recent passes; a GPU's per_token is near 0 until it is compute bound);
  *commit rate*     R, tokens/s the verifier commits over all sessions (rounds and Generate steps);
  *price*           θ = per_token · R: what one more verified token in a pass costs, in committed
                    tokens (dimensionless, in [0, 1) for a verifier that commits what it verifies);
  *budget*          the longest draft (γ) and the most tree nodes whose tokens are worth their price.

The rule. A draft's j-th token (j = 1..γ) is committed with probability α^j (every earlier one
accepted; per-token acceptance α, the geometric model of spec_core.costmodel), so it is worth α^j
tokens to its session. It lengthens the pass it rides in by per_token seconds, and every session
waiting on that pass (all of them, when the verifier is saturated) commits later: with sessions
committing at R tokens/s in all, a pass longer by δ costs δ·R tokens. So the j-th token pays iff

    α^j ≥ θ = per_token · R,     budget γ* = max { j : α^j ≥ θ } = ⌊ln θ / ln α⌋.

Saturated (the pass is all per-token work, base ≪ per_token · tokens), θ → E(γ) / (γ + 1), the
committed tokens per verified token: short drafts. Idle, R is small and θ → 0: as long as the
server allows. A pass whose cost is flat in tokens (per_token ≈ 0, a GPU below its compute
roof) never limits the draft. The rule ignores the edge's own drafting time and round trip; the
edge's adaptive γ counts those, and drafts min(its choice, the budget). Tree nodes follow the same
rule: a node reached through candidates of sibling ranks k_1..k_j (0: the first tried) is
committed with probability Π (1 − α)^k_i · α under the same independence, and is worth its cost
when that is ≥ θ.

The verifier (cloud_verifier.engine) and the fleet simulator (netsim.fleet.policies) price drafts with
these same functions, the simulator feeding them its simulated passes and commits.
"""
from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

from spec_core.estimates import Acceptance, fit_line, x_varies

__all__ = ["Acceptance", "Budget", "CommitRate", "PassCostLine", "draft_budget", "gamma_budget", "tree_node_budget"]


class Budget(NamedTuple):
    max_gamma: int        # longest chain (and tree depth) worth verifying
    max_tree_nodes: int   # most tree nodes worth verifying
    price: float          # θ: the cost of one more verified token, in committed tokens


def gamma_budget(alpha: float, price: float, max_gamma: int) -> int:
    """⌊ln θ / ln α⌋ clamped to [0, max_gamma]: the longest draft whose last token is worth θ."""
    if max_gamma <= 0:
        return 0
    if not price > 0 or alpha >= 1.0:
        return max_gamma
    if price >= 1.0 or alpha <= 0.0:
        return 0
    # The small tolerance keeps α^j == θ exactly (e.g. θ = α²) on the paying side despite rounding.
    return max(0, min(max_gamma, int(math.floor(math.log(price) / math.log(alpha) + 1e-9))))


def tree_node_budget(alpha: float, price: float, max_depth: int, branching: int, max_nodes: int) -> int:
    """Nodes of depth ≤ max_depth, each node with at most `branching` children, whose probability of
    being committed, α^j · (1 − α)^(sum of sibling ranks on its path), is ≥ θ; at most max_nodes."""
    if max_nodes <= 0 or max_depth <= 0:
        return 0
    if not price > 0 or alpha >= 1.0:
        return max_nodes
    if price >= 1.0 or alpha <= 0.0:
        return 0
    branching = max(1, branching)
    log_a, log_miss, log_price = math.log(alpha), math.log1p(-alpha), math.log(price) - 1e-9
    # ways[K]: nodes at the current depth whose sibling ranks sum to K (a polynomial power).
    ways, count = {0: 1}, 0
    for depth in range(1, max_depth + 1):
        nxt: dict[int, int] = {}
        for k, n in ways.items():
            for rank in range(branching):
                nxt[k + rank] = nxt.get(k + rank, 0) + n
        ways = {k: n for k, n in nxt.items() if depth * log_a + k * log_miss >= log_price}
        if not ways:
            break
        count += sum(ways.values())
        if count >= max_nodes:
            return max_nodes
    return count


def draft_budget(alpha: float, price: float, max_gamma: int, max_tree_nodes: int, branching: int) -> Budget:
    """The budget a verifier tells an edge whose drafts are accepted at rate α, at price θ."""
    gamma = gamma_budget(alpha, price, max_gamma)
    nodes = tree_node_budget(alpha, price, gamma, branching, max_tree_nodes) if max_tree_nodes > 0 else 0
    return Budget(gamma, max(nodes, min(gamma, max_tree_nodes)), price)


class PassCostLine:
    """Seconds per pass = base + per_token · tokens, by least squares over the last `window`
    passes. Before `min_passes` passes it says (0, 0): nothing known, as if idle. While the passes
    do not differ in size, the line goes through the origin (per_token = mean seconds / mean
    tokens): an overestimate of the marginal cost, which errs on short drafts."""

    def __init__(self, window: int = 64, min_passes: int = 4):
        self.passes: deque[tuple[int, float]] = deque(maxlen=window)
        self.min_passes = min_passes
        self._line: tuple[float, float] | None = None   # the fit of the passes as they are now

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0 and math.isfinite(seconds):
            self.passes.append((tokens, seconds))
            self._line = None

    def line(self) -> tuple[float, float]:
        """(base_s, per_token_s); (0, 0) before min_passes passes. Fitted once per pass observed (the
        engine and the batcher ask several times a pass)."""
        if self._line is None:
            self._line = self._fit()
        return self._line

    def _fit(self) -> tuple[float, float]:
        pts = list(self.passes)
        if len(pts) < self.min_passes:
            return 0.0, 0.0
        n = len(pts)
        through_origin = (sum(y for _, y in pts) / n) / (sum(x for x, _ in pts) / n)
        if not x_varies(pts):
            return 0.0, through_origin
        # The slope is never above the through-origin cost, never negative.
        return tuple(fit_line(pts, max_slope=through_origin))


class CommitRate:
    """Tokens committed per second over the last `window_s` seconds (all sessions). Always divided
    by the whole window: a verifier that just started reads as less loaded than it is, never more
    (a burst of first commits over a few milliseconds must not price drafts out)."""

    def __init__(self, window_s: float = 2.0):
        self.window_s = window_s
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def observe(self, now: float, tokens: int) -> None:
        self.events.append((now, tokens))
        self.total += tokens
        self._drop(now)

    def _drop(self, now: float) -> None:
        while self.events and self.events[0][0] < now - self.window_s:
            self.total -= self.events.popleft()[1]

    def rate(self, now: float) -> float:
        self._drop(now)
        return self.total / self.window_s
