"""How many tokens to draft per round: fixed, or adaptive from the measured cost model.

The adaptive policy measures, as it goes, the draft time per token, the network round trip
(the RPC's wall time minus the server's own time), the verifier's time as a linear
function of γ, and the per-token acceptance α (accepted / tested drafts with a Beta(1, 1)
prior, exponentially forgotten), then picks the γ that maximises expected tokens per second (spec_core.costmodel).
On a slow link the round trip dominates and the best γ grows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from spec_core.costmodel import RoundCosts, best_gamma, expected_tokens_per_round
from spec_core.estimates import Acceptance, ewma, fit_line, x_varies
from spec_core.tree import TreeShape


class FixedGamma:
    def __init__(self, gamma: int):
        self.gamma = gamma

    def next_gamma(self, record: bool = True) -> int:
        return self.gamma

    def observe(self, **_) -> None:
        pass

    def describe(self) -> str | int:
        return self.gamma


@dataclass
class AdaptiveGamma:
    max_gamma: int = 12
    min_gamma: int = 1
    start_gamma: int = 4
    decay: float = 0.9               # forgetting factor per round for every estimate
    acceptance: Acceptance = field(init=False)   # α, forgotten at `decay` (spec_core.estimates)
    t_draft_s: float | None = None
    rtt_s: float | None = None
    _verify_points: list[tuple[int, float]] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.acceptance = Acceptance(self.decay)

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def observe(self, gamma: int, num_accepted: int, draft_s: float, round_s: float, server_s: float,
                model_s: float | None, rejected: bool = False) -> None:
        # Drafts after the first rejection are never tested, so accepted / drafted would
        # underestimate α and shrink γ; Acceptance counts only tested drafts.
        self.acceptance.observe(gamma, num_accepted, rejected)
        if gamma > 0:
            self.t_draft_s = ewma(self.t_draft_s, draft_s / gamma, 1 - self.decay)
        # round_s is timed around the RPC alone (drafting happens before it).
        self.rtt_s = ewma(self.rtt_s, max(0.0, round_s - server_s), 1 - self.decay)
        if model_s is not None:   # None: a round that opened the session (its pass held the prompt)
            self._verify_points = (self._verify_points + [(gamma, model_s)])[-32:]

    def next_gamma(self, record: bool = True) -> int:
        """record=False: a look at the choice (a continuation's plan), not a round sent with it."""
        if self.t_draft_s is None or self.rtt_s is None or not self._verify_points:
            g = self.start_gamma
        else:
            base, per_tok = fit_line(self._verify_points)   # verifier time over γ
            # The verifier's line is trusted to twice the longest γ it was measured at: beyond, a
            # flat-looking fit over a few short rounds would send the longest γ on a guess.
            reach = min(self.max_gamma, 2 * max(x for x, _ in self._verify_points))
            costs = RoundCosts(self.t_draft_s, self.rtt_s, base, per_tok)
            g = best_gamma(min(self.alpha, 0.999), costs, max(reach, self.min_gamma), self.min_gamma)
        if record:
            self.chosen.append(g)
        return g

    def describe(self) -> str:
        mean = sum(self.chosen) / len(self.chosen) if self.chosen else self.start_gamma
        return f"adaptive(mean {mean:.2f})"


@dataclass(frozen=True)
class RoundPlan:
    arm: str                         # "chain" or the tree's name, e.g. "tree8"
    gamma: int                       # chain length, or the tree's depth
    shape: TreeShape | None = None   # None: a chain

    def within(self, remaining: int) -> "RoundPlan":
        """This plan cut as `TreePolicy.plan(remaining)` cuts a fresh round: depth (or γ) at most
        remaining - 1. A continuation for an outcome is drafted with the plan a fresh round after that
        outcome would have, so the same seed drafts the same tokens whether or not it was guessed."""
        room = max(0, remaining - 1)
        if self.gamma <= room:
            return self
        if self.shape is None:
            return RoundPlan(self.arm, room)
        if room < 1:
            return RoundPlan("chain", 0)
        s = self.shape
        return RoundPlan(self.arm, room, TreeShape(s.budget, room, s.branching, s.width))


@dataclass
class _Arm:
    """One arm's measurements, forgotten at the policy's decay: sums weighted by recency, read
    through `estimate` so that an arm seen in one or two rounds does not stand on them alone."""
    rounds: int = 0
    weight: float = 0.0
    tokens_sum: float = 0.0          # tokens committed per round
    extra_sum: float = 0.0           # seconds a round took beyond the cost model's prediction

    def add(self, decay: float, tokens: float, extra_s: float) -> None:
        self.rounds += 1
        self.weight = decay * self.weight + 1
        self.tokens_sum = decay * self.tokens_sum + tokens
        self.extra_sum = decay * self.extra_sum + extra_s

    def estimate(self, total: float, prior: float, strength: float) -> float:
        """The recency-weighted mean, shrunk toward `prior` as if it were `strength` rounds more."""
        return (total + strength * prior) / (self.weight + strength)


class TreePolicy:
    """Chain or tree, each round, from the cost model with measured inputs.

    Predicted time of a round with `nodes` nodes and `rows` draft forward rows:
        rows · t_row + rtt + t_verify_base + nodes · t_verify_node
    with t_row (draft time per forward row), rtt (the RPC's wall time minus the server's) and the
    verifier's line (least squares of model time over nodes sent, chains and trees alike: nearly
    flat on a GPU, growing on a CPU) measured as rounds go. Per arm, its tokens per round and the
    seconds its rounds take beyond that prediction are measured (`predicted_rate` says how they are
    read). The first rounds are chains (they measure the costs, the verifier's line over two sizes or
    four rounds); a tree is tried (`warmup` times)
    only where the most it could commit (`optimistic_rate`: each level's acceptance as if
    `branching` independent tries of the chain's α) beats the chain's predicted rate, so a verifier
    whose pass grows with its nodes never spends rounds on trees; then the best predicted tokens per
    second is taken, and every `explore_every` rounds the runner-up is tried again so a changed link
    or load is seen. Trees keep the chain's depth (γ from the gamma policy) and spend 2γ or 4γ nodes.
    mode: "off" (chains only), "auto", or a TreeShape (that tree every round).
    """

    def __init__(self, gamma_policy, mode: "str | TreeShape" = "off", max_nodes: int = 64,
                 warmup: int = 1, explore_every: int = 16, decay: float = 0.8, prior_rounds: float = 2.0):
        self.gamma_policy, self.mode, self.max_nodes = gamma_policy, mode, max_nodes
        self.warmup, self.explore_every, self.decay = warmup, explore_every, decay
        self.prior_rounds = prior_rounds
        self.arms: dict[str, _Arm] = {}
        self.t_row_s: float | None = None
        self.rtt_s: float | None = None
        self._verify_points: list[tuple[int, float]] = []
        self.rounds = 0
        self.chosen: dict[str, int] = {}
        self.budget_gamma: int | None = None   # the verifier's draft budget (steer); None: none given
        self.budget_nodes: int | None = None

    def steer(self, max_gamma: int, max_tree_nodes: int) -> None:
        """The verifier's draft budget at its load: chains (and tree depth) of at most max_gamma,
        trees of at most max_tree_nodes, until the next budget. A fixed tree shape is not capped."""
        self.budget_gamma, self.budget_nodes = max(0, max_gamma), max(0, max_tree_nodes)

    def _shapes(self, gamma: int) -> dict[str, TreeShape]:
        if self.mode != "auto" or gamma < 1:
            return {}
        out = {}
        max_nodes = self.max_nodes if self.budget_nodes is None else min(self.max_nodes, self.budget_nodes)
        for mult, width in ((2, 1), (4, 2)):
            budget = min(mult * gamma, max_nodes)
            if budget > gamma:
                out[f"tree{mult}x"] = TreeShape(budget=budget, depth=gamma, branching=2, width=width)
        return out

    def plan(self, remaining: int, peek: bool = False) -> RoundPlan:
        """The next round's plan. peek: the plan a fresh round would get now, for a continuation's
        draft: counts nothing (neither γ's choices nor the rounds between explorations)."""
        if isinstance(self.mode, TreeShape):
            depth = min(self.mode.depth, remaining - 1)
            if depth >= 1:
                shape = TreeShape(self.mode.budget, depth, self.mode.branching, self.mode.width)
                return self._take(RoundPlan(f"tree{shape.budget}", depth, shape))
            return self._take(RoundPlan("chain", 0))
        gamma = max(0, min(self.gamma_policy.next_gamma(record=not peek), remaining - 1))
        if self.budget_gamma is not None:
            gamma = min(gamma, self.budget_gamma)   # min(own adaptive choice, the verifier's budget)
        shapes = self._shapes(gamma)
        chain = RoundPlan("chain", gamma)
        arms = {"chain": chain} | {k: RoundPlan(k, s.depth, s) for k, s in shapes.items()}
        points = self._verify_points
        if len(arms) == 1 or self.t_row_s is None or self.rtt_s is None or \
                len(points) < 2 or not x_varies(points) and len(points) < 4:
            # The costs a tree is judged by are not measured yet (the verifier's time per node: over
            # rounds of more than one size, or after four of one size, a tree is how to learn it).
            return self._take(chain)
        chain_rate = self.predicted_rate(chain)
        for name, arm in arms.items():  # try a tree only where it could beat the chain
            if self.arms.get(name, _Arm()).rounds < self.warmup and self.optimistic_rate(arm) > chain_rate:
                return self._take(arm)
        ranked = sorted(arms.values(), key=lambda a: -self.predicted_rate(a))
        if not peek:
            self.rounds += 1
        if self.rounds % self.explore_every == 0 and len(ranked) > 1 and not peek:
            return self._take(ranked[1])
        return self._take(ranked[0])

    def _take(self, plan: RoundPlan) -> RoundPlan:
        return plan

    def verify_points(self) -> list[tuple[int, float]]:
        """(nodes, model seconds) of the recent rounds the verifier's line is fitted over."""
        return list(self._verify_points)

    def verify_line(self) -> tuple[float, float]:
        """(base_s, per_node_s): the verifier's time for a round over the nodes it carried, fitted."""
        return fit_line(self._verify_points)

    def predicted_round_s(self, plan: RoundPlan) -> float:
        """The cost model's time of a round with this plan (drafting, round trip, verifying)."""
        nodes = plan.gamma if plan.shape is None else plan.shape.budget
        # A tree expands `width` nodes per level (the root once); a chain one row per token.
        rows = plan.gamma if plan.shape is None else 1 + (plan.shape.depth - 1) * plan.shape.width
        return self._round_s(nodes, rows)

    def _round_s(self, nodes: int, rows: int) -> float:
        base, per_node = self.verify_line()
        return rows * (self.t_row_s or 0.0) + (self.rtt_s or 0.0) + base + nodes * per_node

    def predicted_rate(self, plan: RoundPlan) -> float:
        """Tokens per second of a plan: the arm's tokens per round over the cost model's round time
        plus the seconds the arm's rounds took beyond it, recency-weighted means over its rounds (a
        chain not measured yet: the geometric model, no excess). A tree's are shrunk toward the
        chain's as if those were `prior_rounds` rounds more: a tree of the chain's depth holds the
        chain's path, so it commits at least as much, and its excess is the part of its cost the
        model misses (the drafter's and the verifier's work per branch). Trees are sent a few rounds
        in many, so one lucky or slow tree round does not decide."""
        arm = self.arms.get(plan.arm)
        chain_tokens, chain_extra = self._chain_estimates(plan.gamma)
        if plan.shape is None:
            tokens, extra = chain_tokens, chain_extra
        elif arm is None or arm.rounds == 0:   # a tree not measured (never worth trying): at most its optimistic rate
            return self.optimistic_rate(plan)
        else:
            tokens = arm.estimate(arm.tokens_sum, chain_tokens, self.prior_rounds)
            extra = arm.estimate(arm.extra_sum, chain_extra, self.prior_rounds)
        return tokens / max(self.predicted_round_s(plan) + extra, 1e-9)

    def _chain_estimates(self, gamma: int) -> tuple[float, float]:
        """The chain's (tokens per round, seconds beyond the model per round) at γ = gamma."""
        arm = self.arms.get("chain")
        if arm is None or arm.rounds == 0:
            return expected_tokens_per_round(min(getattr(self.gamma_policy, "alpha", 0.5), 0.999), gamma), 0.0
        return arm.estimate(arm.tokens_sum, 0.0, 0.0), arm.estimate(arm.extra_sum, 0.0, 0.0)

    def optimistic_rate(self, plan: RoundPlan) -> float:
        """The most a plan could commit per second: a tree's levels accept as if each of its
        `branching` candidates were an independent try at the chain's α (its candidates are the
        draft's next-best tokens, so this bounds it from above); without a measured α, its depth + 1.
        Its round costs what the model predicts plus the chain's measured excess."""
        alpha = getattr(self.gamma_policy, "alpha", None)
        if plan.shape is None or alpha is None:
            tokens = float(plan.gamma + 1)
        else:
            tokens = expected_tokens_per_round(min(1 - (1 - alpha) ** plan.shape.branching, 0.999), plan.gamma)
        return tokens / max(self.predicted_round_s(plan) + self._chain_estimates(plan.gamma)[1], 1e-9)

    def observe(self, plan: RoundPlan, nodes: int, rows: int, tokens: int, draft_s: float, round_s: float,
                server_s: float, model_s: float | None) -> None:
        """model_s None: a round that opened the session (its pass held the prompt): not on the
        verifier's line. It, and the rounds before the model has its inputs (only chains: trees
        wait for them), count as no excess over the model."""
        self.chosen[plan.arm] = self.chosen.get(plan.arm, 0) + 1  # rounds sent with this plan
        arm = self.arms.setdefault(plan.arm, _Arm())
        # The excess is measured against the model as it stood before this round taught it.
        measured = self.t_row_s is not None and self.rtt_s is not None and len(self._verify_points) >= 2
        extra = draft_s + round_s - self._round_s(nodes, rows) if measured and model_s is not None else 0.0
        arm.add(self.decay, tokens, extra)
        ew = lambda old, new: new if old is None else self.decay * old + (1 - self.decay) * new  # noqa: E731
        if rows > 0:
            self.t_row_s = ew(self.t_row_s, draft_s / rows)
        self.rtt_s = ew(self.rtt_s, max(0.0, round_s - server_s))
        if model_s is not None:
            self._verify_points = (self._verify_points + [(nodes, model_s)])[-48:]

    def describe(self) -> str:
        return ", ".join(f"{k}×{v}" for k, v in sorted(self.chosen.items()))
