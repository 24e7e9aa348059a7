"""Sessions' places in a batching verifier's KV cache (llama.cpp's SharedKV, or the synthetic
target's stand-in for one), and parking.

A hybrid session's round holds the target for one pass; then its KV cache waits, unused, while
the reply crosses the link, the edge drafts, and the next round crosses back (on a 3g link,
hundreds of milliseconds against a pass of tens). `SeqBook` measures that (metrics:
hybridspec_kv_session_seconds{state=busy|idle|parked}) and, with parking on, moves idle sessions'
cells to host memory when the cache is short, so that the cache holds more sessions than it
has places for:

- a new session, or a parked session's next round, needs a place and none is free: the idle
  session that spec_core.kvpark.choose_victim picks is parked (SharedKV.park: its cells are
  copied out and its place freed; it keeps its sequence id), between passes;
- a parked session's next round takes a free place and its cells are copied back
  (SharedKV.restore) bit for bit, as the batcher prepares the round (`PlacePacker`), so the round
  joins the pass that comes next; its logits are those it would have had unparked;
- a round that finds no place waits for one (a session in a pass becomes idle when the pass
  ends) up to `restore_wait_s`, then fails with StateLost (the edge is told NOT_FOUND and replays);
  so does one whose cells fit only after a compaction while another session's tree is in flight
  (SharedKV.restore says "not now": compacting would drop the tree's node cells);
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
from spec_core import clock
from spec_core.estimates import ewma
from spec_core.kvpark import ParkCandidate, ParkCost, choose_victim

log = logging.getLogger(__name__)

DEFAULT_KV_SESSIONS = 8           # a batching backend's default KV pool: places for 8 sessions
DEFAULT_KV_PARK_BYTES = 1 << 30   # host memory for parked cells


def check_park_options(park: bool, batching: bool, max_bytes: int, order: str) -> None:
    """Refuse parking options that cannot work (ValueError naming the flag), before a model loads."""
    if park and not batching:
        raise ValueError("--kv-park on needs --batching on: the serial verifier has no shared KV cache")
    if park and max_bytes <= 0:
        raise ValueError(f"--kv-park-bytes must be positive with --kv-park on, got {max_bytes}")
    if order not in ("next-use", "lru"):
        raise ValueError(f"--kv-park-order must be next-use or lru, got {order!r}")


_EMPTY = ParkedSeq([], np.empty(0, dtype=np.uint8))


class NoPlaceYet(RuntimeError):
    """A parked session's round found no place in the cache this time round."""
    retry_after_pass = True   # the Batcher prepares it again after the next pass


@dataclass(eq=False)
class SeqState:
    """A session's (or stream's) sequence in the shared KV cache; seq is None once released."""
    seq: int | None
    parked: ParkedSeq | None = None   # its cells in host memory, while parked
    released: bool = False
    busy: bool = True                 # a round is in the backend (and from new_state to its first round)
    idle_since: float | None = None   # when its last round's pass ended (spec_core.clock)
    parked_at: float | None = None
    round_t0: float = 0.0             # when its current round arrived
    mean_gap_s: float | None = None   # its mean idle gap, the forecast of its next round
    # The session KV store (cloud_verifier.backends.kvstore), with --kv-store:
    tenant: str = ""                  # whose session it is (checkpoints are looked up per tenant)
    ckpt_key: str | None = None       # its checkpoint file's key, once it has one
    ckpt_at: float = float("-inf")    # when its last checkpoint was taken (spec_core.clock; never yet)
    ckpt_looked: bool = False         # its first round looked for a checkpoint to restore
    ckpt_queued: bool = False         # a checkpoint is waiting for the batcher


class SeqBook:
    def __init__(self, kv: SharedKV, batcher, park: bool = False, max_bytes: int = 0, order: str = "next-use",
                 bytes_per_token: int = 0, restore_wait_s: float = 10.0):
        self.kv, self.batcher, self.park_on, self.max_bytes, self.order = kv, batcher, park, max_bytes, order
        self.bytes_per_token, self.restore_wait_s = bytes_per_token, restore_wait_s
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)   # notified when a session goes idle or is freed
        self._by_seq: dict[int, SeqState] = {}
        self.parked_bytes = 0
        self.cost = ParkCost()
        metrics.track_parking(self)

    @property
    def parked_sessions(self) -> int:
        with self._lock:
            return sum(1 for s in self._by_seq.values() if s.parked is not None)

    # --- sessions -------------------------------------------------------------------------------

    def new_state(self) -> SeqState:
        """A sequence for a new session: one with a free place, or (parking) an idle session's
        place, waiting up to `restore_wait_s` for one when every session is in a round."""
        got: list[int] = []

        def take() -> bool:
            seq = self.kv.acquire()
            if seq is None and self.park_on and self._park_one():
                seq = self.kv.acquire()
            if seq is not None:
                got.append(seq)
            return seq is not None
        if not self.batcher.acquire(take) and self.park_on:
            self._wait(lambda: self.batcher.acquire(take), time.monotonic())
        if not got:
            why = ", all in use" + (" or idle for less than parking one would cost" if self.park_on else "")
            raise NoFreeState(f"the KV cache holds {self.kv.n_seqs} sessions of {self.kv.seq_ctx} tokens{why}")
        state = SeqState(got[0])
        with self._lock:
            self._by_seq[state.seq] = state
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
            self._by_seq.pop(seq, None)
            self._idle.notify_all()
        if seq is not None:
            self.batcher.release(seq)

    @contextlib.contextmanager
    def round(self, state: SeqState):
        """Around one round's backend call: the session is busy (never parked meanwhile), and its
        time is counted busy, idle or parked. Yields its sequence id."""
        t0 = clock.now()
        with self._lock:
            if state.released:
                raise RuntimeError("this session's KV cache was released")
            state.busy, state.round_t0 = True, t0
            if state.idle_since is not None:
                gap = t0 - state.idle_since
                parked = t0 - state.parked_at if state.parked_at is not None else 0.0
                metrics.observe_idle_gap(gap - parked, parked)
                state.mean_gap_s = ewma(state.mean_gap_s, gap)
        try:
            yield state.seq
        finally:
            t1 = clock.now()
            metrics.KV_SESSION_SECONDS.labels("busy").inc(t1 - t0)
            with self._lock:
                state.busy, state.idle_since = False, t1
                if state.parked is None:
                    state.parked_at = None
                self._idle.notify_all()

    def run(self, state: SeqState, call):
        """A round's batcher call; while the batcher finds no place for a parked session's cells
        with nothing else to run (NoPlaceYet), wait for a session to go idle and try again, up to
        `restore_wait_s`; then StateLost."""
        while True:
            try:
                return call()
            except NoPlaceYet:
                if not self._wait(lambda: False, state.round_t0, once=True):
                    metrics.KV_PARK_FAILURES.labels("no_place").inc()
                    raise StateLost(f"no place in the KV cache came free within {self.restore_wait_s:g} s to "
                                    "bring this session's parked cells back") from None

    def frees_room(self, state: SeqState) -> bool:
        """Whether releasing `state` lets a new session have a sequence: one in a place frees it; a
        parked one frees only its id, which is enough only when a place is free already."""
        with self._lock:
            parked = state.parked is not None
        return not parked or self.kv.free_places > 0

    def park(self, state: SeqState) -> bool:
        """Park an idle session now, short of room or not (tests force parking with it)."""
        return self.batcher.acquire(lambda: self._park(state))

    # --- between passes (the model is ours: Batcher thread, or Batcher.acquire) ------------------

    def bring_back(self, seq: int) -> None:
        """Before a round of `seq` is prepared: restore its cells if they are parked, parking
        another idle session if no place is free (NoPlaceYet when none may be)."""
        if seq not in self.kv.parked:
            return
        with self._lock:
            state = self._by_seq.get(seq)
            parked = state.parked if state is not None and state.parked is not None else _EMPTY
        if self.kv.free_places <= 0 and not self._park_one():
            raise NoPlaceYet(f"no place in the KV cache for parked sequence {seq} yet")
        t0 = clock.now()
        try:
            if not self.kv.restore(seq, parked):
                raise NoPlaceYet(f"no place in the KV cache for parked sequence {seq} yet")
        except NoPlaceYet:
            raise
        except RuntimeError:
            log.exception("restoring a session's KV cells failed; its tokens will be evaluated again")
            metrics.KV_PARK_FAILURES.labels("restore").inc()
            parked = _EMPTY
        seconds = clock.now() - t0
        with self._lock:
            if state is not None and state.parked is not None:
                self.parked_bytes -= state.parked.nbytes
                state.parked = None
            if parked.tokens:
                self.cost = self.cost.observed(parked.nbytes, restore_s=seconds)
            waited = clock.now() - state.round_t0 if state is not None else 0.0
        metrics.observe_restore(seconds)
        metrics.KV_RESTORE_WAIT_SECONDS.inc(waited)

    def _park_one(self) -> bool:
        """Park the idle session choose_victim picks; False when there is none."""
        now = clock.now()
        with self._lock:
            idle = {s.seq: s for s in self._by_seq.values()
                    if not s.busy and not s.released and s.seq not in self.kv.parked}
            seq = choose_victim([ParkCandidate(q, s.idle_since or 0.0, self._estimate(q), s.mean_gap_s)
                                 for q, s in idle.items()], now, self.cost, self.max_bytes - self.parked_bytes,
                                self.order)
        return seq is not None and self._park(idle[seq])

    def _park(self, victim: SeqState) -> bool:
        with self._lock:
            if victim.seq is None or victim.busy or victim.released or victim.seq in self.kv.parked:
                return False
            seq, estimate = victim.seq, self._estimate(victim.seq)
            victim.parked, victim.parked_at = _EMPTY, clock.now()
            self.parked_bytes += estimate    # reserved until the real size is known
        t0 = clock.now()
        try:
            parked = self.kv.park(seq)
        except RuntimeError:
            log.exception("parking a session's KV cells failed; its tokens will be evaluated again")
            metrics.KV_PARK_FAILURES.labels("park").inc()
            parked = _EMPTY
        seconds = clock.now() - t0
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

    def _wait(self, attempt, t0: float, once: bool = False) -> bool:
        """Try `attempt` until it returns True, waiting for a session to go idle (or 5 ms) between
        tries, up to `restore_wait_s` from t0. once: wait once, and say whether time is left."""
        deadline = t0 + self.restore_wait_s
        while not attempt():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._lock:
                # A place comes free when a session's pass ends (and it has been idle for as long
                # as moving it costs) or a session is released: try again then, or soon.
                self._idle.wait(min(left, 0.005))
            if once:
                return time.monotonic() < deadline
        return True


class PlacePacker:
    """The shared cache as the Batcher's packer, with parked sessions brought back as their rounds
    are prepared (SeqBook.bring_back), between passes, on the batcher's thread."""

    def __init__(self, kv: SharedKV, book: SeqBook):
        self.kv, self.book, self.n_ubatch = kv, book, kv.n_ubatch

    def prepare(self, seq, tokens, rows):
        self.book.bring_back(seq)
        return self.kv.prepare(seq, tokens, rows)

    def decode(self, items):
        return self.kv.decode(items)

    def release(self, seq: int) -> None:
        self.kv.release(seq)

    def maintain(self) -> bool:
        return self.kv.maintain()

    def tree_job(self, seq, committed, tokens, parents):
        return _BroughtBack(self.kv.tree_job(seq, committed, tokens, parents), self.book)


class _BroughtBack:
    def __init__(self, job, book: SeqBook):
        self.job, self.book = job, book

    def prepare(self):
        self.book.bring_back(self.job.seq)
        return self.job.prepare()

    def finish(self) -> None:
        self.job.finish()
