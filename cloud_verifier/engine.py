"""The verifier's logic as plain methods: validate, run a round, stream the cloud-only baseline.

Every problem with a request becomes a `RequestError` carrying a gRPC status code and a message
that says what to fix; the servicer turns it into a status and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
import logging
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, NamedTuple, Sequence

import grpc
import numpy as np

from cloud_verifier import metrics
from cloud_verifier.backends.base import (Backend, BackendRound, FusedContinuation, NoChatTemplate, NoFreeState,
                                          StateLost)
from cloud_verifier.rounds import (Alternative, Choice, FollowingRun, RoundRun, ValidRound, alternative, fused_digest,
                                   round_digest)
from cloud_verifier.sessions import Session, SessionStore, Slo
from spec_core import qcodec
from spec_core.crossvocab import pack_token_bytes
from spec_core.continuations import MAX_CONTINUATION_NODES, MAX_CONTINUATIONS, pick_continuation
from spec_core.proto import qpayload
from spec_core.proto import verifier_pb2 as pb
from spec_core.steering import CommitRate, draft_budget
from spec_core.tree import DraftTree, TreeError, prune_to_fit, validate_tree
from spec_core.verify import Commit, FinishReason, RoundResult, commit_round
from spec_core.warping import GENERATE_STREAM, VERIFIER_STREAM, SamplingError, SamplingSettings, seeded_rng
from spec_core.wire import OPEN_KEY_BYTES

log = logging.getLogger(__name__)


class RequestError(Exception):
    """`retry_after_s`: set when the request was refused for load, not for its content, so that
    the same request may succeed later (the server sends it as a retry hint)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


@dataclass(frozen=True)
class Limits:
    max_gamma: int = 16
    max_sessions: int = 8
    session_ttl_s: float = 600.0
    default_max_new_tokens: int = 256
    max_new_tokens_cap: int = 4096
    max_tree_nodes: int = 64       # nodes in one tree round (its depth is bounded by max_gamma)
    max_tree_branching: int = 8    # children of one tree node
    pipeline_wait_s: float = 30.0  # longest a pipelined round waits for its predecessor
    steer: bool = True             # tell edges the draft budget at this load (VerifyReply.budget)
    slo_tpot_ms: float = 0.0       # the latency target of sessions that state none (0: none);
    slo_ttft_ms: float = 0.0       # a batching backend with schedule "slack" orders work by it
    max_continuations: int = MAX_CONTINUATIONS            # alternatives beyond a pipelined round's own draft
    max_continuation_nodes: int = MAX_CONTINUATION_NODES  # draft tokens (nodes) over all of them
    max_window: int = 4            # rounds of one session in flight at once (ServerInfo.max_window)

    @property
    def max_assumed(self) -> int:
        """Most assumed_tokens of one alternative: the outcomes of the max_window - 1 unanswered
        rounds before it, each at most max_gamma + 1 tokens."""
        return max(1, self.max_window - 1) * (self.max_gamma + 1)


MAX_SLO_MS = 3_600_000.0

MAX_STOP_IDS = 64
# Text prompts (edges whose draft has another tokenizer): bounded before they are tokenized.
MAX_PROMPT_TEXT_BYTES = 1 << 20
MAX_PROMPT_MESSAGES = 256
_ROLE = re.compile(r"[a-z_]{1,32}")
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


# The one mapping from spec_core's finish reason to the wire's.
_WIRE_FINISH = {FinishReason.NOT_FINISHED: pb.NOT_FINISHED, FinishReason.STOP: pb.STOP,
                FinishReason.LENGTH: pb.LENGTH, FinishReason.CONTEXT: pb.CONTEXT}


def wire_finish(reason: FinishReason) -> int:
    """spec_core.verify.FinishReason as pb.FinishReason."""
    return _WIRE_FINISH[reason]


def _bad(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


QUOTE_CHARS = 48


def quoted(text: str, limit: int = QUOTE_CHARS) -> str:
    """Client input as a message quotes it: at most `limit` characters (then its length). A field
    echoed whole could make the status bigger than a client takes (gRPC's default 16 KiB of
    metadata): the client would see RESOURCE_EXHAUSTED instead of the status we meant."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


class VerifierEngine:
    def __init__(self, backend: Backend, limits: Limits = Limits(), version: str = ""):
        self.backend, self.limits, self.version = backend, limits, version
        self.info = backend.info
        # A batching backend holds sessions in one KV cache: never promise more than it holds.
        self.max_sessions = min(limits.max_sessions, backend.max_states or limits.max_sessions)
        self.sessions = SessionStore(self.max_sessions, limits.session_ttl_s, backend.release)
        self._streams = asyncio.Semaphore(self.max_sessions)  # concurrent Generate streams
        self._vocabulary: pb.Vocabulary | None = None     # made on the first GetVocabulary
        self._vocabulary_lock = asyncio.Lock()
        self.commits = CommitRate()   # tokens/s committed, all sessions and streams: the draft budget's load
        self.default_slo = (Slo(limits.slo_tpot_ms / 1e3, limits.slo_ttft_ms / 1e3)
                            if limits.slo_tpot_ms or limits.slo_ttft_ms else None)
        # Pipelined rounds waiting for their predecessor, by (session id, round): the predecessor's
        # pass takes in their alternatives (fused) when it starts after they arrived.
        self._waiting: dict[tuple[str, int], ValidRound] = {}

    # --- validation --------------------------------------------------------------------------

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        if not len(ids):
            return
        arr = np.asarray(ids, dtype=np.int64)
        bad = np.flatnonzero(arr >= self.info.n_vocab)
        if len(bad):
            i = int(bad[0])
            raise _bad(f"{what}[{i}] = {int(arr[i])} is outside the vocabulary (n_vocab = {self.info.n_vocab})")

    def _settings(self, sp: pb.SamplingParams, has_sampling: bool) -> SamplingSettings:
        if not has_sampling:
            raise _bad("open.sampling is missing: set temperature (0 for greedy), top_k, top_p, max_new_tokens")
        try:  # the one rule for valid settings (spec_core.warping); the wire's top_p 0 means off
            settings = SamplingSettings(
                temperature=float(sp.temperature), top_k=int(sp.top_k), top_p=float(sp.top_p),
                max_new_tokens=int(sp.max_new_tokens or self.limits.default_max_new_tokens),
                stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
                seed=sp.seed if sp.HasField("seed") else None)
        except SamplingError as e:
            raise _bad(f"sampling.{e}") from None
        if sp.max_new_tokens > self.limits.max_new_tokens_cap:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"sampling.max_new_tokens = {sp.max_new_tokens} is above this server's cap of "
                               f"{self.limits.max_new_tokens_cap}")
        if len(sp.stop_token_ids) > MAX_STOP_IDS:
            raise _bad(f"sampling.stop_token_ids has {len(sp.stop_token_ids)} ids; at most {MAX_STOP_IDS} are allowed")
        self._check_ids(sp.stop_token_ids, "sampling.stop_token_ids")
        return settings

    def _slo(self, o: pb.OpenSession) -> Slo | None:
        if not o.HasField("slo"):
            return self.default_slo
        for name in ("tpot_ms", "ttft_ms"):
            value = getattr(o.slo, name)
            if not (math.isfinite(value) and 0 <= value <= MAX_SLO_MS):
                raise _bad(f"open.slo.{name} = {value} must be finite and in [0, {MAX_SLO_MS:.0f}] milliseconds "
                           "(0: no target)")
        return Slo(o.slo.tpot_ms / 1e3, o.slo.ttft_ms / 1e3)

    def _stop_ids(self, s: SamplingSettings) -> frozenset[int]:
        return frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos else self.info.eos_token_ids)

    def _check_context(self, n_tokens: int) -> None:
        """Room for the prompt (+ replayed tokens) and one generated token; drafts that do not fit
        later are cut by the round itself."""
        if n_tokens + 1 > self.info.n_ctx:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{n_tokens} prompt tokens + 1 do not fit the context window of {self.info.n_ctx} "
                               "tokens; shorten the prompt")

    def _text_prompt(self, text: str, messages, what: str) -> tuple[str | None, list[dict[str, str]] | None]:
        """(text, messages) of a text prompt, validated; (None, None) when the prompt is ids."""
        if not text and not len(messages):
            return None, None
        if not self.backend.has_vocabulary:
            raise RequestError(grpc.StatusCode.UNIMPLEMENTED,
                               f"this server ({self.info.name}) takes prompts as token ids only: send "
                               f"{what}prompt_token_ids")
        if text and len(messages):
            raise _bad(f"{what}prompt_text and {what}prompt_messages are both set: send one")
        if len(messages) > MAX_PROMPT_MESSAGES:
            raise _bad(f"{what}prompt_messages has {len(messages)} messages; at most {MAX_PROMPT_MESSAGES}")
        size = len(text.encode()) + sum(len(m.content.encode()) for m in messages)
        if size > MAX_PROMPT_TEXT_BYTES:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the prompt text is {size} bytes; this server takes at most {MAX_PROMPT_TEXT_BYTES}")
        for i, m in enumerate(messages):
            if not _ROLE.fullmatch(m.role):
                raise _bad(f"{what}prompt_messages[{i}].role {quoted(m.role)} is not a role (system, user, "
                           "assistant: lower-case letters and '_', at most 32)")
        if not len(messages):
            return text, None
        if not self.backend.chat_prompts():
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{self.info.model} has no chat template: send {what}prompt_text instead of messages")
        return None, [{"role": m.role, "content": m.content} for m in messages]

    async def _tokenize_prompt(self, text: str | None, messages: list[dict[str, str]] | None, what: str) -> list[int]:
        try:
            ids = await run_in_thread(self.backend.prompt_ids, text, messages)
        except NoChatTemplate as e:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        except ValueError as e:
            raise _bad(f"{what}prompt_messages: {e}") from None
        if not ids:
            raise _bad(f"{what}prompt_text tokenizes to no tokens: send some text")
        return ids

    async def vocabulary(self, req: pb.VocabularyRequest) -> pb.Vocabulary:
        """The target's vocabulary, packed once (seconds for a large one, off the event loop)."""
        if req.fingerprint and not _FINGERPRINT.fullmatch(req.fingerprint):
            raise _bad("fingerprint must be 64 lower-case hex digits (ServerInfo.tokenizer_fingerprint) or empty")
        if req.fingerprint and req.fingerprint != self.info.fingerprint:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this server's tokenizer is {self.info.fingerprint[:16]}…, not {req.fingerprint[:16]}… "
                               f"({self.info.model}); ask GetServerInfo again")
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
        """Everything a round can be refused for without its session: checked before a session is
        created, admitted or touched (a malformed open is INVALID_ARGUMENT even when every slot is full)."""
        drafts = list(req.draft_token_ids)
        tree = self._tree(req, drafts)
        if tree is None and len(drafts) > self.limits.max_gamma:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"gamma = {len(drafts)} draft tokens is above this server's limit of "
                               f"{self.limits.max_gamma}")
        self._check_ids(drafts, "draft_token_ids")
        if req.round < 1:
            raise _bad("round must be >= 1 (1 is the first round of a session)")
        try:
            qs = qpayload.from_proto(req.q, drafts, self.info.n_vocab)
        except qcodec.QError as e:
            raise _bad(str(e)) from None
        if not req.session_id and not req.HasField("open"):
            raise _bad("session_id is empty and `open` is missing: the first round must carry `open`")
        assumed = list(req.assumed_tokens)
        if len(assumed) > self.limits.max_assumed:
            raise _bad(f"assumed_tokens has {len(assumed)} ids; at most (max_window - 1) x (max_gamma + 1) = "
                       f"{self.limits.max_assumed}")
        self._check_ids(assumed, "assumed_tokens")
        alternatives = self._continuations(req, alternative(assumed, drafts, tree, qs))
        following = self._alternatives(req.next_continuations, "next_continuations", set())
        return ValidRound(req, alternatives, None if req.session_id else self._valid_open(req), following)

    async def verify(self, valid: ValidRound) -> pb.VerifyReply:
        """One round of a validated request (`validate`): resolve the session, choose the
        alternative, run the round, commit, reply. A retry of a committed round gets its reply."""
        t_start = time.perf_counter()
        req = valid.req
        session, committed_length = await self._resolve_session(valid)
        if valid.alternatives[0].assumed:
            key = (session.id, req.round)
            self._waiting[key] = valid
            try:
                await self._wait_for_round(session, req.round - 1)
            finally:
                if self._waiting.get(key) is valid:
                    del self._waiting[key]
        async with session.lock:
            if self.sessions.get(session.id) is not session or session.state is None and \
                    session.finish_reason == pb.NOT_FINISHED:
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
                # Keep the (small) session for retries of this last round; free its KV cache now.
                self.backend.release(session.state)
                session.state = None
            metrics.observe_round(run.n_verified, done.num_accepted, run.model_s, time.perf_counter() - t_start)
            return reply

    def _lent_round(self, session: Session, round_: int) -> ValidRound | None:
        """A pipelined `round_` waiting for the round about to run, drafted from the committed
        sequence that round starts from: its alternatives can share that round's pass."""
        waiting = self._waiting.get((session.id, round_))
        if waiting is None or waiting.req.committed_length - len(waiting.alternatives[0].assumed) != \
                len(session.tokens):
            return None
        return waiting

    async def _resolve_session(self, valid: ValidRound) -> ResolvedSession:
        """The session a round names, or the one its `open` makes (or made: a retried first round)."""
        req = valid.req
        if req.session_id:
            session = self.sessions.get(req.session_id)
            if session is None:
                raise RequestError(grpc.StatusCode.NOT_FOUND,
                                   f"session {quoted(req.session_id)} is unknown here (evicted, expired, or the "
                                   "verifier restarted): resend the round with `open` to replay the committed tokens")
            return ResolvedSession(session, req.committed_length)
        session = self._reopen(req) or await self._open(req, valid.open)
        # A text open: the edge counted only what follows the prompt it could not tokenize (see the .proto).
        return ResolvedSession(session, req.committed_length + (session.prompt_len if _text_open(req.open) else 0))

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
        now = time.perf_counter()
        self.commits.observe(now, len(done.tokens))
        if session.first_token_at is None and done.tokens:
            session.first_token_at = (now, len(session.tokens))
        if run.chain:  # a tree round's acceptance is not geometric: α is the chains'
            session.acceptance.observe(run.n_verified, len(run.kept), len(run.kept) < run.n_verified)
        # Used until now, not since the round arrived: a round that queued for seconds behind
        # many others must not leave its session looking idle (and evictable) as it ends.
        session.last_used = time.monotonic()
        return done

    def _reply(self, session: Session, req: pb.VerifyRequest, index: int, run: RoundRun, done: Commit,
               t_start: float, round_: int | None = None) -> pb.VerifyReply:
        """The reply to `req`'s round (or to `round_`, a fused continuation of it: alternative `index`)."""
        reply = pb.VerifyReply(
            session_id=session.id, round=round_ or req.round, num_accepted=done.num_accepted,
            committed_length=len(session.tokens), finish_reason=session.finish_reason,
            timings=pb.ServerTimings(model_ms=run.model_s * 1e3, queue_ms=run.queue_s * 1e3,
                                     total_ms=(time.perf_counter() - t_start) * 1e3))
        if done.has_next_token:
            reply.next_token_id = done.tokens[-1]
        if round_ is None and req.HasField("open") and _text_open(req.open):
            reply.prompt_token_ids.extend(session.tokens[: session.prompt_len])
        reply.kept_nodes.extend(run.kept_nodes[: done.num_accepted])
        budget = self._budget(session, time.perf_counter())
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
        nodes = self.limits.max_tree_nodes if self.backend.supports_trees else 0
        b = draft_budget(session.acceptance.alpha, price, self.limits.max_gamma, nodes, self.limits.max_tree_branching)
        return pb.DraftBudget(max_gamma=b.max_gamma, max_tree_nodes=b.max_tree_nodes, price=b.price)

    async def _backend_round(self, session: Session, fn, *args) -> BackendRound:
        """A round's backend call; a session whose state the backend lost (StateLost) is dropped
        and its edge told to replay (NOT_FOUND), as after an eviction."""
        try:
            return await run_in_thread(fn, *args)
        except StateLost as e:
            self.sessions.remove(session.id)
            metrics.SESSIONS.set(len(self.sessions))
            raise RequestError(grpc.StatusCode.NOT_FOUND,
                               f"session {quoted(session.id)} lost its KV cache ({e}): resend the round with `open` to "
                               "replay the committed tokens") from None

    async def _wait_for_round(self, session: Session, round_: int) -> None:
        """Let a pipelined round's predecessor finish first (it may arrive later on the wire)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.pipeline_wait_s
        while session.round < round_ and session.finish_reason == pb.NOT_FINISHED:
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(session.round_done.wait(), left)
            except asyncio.TimeoutError:
                return

    def _tree(self, req: pb.VerifyRequest | pb.Continuation, drafts: list[int], what: str = "") -> DraftTree | None:
        """The round's tree, validated; None for a chain (no draft_parents)."""
        if not req.draft_parents:
            return None
        if not self.backend.supports_trees or self.limits.max_tree_nodes == 0:
            raise _bad(f"this server ({self.info.name}) verifies chains only: send the drafts without draft_parents")
        try:
            return validate_tree(drafts, list(req.draft_parents), self.info.n_vocab, self.limits.max_tree_nodes,
                                 self.limits.max_gamma, self.limits.max_tree_branching)
        except TreeError as e:
            raise _bad(f"{what}{e}") from None

    def _continuations(self, req: pb.VerifyRequest, own: Alternative) -> list[Alternative]:
        """A pipelined round's alternatives, validated: its own draft (0), then `continuations`."""
        if not req.continuations:
            return [own]
        if not own.assumed:
            raise _bad("continuations ride on a pipelined round: set assumed_tokens (alternative 0's key) too")
        return [own] + self._alternatives(req.continuations, "continuations", {tuple(own.assumed)})

    def _alternatives(self, conts, field: str, keys: set) -> list[Alternative]:
        """`continuations` or `next_continuations`, validated (keys distinct, also from `keys`)."""
        if len(conts) > self.limits.max_continuations:
            raise _bad(f"{len(conts)} {field}; this server takes at most {self.limits.max_continuations}")
        nodes = sum(len(c.draft_token_ids) for c in conts)
        if nodes > self.limits.max_continuation_nodes:
            raise _bad(f"the {field} carry {nodes} draft tokens in all; this server takes at most "
                       f"{self.limits.max_continuation_nodes}")
        out = []
        for i, c in enumerate(conts):
            what = f"{field}[{i}]."
            assumed, drafts = list(c.assumed_tokens), list(c.draft_token_ids)
            if not assumed or len(assumed) > self.limits.max_assumed:
                raise _bad(f"{what}assumed_tokens has {len(assumed)} ids; it needs 1 to (max_window - 1) x "
                           f"(max_gamma + 1) = {self.limits.max_assumed}")
            self._check_ids(assumed, f"{what}assumed_tokens")
            if tuple(assumed) in keys:
                raise _bad(f"{what}assumed_tokens {assumed} repeats another alternative's: each outcome once")
            keys.add(tuple(assumed))
            tree = self._tree(c, drafts, what)
            if tree is None and len(drafts) > self.limits.max_gamma:
                raise _bad(f"{what}draft_token_ids has {len(drafts)} tokens; at most max_gamma = "
                           f"{self.limits.max_gamma}")
            self._check_ids(drafts, f"{what}draft_token_ids")
            try:
                qs = qpayload.from_proto(c.q, drafts, self.info.n_vocab)
            except qcodec.QError as e:
                raise _bad(f"{what}{e}") from None
            out.append(alternative(assumed, drafts, tree, qs))
        return out

    def _reopen(self, req: pb.VerifyRequest) -> Session | None:
        """A retried first round: the same open_key and the same `open` map to the same session."""
        o = req.open
        session = self.sessions.by_open_key(o.open_key)
        if session is not None and session.open_digest != _open_digest(o):
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               "open.open_key is already used by a session with a different prompt or settings; "
                               "draw a fresh random key per generation")
        return session

    def _valid_open(self, req: pb.VerifyRequest) -> "ValidOpen":
        """The first round's `open`, checked as far as it can be without tokenizing a text prompt."""
        o = req.open
        if o.open_key and len(o.open_key) != OPEN_KEY_BYTES:
            raise _bad(f"open.open_key must be {OPEN_KEY_BYTES} random bytes, got {len(o.open_key)}")
        prompt, resume = list(o.prompt_token_ids), list(o.resume_token_ids)
        text, messages = self._text_prompt(o.prompt_text, o.prompt_messages, "open.")
        text_prompt = text is not None or messages is not None
        if prompt and text_prompt:
            raise _bad("open.prompt_token_ids and a text prompt are both set: send one")
        if not prompt and not text_prompt:
            raise _bad("open.prompt_token_ids is empty: send at least one token (e.g. BOS)")
        if not text_prompt:
            self._check_context(len(prompt) + len(resume))
        self._check_ids(prompt, "open.prompt_token_ids")
        self._check_ids(resume, "open.resume_token_ids")
        if o.tokenizer_fingerprint and o.tokenizer_fingerprint != self.info.fingerprint:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"tokenizer mismatch: the draft's fingerprint {o.tokenizer_fingerprint[:16]}… differs "
                               f"from the target's {self.info.fingerprint[:16]}… ({self.info.model}); draft and "
                               "target must share a tokenizer")
        settings = self._settings(o.sampling, o.HasField("sampling"))
        slo = self._slo(o)
        if req.round != 1:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"a round with `open` must be round 1, got {req.round}")
        expected = len(resume) if text_prompt else len(prompt) + len(resume)
        if req.committed_length != expected:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"committed_length {req.committed_length} does not match the "
                               + (f"resumed tokens sent ({expected}; a text open counts the tokens after the prompt only)"
                                  if text_prompt else f"prompt + resumed tokens sent ({expected})"))
        return ValidOpen(prompt, text, messages, resume, settings, slo)

    async def _open(self, req: pb.VerifyRequest, valid: "ValidOpen") -> Session:
        o = req.open
        prompt, resume, settings, slo = valid.prompt, valid.resume, valid.settings, valid.slo
        if valid.text is not None or valid.messages is not None:
            prompt = await self._tokenize_prompt(valid.text, valid.messages, "open.")
            self._check_context(len(prompt) + len(resume))
        tokens = prompt + resume
        # The verifier's stream must be independent of the edge's even when both get the same user
        # seed (identical streams correlate draft sampling with acceptance and bias the output), and
        # a replay must not restart a stream already used: key it by role and committed length.
        rng = seeded_rng(settings.seed, VERIFIER_STREAM, len(tokens))
        state = await self._new_state()
        try:
            reopened = self._reopen(req)  # a concurrent retry of this first round may have won the race
        except RequestError:
            self.backend.release(state)
            raise
        if reopened is not None:
            self.backend.release(state)
            return reopened
        try:
            session = self.sessions.add(lambda sid: Session(
                id=sid, open_key=bytes(o.open_key), open_digest=_open_digest(o), tokens=tokens,
                prompt_len=len(prompt), settings=settings, stop_ids=self._stop_ids(settings),
                rng=rng, state=state, slo=slo))
        except OverflowError:
            self.backend.release(state)
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"all {self.max_sessions} session slots are in use; retry shortly",
                               retry_after_s=1.0) from None
        self.backend.note_open(state, bool(resume), slo.tpot_s if slo else None)   # live rounds first: prefill_budget
        metrics.SESSIONS.set(len(self.sessions))
        metrics.SESSIONS_OPENED.inc()
        if settings.max_new_tokens <= len(resume):
            session.finish_reason = pb.LENGTH
        return session

    async def _new_state(self):
        """A KV cache for a session or stream, made off the event loop (tens of milliseconds). When KV memory
        is full, the least recently used idle session is evicted (its edge replays later) and it is tried again."""
        try:
            return await run_in_thread(self.backend.new_state)
        except NoFreeState as e:
            refusal = str(e)
        if self.sessions.evict_idle(self.backend.release_frees_room):
            metrics.SESSIONS.set(len(self.sessions))
            try:
                return await run_in_thread(self.backend.new_state)
            except NoFreeState as e:
                refusal = str(e)
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{refusal}, and no session is idle to make room; retry shortly", retry_after_s=1.0)

    def close(self, session_id: str) -> bool:
        closed = self.sessions.remove(session_id)
        metrics.SESSIONS.set(len(self.sessions))
        return closed

    # --- cloud-only baseline ------------------------------------------------------------------

    async def generate(self, req: pb.GenerateRequest) -> AsyncIterator[pb.GenerateChunk]:
        prompt = list(req.prompt_token_ids)
        text, messages = self._text_prompt(req.prompt_text, req.prompt_messages, "")
        if prompt and (text is not None or messages is not None):
            raise _bad("prompt_token_ids and a text prompt are both set: send one")
        text_prompt = text is not None or messages is not None
        if text_prompt:
            prompt = await self._tokenize_prompt(text, messages, "")
        if not prompt:
            raise _bad("prompt_token_ids is empty")
        self._check_ids(prompt, "prompt_token_ids")
        settings = self._settings(req.sampling, req.HasField("sampling"))
        self._check_context(len(prompt))
        stop = self._stop_ids(settings)
        rng = seeded_rng(settings.seed, GENERATE_STREAM, len(prompt))
        if self._streams.locked():
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"all {self.max_sessions} Generate streams are busy; retry shortly",
                               retry_after_s=1.0)
        async with self._streams:
            state = await self._new_state()
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
                self.backend.set_deadline(state, self.default_slo.due(time.perf_counter(), first_token_at, generated))
            try:
                step = await run_in_thread(self.backend.sample_next, state, tokens, settings, rng)
            except StateLost as e:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the stream lost its KV cache ({e}); "
                                   "retry shortly", retry_after_s=1.0) from None
            now = time.perf_counter()
            self.commits.observe(now, 1)
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
                             max_tree_nodes=self.limits.max_tree_nodes if self.backend.supports_trees else 0,
                             max_tree_branching=self.limits.max_tree_branching,
                             batching=bool(getattr(self.backend, "batching", False)),
                             text_prompts=self.backend.has_vocabulary,
                             chat_prompts=self.backend.has_vocabulary and self.backend.chat_prompts(),
                             draft_budgets=self.limits.steer and self.backend.pass_cost() is not None,
                             slo=(pb.SessionSlo(tpot_ms=self.limits.slo_tpot_ms, ttft_ms=self.limits.slo_ttft_ms)
                                  if self.default_slo is not None else None),
                             verify_stream=True, max_window=self.limits.max_window)


# Backend calls block their worker thread while a batching backend gathers a pass: every session
# and stream in flight needs a thread of its own, or rounds queue here instead of in the batch
# (asyncio's default pool has min(32, cores + 4) threads). Threads are made on demand.
_WORKERS = ThreadPoolExecutor(max_workers=512, thread_name_prefix="verifier-worker")


async def run_in_thread(fn, *args):
    """Run a backend call in a worker thread. If the RPC is cancelled (client gone, deadline), wait
    for the thread to finish before giving up the caller's locks and state: freeing a KV cache
    that a thread is still decoding into crashes the process."""
    fut = asyncio.get_running_loop().run_in_executor(   # in the call's context: the backend reads its tenant
        _WORKERS, contextvars.copy_context().run, functools.partial(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await fut
        raise


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


def _text_open(o: pb.OpenSession) -> bool:
    return bool(o.prompt_text) or len(o.prompt_messages) > 0


@dataclass
class ValidOpen:
    """A first round's `open`, validated; a text prompt is tokenized once the session is admitted."""

    prompt: list[int]                       # the prompt's ids (empty for a text prompt)
    text: str | None                        # a text prompt, or
    messages: list[dict[str, str]] | None   # a conversation (chat template), or neither
    resume: list[int]                       # tokens committed earlier (a replay)
    settings: SamplingSettings
    slo: Slo | None


class ResolvedSession(NamedTuple):
    session: Session
    committed_length: int   # the round's committed length as the server counts it (text opens add the prompt)


def _open_digest(o: pb.OpenSession) -> bytes:
    return hashlib.sha256(o.SerializeToString(deterministic=True)).digest()
