"""A window of rounds in flight: round r + 2 travels while r and r + 1 are unanswered.

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
import threading
import time
from dataclasses import dataclass, field

import grpc

from edge_client.session import _Guess, _SessionLoop
from edge_client.transport import EdgeError
from spec_core.estimates import EWMA_WEIGHT, ewma
from spec_core.proto import verifier_pb2 as pb


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
class _Flight:
    """A round sent and not yet answered."""

    round: int
    guesses: list[_Guess]            # its alternatives: 0 its own draft, then its continuations
    base_len: int                    # the committed length its keys count from
    task: asyncio.Future
    t_sent: float
    req_bytes: int
    live: bool = True                # False once an earlier round missed: its keys cannot come true
    pipelined: bool = True


@dataclass
class _Ewma:
    value: float | None = None
    weight: float = EWMA_WEIGHT

    def observe(self, x: float) -> None:
        self.value = ewma(self.value, x, self.weight)


@dataclass
class _WindowStats:
    sent: int = 0        # pipelined rounds sent
    ran: int = 0         # of those, verified (not base_mismatch)
    depths: list[int] = field(default_factory=list)

    @property
    def hit(self) -> float:
        return (1 + self.ran) / (2 + self.sent)   # Laplace: 1/2 before any was answered


class WindowLoop(_SessionLoop):
    """The session loop with up to `spec.window` rounds in flight (module docstring)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.flight: list[_Flight] = []   # in round order
        self.verify_s, self.draft_s = _Ewma(), _Ewma()
        self.w = _WindowStats()

    def _costs(self, req_bytes: int) -> WindowCosts:
        return WindowCosts(rtt_s=self.planner.rtt_s or 0.0, verify_s=self.verify_s.value or 0.0,
                           draft_s=self.draft_s.value or 0.0, up_s=req_bytes * self.uplink.seconds_per_byte(),
                           hit=self.w.hit)

    def _depth(self) -> int:
        if self.planner.rtt_s is None:
            return min(2, self.spec.window)   # nothing measured yet: one pipelined round, as --pipeline
        last = self.flight[-1].req_bytes if self.flight else 0
        return window_depth(self._costs(last), self.spec.window)

    async def step(self) -> str:
        """Fill the window, then take the oldest round's reply: its text."""
        remaining = self.settings.max_new_tokens - (len(self.committed) - self.prompt_len)
        if not any(f.live for f in self.flight) and not self._occupied(self.last_round + 1):
            prep = await self._next_draft(remaining)
            self._send_round(self.last_round + 1, [_Guess([], prep)], pipelined=False)
        await self._fill()
        return await self._take_head()

    def _occupied(self, round_: int) -> bool:
        return any(f.round == round_ for f in self.flight)

    async def _fill(self) -> None:
        """Send pipelined rounds behind the last live one while the window has room and they pay."""
        while self.session_id and self.flight and self.flight[-1].live and not self.flight[0].task.done():
            depth = self._depth()
            live = sum(f.live for f in self.flight)
            if live >= depth:
                break
            last = self.flight[-1]
            nxt = last.round + 1
            if self._occupied(nxt):
                break
            # Build on the most likely of `last`'s alternatives that can still run: once the rounds
            # before it are answered that is the one the verifier will run.
            after = next((g for g in last.guesses if _extends(g.prep.base, self.committed)), None)
            if after is None:
                break
            prep = after.prep
            remaining = self.settings.max_new_tokens - (len(prep.base) - self.prompt_len)
            stop = threading.Event()   # the oldest reply is here: stop drafting, use it first
            self.flight[0].task.add_done_callback(lambda _: stop.set())
            t0 = time.perf_counter()
            guesses = await self.c._in_drafter(self._draft_continuations, prep, remaining,
                                               self._budget(prep, time.perf_counter()), stop, thread=True)
            self.draft_s.observe(time.perf_counter() - t0)
            if not guesses:
                break
            # Sent even when the oldest reply came in meanwhile: its keys count from what the edge had
            # committed, which the verifier checks, and the drafting is done.
            self.w.depths.append(live + 1)
            self._send_round(nxt, guesses, pipelined=True)

    def _send_round(self, round_: int, guesses: list[_Guess], pipelined: bool) -> None:
        base_len = len(self.committed)
        # A key counts from the committed sequence, so each alternative must have been drafted after
        # it: a key cut from another prefix could match the verifier's tokens while the draft was made
        # after different ones (not exact). Alternatives that do not extend it cannot run: dropped.
        guesses = [g for g in guesses if _extends(g.prep.base, self.committed)]
        if not guesses:
            return
        own = guesses[0]
        req = self._request(own.prep, round_, assumed=own.prep.base[base_len:] if pipelined else ())
        for g in guesses[1:]:
            cont = self._continuation(g)
            del cont.assumed_tokens[:]
            cont.assumed_tokens.extend(g.prep.base[base_len:])
            req.continuations.append(cont)
        if pipelined:
            self.w.sent += 1
            self.st.continuations_sent += len(guesses)
            self.st.continuation_rounds += 1
        task = asyncio.ensure_future(self._send(req))
        self.flight.append(_Flight(round_, guesses, base_len, task, time.perf_counter(), req.ByteSize(),
                                   pipelined=pipelined))
        self.flight.sort(key=lambda f: f.round)

    async def _take_head(self) -> str:
        """The oldest round's reply: commit it (or discard it), and doom what followed a miss."""
        head = self.flight[0]
        try:
            reply = await head.task
        except EdgeError as e:
            self.flight.pop(0)
            if head.pipelined:
                # Not committed (an error commits nothing): as a miss; what followed it cannot run.
                self._doom_after(head.round)
                self.st.discarded_rounds += 1
                return ""
            await self._settle_all()
            if not self._replay_after(e):
                raise
            return ""
        self.flight.pop(0)
        round_s = time.perf_counter() - head.t_sent
        self.uplink.observe(head.req_bytes, round_s - reply.timings.total_ms / 1e3)
        if reply.base_mismatch:
            self.st.discarded_rounds += 1
            self._doom_after(head.round)
            if reply.finish_reason != pb.NOT_FINISHED:
                return self._finish_outstanding()
            return ""
        if reply.continuation >= len(head.guesses):
            raise EdgeError(grpc.StatusCode.INTERNAL, f"the verifier ran alternative {reply.continuation} of round "
                                                      f"{head.round}, which had {len(head.guesses)}")
        guess = head.guesses[reply.continuation]
        if self.committed != guess.prep.base:
            raise EdgeError(grpc.StatusCode.INTERNAL, f"the verifier ran round {head.round} on a base the edge "
                                                      "did not commit")
        if head.pipelined:
            self.w.ran += 1
            self.st.pipelined_rounds += 1
            self.st.continuation_hits += 1
        self.verify_s.observe((reply.timings.model_ms + reply.timings.queue_ms) / 1e3)
        new = self._apply(guess.prep, reply, round_s)
        self.final = reply
        self.finished = reply.finish_reason != pb.NOT_FINISHED
        if self.finished:
            self._finish_outstanding()
        else:
            self._recheck()
        return self._text(new)

    def _recheck(self) -> None:
        """After a commit: a round in flight none of whose alternatives extends the committed sequence
        cannot run (nor can the rounds drafted after it, whose bases extend its alternatives')."""
        for f in self.flight:
            f.live = f.live and any(_extends(g.prep.base, self.committed) for g in f.guesses)

    def _doom_after(self, round_: int) -> None:
        for f in self.flight:
            if f.round > round_:
                f.live = False

    def _finish_outstanding(self) -> str:
        """Generation ended: what is still in flight can only be answered base_mismatch or out of step."""
        for f in self.flight:
            f.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self.flight.clear()
        return ""

    async def _settle_all(self) -> None:
        """The session is being replaced (or the generation fails): what is in flight no longer matters."""
        for f in self.flight:
            f.task.cancel()
        await asyncio.gather(*(f.task for f in self.flight), return_exceptions=True)
        self.flight.clear()

    async def close(self) -> None:
        # Not awaited: a cancelled caller must still reach the session's Close (super().close()).
        for f in self.flight:
            f.task.cancel()
        self.flight.clear()
        await super().close()

    def _complete_stats(self) -> None:
        super()._complete_stats()
        d = self.w.depths
        self.st.window_depth = sum(d) / len(d) if d else 1.0


def _extends(base: list[int], committed: list[int]) -> bool:
    """Whether a draft made after `base` can still run: `base` is the committed sequence and more."""
    return len(base) >= len(committed) and base[:len(committed)] == committed
