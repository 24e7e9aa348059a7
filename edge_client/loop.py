"""One generation's round loop: draft, send, commit what the verifier kept, learn; replay when the
verifier lost the session.

A step sends a round when none that can run is in flight, keeps the window filled while the oldest
round travels, then takes the oldest reply: commit, then learn. Before a round is drafted the planner
(edge_client.planner.plan_round) chooses its shape from the session's estimates
(edge_client.estimates); the window (edge_client.window) holds what travels during a round trip: the
round; its continuations fused into its own pass; the next round drafted ahead for its likely
outcomes (kept for when the reply matches); that next round sent before the reply (a pipelined
round); more rounds behind it, up to the plan's depth. The wire messages are edge_client.remote's.
There is one commit (`_commit`) and one place the estimates are fed (`_learn`, once per reply).

The loop reaches its client through `EdgeLink` (the verifier, where drafting runs, the transport's
limits, the metrics hook): edge_client.client.EdgeClient is one. Every time the loop and its drafting
read goes through `clock`.
"""
from __future__ import annotations

import codecs
import threading
from typing import Awaitable, Callable, NamedTuple, Protocol, Sequence

from edge_client.crossvocab import PromptPlan
from edge_client.drafts import RoundDrafts
from edge_client.estimates import Estimates, ReplyTaught, RoundTaught
from edge_client.options import Speculation, Transport
from edge_client.pairing import Pairing
from edge_client.planner import Budget, RoundPlan, continuation_budget, fused_budget, pinned_estimates, plan_round
from edge_client.remote import RemoteSession, Reply, bad_reply
from edge_client.rounds import Continuation, Flight, Prepared, extends, pass_nodes
from edge_client.stats import GenerationStats, RoundEvent
from edge_client.transport import EdgeError, Verifier
from edge_client.window import Window
from spec_core import clock as clock_seam
from spec_core.warping import SamplingSettings


class EdgeLink(Protocol):
    """What a session's loop needs of its client."""

    verifier: Verifier
    transport: Transport
    on_round: Callable[[RoundEvent], None] | None

    def run_drafting(self, fn, *args, thread: bool = False) -> Awaitable: ...


class Slot(NamedTuple):
    """The next round to draft behind the last one in flight."""

    after: Continuation   # the last round's continuation it builds on
    remaining: int        # tokens left after that continuation's base
    plan: RoundPlan       # a fresh round's plan there
    depth: int            # rounds in flight once it is sent (1: kept for the reply)
    send: bool            # it may go out now (the plan's depth has room)


class Committed(NamedTuple):
    """One round a reply committed."""

    prep: Prepared
    reply: Reply
    kept: list[int]      # its kept nodes, root first
    new: list[int]       # the tokens it committed
    opened: bool         # it opened the session (its pass held the prompt too)


class RoundLoop:
    """One generation's rounds on one verifier session (module docstring)."""

    def __init__(self, link: EdgeLink, spec: Speculation, prompt_ids: list[int], settings: SamplingSettings,
                 stats: GenerationStats, pairing: Pairing, prompt: PromptPlan | None = None,
                 clock: Callable[[], float] = clock_seam.now):
        self.link, self.spec, self.st, self.clock = link, spec, stats, clock
        self.est = pinned_estimates(spec.plan_inputs) if spec.plan_inputs is not None else Estimates()
        # prompt: a text open's, whose target ids come with the first reply
        self.remote = RemoteSession(link, spec, settings, pairing, prompt or PromptPlan(prompt_ids, None), stats)
        stop_ids = frozenset(settings.stop_token_ids) | (frozenset() if settings.ignore_eos else pairing.hidden_ids)
        self.drafts = RoundDrafts(pairing.drafter, spec, settings, self.est, stop_ids, clock)
        self.window = Window()
        self.text = TextPieces(pairing)
        self.committed = list(prompt_ids)
        self.max_new_tokens = settings.max_new_tokens
        self.t0 = clock()
        self.finish: str | None = None   # why generation ended; None: it goes on

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def prompt_ids(self) -> list[int]:
        return self.remote.prompt_ids

    def _remaining(self, base: Sequence[int]) -> int:
        return self.max_new_tokens - (len(base) - len(self.remote.prompt_ids))

    def _plan(self, remaining: int) -> RoundPlan:
        return plan_round(self.est, self.spec, Budget(remaining, *(self.remote.budget or (None, None))))

    # --- one step: fill the window, take the oldest reply -----------------------------------------

    async def step(self) -> str:
        """Send a round when none that can run is in flight, keep the window filled while the oldest
        travels, then commit the oldest round's reply: its text."""
        if self.window.needs_round(self.remote.last_round + 1):
            await self._send_fresh()
        await self._fill()
        return await self._take_head()

    async def _send_fresh(self) -> None:
        """Plan the next round, draft it (or take the draft made ahead for what was committed), draft
        its fused continuations when the plan fuses, and send it."""
        remaining = self._remaining(self.committed)
        plan = self._plan(remaining)
        self.st.plan_reasons = plan.why
        redo = self._redo()
        if redo is not None:   # the failed round again, as it was drafted (`_failed`)
            self.st.redone_rounds += 1
            self._send(self.remote.last_round + 1, [Continuation([], redo[0])], pipelined=False, fused=redo[1],
                       how="redo")
            return
        prep, how = self.window.take_ahead(self.committed), "ahead"
        if prep is not None:   # the round trip's continuation came true: this draft is ready
            self.st.continuation_hits += 1
            self.st.reused_drafts += len(prep.tree)
        else:
            prep, how = await self.link.run_drafting(self.drafts.prepare, list(self.committed), plan), "alone"
        fused = await self._fused(prep, plan, remaining)
        self._send(self.remote.last_round + 1, [Continuation([], prep)], pipelined=False, fused=fused,
                   how="fused" if fused else how)

    def _redo(self) -> tuple[Prepared, list[Continuation]] | None:
        return self.window.take_redo(self.committed)

    async def _fused(self, prep: Prepared, plan: RoundPlan, remaining: int) -> list[Continuation]:
        """With a plan that fuses: continuations for this round's likely outcomes, drafted before it
        leaves, as many as pay (edge_client.planner.ContinuationBudget, fused)."""
        if not (plan.fuse and self.remote.opened and len(prep.tree)):
            return []
        fused = await self.link.run_drafting(self.drafts.continuations, prep, remaining, self._plan(remaining - 1),
                                             fused_budget(self.est, prep.plan), threading.Event())
        self.st.fused_rounds += bool(fused)
        self.st.continuations_sent += len(fused)
        return fused

    async def _fill(self) -> None:
        """While the oldest round travels: draft the next round for the likely outcomes of the last one
        in flight; send it before the reply (pipelined) while the plan's depth has room, else keep it
        for when the reply comes (drafted ahead, for the oldest round's outcomes only)."""
        while self.remote.opened and self.window.travelling():
            slot = self._next_slot()
            if slot is None or not self._place(slot, *await self._draft_after(slot)):
                return

    def _next_slot(self) -> Slot | None:
        """What to draft next behind the last round in flight, and whether it may go out; None: nothing
        to build on, or the window is full."""
        after = self.window.last_base(self.committed)
        if after is None:
            return None
        remaining = self._remaining(after.prep.base)
        plan, live = self._plan(remaining - 1), self.window.live()
        send = live < plan.depth
        if not (send or plan.ahead and live == 1):
            return None
        return Slot(after, remaining, plan, live + 1 if send else 1, send)

    async def _draft_after(self, slot: Slot) -> tuple[list[Continuation], float]:
        """Continuations of the slot's likely outcomes, drafted while the oldest reply is out; and the
        seconds they took."""
        stop = threading.Event()   # the oldest reply is here: stop drafting, use it first
        self.window.oldest.task.add_done_callback(lambda _: stop.set())
        t0 = self.clock()
        prep = slot.after.prep
        budget = continuation_budget(self.est, prep.plan, prep.rows, t0, slot.depth)
        out = await self.link.run_drafting(self.drafts.continuations, prep, slot.remaining, slot.plan, budget, stop,
                                           thread=True)
        return out, self.clock() - t0

    def _place(self, slot: Slot, continuations: list[Continuation], seconds: float) -> bool:
        """Send the continuations as the next round (True: the window may take more), or keep them for
        when the oldest reply comes."""
        if not continuations:
            return False
        last = self.window.last
        if slot.send and not last.task.done():
            # Sent even when an older reply came in meanwhile: its keys count from what the edge
            # had committed, which the verifier checks, and the drafting is done.
            self._send(last.round + 1, continuations, pipelined=True, ahead_draft_s=seconds)
            return True
        self.st.continuation_rounds += 1
        self.window.ahead = continuations   # for the next round, if the reply commits what one assumes
        return False

    def _send(self, round_: int, continuations: list[Continuation], pipelined: bool,
              fused: Sequence[Continuation] = (), how: str = "pipelined", ahead_draft_s: float | None = None) -> None:
        base_len = len(self.committed)
        # A key counts from the committed sequence, so each continuation must have been drafted after
        # it: a key cut from another prefix could match the verifier's tokens while the draft was made
        # after different ones (not exact). Continuations that do not extend it cannot run: dropped.
        continuations = [c for c in continuations if extends(c.prep.base, self.committed)]
        if not continuations:
            return
        task, nbytes, nodes = self.remote.send(round_, continuations, base_len, pipelined, fused)
        label = continuations[0].prep.plan.label(how)
        self.st.shapes[label] = self.st.shapes.get(label, 0) + 1
        if pipelined:
            self.st.continuations_sent += len(continuations)
            self.st.continuation_rounds += 1
        flight = Flight(round_, continuations, base_len, task, self.clock(), nbytes, nodes,
                        pipelined=pipelined, fused=list(fused), ahead_draft_s=ahead_draft_s)
        task.add_done_callback(lambda _: setattr(flight, "t_answered", self.clock()))
        self.window.add(flight)

    # --- the oldest reply: commit, learn ----------------------------------------------------------

    async def _take_head(self) -> str:
        """The oldest round's reply: commit it and learn from it (or discard it and doom what followed
        a miss); its text."""
        head = self.window.oldest   # in the window until answered: closing cancels it
        try:
            reply = await head.task
        except EdgeError as e:
            reply = e
        self.window.pop_head()
        if isinstance(reply, EdgeError):
            return await self._failed(head, reply)
        # the round trip ends when the reply came, not when the loop (drafting meanwhile) took it
        round_s = (head.t_answered if head.t_answered is not None else self.clock()) - head.t_sent
        if reply.base_mismatch:
            self._discard(head, reply, round_s)
            return ""
        rounds = self._commit(head, reply)
        self._learn(head, reply, round_s, rounds)
        new = [t for c in rounds for t in c.new]
        if new and not self.st.ttft_s:
            self.st.ttft_s = self.clock() - self.t0
        if self.finished:
            self.st.finish_reason = self.finish
            self.window.abandon()
        else:
            self.window.recheck(self.committed)
        return self.text.add(new, final=self.finished)

    async def _failed(self, head: Flight, e: EdgeError) -> str:
        """The oldest round's call failed: a pipelined one is a miss (an error commits nothing, and
        what followed it cannot run); else replay in a new session, or fail the generation.

        Either way the next round is this one's draft again, unchanged (with the continuations fused
        into its pass), not a draft planned afresh. The verifier may have run the failed round before
        its reply was lost (an eviction after the round), drawing an outcome from the seeded stream of
        this committed length; a redo of another shape would read the same stream, and a shape chosen
        after the loss, from timings the lost outcome shaped, could then depend on that outcome and
        bias which outcome commits. The same draft on the same stream gives the outcome the lost
        reply carried (docs/exactness.md, the hunt's redo table)."""
        if head.pipelined:
            self.window.doom_after(head.round)
            self.st.discarded_rounds += 1
            self.est.observe(ReplyTaught((), pipelined=False, ahead_draft_s=head.ahead_draft_s, answered=False))
            self.window.keep_for_redo(head, self.committed)
            return ""
        await self.window.cancel_all()
        if not self.remote.replay_after(e, len(self.committed)):
            raise e
        self.window.keep_for_redo(head, self.committed)
        return ""

    def _discard(self, head: Flight, reply: Reply, round_s: float) -> None:
        """base_mismatch: the round assumed an outcome that was not committed; so did every round behind it."""
        self.st.discarded_rounds += 1
        self.window.doom_after(head.round)
        if reply.finish is not None:
            self.window.abandon()
        self.est.observe(ReplyTaught((), round_s, reply.server_s, request_bytes=head.request_bytes,
                                     request_nodes=head.request_nodes, pipelined=False if head.pipelined else None,
                                     ahead_draft_s=head.ahead_draft_s))

    def _commit(self, head: Flight, reply: Reply) -> list[Committed]:
        """Commit the reply's tokens, and round r + 1's when one of its fused continuations ran in the
        same pass, each checked against what was sent and the verifier's view."""
        if reply.continuation >= len(head.continuations):
            raise bad_reply(f"the verifier ran continuation {reply.continuation} of round {head.round}, which "
                            f"had {len(head.continuations)}")
        prep = head.continuations[reply.continuation].prep
        if self.committed != prep.base:
            raise bad_reply(f"the verifier ran round {head.round} on a base the edge did not commit")
        if head.pipelined:
            self.st.pipelined_rounds += 1
            self.st.continuation_hits += 1
        rounds = [self._commit_round(prep, reply)]
        nxt = reply.next_round
        if head.fused and nxt is not None and not self.finished:
            i = nxt.continuation - 1
            if not 0 <= i < len(head.fused) or head.fused[i].prep.base != self.committed:
                raise bad_reply(f"the verifier answered round {nxt.round} with continuation {nxt.continuation}, "
                                "not one drafted for what it committed")
            self.st.continuation_hits += 1
            self.st.fused_hits += 1
            rounds.append(self._commit_round(head.fused[i].prep, nxt))
        return rounds

    def _commit_round(self, prep: Prepared, reply: Reply) -> Committed:
        """The one commit: a round's kept path and the verifier's token join the committed sequence."""
        kept = prep.kept_path(reply.accepted, reply.kept_nodes)
        if kept is None:
            raise bad_reply(f"the verifier kept {reply.accepted} nodes ({list(reply.kept_nodes)}), not a path from "
                            f"the root of this round's {len(prep.tree)} draft nodes")
        new = [prep.tree.tokens[i] for i in kept] + ([reply.next_token] if reply.next_token is not None else [])
        if not self.remote.prompt_ids and reply.prompt_ids:
            self._prompt_known(list(reply.prompt_ids))
        opened = not self.remote.opened
        self.committed.extend(new)
        self.remote.committed(reply, len(self.committed))
        self.drafts.drafter.observe(self.committed, reply.accepted)
        self.finish = reply.finish
        return Committed(prep, reply, kept, new, opened)

    def _prompt_known(self, ids: list[int]) -> None:
        """A text open's reply: the target's prompt ids become the committed prefix (replays send them)."""
        self.remote.prompt_ids = ids
        self.committed[:0] = ids
        self.drafts.drafter.anchor_prompt(ids, self.remote.prompt.draft_ids)

    def _learn(self, head: Flight, reply: Reply, round_s: float, rounds: list[Committed]) -> None:
        """Count the reply's rounds and teach the estimates what its pass cost and kept (once per reply)."""
        taught = []
        for c in rounds:
            tree = c.prep.tree
            depth = max(tree.depths(), default=0)
            rejected = c.prep.rejected(c.kept, c.reply.next_token is not None)
            # A fused round r + 1 shared round r's pass: its time is counted once.
            self.st.add_round(len(tree), c.reply.accepted, rejected, depth, not tree.is_chain, c.prep.seconds,
                              c.reply.model_s if c is rounds[0] else 0.0)
            taught.append(RoundTaught(c.prep.plan.arm, tree.is_chain, len(tree), c.reply.accepted, rejected,
                                      len(c.new), c.prep.rows, c.prep.seconds))
            if self.link.on_round is not None:
                self.link.on_round(RoundEvent(gamma=depth, accepted=c.reply.accepted, tokens=len(c.new),
                                              draft_s=c.prep.seconds, rpc_s=round_s, server_s=c.reply.server_s,
                                              round=c.reply.round, base=len(c.prep.base), plan=c.prep.plan,
                                              nodes=len(tree)))
        first = rounds[0]
        # The verifier's line is fitted over the nodes its pass held (a fused pass: all of them), and
        # bytes per draft node over requests, both without the round that also carried the prompt.
        self.est.observe(ReplyTaught(
            tuple(taught), round_s, reply.server_s, None if first.opened else reply.model_s, reply.queue_s,
            max(len(first.prep.tree), pass_nodes(first.prep, head.fused)), head.request_bytes,
            0 if first.opened else head.request_nodes,
            pipelined=True if head.pipelined else None, fused=len(rounds) > 1 if head.fused else None,
            ahead_draft_s=head.ahead_draft_s))

    # --- the end --------------------------------------------------------------------------------

    async def close(self) -> None:
        """Settle background work, complete the stats, and close the session if it is unfinished."""
        self.window.cancel_now()   # not awaited: a cancelled caller must still reach the session's Close
        view, view0 = self.drafts.drafter.retokenization(), self.drafts.view0
        self.st.complete(self.clock() - self.t0, self.text.text(), self.committed[len(self.remote.prompt_ids):],
                         self.spec, self.window.mean_depth(),
                         (view.rolled_back - view0.rolled_back, view.retokenized - view0.retokenized)
                         if view is not None and view0 is not None else None)
        await self.remote.close(self.finished)


class TextPieces:
    """The text of committed tokens as it becomes complete: special tokens hidden; UTF-8 split across
    tokens kept until complete."""

    def __init__(self, pairing: Pairing):
        self.pairing = pairing
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pieces: list[str] = []

    def add(self, new: list[int], final: bool) -> str:
        tok = self.pairing.tokenizer
        piece = self.decoder.decode(b"".join(tok.token_bytes(t) for t in new if t not in self.pairing.hidden_ids))
        if final:
            piece += self.decoder.decode(b"", final=True)
        if piece:
            self.pieces.append(piece)
        return piece

    def text(self) -> str:
        return "".join(self.pieces)
