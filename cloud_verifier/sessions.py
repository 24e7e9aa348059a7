"""Sessions: the committed sequence the verifier agrees on, a seeded RNG, the replies of its last
rounds; the store that holds them; and their lifecycle (`SessionLifecycle`: open, reopen, resolve,
end, close, lost).

Ids come from `secrets` (128 bits, unguessable). The store is an LRU bounded by `max_sessions`
and an idle TTL; an evicted session's edge gets NOT_FOUND and replays (nothing is lost: the edge
holds the committed sequence). A session used within `evict_idle_after_s` is not evicted to make
room for a new one: the newcomer is refused instead (admission control, see admission.py).

Tenants: a session belongs to the tenant of the call that opened it (`current_tenant`, set by
the server's interceptor from the bearer token; "" when the server runs without tokens). Open
keys are looked up per tenant, and `get` does not return another tenant's session, so a session
id or open key learned by someone else leads nowhere.
"""
from __future__ import annotations

import asyncio
import contextvars
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import grpc
import numpy as np

from cloud_verifier import metrics
from cloud_verifier.backends.base import Backend, NoFreeState
from cloud_verifier.validation import (RequestError, ValidOpen, ValidRound, Validator, open_digest, quoted,
                                       text_open)
from cloud_verifier.workers import run_in_thread
from spec_core import clock
from spec_core.proto import verifier_pb2 as pb
from spec_core.slo import Slo
from spec_core.steering import Acceptance
from spec_core.warping import VERIFIER_STREAM, SamplingSettings, seeded_rng

# The tenant the current call acts for; set per call by cloud_verifier.guard.CallGuard.
current_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("hybridspec_tenant", default="")

# Committed rounds whose replies a session keeps for retries. It must cover every round that can
# be in flight at once (today two: a round and the pipelined one after it; a window of k rounds
# needs k): a retry of a committed round older than this is answered "out of step" and the edge
# replays, which draws that round's outcome again.
REPLY_CACHE_ROUNDS = 16


class CachedReply(NamedTuple):
    digest: bytes               # what made the request that round (rounds.round_digest)
    reply: pb.VerifyReply


class ReplyCache:
    """The replies of a session's last `size` committed rounds, by round number.

    Why by round and not just the last one: with rounds in flight, round r + 1 may commit before
    the edge sees round r's reply (lost, then retried). Answering that retry with anything but
    round r's own reply makes the edge replay and draw round r again, and which outcomes get
    redrawn then depends on the outcome (r + 1 commits only when its continuation guessed r's
    outcome): the output would be biased. So a retry of any cached round gets its reply,
    whatever committed after it."""

    def __init__(self, size: int = REPLY_CACHE_ROUNDS):
        self.size = size
        self._by_round: OrderedDict[int, CachedReply] = OrderedDict()

    def get(self, round_: int) -> CachedReply | None:
        return self._by_round.get(round_)

    def put(self, round_: int, digest: bytes, reply: pb.VerifyReply) -> None:
        self._by_round[round_] = CachedReply(digest, reply)
        self._by_round.move_to_end(round_)
        while len(self._by_round) > self.size:
            self._by_round.popitem(last=False)

    def oldest(self) -> int | None:
        """The oldest round still answered from the cache (None: none yet)."""
        return next(iter(self._by_round), None)

    def __len__(self) -> int:
        return len(self._by_round)


@dataclass
class Session:
    id: str
    open_key: bytes
    open_digest: bytes            # sha256 of the `open` message, so a reused key cannot hijack
    tokens: list[int]             # committed: prompt + generated
    prompt_len: int               # prompt tokens; everything after them counts as generated,
                                  # including tokens replayed from an earlier session
    settings: SamplingSettings
    stop_ids: frozenset[int]
    rng: np.random.Generator
    state: object                 # backend state (KV cache)
    round: int = 0                # last completed round
    replies: ReplyCache = field(default_factory=ReplyCache)  # the last rounds' replies, for retries
    finish_reason: int = pb.NOT_FINISHED
    last_used: float = field(default_factory=clock.now)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tenant: str = ""              # who opened it (current_tenant at open); only they may use it
    round_done: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) per round;
                                                                       # pipelined rounds wait on it
    slo: "Slo | None" = None      # the latency target it is scheduled by (its own or the server's)
    first_token_at: tuple[float, int] | None = None  # (perf_counter, tokens committed) at its first commit
    acceptance: Acceptance = field(default_factory=Acceptance)  # α of its chains, for the draft budget

    def due(self, arrival: float) -> float | None:
        """When the round arriving at `arrival` (perf_counter) is due under the session's SLO."""
        if self.slo is None:
            return None
        return self.slo.due(arrival, self.first_token_at, len(self.tokens))

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class SessionStore:
    def __init__(self, max_sessions: int, ttl_s: float, release: Callable[[object], None],
                 evict_idle_after_s: float = 0.0):
        self.max_sessions, self.ttl_s, self._release = max_sessions, ttl_s, release
        self.evict_idle_after_s = evict_idle_after_s
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._by_open_key: dict[tuple[str, bytes], str] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def peek(self, session_id: str) -> Session | None:
        """The session with this id whoever owns it, without touching its LRU place (for owner checks)."""
        return self._by_id.get(session_id)

    def get(self, session_id: str) -> Session | None:
        self.expire()
        s = self._by_id.get(session_id)
        if s is None or s.tenant != current_tenant.get():
            return None
        s.last_used = clock.now()
        self._by_id.move_to_end(session_id)
        return s

    def by_open_key(self, key: bytes) -> Session | None:
        sid = self._by_open_key.get((current_tenant.get(), key)) if key else None
        return self.get(sid) if sid else None

    def _evictable(self, s: Session, now: float) -> bool:
        return not s.lock.locked() and (s.state is None or now - s.last_used >= self.evict_idle_after_s)

    def has_room(self) -> bool:
        """Whether add() would find a slot now (a free one, or an idle session to evict)."""
        self.expire()
        now = clock.now()
        return len(self._by_id) < self.max_sessions or any(self._evictable(s, now) for s in self._by_id.values())

    def unfinished(self, tenant: str) -> int:
        """Sessions of `tenant` still generating (finished ones only wait for a retried last round)."""
        return sum(1 for s in self._by_id.values() if s.tenant == tenant and s.state is not None)

    def add(self, make: Callable[[str], Session]) -> Session:
        self.expire()
        now = clock.now()
        while len(self._by_id) >= self.max_sessions:
            # Evict the least recently used session that is neither mid-round nor recently used,
            # preferring finished ones (kept only to answer a retried last round; they hold no KV cache).
            idle = [s for s in self._by_id.values() if self._evictable(s, now)]
            victim = next((s for s in idle if s.state is None), idle[0] if idle else None)
            if victim is None:
                raise OverflowError("every session slot is busy")
            self.remove(victim.id)
            self.evicted += 1
        s = make(secrets.token_urlsafe(16))
        s.tenant = current_tenant.get()
        self._by_id[s.id] = s
        if s.open_key:
            self._by_open_key[(s.tenant, s.open_key)] = s.id
        return s

    def evict_idle(self, frees_room: Callable[[object], bool] = lambda state: True) -> bool:
        """Evict the least recently used session holding a KV cache that is neither mid-round nor
        used within `evict_idle_after_s`, and whose release makes room for a new one
        (`frees_room(state)`, the backend's Backend.release_frees_room: not a session whose KV
        cells are parked in host memory while no place is free, as evicting it frees no place)."""
        now = clock.now()
        victim = next((s for s in self._by_id.values()
                       if s.state is not None and self._evictable(s, now) and frees_room(s.state)), None)
        if victim is None:
            return False
        self.remove(victim.id)
        self.evicted += 1
        return True

    def remove(self, session_id: str) -> bool:
        s = self._by_id.pop(session_id, None)
        if s is None:
            return False
        if self._by_open_key.get((s.tenant, s.open_key)) == s.id:
            del self._by_open_key[(s.tenant, s.open_key)]
        if s.lock.locked():
            # A round is mid-flight on this state: free it once that round lets go of the session.
            asyncio.get_running_loop().create_task(self._release_when_idle(s))
        else:
            self._release_now(s)
        return True

    def _release_now(self, s: Session) -> None:
        if s.state is not None:
            self._release(s.state)
            s.state = None

    async def _release_when_idle(self, s: Session) -> None:
        async with s.lock:
            self._release_now(s)

    def expire(self) -> None:
        cutoff = clock.now() - self.ttl_s
        for sid in [sid for sid, s in self._by_id.items() if s.last_used < cutoff and not s.lock.locked()]:
            self.remove(sid)
            self.evicted += 1

    def clear(self) -> None:
        for sid in list(self._by_id):
            self.remove(sid)

    def sessions(self):
        return list(self._by_id.values())


class ResolvedSession(NamedTuple):
    session: Session
    committed_length: int   # the round's committed length as the server counts it (text opens add the prompt)


class SessionLifecycle:
    """A session from its first round to its end: open it (a KV cache from the backend, evicting an
    idle session when the backend's memory is full), find it again for a retried first round
    (`reopen`) or a later round (`resolve`), and drop it when it ends, is closed or loses its state."""

    def __init__(self, store: SessionStore, backend: Backend, validator: Validator, max_sessions: int):
        self.store, self.backend, self.validator, self.max_sessions = store, backend, validator, max_sessions

    async def resolve(self, valid: ValidRound) -> ResolvedSession:
        """The session a round names, or the one its `open` makes (or made: a retried first round)."""
        req = valid.req
        if req.session_id:
            session = self.store.get(req.session_id)
            if session is None:
                raise RequestError(grpc.StatusCode.NOT_FOUND,
                                   f"session {quoted(req.session_id)} is unknown here (evicted, expired, or the "
                                   "verifier restarted): resend the round with `open` to replay the committed tokens")
            return ResolvedSession(session, req.committed_length)
        session = self.reopen(req) or await self.open(req, valid.open)
        # A text open: the edge counted only what follows the prompt it could not tokenize (see the .proto).
        return ResolvedSession(session, req.committed_length + (session.prompt_len if text_open(req.open) else 0))

    def reopen(self, req: pb.VerifyRequest) -> Session | None:
        """A retried first round: the same open_key and the same `open` map to the same session."""
        o = req.open
        session = self.store.by_open_key(o.open_key)
        if session is not None and session.open_digest != open_digest(o):
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               "open.open_key is already used by a session with a different prompt or settings; "
                               "draw a fresh random key per generation")
        return session

    async def tokenize(self, valid: ValidOpen) -> None:
        """A text prompt's ids, once, in `valid` (admission counts them in tokens; `open` uses them)."""
        if valid.text is not None or valid.messages is not None:
            valid.prompt = await self.validator.tokenize_prompt(valid.text, valid.messages, "open.")
            valid.text = valid.messages = None
            self.validator.check_context(len(valid.prompt) + len(valid.resume))

    async def open(self, req: pb.VerifyRequest, valid: ValidOpen) -> Session:
        o = req.open
        await self.tokenize(valid)
        prompt, resume, settings, slo = valid.prompt, valid.resume, valid.settings, valid.slo
        # The gumbel coupling reads noise keyed by the seed: without one, the session draws its own
        # and keeps it (a replay to this session reads the same noise).
        settings = settings.with_session_seed()
        tokens = prompt + resume
        # The verifier's stream must be independent of the edge's even when both get the same user
        # seed (identical streams correlate draft sampling with acceptance and bias the output), and
        # a replay must not restart a stream already used: key it by role and committed length.
        rng = seeded_rng(settings.seed, VERIFIER_STREAM, len(tokens))
        state = await self.new_state()
        try:
            reopened = self.reopen(req)  # a concurrent retry of this first round may have won the race
        except RequestError:
            self.backend.release(state)
            raise
        if reopened is not None:
            self.backend.release(state)
            return reopened
        try:
            session = self.store.add(lambda sid: Session(
                id=sid, open_key=bytes(o.open_key), open_digest=open_digest(o), tokens=tokens,
                prompt_len=len(prompt), settings=settings, stop_ids=self.validator.stop_ids(settings),
                rng=rng, state=state, slo=slo))
        except OverflowError:
            self.backend.release(state)
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"all {self.max_sessions} session slots are in use; retry shortly",
                               retry_after_s=1.0) from None
        self.backend.note_open(state, bool(resume), slo.tpot_s if slo else None)   # live rounds first: prefill_budget
        metrics.SESSIONS.set(len(self.store))
        metrics.SESSIONS_OPENED.inc()
        if settings.max_new_tokens <= len(resume):
            session.finish_reason = pb.LENGTH
        return session

    async def new_state(self):
        """A KV cache for a session or stream. Making one takes tens of milliseconds: not on the
        event loop. When the backend's KV memory is full, the least recently used idle session
        is evicted (its edge replays later) and the allocation retried once."""
        try:
            return await run_in_thread(self.backend.new_state)
        except NoFreeState as e:
            refusal = str(e)
        if self.store.evict_idle(self.backend.release_frees_room):
            metrics.SESSIONS.set(len(self.store))
            try:
                return await run_in_thread(self.backend.new_state)
            except NoFreeState as e:
                refusal = str(e)
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{refusal}, and no session is idle to make room; retry shortly", retry_after_s=1.0)

    def close(self, session_id: str) -> bool:
        closed = self.store.remove(session_id)
        metrics.SESSIONS.set(len(self.store))
        return closed

    def alive(self, session: Session) -> bool:
        """Still held here, and not closed or evicted while a round waited for its lock."""
        return self.store.get(session.id) is session and not (
            session.state is None and session.finish_reason == pb.NOT_FINISHED)

    def end(self, session: Session) -> None:
        """Generation finished: keep the (small) session for retries of its last round; free its KV cache now."""
        self.backend.release(session.state)
        session.state = None

    def lost(self, session: Session, e: Exception) -> RequestError:
        """The backend lost the session's state (StateLost): drop it; its edge is told to replay (NOT_FOUND)."""
        self.store.remove(session.id)
        metrics.SESSIONS.set(len(self.store))
        return RequestError(grpc.StatusCode.NOT_FOUND,
                            f"session {quoted(session.id)} lost its KV cache ({e}): resend the round with `open` to "
                            "replay the committed tokens")
