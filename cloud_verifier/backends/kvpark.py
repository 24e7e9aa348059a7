"""Sessions' places in the batched llama.cpp verifier's shared KV cache, and parking.

A hybrid session's round holds the target for one pass; then its KV cache waits, unused, while
the reply crosses the link, the edge drafts, and the next round crosses back (on a 3g link,
hundreds of milliseconds against a pass of tens). `SeqBook` measures that (metrics:
hybridspec_kv_session_seconds{state=busy|idle|parked}) and, with parking on, moves idle sessions'
cells to host memory when the cache is short, so that the cache holds more sessions than it
has places for:

- a new session, or a parked session's next round, needs a place and none is free: the idle
  session that spec_core.kvpark.choose_victim picks is parked (SharedKV.park: its cells are
  copied out and its place freed), between passes;
- a parked session's next round takes a free place and its cells are copied back
  (SharedKV.restore) bit for bit; its logits are those it would have had unparked;
- a round that finds no place waits for one (a session in a pass becomes idle when the pass
  ends) up to `restore_wait_s`, then fails with StateLost (the edge is told NOT_FOUND and replays);
- a park or restore that llama.cpp refuses loses the cells, not the session: it restarts from an
  empty place and the batcher evaluates its committed tokens again (a replay on the server).

Parked bytes are bounded (`max_bytes`); the backend promises only as many sessions as fit them
at their full context (spec_core.kvpark.parked_capacity), so a park never fails for room.
Locks: the model is used between passes only (Batcher.acquire); `_lock` guards the bookkeeping
and is never held while waiting for the model.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from cloud_verifier import metrics
from cloud_verifier.backends.base import NoFreeState, StateLost
from llama_runtime import ParkedSeq, SharedKV
from spec_core.kvpark import ParkCandidate, ParkCost, choose_victim, ewma

log = logging.getLogger(__name__)

_EMPTY = np.empty(0, dtype=np.uint8)


@dataclass(eq=False)
class SeqState:
    """A session's (or stream's) place in the shared KV cache.
    seq: its sequence id; None while parked, and once released."""
    seq: int | None
    parked: ParkedSeq | None = None
    released: bool = False
    busy: bool = True                 # a round is in the backend (and from new_state to its first round)
    idle_since: float | None = None   # when its last round's pass ended (monotonic)
    parked_at: float | None = None
    mean_gap_s: float | None = None   # its mean idle gap, the forecast of its next round


class SeqBook:
    def __init__(self, kv: SharedKV, batcher, park: bool = False, max_bytes: int = 0, order: str = "next-use",
                 bytes_per_token: int = 0, restore_wait_s: float = 10.0):
        self.kv, self.batcher, self.park_on, self.max_bytes, self.order = kv, batcher, park, max_bytes, order
        self.bytes_per_token, self.restore_wait_s = bytes_per_token, restore_wait_s
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)   # notified when a session goes idle or is freed
        self._states: set[SeqState] = set()
        self.parked_bytes = 0
        self.cost = ParkCost()
        metrics.track_parking(self)

    @property
    def parked_sessions(self) -> int:
        with self._lock:
            return sum(1 for s in self._states if s.seq is None)

    # --- places ---------------------------------------------------------------------------------

    def new_state(self) -> SeqState:
        """A place for a new session: a free one, or (parking) an idle session's, waiting up to
        `restore_wait_s` for one to come free when every session is in a round."""
        got: list[int] = []

        def take() -> bool:
            seq = self._take_place()
            if seq is not None:
                got.append(seq)
            return seq is not None
        if not self.batcher.acquire(take) and self.park_on:
            self._wait(take, time.monotonic())
        seq = got[0] if got else None
        if seq is None:
            why = ", all in use" + (" or idle for less than parking one would cost" if self.park_on else "")
            raise NoFreeState(f"the KV cache holds {self.kv.n_seqs} sessions of {self.kv.seq_ctx} tokens{why}")
        state = SeqState(seq)
        with self._lock:
            self._states.add(state)
        return state

    def release(self, state: SeqState) -> None:
        with self._lock:
            if state.released:
                return
            state.released = True
            seq, state.seq = state.seq, None
            if state.parked is not None:
                self.parked_bytes -= state.parked.nbytes
                state.parked = None
            self._states.discard(state)
            self._idle.notify_all()
        if seq is not None:
            self.batcher.release(seq)

    @contextlib.contextmanager
    def round(self, state: SeqState):
        """Around one round's backend call: the session is busy (never parked), its KV is in the
        cache (restored if it was parked), and its time is counted busy, idle or parked."""
        t0 = time.monotonic()
        with self._lock:
            if state.released:
                raise RuntimeError("this session's KV cache was released")
            state.busy = True
            if state.idle_since is not None:
                gap = t0 - state.idle_since
                parked = t0 - state.parked_at if state.parked_at is not None else 0.0
                metrics.observe_idle_gap(gap - parked, parked)
                state.mean_gap_s = ewma(state.mean_gap_s, gap)
            missing = state.seq is None
        try:
            if missing:
                self._restore(state, t0)
            yield state.seq
        finally:
            t1 = time.monotonic()
            metrics.KV_SESSION_SECONDS.labels("busy").inc(t1 - t0)
            with self._lock:
                state.busy, state.idle_since, state.parked_at = False, t1, None
                self._idle.notify_all()

    # --- between passes (the model is ours: Batcher.acquire) -----------------------------------

    def _take_place(self) -> int | None:
        seq = self.kv.acquire()
        if seq is None and self.park_on and self._park_one():
            seq = self.kv.acquire()
        return seq

    def _park_one(self) -> bool:
        """Park the idle session choose_victim picks; False when there is none."""
        now = time.monotonic()
        with self._lock:
            by_key = {id(s): s for s in self._states if s.seq is not None and not s.busy and not s.released}
            key = choose_victim([ParkCandidate(k, s.idle_since or 0.0, self._estimate(s.seq), s.mean_gap_s)
                                 for k, s in by_key.items()], now, self.cost, self.max_bytes - self.parked_bytes,
                                self.order)
        return key is not None and self._park(by_key[key])

    def park(self, state: SeqState) -> bool:
        """Park an idle session now, short of room or not (tests force parking with it)."""
        return self.batcher.acquire(lambda: self._park(state))

    def _park(self, victim: SeqState) -> bool:
        with self._lock:
            if victim.seq is None or victim.busy or victim.released:
                return False
            estimate = self._estimate(victim.seq)
            seq, victim.seq, victim.parked_at = victim.seq, None, time.monotonic()
            self.parked_bytes += estimate    # reserved until the real size is known
        t0 = time.perf_counter()
        try:
            parked = self.kv.park(seq)
        except RuntimeError:
            log.exception("parking a session's KV cells failed; it will be evaluated again from its tokens")
            metrics.KV_PARK_FAILURES.labels("park").inc()
            parked = ParkedSeq([], _EMPTY)
        seconds = time.perf_counter() - t0
        with self._lock:
            self.parked_bytes += parked.nbytes - estimate
            if victim.released:           # closed while it was being parked
                self.parked_bytes -= parked.nbytes
            else:
                victim.parked = parked
            if parked.tokens:
                self.cost = self.cost.observed(parked.nbytes, park_s=seconds)
        metrics.observe_park(parked.nbytes, seconds)
        return True

    def _estimate(self, seq: int) -> int:
        return (len(self.kv.held[seq]) + 1) * self.bytes_per_token

    def _restore_now(self, state: SeqState) -> bool:
        """Bring a parked session's cells back into a free place; False when none is free."""
        if self.kv.free_seqs == 0 and not self._park_one():
            return False
        with self._lock:
            parked = state.parked if state.parked is not None else ParkedSeq([], _EMPTY)
        t0 = time.perf_counter()
        try:
            seq = self.kv.restore(parked)
        except RuntimeError:
            log.exception("restoring a session's KV cells failed; it will be evaluated again from its tokens")
            metrics.KV_PARK_FAILURES.labels("restore").inc()
            seq = self.kv.acquire()
            parked = ParkedSeq([], _EMPTY)
        if seq is None:
            return False
        seconds = time.perf_counter() - t0
        with self._lock:
            if state.released:            # (a round and a release never overlap; be safe)
                self.kv.release(seq)
                raise RuntimeError("this session's KV cache was released")
            if state.parked is not None:
                self.parked_bytes -= state.parked.nbytes
            state.seq, state.parked = seq, None
            if parked.tokens:
                self.cost = self.cost.observed(parked.nbytes, restore_s=seconds)
        metrics.observe_restore(seconds)
        return True

    def _restore(self, state: SeqState, t0: float) -> None:
        if not self._wait(lambda: self._restore_now(state), t0):
            metrics.KV_PARK_FAILURES.labels("no_place").inc()
            raise StateLost(f"no place in the KV cache came free within {self.restore_wait_s:g} s to bring "
                            "this session's parked cells back")
        metrics.KV_RESTORE_WAIT_SECONDS.inc(time.monotonic() - t0)

    def _wait(self, attempt, t0: float) -> bool:
        """Run `attempt` between passes until it returns True, for up to `restore_wait_s` from t0."""
        deadline = t0 + self.restore_wait_s
        while not self.batcher.acquire(attempt):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._lock:
                # A place comes free when a session's pass ends (and it has been idle for as long
                # as moving it costs) or a session is released: try again then, or soon.
                self._idle.wait(min(left, 0.005 + self.cost.fixed_s))
        return True
