"""One generation's round loop: draft, send, commit what the verifier kept, learn; replay when the
verifier lost the session.

There is one loop and one place that commits a reply's tokens (`RoundLoop._commit`: the checks, the
commit, the stats, the learning). What travels during a round trip is what the window
(edge_client.window) holds: the round; its continuations fused into its own pass; the next round
drafted ahead for its likely outcomes (kept for when the reply matches); that next round sent before
the reply (a pipelined round); more rounds behind it, up to the window's depth. Which of these a
round gets is chosen before it, from the options and what the session has measured.

The loop reaches its client through `EdgeLink` (the verifier, where drafting runs, the transport's
limits, the metrics hook): edge_client.client.EdgeClient is one.
"""
from __future__ import annotations

import asyncio
import codecs
import dataclasses
import logging
import os
import threading
from typing import Awaitable, Callable, Protocol, Sequence

import grpc

from edge_client import window as window_mod
from edge_client.continuations import UplinkFit
from edge_client.crossvocab import PromptPlan
from edge_client.drafts import RoundDrafts
from edge_client.gamma import AdaptiveGamma, FixedGamma, TreePolicy
from edge_client.options import ADAPTIVE, Speculation, Transport
from edge_client.pairing import Pairing
from edge_client.planner import ShapePlanner, pinned_choices
from edge_client.protocols import GammaPolicy
from edge_client.rounds import Flight, Guess, Prepared, extends, pass_nodes
from edge_client.stats import GenerationStats, RoundEvent
from edge_client.stream import RoundStream, verify_on_stream
from edge_client.transport import EdgeError, Verifier, sampling_proto
from spec_core import clock
from spec_core.costmodel import expected_tokens_per_round
from spec_core.estimates import Acceptance
from spec_core.proto import qpayload
from spec_core.proto import verifier_pb2 as pb
from spec_core.tree import ROOT
from spec_core.warping import REJECTION, SamplingSettings
from spec_core.wire import OPEN_KEY_BYTES

log = logging.getLogger(__name__)


class EdgeLink(Protocol):
    """What a session's loop needs of its client."""

    verifier: Verifier
    transport: Transport
    on_round: Callable[[RoundEvent], None] | None

    def run_drafting(self, fn, *args, thread: bool = False) -> Awaitable: ...


class RoundLoop:
    """One generation's rounds on one verifier session (module docstring)."""

    def __init__(self, link: EdgeLink, spec: Speculation, prompt_ids: list[int], settings: SamplingSettings,
                 stats: GenerationStats, pairing: Pairing, plan: PromptPlan | None = None):
        if spec.plan_inputs is not None and spec.planned:   # the planner chooses once, from the pinned inputs
            spec = dataclasses.replace(spec, **pinned_choices(spec), planned=())
        self.link, self.spec, self.settings, self.st = link, spec, settings, stats
        self.pairing, self.drafter, self.verifier = pairing, pairing.drafter, link.verifier
        self.prompt_ids = prompt_ids
        self.plan = plan or PromptPlan(prompt_ids, None)   # a text open: the target's ids come with the first reply
        self.policy: GammaPolicy
        if spec.gamma == ADAPTIVE:
            self.policy = AdaptiveGamma(max_gamma=spec.max_gamma,
                                        start_gamma=min(AdaptiveGamma.start_gamma, spec.max_gamma))
        else:
            self.policy = FixedGamma(spec.gamma)
        self.planner = TreePolicy(self.policy, spec.tree, max_nodes=spec.max_tree_nodes)
        # Per-token α of this session's chains, for ranking a round's outcomes (continuations): the
        # rule the verifier and AdaptiveGamma use (spec_core.estimates.Acceptance).
        self.acceptance = Acceptance()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.committed = list(prompt_ids)
        self.prompt_len = len(self.committed)
        self.session_id, self.last_round = "", 0
        self.replays_in_a_row, self.replayed_at = 0, -1   # for max_replays (_replay_after)
        self.gammas: list[int] = []
        self.nodes_sent = 0
        self.t0 = clock.now()
        self.pieces: list[str] = []
        self.finished = False
        self.final: pb.VerifyReply | None = None  # the last reply applied: its finish reason is the generation's
        self.stop_ids = frozenset(settings.stop_token_ids) | (frozenset() if settings.ignore_eos else pairing.hidden_ids)
        self.drafts = RoundDrafts(self.drafter, spec, settings, self.planner, self.acceptance, self.stop_ids)
        self.window = window_mod.Window()
        self.shaper = ShapePlanner(spec, self.planner, self.window)
        if spec.plan_inputs is not None:
            self.drafts.fixed_lengths = True   # a continuation keeps a fresh round's plan: a seed pins the output
        self.ahead: list[Guess] = []   # drafted during the last round trip for its outcomes, not sent
        self.reused = False            # the next round's draft came from `ahead`
        self.view0 = self.drafter.retokenization()   # across tokenizers: the draft view's counters so far
        self.uplink = UplinkFit()  # the uplink's time per request byte, for the continuations' cost
        # Rounds after the first on one VerifyStream call when the verifier offers it (edge_client.stream).
        info = self.verifier.known_info() if self.verifier is not None else None
        self.stream = RoundStream(self.verifier.stub, self.verifier.metadata, link.transport.deadline_s) \
            if info is not None and info.verify_stream and link.transport.stream else None

    def _send(self, req: pb.VerifyRequest):
        if not req.session_id:
            return self._open(req)
        if self.stream is None:
            return self.verifier.verify(req, self.st)
        self.stream.follow(self.verifier.stub)   # the replica the session was (re)opened on
        return verify_on_stream(self.verifier, self.stream, req, self.st)

    async def _open(self, req: pb.VerifyRequest) -> pb.VerifyReply:
        if self.st.replays and self.settings.coupling != REJECTION:
            # A replay may reach another verifier than the one negotiated with (a restart, a replica
            # move): its ServerInfo is asked again before the open (Verifier.verify refuses one that
            # does not list the coupling). One call per replay, with a coupling other than the default.
            self.verifier.forget_limits()
        return await self.verifier.open_round(req, self.st)

    def _remaining(self, base: Sequence[int]) -> int:
        return self.settings.max_new_tokens - (len(base) - self.prompt_len)

    # --- one step: fill the window, take the oldest reply -----------------------------------------

    async def step(self) -> str:
        """Send a round when none that can run is in flight, keep the window filled while the oldest
        travels, then commit the oldest round's reply: its text."""
        if not self.window.live() and not self.window.occupied(self.last_round + 1):
            remaining = self._remaining(self.committed)
            prep = await self._next_draft(remaining)
            fused = await self._fused_continuations(prep, remaining)
            self._send_round(self.last_round + 1, [Guess([], prep)], pipelined=False, fused=fused)
        await self._fill()
        return await self._take_head()

    def _depth(self) -> int:
        return self.shaper.depth(self.uplink.seconds_per_byte())

    async def _next_draft(self, remaining: int) -> Prepared:
        ahead, self.ahead = self.ahead, []
        for guess in ahead:
            if guess.prep.base == self.committed:   # the round trip's guess came true: this draft is ready
                self.st.continuation_hits += 1
                self.st.reused_drafts += len(guess.prep.tree)
                self.reused = True
                return guess.prep
        self.reused = False
        return await self.link.run_drafting(self.drafts.prepare, list(self.committed), self.planner.plan(remaining))

    async def _fill(self) -> None:
        """While the oldest round travels: draft the next round for the likely outcomes of the last one
        in flight; send it before the reply (pipelined) while the window has room, else keep it for
        when the reply comes (drafted ahead). Drafting stops when the oldest reply is in."""
        flights = self.window.flights
        while (self.spec.proactive or self.spec.pipeline) and self.session_id and flights and not flights[0].task.done():
            last = flights[-1]
            if not last.live or last.fused or self.window.occupied(last.round + 1):
                return   # a fused round's next round rides with it
            live, depth = self.window.live(), self._depth()
            if live >= depth and (live > 1 or self.spec.window > 1 and not self.spec.proactive):
                return   # the window is full; drafting ahead (not sent) is for the oldest round's outcomes only
            # Build on the most likely of `last`'s alternatives that can still run: once the rounds
            # before it are answered that is the one the verifier will run.
            after = next((g for g in last.guesses if extends(g.prep.base, self.committed)), None)
            if after is None or not len(after.prep.tree):
                return
            stop = threading.Event()   # the oldest reply is here: stop drafting, use it first
            flights[0].task.add_done_callback(lambda _: stop.set())
            t0 = clock.now()
            guesses = await self.link.run_drafting(
                self.drafts.continuations, after.prep, self._remaining(after.prep.base),
                self.drafts.budget(after.prep, t0, self.uplink.seconds_per_byte(), live + 1 if live < depth else 1),
                stop, thread=True)
            self.window.draft_s.observe(clock.now() - t0)
            if not guesses:
                return
            if live < depth and not last.task.done():
                # Sent even when an older reply came in meanwhile: its keys count from what the edge
                # had committed, which the verifier checks, and the drafting is done.
                self.window.depths.append(live + 1)
                self._send_round(last.round + 1, guesses, pipelined=True)
                continue
            self.st.continuation_rounds += 1
            self.ahead = guesses   # for the next round, if the reply commits what one assumes
            return

    async def _fused_continuations(self, prep: Prepared, remaining: int) -> list[Guess]:
        """With `fuse` (or when the planner fuses this round): continuations for this round's likely outcomes, drafted before it leaves, as
        many as pay (edge_client.continuations.FusedBudget); none until the round trip is measured."""
        if not (self.session_id and len(prep.tree)) or self.planner.rtt_s is None or \
                not self.shaper.fuse(len(prep.tree), self.st.fused_rounds, self.st.fused_hits):
            return []
        budget = self.drafts.fused_budget(prep, self.uplink.seconds_per_byte())
        fused = await self.link.run_drafting(self.drafts.continuations, prep, remaining, budget, threading.Event())
        self.st.fused_rounds += bool(fused)
        self.st.continuations_sent += len(fused)
        return fused

    def _send_round(self, round_: int, guesses: list[Guess], pipelined: bool, fused: Sequence[Guess] = ()) -> None:
        base_len = len(self.committed)
        # A key counts from the committed sequence, so each alternative must have been drafted after
        # it: a key cut from another prefix could match the verifier's tokens while the draft was made
        # after different ones (not exact). Alternatives that do not extend it cannot run: dropped.
        guesses = [g for g in guesses if extends(g.prep.base, self.committed)]
        if not guesses:
            return
        own = guesses[0]
        req = self._request(own.prep, round_, assumed=own.prep.base[base_len:] if pipelined else ())
        for g in guesses[1:]:
            cont = self.drafts.continuation(g)
            del cont.assumed_tokens[:]
            cont.assumed_tokens.extend(g.prep.base[base_len:])
            req.continuations.append(cont)
        req.next_continuations.extend(self.drafts.continuation(g) for g in fused)
        self.shaper.record(own.prep.plan, "pipelined" if pipelined else "fused" if fused else
                           "ahead" if self.reused else "alone")
        if pipelined:
            self.window.sent += 1
            self.st.continuations_sent += len(guesses)
            self.st.continuation_rounds += 1
        # Retried like any round: a lost reply is answered from the server's cache.
        task = asyncio.ensure_future(self._send(req))
        self.window.add(Flight(round_, guesses, base_len, task, clock.now(), req.ByteSize(),
                               pipelined=pipelined, fused=list(fused)))

    async def _take_head(self) -> str:
        """The oldest round's reply: commit it (or discard it), and doom what followed a miss."""
        w = self.window
        head = w.flights[0]
        try:
            reply = await head.task
        except EdgeError as e:
            w.flights.pop(0)
            if head.pipelined:
                # Not committed (an error commits nothing): as a miss; what followed it cannot run.
                w.doom_after(head.round)
                self.st.discarded_rounds += 1
                return ""
            await w.cancel_all()
            self.ahead = []
            if not self._replay_after(e):
                raise
            return ""
        w.flights.pop(0)
        round_s = clock.now() - head.t_sent
        self.uplink.observe(head.req_bytes, round_s - reply.timings.total_ms / 1e3)
        if reply.base_mismatch:
            self.st.discarded_rounds += 1
            w.doom_after(head.round)
            if reply.finish_reason != pb.NOT_FINISHED:
                w.abandon()
            return ""
        if reply.continuation >= len(head.guesses):
            raise EdgeError(grpc.StatusCode.INTERNAL, f"the verifier ran alternative {reply.continuation} of round "
                                                      f"{head.round}, which had {len(head.guesses)}")
        guess = head.guesses[reply.continuation]
        if self.committed != guess.prep.base:
            raise EdgeError(grpc.StatusCode.INTERNAL, f"the verifier ran round {head.round} on a base the edge "
                                                      "did not commit")
        if head.pipelined:
            w.ran += 1
            self.st.pipelined_rounds += 1
            self.st.continuation_hits += 1
        if self.session_id:   # a round that opened the session: its pass held the prompt too
            w.verify_s.observe((reply.timings.model_ms + reply.timings.queue_ms) / 1e3)
        shared = pass_nodes(guess.prep, head.fused)
        new = self._commit(guess.prep, reply, round_s, shared)
        if head.fused and reply.HasField("next_round") and not self.finished:
            new += self._commit_fused(head.fused, reply.next_round, round_s, shared)
        if self.finished:
            w.abandon()
        else:
            w.recheck(self.committed)
        return self._text(new)

    def _commit_fused(self, fused: list[Guess], nxt: pb.VerifyReply, round_s: float, shared: int) -> list[int]:
        """Round r + 1, answered with round r (its continuation ran in round r's pass)."""
        i = nxt.continuation - 1
        if not 0 <= i < len(fused) or fused[i].prep.base != self.committed:
            raise EdgeError(grpc.StatusCode.INTERNAL, f"the verifier answered round {nxt.round} with continuation "
                                                      f"{nxt.continuation}, not one drafted for what it committed")
        self.st.continuation_hits += 1
        self.st.fused_hits += 1
        new = self._commit(fused[i].prep, nxt, round_s, shared)
        self.st.server_model_s -= nxt.timings.model_ms / 1e3   # the pass it shared with round r, counted once
        return new

    def _replay_after(self, e: EdgeError) -> bool:
        """Whether to replay the committed tokens in a new session: the verifier lost ours (NOT_FOUND:
        a restart, an eviction, a draining verifier's "moved") or is out of step with it
        (FAILED_PRECONDITION). A first round (it carries `open`) answered NOT_FOUND opened a session
        that was evicted before its round ran: it is sent again, as a replay; FAILED_PRECONDITION
        there is a refusal (e.g. the tokenizer) that replaying cannot fix. The replay is the next
        round with `open`: the prompt, the committed tokens and that round's draft, nothing more.
        `max_replays` bounds replays in a row with nothing committed between them (a verifier that
        keeps losing the session), not a long generation's restarts and drains."""
        lost = e.code == grpc.StatusCode.NOT_FOUND or (
            e.code == grpc.StatusCode.FAILED_PRECONDITION and bool(self.session_id))
        if len(self.committed) != self.replayed_at:
            self.replays_in_a_row = 0   # the last replay got somewhere
        if lost and self.replays_in_a_row < self.link.transport.max_replays:
            log.warning("replaying %d committed tokens: %s", len(self.committed) - self.prompt_len, e)
            self.st.replays += 1
            self.replays_in_a_row += 1
            self.replayed_at = len(self.committed)
            self.session_id, self.last_round = "", 0
            if self.stream is not None:
                self.stream.reset()   # the new session's rounds go on a new call, to where it opens
            return True
        return False

    def _text(self, new: list[int]) -> str:
        """The text of newly committed tokens (special tokens hidden; UTF-8 split across tokens kept
        until complete)."""
        st, pairing = self.st, self.pairing
        if new and not st.ttft_s:
            st.ttft_s = clock.now() - self.t0
        if self.finished:
            st.finish_reason = pb.FinishReason.Name(self.final.finish_reason).lower()
        piece = self.decoder.decode(b"".join(pairing.tokenizer.token_bytes(t) for t in new
                                             if t not in pairing.hidden_ids))
        if self.finished:
            piece += self.decoder.decode(b"", final=True)
        if piece:
            self.pieces.append(piece)
        return piece

    def _request(self, prep: Prepared, round_: int, assumed: Sequence[int] = ()) -> pb.VerifyRequest:
        req = pb.VerifyRequest(session_id=self.session_id, round=round_, committed_length=len(prep.base),
                               draft_token_ids=prep.tree.tokens, draft_parents=prep.wire_parents(),
                               q=qpayload.to_proto(prep.qs, self.spec.qmode.scale_bits),
                               assumed_tokens=list(assumed))
        if not self.session_id:
            req.open.CopyFrom(pb.OpenSession(
                prompt_token_ids=self.prompt_ids, resume_token_ids=prep.base[self.prompt_len:],
                sampling=sampling_proto(self.settings), tokenizer_fingerprint=self.drafter.fingerprint or "",
                open_key=os.urandom(OPEN_KEY_BYTES), draft_tokenizer_fingerprint=self.pairing.draft_fingerprint))
            if self.spec.slo_tpot_ms or self.spec.slo_ttft_ms:
                req.open.slo.CopyFrom(pb.SessionSlo(tpot_ms=self.spec.slo_tpot_ms, ttft_ms=self.spec.slo_ttft_ms))
            if not self.prompt_ids and self.plan.text_open is not None:
                req.open.MergeFrom(self.plan.text_open)   # committed_length counts what follows the prompt
        return req

    # --- the one commit -------------------------------------------------------------------------

    def _commit(self, prep: Prepared, reply: pb.VerifyReply, round_s: float, shared_nodes: int = 0) -> list[int]:
        """Commit a reply's tokens (checked against the server's view), count the round, and teach γ,
        the tree planner and the drafter what it cost and kept; the generation is finished when the
        reply says so. shared_nodes: the nodes its target pass held when more than its own (fused)."""
        kept = prep.kept_path(reply)
        new = [prep.tree.tokens[i] for i in kept] + ([reply.next_token_id] if reply.HasField("next_token_id") else [])
        if not self.prompt_ids and reply.prompt_token_ids:
            self._prompt_known(list(reply.prompt_token_ids))
        self.committed.extend(new)
        if reply.committed_length != len(self.committed):
            raise EdgeError(grpc.StatusCode.INTERNAL, f"server committed {reply.committed_length} tokens, "
                                                      f"the edge {len(self.committed)}")
        opened = not self.session_id   # this round opened the session: its pass held the prompt too
        self.session_id, self.last_round = reply.session_id, reply.round
        self._learn(prep, reply, kept, round_s, len(new), shared_nodes, opened)
        self.final = reply
        self.finished = reply.finish_reason != pb.NOT_FINISHED
        return new

    def _prompt_known(self, ids: list[int]) -> None:
        """A text open's reply: the target's prompt ids become the committed prefix (replays send them)."""
        self.prompt_ids = ids
        self.committed[:0] = ids
        self.prompt_len = len(ids)
        self.drafter.anchor_prompt(ids, self.plan.draft_ids)

    def _learn(self, prep: Prepared, reply: pb.VerifyReply, kept: list[int], round_s: float, n_new: int,
               shared_nodes: int, opened: bool = False) -> None:
        st, tree = self.st, prep.tree
        st.rounds += 1
        st.drafted += len(tree)
        st.accepted += reply.num_accepted
        depth = max(tree.depths(), default=0)
        # Rejected: the verifier drew the next token where a draft was still on offer (the last
        # kept node, or the root, has children); else it was the bonus, after a leaf.
        rejected = reply.HasField("next_token_id") and bool(tree.children()[kept[-1] if kept else ROOT])
        st.rejections += rejected
        st.draft_s += prep.seconds
        st.server_model_s += reply.timings.model_ms / 1e3
        self.nodes_sent += len(tree)
        st.tree_rounds += not tree.is_chain
        self.gammas.append(depth)
        server_s, model_s = reply.timings.total_ms / 1e3, reply.timings.model_ms / 1e3
        fit_s = None if opened else model_s   # the verifier's line is fitted over rounds without a prompt
        if tree.is_chain:  # the chain's α and γ model; a tree round's acceptance is not geometric
            self.acceptance.observe(len(tree), reply.num_accepted, rejected)
            self.policy.observe(gamma=len(tree), num_accepted=reply.num_accepted, draft_s=prep.seconds,
                                round_s=round_s, server_s=server_s, model_s=fit_s, rejected=rejected)
        # The verifier's time is fitted over the nodes its pass held (a fused pass: all of them).
        self.planner.observe(prep.plan, nodes=max(len(tree), shared_nodes), rows=prep.rows, tokens=n_new,
                             draft_s=prep.seconds, round_s=round_s, server_s=server_s, model_s=fit_s)
        self.drafter.observe(self.committed, reply.num_accepted)
        if reply.HasField("budget") and self.spec.steer and self.spec.gamma == ADAPTIVE:
            self.planner.steer(reply.budget.max_gamma, reply.budget.max_tree_nodes)
        if self.link.on_round is not None:
            self.link.on_round(RoundEvent(gamma=depth, accepted=reply.num_accepted, tokens=n_new,
                                          draft_s=prep.seconds, rpc_s=round_s, server_s=server_s))

    # --- the end --------------------------------------------------------------------------------

    async def close(self) -> None:
        """Settle background work, complete the stats, and close the session if it is unfinished."""
        # Not awaited: a cancelled caller must still reach the session's Close below.
        for f in self.window.flights:
            f.task.cancel()
        self.window.flights.clear()
        self._complete_stats()
        try:
            # A finished session needs no Close: the server frees its KV cache when generation ends.
            # One left early (the caller stopped reading, was cancelled, or a round failed) is closed
            # now; shielded, so a cancelled caller still sends it.
            if self.session_id and not self.finished:
                await asyncio.shield(self.verifier.close_session(self.session_id))
        finally:
            if self.stream is not None:   # after the Close: ending the stream may wait for the verifier
                await self.stream.close()

    def _complete_stats(self) -> None:
        st = self.st
        st.wall_s = clock.now() - self.t0
        st.text = "".join(self.pieces)
        st.token_ids = self.committed[self.prompt_len:]
        st.tokens = len(st.token_ids)
        st.acceptance_rate = st.accepted / st.drafted if st.drafted else 0.0
        st.alpha = st.accepted / (st.accepted + st.rejections) if st.accepted + st.rejections else 0.0
        st.tokens_per_round = st.tokens / st.rounds if st.rounds else 0.0
        st.mean_gamma = sum(self.gammas) / len(self.gammas) if self.gammas else 0.0
        st.gamma = self.policy.describe()
        st.nodes_per_round = self.nodes_sent / st.rounds if st.rounds else 0.0
        st.plans = self.planner.describe()
        st.expected_tokens_per_round = expected_tokens_per_round(st.alpha, round(st.mean_gamma))
        st.tokens_per_s = st.tokens / st.wall_s if st.wall_s else 0.0
        if self.spec.window > 1:
            st.window_depth = self.window.mean_depth()
        st.shapes, st.planned = self.shaper.describe(), list(self.spec.planned)
        view = self.drafter.retokenization()
        if view is not None and self.view0 is not None:
            st.draft_rolled_back = view.rolled_back - self.view0.rolled_back
            st.draft_retokenized = view.retokenized - self.view0.retokenized

