"""The window of rounds in flight: round r + 1 (and r + 2, ...) travels while r is unanswered.

A session always has a window (edge_client.loop): depth 1 holds one round (with what is drafted
ahead for its outcomes, or its continuations fused into its own pass); deeper, the rounds behind it.

Each round beyond the oldest unanswered one is pipelined: its alternatives (its own draft and its
continuations, edge_client.continuations) are drafted after the outcomes of the round before it,
that round's most likely alternative that can still run (once the rounds before it are answered,
the one the verifier will run) extended by one of its likely outcomes, and
each is keyed (assumed_tokens) by every token it assumes the unanswered rounds before it commit,
counted from the committed sequence the edge knew when it sent it. The verifier runs a round only
when every round before it committed exactly the tokens one alternative's key assumes (the engine
checks the whole key against its committed sequence: spec_core.continuations.pick_continuation),
else answers base_mismatch; so each alternative is verified only against the prefix it was drafted
after, with the q it was sampled from, and the argument of spec_core/continuations.py carries over
round by round: the output follows the target. Rounds travel on VerifyStream when the verifier
offers it (edge_client.stream), else as concurrent unary calls; the semantics are the same.

A base_mismatch dooms every later round in flight (their keys extend the missed one's); they stay
outstanding until the verifier answers them (usually base_mismatch too, which frees their round
numbers; a coincidental hit is applied as any other), and a round number is never sent twice while
an earlier request for it is unanswered.

How deep (`window_depth`): a new round pays when the rounds already in flight do not yet cover the
round trip, and the chance that it runs (the measured pipelined hit rate, to the power of its depth)
times what it hides (the round trip and the verifier's time) beats what it costs when it is
discarded (its drafting and its upload). When the uplink is the slowest stage a deeper window only
queues bytes on the link: the depth stays at what the link carries.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from edge_client.rounds import Flight, extends
from spec_core.estimates import EWMA_WEIGHT, ewma


@dataclass(frozen=True)
class WindowCosts:
    """Measured costs, seconds per round."""

    rtt_s: float       # the network round trip
    verify_s: float    # the verifier's time for one round (model and queue)
    draft_s: float     # drafting one pipelined round with its continuations
    up_s: float        # the uplink's time for one pipelined round's request
    hit: float         # the share of pipelined rounds that ran (not base_mismatch)


def window_depth(c: WindowCosts, max_window: int) -> int:
    """Rounds to keep in flight (1..max_window), from the measured costs (module docstring)."""
    stage = max(c.draft_s, c.up_s, c.verify_s, 1e-4)   # the slowest stage sets the pace
    cycle = c.draft_s + c.up_s + c.rtt_s + c.verify_s  # one round's way from drafting to its reply
    cover = max(1, math.ceil(cycle / stage))          # rounds in flight that keep the slowest stage busy
    if c.up_s >= max(c.draft_s, c.verify_s) and c.up_s > 0:
        cover = min(cover, 2)   # the link is the bottleneck: more rounds in flight only queue on it
    depth = 1
    while depth < min(cover, max_window):
        runs = c.hit ** depth   # it runs only if every pipelined round before it hit
        if runs * (c.rtt_s + c.verify_s) <= (1 - runs) * (c.draft_s + c.up_s):
            break
        depth += 1
    return depth


@dataclass
class Ewma:
    value: float | None = None
    weight: float = EWMA_WEIGHT

    def observe(self, x: float) -> None:
        self.value = ewma(self.value, x, self.weight)


@dataclass
class Window:
    """The rounds of one session in flight, in round order, and what the depth is chosen from."""

    flights: list[Flight] = field(default_factory=list)
    verify_s: Ewma = field(default_factory=Ewma)   # the verifier's time for a round (model and queue)
    draft_s: Ewma = field(default_factory=Ewma)    # drafting one pipelined round with its continuations
    sent: int = 0        # pipelined rounds sent
    ran: int = 0         # of those, verified (not base_mismatch)
    depths: list[int] = field(default_factory=list)   # rounds in flight when a pipelined one was sent

    @property
    def hit(self) -> float:
        return (1 + self.ran) / (2 + self.sent)   # Laplace: 1/2 before any was answered

    def costs(self, rtt_s: float | None, s_per_byte: float) -> WindowCosts:
        last = self.flights[-1].req_bytes if self.flights else 0
        return WindowCosts(rtt_s=rtt_s or 0.0, verify_s=self.verify_s.value or 0.0, draft_s=self.draft_s.value or 0.0,
                           up_s=last * s_per_byte, hit=self.hit)

    def live(self) -> int:
        return sum(f.live for f in self.flights)

    def occupied(self, round_: int) -> bool:
        return any(f.round == round_ for f in self.flights)

    def add(self, flight: Flight) -> None:
        self.flights.append(flight)
        self.flights.sort(key=lambda f: f.round)

    def recheck(self, committed: list[int]) -> None:
        """After a commit: a round in flight none of whose alternatives extends the committed sequence
        cannot run (nor can the rounds drafted after it, whose bases extend its alternatives')."""
        for f in self.flights:
            f.live = f.live and any(extends(g.prep.base, committed) for g in f.guesses)

    def doom_after(self, round_: int) -> None:
        for f in self.flights:
            if f.round > round_:
                f.live = False

    def abandon(self) -> None:
        """Generation ended: what is still in flight can only be answered base_mismatch or out of step;
        not awaited (a cancelled caller must still reach the session's Close)."""
        for f in self.flights:
            f.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self.flights.clear()

    async def cancel_all(self) -> None:
        """The session is being replaced (or the generation fails): what is in flight no longer matters."""
        for f in self.flights:
            f.task.cancel()
        await asyncio.gather(*(f.task for f in self.flights), return_exceptions=True)
        self.flights.clear()

    def mean_depth(self) -> float:
        return sum(self.depths) / len(self.depths) if self.depths else 1.0
