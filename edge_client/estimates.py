"""What one session has measured: every input of the planner (edge_client.planner.plan_round), kept
once and fed once per reply (`Estimates.observe`).

- drafting per row (`t_row_s`): a round's drafting seconds over the forward rows it cost;
- the round trip (`rtt_s`): the RPC's wall time minus the verifier's own time, of rounds sent on
  their own (a pipelined round's also holds its wait for the round before it);
- the uplink per byte: least squares of that round trip over the request's bytes (`UplinkFit`), and
  the typical request's bytes, so that the round trip at zero bytes is rtt_s − typical · per byte;
- the verifier's line: its model seconds over the nodes its pass held (chains, trees and fused
  passes alike: nearly flat on a GPU, growing on a CPU), and its queue time;
- acceptance: per-token α (spec_core.estimates.Acceptance) and its shape by draft position
  (`alphas`), from chain rounds (a tree round's is not geometric);
- per arm (the chain, each tree size): its tokens per round and the seconds its rounds take beyond
  the cost model, recency-weighted (`Arm`): what the model does not see (a tree's work per branch);
- continuation hit rates: of pipelined rounds, those that ran (not base_mismatch); of fused rounds,
  those whose continuation ran; and the seconds spent drafting continuations during a round trip.

Running means weigh a new value spec_core.estimates.EWMA_WEIGHT against the mean; counts and sums
are forgotten at DECAY per round. `pinned(inputs)` is the same record with the planner's inputs
fixed (`--plan-inputs`): it learns nothing, so the planner chooses the same shape every round.
Nothing here reads a clock: the loop passes the seconds it measured.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from spec_core.costmodel import RoundCosts, expected_tokens_by_position
from spec_core.estimates import Acceptance, Line, ewma, fit_line, x_varies

DECAY = 0.9              # forgetting per round of α (the verifier's and the steering's rule too)
ARM_DECAY = 0.8          # ... of an arm's tokens and excess
POSITION_DECAY = 0.98   # ... of the acceptance curve's shape by draft position (slow: a property of the pair)
POSITION_PRIOR = 10.0    # a position's rate is shrunk toward the curve's mean as if it had this many more tests
VERIFY_POINTS, UPLINK_POINTS = 48, 32   # recent rounds the verifier's line and the uplink's are fitted over
BYTES_PER_DRAFT = 80     # a draft token with its q (fixed:16:16) on the wire, before requests are measured
MAX_ALPHA = 0.999


class RoundTaught(NamedTuple):
    """One round a reply committed, as the planner learns from it."""

    arm: str            # the plan's arm: "chain", "tree2x", "tree8", ...
    chain: bool         # its draft was a chain (its acceptance is geometric)
    drafted: int        # draft nodes sent
    accepted: int
    rejected: bool      # the verifier drew its own token where a draft was on offer
    tokens: int         # committed: accepted + the corrected or bonus token
    rows: int           # draft forward rows it cost
    draft_s: float      # seconds drafting it


class ReplyTaught(NamedTuple):
    """One reply, as the planner learns from it (Estimates.observe)."""

    rounds: tuple[RoundTaught, ...]   # the rounds it committed: none (a miss), one, or two (a fused hit)
    round_s: float = 0.0              # the RPC's wall time, retries included
    server_s: float = 0.0             # the verifier's own time for it
    model_s: float | None = None      # its target pass; None: none, or one that also held the prompt
    queue_s: float = 0.0              # time it waited on the verifier before its pass
    pass_nodes: int = 0               # draft nodes that pass held (a fused pass: the continuations' too)
    request_bytes: int = 0            # the request's size
    request_nodes: int = 0            # draft nodes in it (its own, its continuations', fused ones'; 0:
                                      # not a measure of bytes per node, as an open that carries the prompt)
    pipelined: bool | None = None     # sent before the reply of the round before: whether it ran
    fused: bool | None = None         # sent with continuations for its own pass: whether one ran
    ahead_draft_s: float | None = None   # seconds spent drafting it during the round before's trip
    answered: bool = True             # False: the call failed (nothing measured but the miss)


@dataclass
class Arm:
    """One arm's measurements, forgotten at ARM_DECAY: sums weighted by recency, read through
    `estimate` so that an arm seen in one or two rounds does not stand on them alone."""

    rounds: int = 0
    weight: float = 0.0
    tokens_sum: float = 0.0   # tokens committed per round
    extra_sum: float = 0.0    # seconds a round took beyond the cost model's prediction

    def add(self, tokens: float, extra_s: float) -> None:
        self.rounds += 1
        self.weight = ARM_DECAY * self.weight + 1
        self.tokens_sum = ARM_DECAY * self.tokens_sum + tokens
        self.extra_sum = ARM_DECAY * self.extra_sum + extra_s

    def tokens(self, prior: float, strength: float) -> float:
        """The recency-weighted mean of its tokens, shrunk toward `prior` as if it were `strength` rounds more."""
        return (self.tokens_sum + strength * prior) / (self.weight + strength)

    def extra_s(self, prior: float, strength: float) -> float:
        return (self.extra_sum + strength * prior) / (self.weight + strength)


@dataclass
class UplinkFit:
    """Uplink seconds per request byte: least squares of (round trip − server time) over request
    bytes for recent rounds; 0 until the points spread (then bytes cost nothing in the model)."""

    points: list[tuple[int, float]] = field(default_factory=list)

    def observe(self, request_bytes: int, network_s: float) -> None:
        self.points = (self.points + [(request_bytes, max(0.0, network_s))])[-UPLINK_POINTS:]

    def seconds_per_byte(self) -> float:
        if len(self.points) < 4:
            return 0.0
        sizes = [p[0] for p in self.points]
        if max(sizes) - min(sizes) < 16:
            return 0.0
        return fit_line(self.points).slope


@dataclass
class Estimates:
    """One session's measurements (module docstring). `learning` False: pinned, `observe` ignores replies."""

    t_row_s: float | None = None
    rtt_s: float | None = None
    queue_s: float = 0.0
    request_bytes: float | None = None   # the typical request's bytes (running mean)
    bytes_per_node: float | None = None  # a draft node's bytes on the wire (running mean)
    verify_points: list[tuple[int, float]] = field(default_factory=list)   # (nodes, model seconds)
    line: Line = Line(0.0, 0.0)          # fitted over verify_points (or pinned), once per reply
    line_varies: bool = False            # verify_points span more than one size (a slope can be read)
    uplink: UplinkFit = field(default_factory=UplinkFit)
    uplink_s_per_byte: float = 0.0       # the uplink's fit (or pinned), once per reply
    acceptance: Acceptance = field(default_factory=lambda: Acceptance(DECAY))
    accepted_at: list[float] = field(default_factory=list)   # per draft position, recency-weighted
    tested_at: list[float] = field(default_factory=list)
    arms: dict[str, Arm] = field(default_factory=dict)
    rounds: int = 0                      # rounds learned from
    pipelined_sent: int = 0              # pipelined rounds answered (or lost) ...
    pipelined_ran: int = 0               # ... and of those, run
    fused_tried: int = 0                 # rounds sent with fused continuations, answered ...
    fused_hits: int = 0                  # ... and of those, with a continuation run in the same pass
    ahead_draft_s: float | None = None   # drafting one pipelined round's continuations
    learning: bool = True                # False: pinned (`pinned`), the inputs as given
    hit_prior: float | None = 0.5        # a pipelined round's chance to run before any was answered;
                                         # None: the model's (every draft of the round before accepted)

    # --- what the planner reads --------------------------------------------------------------------

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def alphas(self, gamma: int) -> list[float]:
        """Acceptance by draft position for a chain of `gamma`: α (which follows the content, forgotten
        at DECAY) times the position's rate relative to the curve's mean (a shape that belongs to the
        pair, forgotten at POSITION_DECAY; each position shrunk toward the mean by POSITION_PRIOR
        tests, so a flat curve, or one barely measured, gives α at every position)."""
        a = min(self.alpha, MAX_ALPHA)
        total = sum(self.tested_at)
        mean = sum(self.accepted_at) / total if total else 0.0
        out = []
        for j in range(gamma):
            if mean <= 0.0 or j >= len(self.tested_at):
                out.append(a)
                continue
            rate = (self.accepted_at[j] + POSITION_PRIOR * mean) / (self.tested_at[j] + POSITION_PRIOR)
            out.append(min(a * rate / mean, MAX_ALPHA))
        return out

    def chain_tokens(self, gamma: int) -> float:
        """Expected tokens a chain of `gamma` drafts commits (spec_core.costmodel)."""
        return expected_tokens_by_position(self.alphas(gamma))

    def verify_line(self) -> Line:
        """The verifier's model seconds over the nodes of its pass (base, per node)."""
        return self.line

    def line_spread(self) -> bool:
        """Whether the line has a slope to read: measured over passes of more than one size (or pinned)."""
        return not self.learning or self.line_varies

    def line_reach(self) -> int | None:
        """The most nodes the line was measured at (None: pinned, or not measured)."""
        return max((x for x, _ in self.verify_points), default=None) if self.learning else None

    def chain_costs_known(self) -> bool:
        """Drafting, the round trip and the verifier measured once: γ can be chosen by the model."""
        return self.t_row_s is not None and self.rtt_s is not None and (not self.learning or bool(self.verify_points))

    def tree_costs_known(self) -> bool:
        """The verifier's time per node measured too (over two sizes, or four rounds of one): trees can be judged."""
        pts = self.verify_points
        return self.chain_costs_known() and (not self.learning or len(pts) >= 2 and (self.line_varies or len(pts) >= 4))

    def s_per_byte(self) -> float:
        return self.uplink_s_per_byte

    def costs(self) -> RoundCosts:
        """The measured costs as the cost model takes them; the round trip is at zero bytes."""
        base, per_node = self.verify_line()
        spb = self.s_per_byte()
        rtt = max(0.0, (self.rtt_s or 0.0) - (self.request_bytes or 0.0) * spb)
        return RoundCosts(self.t_row_s or 0.0, rtt, base + self.queue_s, per_node,
                          bytes_per_s=1.0 / spb if spb > 0 else float("inf"))

    def bytes_for(self, nodes: int) -> float:
        """A request's bytes with `nodes` draft nodes (measured per node, else BYTES_PER_DRAFT)."""
        return nodes * (self.bytes_per_node if self.bytes_per_node is not None else BYTES_PER_DRAFT)

    def round_s(self, nodes: int, rows: int) -> float:
        """The cost model's time of a round: drafting its rows, sending it, the round trip, the pass."""
        return self.costs().seconds(rows, nodes, self.bytes_for(nodes))

    def arm(self, name: str) -> Arm:
        return self.arms.get(name) or Arm()

    def pipelined_hit(self, gamma: int) -> float:
        """The chance a pipelined round runs: Laplace over those answered, or the model's prior."""
        prior = self.hit_prior if self.hit_prior is not None else min(self.alpha, MAX_ALPHA) ** gamma
        return (self.pipelined_ran + 2 * prior) / (self.pipelined_sent + 2)

    # --- what a reply teaches ----------------------------------------------------------------------

    def observe(self, r: ReplyTaught) -> None:
        """One reply: each round it committed, then the link and the verifier's pass."""
        if not self.learning:
            return
        if r.pipelined is not None:
            self.pipelined_sent += 1
            self.pipelined_ran += r.pipelined
        if r.fused is not None:
            self.fused_tried += 1
            self.fused_hits += r.fused
        if r.ahead_draft_s is not None:
            self.ahead_draft_s = ewma(self.ahead_draft_s, r.ahead_draft_s)
        if not r.answered:
            return
        # A pipelined round's wall time also holds its wait for the round before it: it times the
        # link only when it was sent on its own.
        timed = r.pipelined is None
        if timed:
            self.uplink.observe(r.request_bytes, r.round_s - r.server_s)
            self.uplink_s_per_byte = self.uplink.seconds_per_byte()
        for t in r.rounds:
            self._round(t, r, timed)
        if timed:
            self.rtt_s = ewma(self.rtt_s, max(0.0, r.round_s - r.server_s))
            self.request_bytes = ewma(self.request_bytes, r.request_bytes)
        if r.request_nodes:
            self.bytes_per_node = ewma(self.bytes_per_node, r.request_bytes / r.request_nodes)
        if r.model_s is not None and r.rounds:
            self.queue_s = ewma(self.queue_s, r.queue_s)
            self.verify_points = (self.verify_points + [(r.pass_nodes, r.model_s)])[-VERIFY_POINTS:]
            self.line, self.line_varies = fit_line(self.verify_points), x_varies(self.verify_points)

    def _round(self, t: RoundTaught, r: ReplyTaught, timed: bool) -> None:
        self.rounds += 1
        # The excess is measured against the model as it stood before this reply taught it; a round
        # that opened the session (its pass held the prompt), one before the model has its inputs,
        # or a pipelined one (not timed), counts as none.
        measured = self.t_row_s is not None and self.rtt_s is not None and len(self.verify_points) >= 2
        extra = t.draft_s + r.round_s - self.round_s(r.pass_nodes, t.rows) \
            if timed and measured and r.model_s is not None else 0.0
        self.arms.setdefault(t.arm, Arm()).add(t.tokens, extra)
        if t.rows > 0:
            self.t_row_s = ewma(self.t_row_s, t.draft_s / t.rows)
        if t.chain:
            self.acceptance.observe(t.drafted, t.accepted, t.rejected)
            self._by_position(t.drafted, t.accepted, t.rejected)

    def _by_position(self, drafted: int, accepted: int, rejected: bool) -> None:
        if drafted <= 0:
            return
        tested = accepted + (1 if rejected else 0)
        grow = max(0, tested - len(self.tested_at))
        self.tested_at += [0.0] * grow
        self.accepted_at += [0.0] * grow
        for j in range(len(self.tested_at)):
            self.tested_at[j] = POSITION_DECAY * self.tested_at[j] + (j < tested)
            self.accepted_at[j] = POSITION_DECAY * self.accepted_at[j] + (j < accepted)


def pinned(rtt_ms: float, draft_ms: float, verify_ms: float, node_ms: float, up_ms_per_kb: float,
           alpha: float, by_position: Sequence[float] = ()) -> Estimates:
    """The planner's inputs as given (`--plan-inputs`, or a cost table): an Estimates that learns
    nothing. `by_position`: the acceptance of each draft position (a falling curve), which then sets
    α to its mean (the rate beyond it). A pipelined round's chance to run is the model's (every draft
    of the round before accepted)."""
    est = Estimates(t_row_s=draft_ms / 1e3, rtt_s=rtt_ms / 1e3, learning=False, hit_prior=None,
                    line=Line(verify_ms / 1e3, node_ms / 1e3), uplink_s_per_byte=up_ms_per_kb / 1e3 / 1024)
    # As if measured long: the priors (Beta(1, 1), the shrinkage toward the mean) no longer show.
    if by_position:
        alpha = sum(by_position) / len(by_position)
    est.acceptance.accepted, est.acceptance.tested = alpha * 1e9, 1e9
    est.accepted_at, est.tested_at = [a * 1e9 for a in by_position], [1e9] * len(by_position)
    return est
