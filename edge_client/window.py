"""The window of rounds in flight: round r + 1 (and r + 2, ...) travels while r is unanswered.

A session always has a window (edge_client.loop): depth 1 holds one round (with what is drafted
ahead for its outcomes, or its continuations fused into its own pass); deeper, the rounds behind it.

Each round beyond the oldest unanswered one is pipelined: it carries continuations of the round
before it (edge_client.rounds.Continuation: one per likely outcome, drafted after that round's most
likely continuation that can still run, extended by the outcome), each keyed (assumed_tokens) by
every token it assumes the unanswered rounds before it commit, counted from the committed sequence
the edge knew when it sent it. The verifier runs a round only when every round before it committed
exactly the tokens one continuation's key assumes (the engine checks the whole key against its
committed sequence: spec_core.continuations.pick_continuation), else answers base_mismatch; so each
continuation is verified only against the prefix it was drafted after, with the q it was sampled
from, and the argument of spec_core/continuations.py carries over round by round: the output follows
the target. Rounds travel on VerifyStream when the verifier offers it (edge_client.stream), else as
concurrent unary calls; the semantics are the same.

A base_mismatch dooms every later round in flight (their keys extend the missed one's); they stay
outstanding until the verifier answers them (usually base_mismatch too, which frees their round
numbers; a coincidental hit is applied as any other), and a round number is never sent twice while
an earlier request for it is unanswered.

How deep: edge_client.planner chooses each round's depth (`RoundPlan.depth`) with the rest of its
shape. The window holds the rounds and what is drafted ahead for the oldest's outcomes when no more
may travel.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from edge_client.rounds import Continuation, Flight, Prepared, extends


@dataclass
class Window:
    """The rounds of one session in flight, in round order, and the continuations drafted ahead (for
    the oldest round's outcomes, kept for when its reply comes)."""

    flights: list[Flight] = field(default_factory=list)
    ahead: list[Continuation] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)   # rounds in flight when a pipelined one was sent
    redo: tuple[Prepared, list[Continuation]] | None = None   # a failed round's draft and fused continuations

    def live(self) -> int:
        return sum(f.live for f in self.flights)

    def occupied(self, round_: int) -> bool:
        return any(f.round == round_ for f in self.flights)

    def needs_round(self, next_round: int) -> bool:
        """No round that can run is in flight, and none numbered `next_round` is outstanding."""
        return not self.live() and not self.occupied(next_round)

    @property
    def oldest(self) -> Flight:
        return self.flights[0]

    @property
    def last(self) -> Flight:
        return self.flights[-1]

    def travelling(self) -> bool:
        """The oldest round's reply is not in yet."""
        return bool(self.flights) and not self.flights[0].task.done()

    def add(self, flight: Flight) -> None:
        if flight.pipelined:
            self.depths.append(self.live() + 1)
        self.flights.append(flight)
        self.flights.sort(key=lambda f: f.round)

    def pop_head(self) -> Flight:
        return self.flights.pop(0)

    def last_base(self, committed: list[int]) -> Continuation | None:
        """What the next round builds on: the most likely continuation of the last round in flight
        that can still run (once the rounds before it are answered, the one the verifier will run);
        None where nothing may follow it (doomed, fused: its next round rides with it, or the next
        round is out already)."""
        last = self.last
        if not last.live or last.fused or self.occupied(last.round + 1):
            return None
        after = next((c for c in last.continuations if extends(c.prep.base, committed)), None)
        return after if after is not None and len(after.prep.tree) else None

    def keep_for_redo(self, failed: Flight, committed: list[int]) -> None:
        """A round's call failed (its reply lost with its session, a stale pipelined round refused): its
        own draft for what is committed, and the continuations fused into its pass, are what the next
        round sends again, unchanged (edge_client.loop: the redo)."""
        own = next((c.prep for c in failed.continuations if c.prep.base == committed), None)
        self.redo = None if own is None else (own, list(failed.fused))

    def take_redo(self, committed: list[int]) -> tuple[Prepared, list[Continuation]] | None:
        redo, self.redo = self.redo, None
        return redo if redo is not None and redo[0].base == committed else None

    def take_ahead(self, committed: list[int]) -> Prepared | None:
        """The draft made ahead for what was committed, if one was (a hit); the others are dropped."""
        ahead, self.ahead = self.ahead, []
        return next((c.prep for c in ahead if c.prep.base == committed), None)

    def recheck(self, committed: list[int]) -> None:
        """After a commit: a round in flight none of whose continuations extends the committed sequence
        cannot run (nor can the rounds drafted after it, whose bases extend its continuations')."""
        for f in self.flights:
            f.live = f.live and any(extends(c.prep.base, committed) for c in f.continuations)

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
        self.ahead = []

    def cancel_now(self) -> None:
        """The generation is closing: cancel what is in flight, not awaited (a cancelled caller must
        still reach the session's Close)."""
        for f in self.flights:
            f.task.cancel()
        self.flights.clear()

    def mean_depth(self) -> float:
        return sum(self.depths) / len(self.depths) if self.depths else 1.0
