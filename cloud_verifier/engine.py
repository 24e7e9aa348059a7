"""The verifier's round, as plain methods: verify → choose → run → commit → reply; and the
cloud-only baseline's stream.

A round arrives validated (`validate`: cloud_verifier.validation) and finds its session through
the lifecycle (cloud_verifier.sessions.SessionLifecycle); the engine chooses the alternative to
run, runs it on the backend (with the fused continuations of the next round), commits what it
keeps and answers. Every problem with a request is a `RequestError` carrying a gRPC status code
and a message that says what to fix; the servicer turns it into a status and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import AsyncIterator, NamedTuple, Sequence

import grpc
import numpy as np

from cloud_verifier import metrics
from cloud_verifier.backends.base import Backend, BackendRound, FusedContinuation, StateLost
from cloud_verifier.rounds import Alternative, Choice, FollowingRun, RoundRun, fused_digest, round_digest
from cloud_verifier.sessions import Session, SessionLifecycle, SessionStore
from cloud_verifier.validation import Limits, RequestError, ValidRound, Validator, quoted, text_open
from cloud_verifier.workers import run_in_thread
from spec_core import clock
from spec_core.continuations import pick_continuation
from spec_core.crossvocab import pack_token_bytes
from spec_core.proto import couplings
from spec_core.proto import verifier_pb2 as pb
from spec_core.steering import CommitRate, draft_budget
from spec_core.tree import DraftTree, prune_to_fit
from spec_core.verify import Commit, FinishReason, RoundResult, commit_round
from spec_core.warping import GENERATE_STREAM, VERIFIER_STREAM, seeded_rng

__all__ = ["Limits", "RequestError", "VerifierEngine", "quoted", "run_in_thread", "wire_finish"]

log = logging.getLogger(__name__)


# The one mapping from spec_core's finish reason to the wire's.
_WIRE_FINISH = {FinishReason.NOT_FINISHED: pb.NOT_FINISHED, FinishReason.STOP: pb.STOP,
                FinishReason.LENGTH: pb.LENGTH, FinishReason.CONTEXT: pb.CONTEXT}


def wire_finish(reason: FinishReason) -> int:
    """spec_core.verify.FinishReason as pb.FinishReason."""
    return _WIRE_FINISH[reason]


class VerifierEngine:
    def __init__(self, backend: Backend, limits: Limits = Limits(), version: str = "",
                 evict_idle_after_s: float = 0.0):
        self.backend, self.limits, self.version = backend, limits, version
        self.info, self.caps = backend.info, backend.caps   # the one place the engine reads what the backend can do
        # A batching backend holds sessions in one KV cache: never promise more than it holds.
        self.max_sessions = min(limits.max_sessions, self.caps.max_states or limits.max_sessions)
        self.validator = Validator(backend, self.caps, limits)
        self.default_slo = self.validator.default_slo
        self.sessions = SessionStore(self.max_sessions, limits.session_ttl_s, backend.release, evict_idle_after_s)
        self.lifecycle = SessionLifecycle(self.sessions, backend, self.validator, self.max_sessions)
        self._streams = asyncio.Semaphore(self.max_sessions)  # concurrent Generate streams
        self._vocabulary: pb.Vocabulary | None = None     # made on the first GetVocabulary
        self._vocabulary_lock = asyncio.Lock()
        self.commits = CommitRate()   # tokens/s committed, all sessions and streams: the draft budget's load
        # Pipelined rounds waiting for their predecessor, by (session id, round): the predecessor's
        # pass takes in their alternatives (fused) when it starts after they arrived.
        self._waiting: dict[tuple[str, int], ValidRound] = {}

    async def vocabulary(self, req: pb.VocabularyRequest) -> pb.Vocabulary:
        """The target's vocabulary, packed once (seconds for a large one, off the event loop)."""
        self.validator.fingerprint(req.fingerprint)
        async with self._vocabulary_lock:
            if self._vocabulary is None:
                vocab = self.backend.vocabulary()
                if vocab is None:
                    raise RequestError(grpc.StatusCode.UNIMPLEMENTED,
                                       f"this server ({self.info.name}) cannot export its vocabulary")

                def build() -> pb.Vocabulary:
                    return pb.Vocabulary(fingerprint=self.info.fingerprint, n_vocab=vocab.n_vocab,
                                         token_bytes_zlib=pack_token_bytes(vocab.token_bytes),
                                         special_token_ids=sorted(vocab.special_ids),
                                         eog_token_ids=sorted(vocab.eog_ids), byte_token_ids=sorted(vocab.byte_ids))
                self._vocabulary = await run_in_thread(build)
        return self._vocabulary

    # --- one round ----------------------------------------------------------------------------

    def validate(self, req: pb.VerifyRequest) -> ValidRound:
        """Everything a round can be refused for without its session (cloud_verifier.validation):
        checked before a session is created, admitted or touched."""
        return self.validator.round(req)

    async def verify(self, valid: ValidRound) -> pb.VerifyReply:
        """One round of a validated request (`validate`): resolve the session, choose the
        alternative, run the round, commit, reply. A retry of a committed round gets its reply."""
        t_start = clock.now()
        req = valid.req
        session, committed_length = await self.lifecycle.resolve(valid)
        if valid.alternatives[0].assumed:
            key = (session.id, req.round)
            self._waiting[key] = valid
            try:
                await self._wait_for_round(session, req.round - 1)
            finally:
                if self._waiting.get(key) is valid:
                    del self._waiting[key]
        async with session.lock:
            if not self.lifecycle.alive(session):
                # Evicted or closed while this round waited for the lock.
                raise RequestError(grpc.StatusCode.NOT_FOUND,
                                   f"session {quoted(session.id)} was evicted: resend the round with `open` to replay")
            digest = round_digest(req)
            cached = session.replies.get(req.round)
            if cached is not None:
                # A retry of a committed round gets that round's reply, whatever committed after it
                # (sessions.ReplyCache says why anything else would bias the output).
                if digest != cached.digest:
                    raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"round {req.round} was already verified with different drafts")
                metrics.RETRIES.inc()
                return cached.reply
            choice = self._choose(session, valid, committed_length)
            if choice.alternative is None:
                # No alternative's base was committed: answered, never verified, not cached, and
                # the round number stays free.
                metrics.PIPELINE_DISCARDS.inc()
                return pb.VerifyReply(session_id=session.id, round=req.round, committed_length=len(session.tokens),
                                      finish_reason=session.finish_reason, base_mismatch=True)
            self._check_step(session, req.round, choice.committed_length)
            # Fused continuations were drafted after the outcomes of the round's own draft only.
            # Without any, a pipelined round + 1 already waiting lends its alternatives.
            following = valid.following if choice.index == 0 else []
            lent = None if following else self._lent_round(session, req.round + 1)
            run = await self._run_round(session, choice.alternative, t_start,
                                        following or (lent.alternatives if lent is not None else []))
            done = self._commit(session, req.round, run)
            reply = self._reply(session, req, choice.index, run, done, t_start)
            last = done
            if run.following is not None and done.finish_reason is FinishReason.NOT_FINISHED:
                # Round r committed exactly this continuation's key (uncut): it is round r + 1.
                nxt = run.following
                last = self._commit(session, req.round + 1, nxt.run)
                if lent is None:
                    reply.next_round.CopyFrom(self._reply(session, req, nxt.index + 1, nxt.run, last, t_start,
                                                          req.round + 1))
                    session.replies.put(req.round + 1, fused_digest(req, nxt.index), reply.next_round)
                else:   # the waiting round finds its reply in the cache, as a retry would
                    session.replies.put(req.round + 1, round_digest(lent.req),
                                        self._reply(session, lent.req, nxt.index, nxt.run, last, t_start))
                    metrics.PIPELINE_FUSED.inc()
                # Counted as a round, but no pass or time of its own (the histograms keep round r's).
                metrics.ROUNDS.inc()
                metrics.DRAFT_TOKENS.inc(nxt.run.n_verified)
                metrics.ACCEPTED_TOKENS.inc(last.num_accepted)
            session.replies.put(req.round, digest, reply)
            session.round_done.set()
            session.round_done = asyncio.Event()
            if last.finish_reason is not FinishReason.NOT_FINISHED:
                self.lifecycle.end(session)
            metrics.observe_round(run.n_verified, done.num_accepted, run.model_s, clock.now() - t_start)
            return reply

    def _lent_round(self, session: Session, round_: int) -> ValidRound | None:
        """A pipelined `round_` waiting for the round about to run, drafted from the committed
        sequence that round starts from: its alternatives can share that round's pass."""
        waiting = self._waiting.get((session.id, round_))
        if waiting is None or waiting.req.committed_length - len(waiting.alternatives[0].assumed) != \
                len(session.tokens):
            return None
        return waiting

    def _choose(self, session: Session, valid: ValidRound, committed_length: int) -> Choice:
        """The alternative this round runs: its own draft, or for a pipelined round the one drafted
        after what the last round committed (alternative None: none was)."""
        req, alternatives = valid.req, valid.alternatives
        assumed = alternatives[0].assumed
        if not (assumed and req.round == session.round + 1):
            return Choice(0, alternatives[0], committed_length)
        base_length = req.committed_length - len(assumed)
        hit = pick_continuation(session.tokens, base_length, [a.assumed for a in alternatives]) \
            if session.finish_reason == pb.NOT_FINISHED and 0 <= base_length <= len(session.tokens) else None
        if hit is None:
            return Choice(0, None, committed_length)
        return Choice(hit, alternatives[hit], base_length + len(alternatives[hit].assumed))

    @staticmethod
    def _check_step(session: Session, round_: int, committed_length: int) -> None:
        """The round is the session's next one, from the committed sequence the server holds."""
        if round_ != session.round + 1:
            older = "" if round_ > session.round else \
                f"; its reply is no longer kept (this server keeps the last {session.replies.size} rounds')"
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"round {round_} is out of step: this session expects round {session.round + 1} "
                               f"(committed length {len(session.tokens)}){older}")
        if committed_length != len(session.tokens):
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"committed_length {committed_length} does not match the server's "
                               f"{len(session.tokens)} (after round {session.round}); resync by replaying")
        if session.finish_reason != pb.NOT_FINISHED:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"generation already finished ({pb.FinishReason.Name(session.finish_reason)})")

    async def _run_round(self, session: Session, alt: Alternative, t_start: float,
                         following: Sequence[Alternative] = ()) -> RoundRun:
        """Verify one alternative's draft against the session's committed sequence, and with
        `following` (fused continuations) the one whose key it commits, in the same pass."""
        # Near the end of the context window verify only the drafts that fit: a prefix of the
        # draft is still a valid draft, and the target alone would stop there too (CONTEXT).
        room = self.info.n_ctx - len(session.tokens) - 1
        if room < 0:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the context window is full")
        self.backend.set_deadline(session.state, session.due(t_start))
        own = _fit(alt, room)
        conts = [_fit(c, self.info.n_ctx - len(session.tokens) - len(c.assumed) - 1) for c in following]
        fused = [FusedContinuation(tuple(c.assumed), fc.tree, fc.qs) for c, fc in zip(following, conts)
                 if fc is not None]
        index = [i for i, fc in enumerate(conts) if fc is not None]
        out = await self._backend_round(session, self.backend.verify_round, session.state, session.tokens, own.tree,
                                        own.qs, session.settings, _round_rng(session), fused,
                                        functools.partial(_round_rng, session))
        nxt = None
        if out.following is not None:
            i = index[out.following.index]
            c, fc = following[i], conts[i]
            nxt = FollowingRun(i, _round_run(c, fc.tree, fc.fit, out.following.result, out.queue_s, out.model_s))
        return _round_run(alt, own.tree, own.fit, out.result, out.queue_s, out.model_s)._replace(following=nxt)

    def _commit(self, session: Session, round_: int, run: RoundRun) -> Commit:
        """Append what the round keeps (cut at a stop token, the length or the context) to the session."""
        done = commit_round(run.kept, RoundResult(len(run.kept), run.next_token), session.stop_ids,
                            remaining=session.settings.max_new_tokens - session.generated,
                            context_left=self.info.n_ctx - len(session.tokens))
        session.tokens.extend(done.tokens)
        session.finish_reason = wire_finish(done.finish_reason)
        session.round = round_
        now = clock.now()
        self.commits.observe(now, len(done.tokens))
        metrics.COMMITTED_TOKENS.inc(len(done.tokens))
        if session.first_token_at is None and done.tokens:
            session.first_token_at = (now, len(session.tokens))
        if run.chain:  # a tree round's acceptance is not geometric: α is the chains'
            session.acceptance.observe(run.n_verified, len(run.kept), len(run.kept) < run.n_verified)
        # Used until now, not since the round arrived: a round that queued for seconds behind
        # many others must not leave its session looking idle (and evictable) as it ends.
        session.last_used = clock.now()
        return done

    def _reply(self, session: Session, req: pb.VerifyRequest, index: int, run: RoundRun, done: Commit,
               t_start: float, round_: int | None = None) -> pb.VerifyReply:
        """The reply to `req`'s round (or to `round_`, a fused continuation of it: alternative `index`)."""
        reply = pb.VerifyReply(
            session_id=session.id, round=round_ or req.round, num_accepted=done.num_accepted,
            committed_length=len(session.tokens), finish_reason=session.finish_reason,
            timings=pb.ServerTimings(model_ms=run.model_s * 1e3, queue_ms=run.queue_s * 1e3,
                                     total_ms=(clock.now() - t_start) * 1e3))
        if done.has_next_token:
            reply.next_token_id = done.tokens[-1]
        if round_ is None and req.HasField("open") and text_open(req.open):
            reply.prompt_token_ids.extend(session.tokens[: session.prompt_len])
        reply.kept_nodes.extend(run.kept_nodes[: done.num_accepted])
        budget = self._budget(session, clock.now())
        if budget is not None:
            reply.budget.CopyFrom(budget)
        reply.continuation = index
        return reply

    def _budget(self, session: Session, now: float) -> pb.DraftBudget | None:
        """The draft that pays at this load (spec_core.steering); None when the server does not steer."""
        cost = self.backend.pass_cost() if self.limits.steer else None
        if cost is None:
            return None
        price = cost[1] * self.commits.rate(now)
        nodes = self.limits.max_tree_nodes if self.caps.trees else 0
        b = draft_budget(session.acceptance.alpha, price, self.limits.max_gamma, nodes, self.limits.max_tree_branching)
        return pb.DraftBudget(max_gamma=b.max_gamma, max_tree_nodes=b.max_tree_nodes, price=b.price)

    async def _backend_round(self, session: Session, fn, *args) -> BackendRound:
        """A round's backend call; a session whose state the backend lost (StateLost) is dropped
        and its edge told to replay (NOT_FOUND), as after an eviction."""
        try:
            return await run_in_thread(fn, *args)
        except StateLost as e:
            raise self.lifecycle.lost(session, e) from None

    async def _wait_for_round(self, session: Session, round_: int) -> None:
        """Let a pipelined round's predecessor finish first (it may arrive later on the wire)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.pipeline_wait_s
        while session.round < round_ and session.finish_reason == pb.NOT_FINISHED:
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                async with asyncio.timeout(left):
                    await session.round_done.wait()
            except asyncio.TimeoutError:
                return

    # --- the sessions, as the server asks for them ------------------------------------------------

    def close(self, session_id: str) -> bool:
        return self.lifecycle.close(session_id)

    def session(self, session_id: str) -> Session | None:
        """The session with this id whoever owns it (for owner checks and draining), or None."""
        return self.sessions.peek(session_id)

    def held_sessions(self) -> list[Session]:
        return self.sessions.sessions()

    def open_key_known(self, key: bytes) -> bool:
        """A session of the calling tenant was opened with this key (a retried first round)."""
        return self.sessions.by_open_key(key) is not None

    def unfinished_sessions(self, tenant: str) -> int:
        return self.sessions.unfinished(tenant)

    def has_session_room(self) -> bool:
        return self.sessions.has_room()

    def drop_sessions(self) -> None:
        self.sessions.clear()

    # --- cloud-only baseline ------------------------------------------------------------------

    async def generate(self, req: pb.GenerateRequest) -> AsyncIterator[pb.GenerateChunk]:
        valid = await self.validator.generate(req)
        prompt, settings, text_prompt = valid.prompt, valid.settings.with_session_seed(), valid.text_prompt
        stop = self.validator.stop_ids(settings)
        rng = seeded_rng(settings.seed, GENERATE_STREAM, len(prompt))
        if self._streams.locked():
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"all {self.max_sessions} Generate streams are busy; retry shortly",
                               retry_after_s=1.0)
        async with self._streams:
            state = await self.lifecycle.new_state()
            tokens = list(prompt)
            try:
                async for chunk in self._generate_tokens(state, tokens, settings, stop, rng):
                    if text_prompt:
                        chunk.prompt_token_ids.extend(prompt)
                        text_prompt = False
                    yield chunk
            finally:
                self.backend.release(state)

    async def _generate_tokens(self, state, tokens, settings, stop, rng) -> AsyncIterator[pb.GenerateChunk]:
        first_token_at = None
        for generated in range(settings.max_new_tokens):
            if self.default_slo is not None:
                self.backend.set_deadline(state, self.default_slo.due(clock.now(), first_token_at, generated))
            try:
                step = await run_in_thread(self.backend.sample_next, state, tokens, settings, rng)
            except StateLost as e:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the stream lost its KV cache ({e}); "
                                   "retry shortly", retry_after_s=1.0) from None
            now = clock.now()
            self.commits.observe(now, 1)
            metrics.COMMITTED_TOKENS.inc()
            first_token_at = first_token_at or (now, generated + 1)
            # A round without drafts: the hybrid path's stop, length and context cuts, one token at a time.
            done = commit_round((), RoundResult(0, step.token), stop, remaining=settings.max_new_tokens - generated,
                                context_left=self.info.n_ctx - len(tokens))
            tokens.append(step.token)
            yield pb.GenerateChunk(token_ids=[step.token], finish_reason=wire_finish(done.finish_reason),
                                   model_ms=step.model_s * 1e3)
            if done.finish_reason is not FinishReason.NOT_FINISHED:
                return

    def server_info(self) -> pb.ServerInfo:
        i = self.info
        return pb.ServerInfo(backend=i.name, model=i.model, n_vocab=i.n_vocab, n_ctx=i.n_ctx,
                             tokenizer_fingerprint=i.fingerprint, max_gamma=self.limits.max_gamma,
                             max_sessions=self.max_sessions, eos_token_ids=sorted(i.eos_token_ids),
                             version=self.version,
                             max_tree_nodes=self.limits.max_tree_nodes if self.caps.trees else 0,
                             max_tree_branching=self.limits.max_tree_branching,
                             batching=self.caps.batching, text_prompts=self.caps.vocabulary,
                             chat_prompts=self.caps.vocabulary and self.backend.chat_prompts(),
                             draft_budgets=self.limits.steer and self.backend.pass_cost() is not None,
                             slo=(pb.SessionSlo(tpot_ms=self.limits.slo_tpot_ms, ttft_ms=self.limits.slo_ttft_ms)
                                  if self.default_slo is not None else None),
                             verify_stream=True, max_window=self.limits.max_window,
                             couplings=[couplings.TO_WIRE[c] for c in self.caps.couplings])


def _round_rng(session: Session, length: int | None = None) -> np.random.Generator:
    """With a user seed, each round draws from a stream keyed by the committed length it starts
    from (`length`, default the session's now: a fused continuation's round starts later), so a
    session replayed after an eviction or restart draws exactly what the lost session would have
    (same seed, same text); streams of different rounds never overlap. Without a seed the
    session's own generator goes on (a fused continuation draws after the round before it)."""
    if session.settings.seed is None:
        return session.rng
    return seeded_rng(session.settings.seed, VERIFIER_STREAM, len(session.tokens) if length is None else length)


class _Fit(NamedTuple):
    """An alternative's draft cut to the context room it has."""

    tree: DraftTree
    qs: list | None
    fit: list[int]      # the kept nodes' indices in the tree as sent


def _fit(alt: Alternative, room: int) -> "_Fit | None":
    """A draft cut to `room` more tokens, as its own round cuts it (None: no room at all). Whole
    levels past the room, then nodes in index order (a chain: its first drafts)."""
    if room < 0:
        return None
    fit = prune_to_fit(alt.tree, room)
    if len(fit) == len(alt.tree):
        return _Fit(alt.tree, alt.qs, fit)
    return _Fit(alt.tree.subtree(fit), [alt.qs[i] for i in fit] if alt.qs is not None else None, fit)


def _round_run(alt: Alternative, tree: DraftTree, fit: list[int], result, queue_s: float, model_s: float) -> RoundRun:
    path = result.path
    return RoundRun([tree.tokens[i] for i in path], result.next_token, [fit[i] for i in path] if alt.sent_as_tree
                    else [], len(tree), not alt.sent_as_tree, queue_s, model_s)
