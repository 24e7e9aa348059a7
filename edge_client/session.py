"""One generation's session loop: draft, send, commit what the verifier kept, learn; with rounds
in flight (proactive drafting, pipelined rounds, continuations) and replay when the verifier lost
the session. `Generation` is what EdgeClient.generate returns."""
from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, NamedTuple, Sequence

import grpc
import numpy as np

from edge_client.continuations import ContinuationBudget, FusedBudget, UplinkFit, choose_length, ranked_outcomes
from edge_client.crossvocab import Chat, PromptPlan
from edge_client.gamma import AdaptiveGamma, FixedGamma, RoundPlan, TreePolicy
from edge_client.options import ADAPTIVE, Speculation
from edge_client.pairing import Pairing, plan_prompt
from edge_client.protocols import GammaPolicy
from edge_client.stats import GenerationStats, RoundEvent
from edge_client.stream import RoundStream, verify_on_stream
from edge_client.transport import EdgeError, sampling_proto
from spec_core import qcodec
from spec_core.continuations import MAX_CONTINUATION_NODES, MAX_CONTINUATIONS, Outcome
from spec_core.wire import OPEN_KEY_BYTES
from spec_core.costmodel import expected_tokens_per_round
from spec_core.drafting import QMode
from spec_core.estimates import Acceptance
from spec_core.proto import qpayload
from spec_core.proto import verifier_pb2 as pb
from spec_core.qcodec import EncodedQ
from spec_core.tree import ROOT, DraftTree
from spec_core.warping import EDGE_STREAM, SamplingSettings, seeded_rng

if TYPE_CHECKING:
    from edge_client.client import EdgeClient

log = logging.getLogger(__name__)


class Generation:
    """Async iterator of text pieces as they are committed; `stats` is complete at the end,
    also when the caller stops early (`aclose()`, cancellation): then the verifier's session is
    closed, so it does not hold a KV cache until its idle TTL."""

    def __init__(self, client: "EdgeClient", prompt: "str | Chat | Sequence[int]", settings: SamplingSettings):
        self._client, self._prompt, self.settings = client, prompt, settings
        self.prompt_ids = None if isinstance(prompt, (str, Chat)) else list(prompt)  # the target's, once known
        self.stats = GenerationStats()
        self._it = self._run()

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        return await self._it.__anext__()

    async def text(self) -> str:
        return "".join([p async for p in self])

    async def aclose(self) -> None:
        """Stop generating; an unfinished session is closed on the verifier."""
        await self._it.aclose()

    async def _run(self) -> AsyncIterator[str]:
        client = self._client
        spec = await client._speculation(self.stats)  # within the verifier's limits
        pairing = await client._pair(self.stats)      # decided once per client, before its first round
        plan = await plan_prompt(pairing, self._prompt, client._in_drafter)
        loop_class = _SessionLoop
        if spec.window > 1:
            from edge_client.window import WindowLoop   # it builds on this module's loop
            loop_class = WindowLoop
        loop = loop_class(client, spec, plan.ids, self.settings, self.stats, pairing, plan)
        try:
            while not loop.finished:
                piece = await loop.step()
                if piece:
                    yield piece
        except EdgeError as e:
            if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after_s is None:
                self._client._forget_server_limits()  # a verifier restarted with other limits: ask again
            raise
        finally:
            self.prompt_ids = loop.prompt_ids or self.prompt_ids   # a text open's: from the verifier
            await loop.close()


class _Guess(NamedTuple):
    """A continuation: one likely outcome of a round in flight, and the draft made after it."""

    tokens: list[int]       # what it assumes the round commits (kept drafts + corrected or bonus token)
    prep: "_Prepared"       # the next round's draft, for base = this round's base + tokens


class _SessionLoop:
    """One generation's rounds on one verifier session: draft, send, commit what the verifier
    kept, learn. While a round is in flight it may draft the next round from the most likely
    outcome (proactive) and send it before the reply (pipeline); `ahead` holds such a draft for
    the next round, kept only if its base comes true."""

    def __init__(self, client: "EdgeClient", spec: Speculation, prompt_ids: list[int], settings: SamplingSettings,
                 stats: GenerationStats, pairing: Pairing, plan: PromptPlan | None = None):
        self.c, self.spec, self.settings, self.st = client, spec, settings, stats
        self.pairing, self.drafter, self.verifier = pairing, pairing.drafter, client.verifier
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
        self.rng = seeded_rng(settings.seed, EDGE_STREAM)  # never the verifier's stream (see warping)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.committed = list(prompt_ids)
        self.prompt_len = len(self.committed)
        self.session_id, self.last_round = "", 0
        self.replays_in_a_row, self.replayed_at = 0, -1   # for max_replays (_replay_after)
        self.gammas: list[int] = []
        self.nodes_sent = 0
        self.t0 = time.perf_counter()
        self.pieces: list[str] = []
        self.finished = False
        self.final: pb.VerifyReply | None = None  # the last reply applied: its finish reason is the generation's
        self.stop_ids = frozenset(settings.stop_token_ids) | (frozenset() if settings.ignore_eos else pairing.hidden_ids)
        self.ahead: _Prepared | None = None  # drafted during the last round trip, for a guessed base
        self.ahead_job: asyncio.Future | None = None  # drafting `ahead` during the round trip
        self.spec_task: asyncio.Future | None = None  # the pipelined round, sent before the reply
        self.view0 = self.drafter.retokenization()   # across tokenizers: the draft view's counters so far
        self.uplink = UplinkFit()  # the uplink's time per request byte, for the continuations' cost
        # Rounds after the first on one VerifyStream call when the verifier offers it (edge_client.stream).
        info = self.verifier.known_info() if self.verifier is not None else None
        self.stream = RoundStream(self.verifier.stub, self.verifier.metadata, client.transport.deadline_s) \
            if info is not None and info.verify_stream and client.transport.stream else None

    def _send(self, req: pb.VerifyRequest):
        """A round's reply, retried and waited out as every call is (Verifier.call): the round that
        opens a session as unary Verify (a cancelled open is closed there), later rounds on the stream
        when there is one."""
        if not req.session_id:
            return self.verifier.open_round(req, self.st)
        if self.stream is None:
            return self.verifier.verify(req, self.st)
        self.stream.follow(self.verifier.stub)   # the replica the session was (re)opened on
        return verify_on_stream(self.verifier, self.stream, req, self.st)

    # --- one round ----------------------------------------------------------------------------

    async def step(self) -> str:
        """One round (and the pipelined one after it, when its base came true): its text."""
        remaining = self.settings.max_new_tokens - (len(self.committed) - self.prompt_len)
        prep = await self._next_draft(remaining)
        fused = await self._fused_continuations(prep, remaining)
        req = self._request(prep, self.last_round + 1)
        req.next_continuations.extend(self._continuation(g) for g in fused)
        t_round = time.perf_counter()
        reply_task = asyncio.ensure_future(self._send(req))
        self.ahead_job = self.spec_task = None
        if not fused:   # a fused round's next round rides with it: nothing to draft during the trip
            await self._work_during_round_trip(prep, remaining, reply_task, req.round)
        try:
            reply = await reply_task
        except EdgeError as e:
            await _settle(self.ahead_job, self.spec_task)
            self.st.discarded_rounds += self.spec_task is not None
            if not self._replay_after(e):
                raise
            return ""
        round_s = time.perf_counter() - t_round
        guesses = await self.ahead_job if self.ahead_job is not None else []  # the drafter is free again
        self.st.continuation_rounds += bool(guesses)
        self.uplink.observe(req.ByteSize(), round_s - reply.timings.total_ms / 1e3)
        new = self._apply(prep, reply, round_s, _pass_nodes(prep, fused))
        self.final = reply
        self.finished = reply.finish_reason != pb.NOT_FINISHED
        if fused and reply.HasField("next_round") and not self.finished:
            new += self._use_fused(fused, reply.next_round, round_s, _pass_nodes(prep, fused))
        elif guesses and not self.finished:
            new += await self._use_guess(guesses, t_round)
        elif self.spec_task is not None:
            await _settle(None, self.spec_task)
            self.st.discarded_rounds += 1
        return self._text(new)

    async def _next_draft(self, remaining: int) -> "_Prepared":
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.base == self.committed:
            self.st.reused_drafts += len(ahead.tree)
            return ahead  # the round trip's guess came true: this draft is ready
        return await self.c._in_drafter(self._prepare, list(self.committed), self.planner.plan(remaining))

    async def _work_during_round_trip(self, prep: "_Prepared", remaining: int, reply_task: asyncio.Future,
                                      round_: int) -> None:
        """Draft continuations, next rounds for this one's likely outcomes (proactive), and send them
        as one round before the reply when they are ready first (pipeline): alternative 0 in the
        request's own fields, the others in `continuations`."""
        if not ((self.spec.proactive or self.spec.pipeline) and self.session_id and len(prep.tree)):
            return
        stop = threading.Event()  # the reply is here: stop drafting for outcomes, one is known
        reply_task.add_done_callback(lambda _: stop.set())
        self.ahead_job = asyncio.ensure_future(self.c._in_drafter(
            self._draft_continuations, prep, remaining, self._budget(prep, time.perf_counter()), stop, thread=True))
        if not self.spec.pipeline:
            return
        done, _ = await asyncio.wait({reply_task, self.ahead_job}, return_when=asyncio.FIRST_COMPLETED)
        if self.ahead_job in done and not reply_task.done() and self.ahead_job.result():
            guesses = self.ahead_job.result()
            spec_req = self._request(guesses[0].prep, round_ + 1, assumed=guesses[0].tokens)
            spec_req.continuations.extend(self._continuation(g) for g in guesses[1:])
            self.st.continuations_sent += len(guesses)
            # Retried like any round: a lost reply is answered from the server's cache.
            self.spec_task = asyncio.ensure_future(self._send(spec_req))

    async def _fused_continuations(self, prep: "_Prepared", remaining: int) -> list[_Guess]:
        """With `fuse`: continuations for this round's likely outcomes, drafted before it leaves, as
        many as pay (edge_client.continuations.FusedBudget); none until the round trip is measured."""
        pl = self.planner
        if not (self.spec.fuse and self.session_id and len(prep.tree)) or pl.rtt_s is None:
            return []
        per_node = max(pl.verify_line()[1], 0.0)
        budget = FusedBudget(pl.predicted_round_s(prep.plan), self.uplink.seconds_per_byte(),
                             per_node / pl.t_row_s if pl.t_row_s else 0.0)
        fused = await self.c._in_drafter(self._draft_continuations, prep, remaining, budget, threading.Event())
        self.st.fused_rounds += bool(fused)
        self.st.continuations_sent += len(fused)
        return fused

    def _use_fused(self, fused: list[_Guess], nxt: pb.VerifyReply, round_s: float, pass_nodes: int) -> list[int]:
        """Commit round r + 1, answered with round r (its continuation ran in round r's pass)."""
        i = nxt.continuation - 1
        if not 0 <= i < len(fused) or fused[i].prep.base != self.committed:
            raise EdgeError(grpc.StatusCode.INTERNAL, f"the verifier answered round {nxt.round} with continuation "
                                                      f"{nxt.continuation}, not one drafted for what it committed")
        new = self._apply(fused[i].prep, nxt, round_s, pass_nodes)
        self.st.server_model_s -= nxt.timings.model_ms / 1e3   # the pass it shared with round r, counted once
        self.st.continuation_hits += 1
        self.st.fused_hits += 1
        self.final = nxt
        self.finished = nxt.finish_reason != pb.NOT_FINISHED
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
        if lost and self.replays_in_a_row < self.c.transport.max_replays:
            log.warning("replaying %d committed tokens: %s", len(self.committed) - self.prompt_len, e)
            self.st.replays += 1
            self.replays_in_a_row += 1
            self.replayed_at = len(self.committed)
            self.session_id, self.last_round = "", 0
            if self.stream is not None:
                self.stream.reset()   # the new session's rounds go on a new call, to where it opens
            return True
        return False

    async def _use_guess(self, guesses: list[_Guess], t_round: float) -> list[int]:
        """After a reply: commit the pipelined round if one alternative's base came true (its tokens),
        or keep the continuation drafted for what was committed for the next round."""
        if self.spec_task is None:
            for guess in guesses:
                if self.committed == guess.prep.base:
                    self.ahead = guess.prep
                    self.st.continuation_hits += 1
                    break
            return []
        spec_reply = await _settle(None, self.spec_task)
        guess = guesses[spec_reply.continuation] if spec_reply is not None and not spec_reply.base_mismatch \
            and spec_reply.continuation < len(guesses) else None
        if guess is not None and self.committed == guess.prep.base:
            new = self._apply(guess.prep, spec_reply, time.perf_counter() - t_round)
            self.st.pipelined_rounds += 1
            self.st.continuation_hits += 1
            self.final = spec_reply
            self.finished = spec_reply.finish_reason != pb.NOT_FINISHED
            return new
        self.st.discarded_rounds += 1
        return []

    def _text(self, new: list[int]) -> str:
        """The text of newly committed tokens (special tokens hidden; UTF-8 split across tokens kept
        until complete)."""
        st, pairing = self.st, self.pairing
        if new and not st.ttft_s:
            st.ttft_s = time.perf_counter() - self.t0
        if self.finished:
            st.finish_reason = pb.FinishReason.Name(self.final.finish_reason).lower()
        piece = self.decoder.decode(b"".join(pairing.tokenizer.token_bytes(t) for t in new
                                             if t not in pairing.hidden_ids))
        if self.finished:
            piece += self.decoder.decode(b"", final=True)
        if piece:
            self.pieces.append(piece)
        return piece

    # --- drafts and requests --------------------------------------------------------------------

    def _base_rng(self, base: list[int]) -> np.random.Generator:
        # With a user seed, a round's draft depends only on the committed tokens (a stream per
        # committed length, like the verifier's): a round redone after a replay drafts the same.
        seed = self.settings.seed
        return self.rng if seed is None else seeded_rng(seed, EDGE_STREAM, len(base))

    def _prepare(self, base: list[int], plan: RoundPlan) -> "_Prepared":
        """Draft the planned chain or tree after `base` (in the drafting executor while a round is in
        flight); either way the round's draft is a tree (a chain: one path)."""
        drafter, rng = self.drafter, self._base_rng(base)
        if plan.shape is None:
            d = drafter.propose(base, plan.gamma, self.settings, self.spec.qmode, rng)
            return _Prepared(base, plan, DraftTree.chain(d.tokens), d.qs, d.seconds, len(d.tokens))
        d = drafter.propose_tree(base, plan.shape, self.settings, self.spec.qmode, rng)
        return _Prepared(base, plan, DraftTree(tuple(d.tokens), tuple(d.parents)), d.qs, d.seconds, d.rows,
                         d.path_probs)

    def _budget(self, prep: "_Prepared", now: float) -> ContinuationBudget:
        """When the reply is expected and what a hit saves, from the planner's measured costs."""
        pl = self.planner
        draft_s = prep.rows * (pl.t_row_s or 0.0)
        return ContinuationBudget(t_reply=now + max(0.0, pl.predicted_round_s(prep.plan) - draft_s),
                                  rtt_s=pl.rtt_s or 0.0, fresh_draft_s=draft_s,
                                  s_per_byte=self.uplink.seconds_per_byte())

    def _draft_continuations(self, prep: "_Prepared", remaining: int, budget: ContinuationBudget | FusedBudget,
                             stop: threading.Event) -> list[_Guess]:
        """Continuations for the round's likely outcomes, most probable first, while one more pays
        (edge_client.continuations) and the reply is not in. Empty when the round may end generation.
        With max_continuations 1: the one guess that every draft is accepted, then the draft's argmax."""
        path = prep.guess_path()
        if not path or len(path) + 1 >= remaining or self.stop_ids & set(path):
            return []
        # Planned for the shortest outcome (a rejection at the first draft), cut per outcome below.
        plan = self.planner.plan(remaining - 1)
        out: list[_Guess] = []
        covered, spent, nodes, nbytes = 0.0, [prep.seconds], 0, self._request(prep, 0).q.ByteSize()
        outcomes = self._outcomes(prep, path)
        if (self.spec.pipeline or budget.check_first) and plan.shape is None and len(outcomes) > 1 and plan.gamma > 1:
            # How long: as many outcomes covered as pay, times what a hit commits (edge_client.continuations).
            t_row = self.planner.t_row_s or prep.seconds / max(prep.rows, 1)
            gamma = choose_length(outcomes, self._alpha(), plan.gamma, t_row, nbytes / max(len(prep.tree), 1),
                                  budget, time.perf_counter())
            plan = RoundPlan(plan.arm, gamma)
            spent = [(gamma + 1) * t_row]
        for outcome in outcomes:
            if out and stop.is_set() or len(out) > MAX_CONTINUATIONS:  # the first is drafted in any case
                break
            tokens = list(outcome.tokens)
            if self.stop_ids & set(tokens) or len(tokens) + 1 >= remaining:
                continue
            if (out or budget.check_first) and (self.spec.pipeline or budget.check_first) and \
                    not budget.worth(outcome.prob, covered, time.perf_counter(), sum(spent) / len(spent), nbytes):
                break
            t0 = time.perf_counter()
            nxt = self._prepare(prep.base + tokens, plan.within(remaining - len(tokens)))
            spent.append(time.perf_counter() - t0)
            if out:
                nodes += len(nxt.tree)
                if nodes > MAX_CONTINUATION_NODES:
                    break
            if len(nxt.tree):
                out.append(_Guess(tokens, nxt))
                covered += outcome.prob
                nbytes = self._continuation(out[-1]).ByteSize()
        return out

    def _outcomes(self, prep: "_Prepared", path: list[int]) -> list[Outcome]:
        """The round's outcomes ranked by the draft's estimate (spec_core.continuations), at most
        max_continuations of them."""
        drafter, after = self.drafter, prep.base + path
        if self.spec.max_continuations <= 1:
            bonus = drafter.propose(after, 1, GREEDY, QMode("none"), self._base_rng(after)).tokens
            return [Outcome(tuple(path + bonus), 1.0)] if bonus else []
        # The draft's distribution where the verifier draws a token (greedy sessions rank by T = 1).
        est = self.settings if not self.settings.greedy else SamplingSettings(temperature=1.0)

        def probe(seq: list[int]):
            qs = drafter.propose(seq, 1, est, QMode("float", 16), np.random.default_rng(0)).qs
            return qs[0] if qs else None
        nodes, tree, shipped = prep.guess_nodes(), prep.tree, prep.qs
        # Position j's other candidates: the siblings of the path's node there (none in a chain).
        children = tree.children()
        siblings = [[tree.tokens[c] for c in children[tree.parents[n]] if c != n] for n in nodes]
        position_q = (lambda j: shipped[nodes[j]]) if shipped is not None else (lambda j: probe(prep.base + path[:j]))
        return ranked_outcomes(path, self._alpha(), position_q, probe(after), self.spec.max_continuations,
                               excluded=lambda j: siblings[j])

    def _alpha(self) -> float:
        """The per-token acceptance estimate of this session's chains so far."""
        return self.acceptance.alpha

    def _continuation(self, guess: _Guess) -> pb.Continuation:
        p = guess.prep
        return pb.Continuation(assumed_tokens=guess.tokens, draft_token_ids=p.tree.tokens, draft_parents=p.wire_parents(),
                               q=qpayload.to_proto(p.qs, self.spec.qmode.scale_bits))

    def _request(self, prep: "_Prepared", round_: int, assumed: Sequence[int] = ()) -> pb.VerifyRequest:
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

    # --- replies --------------------------------------------------------------------------------

    def _apply(self, prep: "_Prepared", reply: pb.VerifyReply, round_s: float, pass_nodes: int = 0) -> list[int]:
        """Commit a reply's tokens (checked against the server's view) and learn from the round.
        pass_nodes: the nodes its target pass held when more than its own (a fused round's)."""
        kept = prep.kept_path(reply)
        new = [prep.tree.tokens[i] for i in kept] + ([reply.next_token_id] if reply.HasField("next_token_id") else [])
        if not self.prompt_ids and reply.prompt_token_ids:
            self._prompt_known(list(reply.prompt_token_ids))
        self.committed.extend(new)
        if reply.committed_length != len(self.committed):
            raise EdgeError(grpc.StatusCode.INTERNAL, f"server committed {reply.committed_length} tokens, "
                                                      f"the edge {len(self.committed)}")
        self.session_id, self.last_round = reply.session_id, reply.round
        self._learn(prep, reply, kept, round_s, len(new), pass_nodes)
        return new

    def _prompt_known(self, ids: list[int]) -> None:
        """A text open's reply: the target's prompt ids become the committed prefix (replays send them)."""
        self.prompt_ids = ids
        self.committed[:0] = ids
        self.prompt_len = len(ids)
        self.drafter.anchor_prompt(ids, self.plan.draft_ids)

    def _learn(self, prep: "_Prepared", reply: pb.VerifyReply, kept: list[int], round_s: float, n_new: int,
               pass_nodes: int = 0) -> None:
        """Count the round, and teach γ, the tree planner and the drafter what it cost and kept."""
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
        if tree.is_chain:  # the chain's α and γ model; a tree round's acceptance is not geometric
            self.acceptance.observe(len(tree), reply.num_accepted, rejected)
            self.policy.observe(gamma=len(tree), num_accepted=reply.num_accepted, draft_s=prep.seconds,
                                round_s=round_s, server_s=server_s, model_s=model_s, rejected=rejected)
        # The verifier's time is fitted over the nodes its pass held (a fused pass: all of them).
        self.planner.observe(prep.plan, nodes=max(len(tree), pass_nodes), rows=prep.rows, tokens=n_new,
                             draft_s=prep.seconds, round_s=round_s, server_s=server_s, model_s=model_s)
        self.drafter.observe(self.committed, reply.num_accepted)
        if reply.HasField("budget") and self.spec.steer and self.spec.gamma == ADAPTIVE:
            self.planner.steer(reply.budget.max_gamma, reply.budget.max_tree_nodes)
        if self.c.on_round is not None:
            self.c.on_round(RoundEvent(gamma=depth, accepted=reply.num_accepted, tokens=n_new,
                                       draft_s=prep.seconds, rpc_s=round_s, server_s=server_s))

    # --- the end --------------------------------------------------------------------------------

    async def close(self) -> None:
        """Settle background work, complete the stats, and close the session if it is unfinished."""
        await _settle(self.ahead_job, self.spec_task)
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
        st.wall_s = time.perf_counter() - self.t0
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
        view = self.drafter.retokenization()
        if view is not None and self.view0 is not None:
            st.draft_rolled_back = view.rolled_back - self.view0.rolled_back
            st.draft_retokenized = view.retokenized - self.view0.retokenized


GREEDY = SamplingSettings(temperature=0.0)


@dataclass
class _Prepared:
    """A round's draft, made for one base (the committed sequence it follows): a tree of draft
    tokens, a chain being the tree with one path. On the wire a one-path tree stays a chain (no
    draft_parents), as every verifier takes it."""

    base: list[int]
    plan: RoundPlan                      # what the planner chose (its arm learns from the round)
    tree: DraftTree                      # [n] node tokens and parents
    qs: list[EncodedQ] | None            # [n] each node's shipped q, or None: point masses
    seconds: float                       # time spent drafting
    rows: int                            # draft forward rows it cost
    path_probs: Sequence[float] | None = None   # [n] the draft's probability of reaching each node
                                                # (None: a chain, whose one path is every node)

    def wire_parents(self) -> list[int]:
        """draft_parents on the wire: none for a chain."""
        return [] if self.tree.is_chain else list(self.tree.parents)

    def guess_path(self) -> list[int]:
        """The tokens of the most likely full acceptance: every draft, or the most probable branch."""
        return [self.tree.tokens[i] for i in self.guess_nodes()]

    def guess_nodes(self) -> list[int]:
        """The nodes of that path, root first."""
        leaves = self.tree.leaves()
        if not leaves:
            return []
        probs = self.path_probs
        return self.tree.path_to(max(leaves, key=lambda i: (probs[i] if probs is not None else 1.0, -i)))

    def kept_path(self, reply: pb.VerifyReply) -> list[int]:
        """The nodes the verifier kept, root first (a chain's reply says only how many); a reply that
        names no path of this tree is an error."""
        n = reply.num_accepted
        kept = list(range(n)) if self.tree.is_chain else list(reply.kept_nodes)
        if len(kept) != n or any(k >= len(self.tree) for k in kept) or (kept and self.tree.path_to(kept[-1]) != kept):
            raise EdgeError(grpc.StatusCode.INTERNAL, f"the verifier kept {n} nodes ({list(reply.kept_nodes)}), not a "
                                                      f"path from the root of this round's {len(self.tree)} draft nodes")
        return kept


def _pass_nodes(prep: "_Prepared", fused: Sequence[_Guess]) -> int:
    """Nodes of a fused round's target pass: its own, then per continuation its key's last token
    and its drafts (spec_core.continuations.fuse_tree); 0 without continuations."""
    return len(prep.tree) + sum(1 + len(g.prep.tree) for g in fused) if fused else 0


async def _settle(job, spec_task):
    """Wait for background work we no longer need; a speculative round's failure is only a discard."""
    if job is not None:
        with contextlib.suppress(Exception):
            await job
    if spec_task is not None:
        try:
            return await spec_task
        except (EdgeError, grpc.aio.AioRpcError):
            return None
    return None
