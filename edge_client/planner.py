"""The planner: before each round, the round's whole shape from what the session has measured.

`plan_round(estimates, speculation, budget)` is the one place a round's shape is decided. A shape
(RoundPlan) is: chain or tree and its size (γ, the tree's nodes); the rounds in flight (`depth`: 1,
or a window of pipelined rounds behind the oldest); whether the round's continuations are fused into
its own pass (`fuse`); and whether the next round is drafted ahead during the round trip (`ahead`).
It reads only its arguments (edge_client.estimates.Estimates: the measurements; the options; the
tokens left and the verifier's draft budget): no clock and no I/O, so a loop, a test or a grid of
synthetic cells can call it with any estimates.

One cost model scores every candidate (spec_core.costmodel):
  round time   T = rows · t_row + bytes · s_per_byte + rtt + base + nodes · per_node (+ queue)
               + the seconds the arm's rounds took beyond that (Estimates.arms);
  tokens       E = Σ_k Π_{j≤k} α_j for a chain (acceptance by draft position); a tree's measured tokens
               per round shrunk toward its chain's (a tree of the chain's depth holds the chain's path);
  rate         E / T tokens per second.
The choices, in order:
1. γ (when adaptive): the chain's best rate, over at most twice the most nodes the verifier's line
   was measured at (a line fitted over one size looks flat and would ask for the longest γ on a guess);
   before drafting, the round trip and the verifier are measured once, `start_gamma`.
2. Chain or tree (tree "auto"): the chain of γ, and trees of depth γ with 2γ and 4γ nodes. Not judged
   until the verifier's time per node is measured; then a tree is tried (`warmup` rounds) only where its
   best case (each level accepting as if its branches were independent tries at α) beats the chain;
   then the best rate is taken, and every `explore_every` rounds the runner-up, so a changed link or
   load is seen.
3. Rounds in flight (with pipelining): one more round in flight at depth k runs with chance h^k (h: a
   pipelined round's measured chance to run) and then hides the round trip and the pass, and costs
   its drafting and upload when discarded; the depth that saves the most, so the most tokens per
   second for the arm (`best_depth`), among those that do not already cover one round's way
   (draft + upload + round trip + pass, over the slowest of those stages; when the uplink is the
   slowest, at most 2: more would only queue bytes on the link).
4. Fused continuations (when the planner may fuse): where the verifier's pass barely grows with its
   nodes (one continuation's nodes cost at most `flat_share` of a pass), drafting one continuation
   is cheap beside the round trip and pass a hit saves (at most `fuse_draft_share` of them: drafted
   before the round leaves, it delays every fused round, hit or miss), and fused rounds have hit
   (under `min_hits` of `min_tried` or more: stop). How many continuations then travel is decided per
   outcome as they are drafted (`ContinuationBudget`).
5. Drafting ahead (when the planner may: `proactive` unset): the next round is drafted during the
   round trip where that drafting fits the wait for the reply, or where a hit's saving pays for the
   wait it adds (`ahead_pays`).
Options that are set pin their part (`plan_conflicts` checks a plan against them); the verifier's
draft budget binds γ and tree size under steering, and a budget of one draft or none keeps one round
in flight, unfused. The constants are a `Tuning` (`TUNING` unless given).

Continuations (drafted for a round's likely outcomes) are priced by the same model:
`ContinuationBudget` says when one more pays, `continuation_length` how long they are.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

from edge_client.estimates import MAX_ALPHA, Estimates, pinned
from edge_client.options import ADAPTIVE, PlanInputs, Speculation
from spec_core.continuations import Outcome, worth_drafting
from spec_core.costmodel import expected_tokens_per_round
from spec_core.tree import TreeShape


@dataclass(frozen=True)
class Tuning:
    """The planner's constants, in one record so that a tuning run (the virtual clock's grid) can
    score other values through plan_round(..., tune=Tuning(...)); TUNING is the default."""

    start_gamma: int = 4                 # γ before the costs are measured
    tree_sizes: tuple[tuple[int, int], ...] = ((2, 1), (4, 2))   # "auto"'s trees: (nodes per draft
                                         # position, nodes expanded per level)
    warmup: int = 1                      # rounds a tree is tried where its best case beats the chain
    explore_every: int = 16              # rounds between tries of the runner-up
    prior_rounds: float = 2.0            # a tree's tokens and excess are shrunk toward the chain's as if
                                         # this many rounds
    flat_share: float = 0.1              # fuse where one continuation's nodes add at most this share to a pass
    fuse_draft_share: float = 0.5        # ... and drafting one continuation takes at most this share of the
                                         # round trip and pass that a hit saves (it delays every fused round)
    min_tried: int = 4                   # stop fusing when, of this many fused rounds or more, ...
    min_hits: float = 0.25               # ... under this share hit


TUNING = Tuning()


@dataclass(frozen=True)
class Budget:
    """What a round may spend: the tokens the generation may still commit, and the verifier's draft
    budget at its load (VerifyReply.budget; None: none given)."""

    remaining: int
    max_gamma: int | None = None        # longest chain (and deepest tree)
    max_tree_nodes: int | None = None


@dataclass(frozen=True)
class RoundPlan:
    """A round's shape."""

    arm: str                         # "chain" or the tree's name, e.g. "tree4x" (auto) or "tree16" (a fixed shape)
    gamma: int                       # chain length, or the tree's depth
    shape: TreeShape | None = None   # None: a chain
    depth: int = 1                   # rounds to keep in flight (1: this one alone)
    fuse: bool = False               # draft continuations for its outcomes into its own pass
    ahead: bool = False              # draft the next round during its round trip, kept for the reply
    why: str = field(default="", compare=False)   # the model's reasons, one line

    @property
    def nodes(self) -> int:
        return self.gamma if self.shape is None else self.shape.budget

    @property
    def rows(self) -> int:
        """Draft forward rows: one per chain token; a tree expands `width` nodes per level (the root once)."""
        return self.gamma if self.shape is None else 1 + (self.shape.depth - 1) * self.shape.width

    def within(self, remaining: int) -> "RoundPlan":
        """This plan cut as plan_round cuts a fresh round: depth (or γ) at most remaining - 1. A
        continuation for an outcome is drafted with the plan a fresh round after that outcome would
        have, so the same seed drafts the same tokens whether or not a continuation was drafted for
        that outcome."""
        room = max(0, remaining - 1)
        if self.gamma <= room:
            return self
        if self.shape is None:
            return dataclasses.replace(self, gamma=room)
        if room < 1:
            return dataclasses.replace(self, arm="chain", gamma=0, shape=None)
        s = self.shape
        return dataclasses.replace(self, gamma=room, shape=TreeShape(s.budget, room, s.branching, s.width))

    def label(self, how: str) -> str:
        """The statistics' name of a round sent with this plan: 'chain g5 pipelined'."""
        return f"{self.arm} g{self.gamma} {how}"


# --- the one decision --------------------------------------------------------------------------------

def plan_round(est: Estimates, spec: Speculation, budget: Budget, tune: Tuning = TUNING) -> RoundPlan:
    """The next round's shape (module docstring)."""
    arms = candidate_arms(est, spec, budget, tune)
    arm, arm_why = pick_arm(est, arms, tune)
    depth, depth_why = rounds_in_flight(est, spec, budget, arm)
    fuse = fuses(est, spec, budget, arm, tune)
    ahead = spec.proactive and ("proactive" not in spec.planned or ahead_pays(est, arm)) or \
        spec.pipeline and spec.window <= 1
    plan = dataclasses.replace(arm, depth=depth, fuse=fuse, ahead=ahead,
                               why="; ".join(filter(None, (arm_why, depth_why, "fused" if fuse else ""))))
    assert not plan_conflicts(plan, spec), (plan, plan_conflicts(plan, spec))
    return plan


def plan_conflicts(plan: RoundPlan, spec: Speculation) -> list[str]:
    """What in `plan` the options do not allow (empty: nothing). The options' own rules refuse
    conflicting options before the first round (edge_client.options.refuse_conflicts)."""
    out = []
    if spec.gamma != ADAPTIVE and plan.shape is None and plan.gamma > spec.gamma:
        out.append(f"γ {plan.gamma} beyond gamma={spec.gamma}")
    if spec.tree == "off" and plan.shape is not None:
        out.append("a tree with tree=off")
    if isinstance(spec.tree, TreeShape) and plan.shape is not None and plan.shape.budget != spec.tree.budget:
        out.append(f"a tree of {plan.shape.budget} nodes, not the {spec.tree.budget} asked for")
    if plan.depth > max(spec.window, 2 if spec.pipeline else 1):
        out.append(f"{plan.depth} rounds in flight with window={spec.window}, pipeline={spec.pipeline}")
    if plan.fuse and not spec.fuse:
        out.append("fused with fuse off")
    return out


def steering(spec: Speculation) -> bool:
    """Whether the verifier's draft budget binds: adaptive γ with steering on (a fixed γ or tree, or
    pinned inputs, stay as asked: a seed then pins the output whatever the verifier's load)."""
    return spec.steer and spec.gamma == ADAPTIVE and spec.plan_inputs is None


def starved(spec: Speculation, budget: Budget) -> bool:
    """The verifier's budget allows one draft or none: nothing the planner sends ahead pays."""
    return steering(spec) and budget.max_gamma is not None and budget.max_gamma <= 1 and \
        bool({"window", "fuse"} & set(spec.planned))


# --- chain or tree, and its size ------------------------------------------------------------------------

def chain_gamma(est: Estimates, spec: Speculation, budget: Budget, tune: Tuning = TUNING) -> int:
    """γ: pinned, or the chain's best rate within the line's reach; cut to the tokens left and the budget."""
    if spec.gamma != ADAPTIVE:
        gamma = spec.gamma
    elif not est.chain_costs_known():
        gamma = min(tune.start_gamma, spec.max_gamma)
    else:
        measured = est.line_reach()
        reach = max(1, spec.max_gamma if measured is None else min(spec.max_gamma, 2 * measured))
        gamma = max(range(1, reach + 1), key=lambda g: chain_rate(est, g, tune))
    gamma = max(0, min(gamma, budget.remaining - 1))
    if steering(spec) and budget.max_gamma is not None:
        gamma = min(gamma, budget.max_gamma)   # min(own choice, the verifier's budget)
    return gamma


def candidate_arms(est: Estimates, spec: Speculation, budget: Budget, tune: Tuning = TUNING) -> list[RoundPlan]:
    """The chain first, then the trees weighed against it: a fixed shape alone, or "auto"'s sizes."""
    if isinstance(spec.tree, TreeShape):
        s, depth = spec.tree, min(spec.tree.depth, budget.remaining - 1)
        if depth < 1:
            return [RoundPlan("chain", 0)]
        return [RoundPlan(f"tree{s.budget}", depth, TreeShape(s.budget, depth, s.branching, s.width))]
    gamma = chain_gamma(est, spec, budget, tune)
    arms = [RoundPlan("chain", gamma)]
    if spec.tree != "auto" or gamma < 1:
        return arms
    max_nodes = spec.max_tree_nodes
    if steering(spec) and budget.max_tree_nodes is not None:
        max_nodes = min(max_nodes, budget.max_tree_nodes)
    for mult, width in tune.tree_sizes:
        nodes = min(mult * gamma, max_nodes)
        if nodes > gamma:
            shape = TreeShape(budget=nodes, depth=gamma, branching=2, width=width)
            arms.append(RoundPlan(f"tree{mult}x", gamma, shape))
    return arms


def pick_arm(est: Estimates, arms: list[RoundPlan], tune: Tuning = TUNING) -> tuple[RoundPlan, str]:
    """The arm with the best rate, after trying trees whose best case beats the chain (module docstring)."""
    chain = arms[0]
    if len(arms) == 1 or not est.tree_costs_known():
        return chain, f"{chain.arm} g{chain.gamma} {arm_rate(est, chain, tune):.1f} tok/s"
    chain_r = arm_rate(est, chain, tune)
    if est.learning:
        for arm in arms:
            if est.arm(arm.arm).rounds < tune.warmup and optimistic_rate(est, arm, tune) > chain_r:
                return arm, f"trying {arm.arm} g{arm.gamma}: its best case beats the chain's {chain_r:.1f} tok/s"
    ranked = sorted(arms, key=lambda a: -arm_rate(est, a, tune))
    if est.learning and est.rounds and est.rounds % tune.explore_every == 0:
        return ranked[1], f"trying the runner-up {ranked[1].arm} g{ranked[1].gamma}"
    best = ranked[0]
    others = ", ".join(f"{a.arm} {arm_rate(est, a, tune):.1f}" for a in ranked[1:])
    return best, f"{best.arm} g{best.gamma} {arm_rate(est, best, tune):.1f} tok/s" + (f" ({others})" if others else "")


def chain_rate(est: Estimates, gamma: int, tune: Tuning = TUNING) -> float:
    return arm_rate(est, RoundPlan("chain", gamma), tune)


def arm_tokens_and_extra(est: Estimates, plan: RoundPlan, tune: Tuning = TUNING) -> tuple[float, float]:
    """A plan's expected tokens per round and seconds beyond the model per round: a chain's from
    acceptance by position and the chain's measured excess; a tree's measured ones shrunk toward the
    chain's of its depth as if those were `prior_rounds` rounds more (a tree seen in one or two lucky
    or slow rounds does not decide; never seen, it counts as its chain)."""
    chain_tokens = est.chain_tokens(plan.gamma)
    chain_extra = est.arm("chain").extra_s(0.0, 0.0) if est.arm("chain").rounds else 0.0
    if plan.shape is None:
        return chain_tokens, chain_extra
    arm = est.arm(plan.arm)
    return arm.tokens(chain_tokens, tune.prior_rounds), arm.extra_s(chain_extra, tune.prior_rounds)


def arm_rate(est: Estimates, plan: RoundPlan, tune: Tuning = TUNING) -> float:
    """Tokens per second of a plan's round on its own (no rounds in flight)."""
    tokens, extra = arm_tokens_and_extra(est, plan, tune)
    return tokens / max(est.round_s(plan.nodes, plan.rows) + extra, 1e-9)


def optimistic_rate(est: Estimates, plan: RoundPlan, tune: Tuning = TUNING) -> float:
    """The most a plan could commit per second: a tree's levels accept as if each of its `branching`
    candidates were an independent try at α (its candidates are the draft's next-best tokens, so this
    bounds it from above); its round costs what the model predicts plus the chain's measured excess."""
    alpha = min(est.alpha, 0.999)
    if plan.shape is None:
        tokens = float(plan.gamma + 1)
    else:
        tokens = expected_tokens_per_round(min(1 - (1 - alpha) ** plan.shape.branching, 0.999), plan.gamma)
    chain_extra = arm_tokens_and_extra(est, RoundPlan("chain", plan.gamma), tune)[1]
    return tokens / max(est.round_s(plan.nodes, plan.rows) + chain_extra, 1e-9)


# --- rounds in flight -------------------------------------------------------------------------------

@dataclass(frozen=True)
class WindowCosts:
    """The costs the depth is chosen from, seconds per round."""

    rtt_s: float       # the network round trip
    verify_s: float    # the verifier's time for one round (pass and queue)
    draft_s: float     # drafting one pipelined round with its continuations
    up_s: float        # the uplink's time for one pipelined round's request
    hit: float         # the chance a pipelined round runs (not base_mismatch)


def window_saving_s(c: WindowCosts, depth: int) -> float:
    """Seconds per round that `depth` rounds in flight save over one: the round at depth k runs with
    chance hit^k and then hides the round trip and the pass; discarded, it cost its drafting and upload."""
    saved = 0.0
    for k in range(1, depth):
        runs = c.hit ** k   # it runs only if every pipelined round before it ran
        saved += runs * (c.rtt_s + c.verify_s) - (1 - runs) * (c.draft_s + c.up_s)
    return saved


def window_cover(c: WindowCosts) -> int:
    """Rounds in flight that keep the slowest stage busy (more only wait): one round's way over it."""
    stage = max(c.draft_s, c.up_s, c.verify_s, 1e-4)
    cover = max(1, math.ceil((c.draft_s + c.up_s + c.rtt_s + c.verify_s) / stage))
    if c.up_s >= max(c.draft_s, c.verify_s) and c.up_s > 0:
        cover = min(cover, 2)   # the link is the bottleneck: more rounds in flight only queue on it
    return cover


def best_depth(c: WindowCosts, max_window: int) -> int:
    """The depth (1..max_window, within `window_cover`) that saves the most; the shallower on a tie."""
    return max(range(1, max(1, min(window_cover(c), max_window)) + 1), key=lambda d: (window_saving_s(c, d), -d))


def window_costs(est: Estimates, plan: RoundPlan) -> WindowCosts:
    base, per_node = est.verify_line()
    draft_s = est.ahead_draft_s if est.ahead_draft_s is not None else (plan.gamma + 1) * (est.t_row_s or 0.0)
    nbytes = est.request_bytes if est.request_bytes is not None else est.bytes_for(plan.nodes)
    return WindowCosts(rtt_s=est.rtt_s or 0.0, verify_s=base + per_node * plan.nodes + est.queue_s, draft_s=draft_s,
                       up_s=nbytes * est.s_per_byte(), hit=est.pipelined_hit(plan.gamma))


def rounds_in_flight(est: Estimates, spec: Speculation, budget: Budget, plan: RoundPlan) -> tuple[int, str]:
    """1 without pipelining (or with fused rounds asked for); 2 with pipelined rounds and no window (or
    nothing measured yet); with a window, the depth that saves the most (`best_depth`), up to the window's."""
    if not spec.pipeline or starved(spec, budget) or spec.fuse and "fuse" not in spec.planned:
        return 1, ""   # (fused rounds asked for: no window beside them)
    if spec.window <= 1:
        return 2, "2 in flight"
    if est.rtt_s is None:
        return min(2, spec.window), f"{min(2, spec.window)} in flight (nothing measured)"
    c = window_costs(est, plan)
    depth = best_depth(c, spec.window)
    return depth, f"{depth} in flight (a pipelined round runs {c.hit:.2f})"


def ahead_pays(est: Estimates, plan: RoundPlan) -> bool:
    """Whether drafting the next round during this one's round trip pays (when the planner chooses it).
    The first continuation, once begun, is drafted to its end: where that outlasts the wait for the
    reply (round trip and pass), the reply waits the difference; a hit saves the fresh drafting.
    So it pays where the chance of a hit times that drafting beats the wait; the chance is at most
    a pipelined round's and the chance that every draft and the bonus token come as drafted
    (α^(γ+1)): a continuation after a rejection must also guess the corrected token."""
    if est.rtt_s is None or est.t_row_s is None:
        return True   # nothing measured: as before
    base, per_node = est.verify_line()
    drafting = (plan.gamma + 1) * est.t_row_s
    wait = est.rtt_s + base + per_node * plan.nodes + est.queue_s
    if drafting <= wait:
        return True
    hit = min(est.pipelined_hit(plan.gamma), min(est.alpha, MAX_ALPHA) ** (plan.gamma + 1))
    return hit * drafting >= drafting - wait


# --- fused continuations -------------------------------------------------------------------------------

def fuses(est: Estimates, spec: Speculation, budget: Budget, plan: RoundPlan, tune: Tuning = TUNING) -> bool:
    """Whether the round carries continuations for its own pass (module docstring, 4)."""
    if est.rtt_s is None:
        return False   # nothing to price them by before the round trip is measured
    if spec.fuse and "fuse" not in spec.planned:
        return True   # asked for
    if "fuse" not in spec.planned or starved(spec, budget):
        return False
    if est.fused_tried >= tune.min_tried and est.fused_hits < tune.min_hits * est.fused_tried:
        return False
    if not est.line_spread():
        return False
    base, per_node = est.verify_line()
    drafting = (plan.gamma + 1) * (est.t_row_s or 0.0)   # one continuation: the outcome's token and γ drafts
    return per_node * (plan.nodes + 1) <= tune.flat_share * base and \
        drafting <= tune.fuse_draft_share * ((est.rtt_s or 0.0) + base + est.queue_s)


def plan_rate(est: Estimates, plan: RoundPlan, tune: Tuning = TUNING) -> float:
    """The model's tokens per second of a plan: its arm's, with the rounds in flight's saving."""
    tokens, extra = arm_tokens_and_extra(est, plan, tune)
    round_s = est.round_s(plan.nodes, plan.rows) + extra
    if plan.depth > 1 and est.rtt_s is not None:
        c = window_costs(est, plan)
        round_s = max(round_s - window_saving_s(c, plan.depth), c.draft_s, c.up_s, c.verify_s, 1e-9)
    return tokens / max(round_s, 1e-9)


def pinned_estimates(inputs: PlanInputs) -> Estimates:
    """`--plan-inputs` as estimates: plan_round then chooses the same shape every round."""
    return pinned(inputs.rtt_ms, inputs.draft_ms, inputs.verify_ms, inputs.node_ms, inputs.up_ms_per_kb, inputs.alpha)


# --- continuations ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContinuationBudget:
    """When drafting one more continuation pays, and what the next round costs on a hit and a miss.

    Ahead (fused False): drafted during round r's round trip, sent as a pipelined round (depth > 1)
    or kept for when the reply comes. One pays when its chance of being the outcome times what a hit
    saves (the round trip it hides and the fresh draft it replaces) beats the delay that drafting
    and uploading it adds to every hit (spec_core.continuations.worth_drafting); the first is drafted
    in any case (the reply is awaited anyway).
    Fused: drafted before round r leaves, verified in round r's own pass: this drafting delays round r
    itself, hit or miss, so every continuation must pay: its chance times what a hit saves (round
    r + 1's fresh draft, round trip and pass: round_s) against its drafting, its upload and the
    verifier's time for its nodes (`verify_per_draft`: the verifier's seconds per node / the draft's
    per row). Times are on the loop's clock."""

    round_s: float             # a fresh round's predicted time: its drafting, round trip and pass
    fresh_draft_s: float       # drafting it (what a hit saves)
    s_per_byte: float
    rtt_s: float = 0.0
    t_reply: float = 0.0       # ahead: when round r's reply is expected
    depth: int = 1             # ahead: rounds in flight once a continuation is sent (1: kept for the reply)
    fused: bool = False
    verify_per_draft: float = 0.0

    @property
    def check_first(self) -> bool:
        """The first continuation must pay too (fused); ahead it is drafted in any case."""
        return self.fused

    def saving_s(self, t_send: float) -> float:
        """What an ahead hit saves against drafting afresh after the reply, if the round leaves at t_send."""
        return max(0.0, min(self.t_reply - t_send, self.rtt_s)) + self.fresh_draft_s

    def worth(self, prob: float, covered: float, now: float, draft_s: float, nbytes: int) -> bool:
        """Whether one more continuation (probability `prob`, ~draft_s to draft, ~nbytes up) pays,
        given the probability `covered` of those drafted so far."""
        if self.fused:
            return prob * self.round_s > draft_s * (1.0 + self.verify_per_draft) + nbytes * self.s_per_byte
        cost = draft_s + nbytes * self.s_per_byte
        if covered <= 0.0:
            return self.saving_s(now + cost) > 0.0
        after, before = self.saving_s(now + cost), self.saving_s(now)
        return worth_drafting(prob, covered, before, before - after) if before > 0 else False

    def hit_miss_s(self, draft_s: float) -> tuple[float, float]:
        """The next round's time after this reply when a continuation drafted in `draft_s` hits, and
        when none does (a fresh round). Ahead, a hit skips the drafting (done during the round trip)
        and, sent ahead, shares the round trip with the other rounds in flight; fused, a hit costs
        what its drafting and nodes added to round r."""
        if self.fused:
            return draft_s * (1.0 + self.verify_per_draft), self.round_s
        return max(0.0, self.round_s - self.fresh_draft_s) / max(self.depth, 1), self.round_s


def continuation_budget(est: Estimates, plan: RoundPlan, rows: int, now: float, depth: int = 1) -> ContinuationBudget:
    """For continuations of a round of `plan` (`rows` drafted) in flight since `now`."""
    draft_s = rows * (est.t_row_s or 0.0)
    round_s = est.round_s(plan.nodes, plan.rows)
    return ContinuationBudget(round_s=round_s, fresh_draft_s=draft_s, s_per_byte=est.s_per_byte(),
                              rtt_s=est.rtt_s or 0.0, t_reply=now + max(0.0, round_s - draft_s), depth=depth)


def fused_budget(est: Estimates, plan: RoundPlan) -> ContinuationBudget:
    """For continuations fused into a round of `plan`."""
    per_node = max(est.verify_line().slope, 0.0)
    return ContinuationBudget(round_s=est.round_s(plan.nodes, plan.rows), fresh_draft_s=0.0,
                              s_per_byte=est.s_per_byte(), fused=True,
                              verify_per_draft=per_node / est.t_row_s if est.t_row_s else 0.0)


def continuation_length(outcomes: Sequence[Outcome], alpha: float, max_gamma: int, t_row_s: float,
                        bytes_per_token: float, budget: ContinuationBudget, now: float) -> int:
    """The continuations' length g (at most the fresh round's γ, `max_gamma`): the one that maximises
    the next round's expected tokens per second. P(hit) sums the outcomes that `budget.worth` would
    let be drafted at length g (shorter continuations cover more outcomes); a hit commits E[tokens]
    of a g-round in the hit's time, a miss a fresh γ-round in a fresh round's time
    (`budget.hit_miss_s`). So a short continuation pays only where hits save enough time to make up
    for the tokens it gives away: a continuation kept for when the reply comes still costs its round
    trip, and there the fresh round's γ wins."""
    a = min(alpha, 0.999)
    fresh = expected_tokens_per_round(a, max_gamma)

    def covered(g: int) -> float:
        cost = (g + 1) * t_row_s   # the outcome's own token, then g drafts
        total, t = 0.0, now
        for i, o in enumerate(outcomes):
            if i and not budget.worth(o.prob, total, t, cost, int(g * bytes_per_token)):
                break
            total += o.prob
            t += cost
        return total

    def rate(g: int) -> float:
        p = min(covered(g), 1.0)
        hit_s, miss_s = budget.hit_miss_s((g + 1) * t_row_s)
        tokens = p * expected_tokens_per_round(a, g) + (1 - p) * fresh
        return tokens / max(p * hit_s + (1 - p) * miss_s, 1e-9)
    return max(range(1, max_gamma + 1), key=lambda g: (rate(g), g))
