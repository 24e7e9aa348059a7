"""Sessions: the committed sequence the verifier agrees on, a seeded RNG, the last reply.

Ids come from `secrets` (128 bits, unguessable). The store is an LRU bounded by `max_sessions`
and an idle TTL; an evicted session's edge gets NOT_FOUND and replays (nothing is lost: the edge
holds the committed sequence).
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import SamplingSettings


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
    last_reply: pb.VerifyReply | None = None
    last_request_digest: bytes = b""
    finish_reason: int = pb.NOT_FINISHED
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    round_done: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) per round;
                                                                       # pipelined rounds wait on it

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class SessionStore:
    def __init__(self, max_sessions: int, ttl_s: float, release: Callable[[object], None]):
        self.max_sessions, self.ttl_s, self._release = max_sessions, ttl_s, release
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._by_open_key: dict[bytes, str] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, session_id: str) -> Session | None:
        self.expire()
        s = self._by_id.get(session_id)
        if s is not None:
            s.last_used = time.monotonic()
            self._by_id.move_to_end(session_id)
        return s

    def by_open_key(self, key: bytes) -> Session | None:
        sid = self._by_open_key.get(key) if key else None
        return self.get(sid) if sid else None

    def add(self, make: Callable[[str], Session]) -> Session:
        self.expire()
        while len(self._by_id) >= self.max_sessions:
            # Evict the least recently used session that is not mid-round.
            victim = next((s for s in self._by_id.values() if not s.lock.locked()), None)
            if victim is None:
                raise OverflowError("every session slot is busy")
            self.remove(victim.id)
            self.evicted += 1
        s = make(secrets.token_urlsafe(16))
        self._by_id[s.id] = s
        if s.open_key:
            self._by_open_key[s.open_key] = s.id
        return s

    def remove(self, session_id: str) -> bool:
        s = self._by_id.pop(session_id, None)
        if s is None:
            return False
        self._by_open_key.pop(s.open_key, None)
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
        cutoff = time.monotonic() - self.ttl_s
        for sid in [sid for sid, s in self._by_id.items() if s.last_used < cutoff and not s.lock.locked()]:
            self.remove(sid)
            self.evicted += 1

    def clear(self) -> None:
        for sid in list(self._by_id):
            self.remove(sid)

    def sessions(self):
        return list(self._by_id.values())
