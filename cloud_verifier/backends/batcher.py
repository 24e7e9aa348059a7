"""Continuous batching: rounds (and Generate steps) of many sessions share target passes.

Callers block in `Batcher.submit` from their worker threads. One batcher thread owns the model:
when a pass finishes it takes every request that has arrived since (a round never waits for a
batch to fill; `window_s` optionally waits that long after the first arrival when the batcher is
idle), and packs the pending tokens of all active requests into the next pass. Each active
request gets a fair share of a pass and the rest of the pass is filled in arrival order: that is
`spec_core.batchplan.fair_share`, which the fleet simulator plans with too. With
`schedule="slack"` the pass is planned by `spec_core.batchplan.least_slack_first` instead: least
slack before the request's deadline first (the engine sets each session's deadline from its SLO,
`set_deadline`). Under either schedule a prefill (a prompt, a replay: more than `prefill_chunk`
tokens evaluated for the cache, not for rows) takes at most `prefill_chunk` tokens of a pass
until every round in it got all it had (`spec_core.batchplan.chunk_prefills`): rounds are served
as if each prompt had a chunk left to evaluate, and wait for no more of a prompt than the pass in
flight when they arrived. Without a fixed `prefill_chunk` the chunk is sized pass by pass from the
measured cost line and the live sessions' pace: a share of each pass that carries rounds, and in
a pass without any, the time until the next live round is due (cloud_verifier.backends.
prefill_budget: replays first, then new sessions in arrival order).
Either way a pass is a set of tokens whose rows do not depend on each other: the order changes
when a round is done, never what it computes.
The batcher also keeps the line of its pass costs (`cost`, seconds over tokens) that the engine's
draft budget is priced with (spec_core.steering).

The model is a `Packer`: `prepare` rolls a request's sequence back and lists the tokens to
evaluate as `PassItem`s (seq, pos, token, want_logits); `decode` runs one pass over such items. A
request's items need not come from a single sequence: a tree round (`submit_tree`, with a packer
that has `tree_job`) lists its nodes on sequence ids of their own, for as long as the request
runs; such a job may have to wait a pass for ids, and is prepared again if the packer's
`maintain` (called between passes) moved the cache under it.

Freeing a sequence (`release`) never blocks the caller (the event loop frees sessions): it is
queued and applied between passes, so a pass never decodes into freed cells, and a released
sequence's pending request fails instead. `acquire` applies queued releases first.

Times are spec_core.clock's. Made under a virtual clock the batcher has no thread: `submit` runs
the batcher's turns inline until its request is done (one process, one event loop), and each
pass's seconds are what the packer charged the clock.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from cloud_verifier.backends.prefill_budget import PrefillBudget, cap_prefills, chunk_tokens, order
from spec_core import clock
from spec_core.batchplan import PassItem, fair_share, least_slack_first
from spec_core.steering import PassCostLine

log = logging.getLogger(__name__)


class Packer(Protocol):
    n_ubatch: int

    def prepare(self, seq: int, tokens: Sequence[int], rows: int) -> list[PassItem]: ...

    def decode(self, items: Sequence[PassItem]) -> list[np.ndarray]: ...

    def release(self, seq: int) -> None: ...

    # Optional: `maintain() -> bool` between passes (True: jobs must be prepared again), and
    # `tree_job(seq, committed, tokens, parents)` -> an object with prepare() -> items (may raise
    # an exception with `retry_after_pass = True`: what it needs is held by requests in flight)
    # and finish().


@dataclass
class BatchStep:
    """What one pass did, for metrics: real tokens (no padding), distinct sessions, seconds."""
    tokens: int
    sessions: int
    seconds: float


@dataclass
class _Request:
    seq: int
    prepare: Callable[[], list[PassItem]]      # (re)builds the items; batcher thread, between passes
    finish: Callable[[], None] | None = None   # once, when the request ends (done or failed)
    redo_after_maintain: bool = False          # prepare again from scratch if the packer moved the cache
    t_submit: float = field(default_factory=clock.now)
    deadline: float | None = None              # spec_core.clock time it is due (schedule "slack"); None: on arrival
    items: list[PassItem] = field(default_factory=list)
    cursor: int = 0
    out: list[np.ndarray] = field(default_factory=list)
    t_first: float | None = None
    t_done: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class PrefillPass(NamedTuple):
    """What one planned pass gave live rounds and prefills (Batcher.prefill_log, for tests and benches)."""
    round_tokens: int          # tokens of rounds (requests with at most a base chunk of cache tokens)
    prefill_tokens: int        # tokens of prefills (prompts, replays)
    chunk: int | None          # the rule's bound on prefill_tokens (None: no session was live)


SCHEDULES = ("fair", "slack")


def _first(before: Callable[[], None] | None, prepare: Callable[[], list[PassItem]]) -> Callable[[], list[PassItem]]:
    """`prepare`, with `before` run once ahead of its first call (a request may be prepared again)."""
    if before is None:
        return prepare
    pending = [before]

    def run() -> list[PassItem]:
        while pending:
            pending.pop()()
        return prepare()
    return run


class Batcher:
    def __init__(self, packer: Packer, window_s: float = 0.0,
                 on_step: Callable[[BatchStep], None] | None = None, name: str = "batcher",
                 schedule: str = "fair", prefill_chunk: int | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.packer, self.window_s, self.on_step = packer, window_s, on_step
        self.schedule = schedule
        self.prefill_chunk = max(1, prefill_chunk or packer.n_ubatch // 4)
        self.cost = PassCostLine()
        # Live rounds first (prefill_budget): the chunk follows the measured cost, unless fixed.
        self.budget: PrefillBudget | None = PrefillBudget() if prefill_chunk is None else None
        self.prefill_log: list[PrefillPass] | None = None   # set to a list to record every pass's plan
        self._prefill_rates: tuple[float, float] | None = None   # (while live, idle) tokens/s: prefill_rate
        self._deadlines: dict[int, float] = {}
        self._cond = threading.Condition()
        self._queue: list[_Request] = []
        self._waiting: list[_Request] = []    # prepared later: the packer was busy (tree ids)
        self._active: list[_Request] = []
        self._releases: list[int] = []
        self._chores: list[Callable[[], None]] = []   # run between passes (`between`)
        self._model_lock = threading.Lock()   # a pass or a release, never both
        self._closed = False
        self.passes = 0
        # A virtual clock: no thread, `submit` runs the turns itself (module docstring).
        self.inline = clock.inline()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if not self.inline:
            self._thread.start()

    def submit(self, seq: int, tokens: Sequence[int], rows: int,
               before: Callable[[], None] | None = None) -> tuple[np.ndarray, float, float]:
        """Logits of the last `rows` positions of `tokens` on sequence `seq`  # [rows, vocab];
        blocks until computed. Returns (logits, queue_s, model_s). `before`: run on the batcher
        thread before the request is first prepared (a checkpoint's cells restored into `seq`)."""
        return self._submit(_Request(seq, _first(before, lambda: self.packer.prepare(seq, tokens, rows))))

    def submit_tree(self, seq: int, committed: Sequence[int], tokens: Sequence[int],
                    parents: Sequence[int], before: Callable[[], None] | None = None) -> tuple[np.ndarray, float, float]:
        """Logits after `committed` and after each node of a token tree  # [n + 1, vocab]: row 0
        the last committed token's, row i + 1 node i's. Blocks; returns (logits, queue_s, model_s)."""
        job = self.packer.tree_job(seq, committed, tokens, parents)   # ValueError: a tree it cannot hold
        return self._submit(_Request(seq, _first(before, job.prepare), job.finish, redo_after_maintain=True))

    def set_deadline(self, seq: int, deadline: float | None) -> None:
        """When the next request of `seq` is due (spec_core.clock seconds); None: on arrival."""
        with self._cond:
            if deadline is None:
                self._deadlines.pop(seq, None)
            else:
                self._deadlines[seq] = deadline

    # --- live rounds first (prefill_budget) ---------------------------------------------------
    def note_open(self, seq: int, replay: bool, tpot_s: float | None) -> None:
        """A session opens on `seq`: a replay's prefill goes ahead of new sessions'; `tpot_s`, its
        SLO's time per output token, paces the prefills that share passes with it once it is live."""
        if self.budget is None:
            return
        with self._cond:
            if replay:
                self.budget.replays.add(seq)
            if tpot_s:
                self.budget.pace[seq] = tpot_s

    def prefill_rate(self) -> float | None:
        """Prefill tokens a second this batcher gives new sessions now: the rule's share of the live
        rounds' passes and the idle time between them while sessions are live, whole passes
        otherwise; None until the pass cost is measured. Any thread may ask: the batcher thread
        prices both after every pass (`_price_prefill`)."""
        rates = self._prefill_rates
        if rates is None:
            return None
        # Live: a session that has not closed had a request finish lately (a closed one is forgotten).
        live = self.budget is not None and bool(self.budget.live(clock.now()))
        return rates[0] if live else rates[1]

    def _price_prefill(self) -> None:
        cost = self.cost.line()
        base_s, per_token_s = cost
        if per_token_s <= 0:
            return
        n = self.packer.n_ubatch
        idle = n / (base_s + per_token_s * n)
        live = self.budget.rate(cost, clock.now(), n) if self.budget is not None else None
        self._prefill_rates = (live or idle, idle)

    def _submit(self, req: _Request) -> tuple[np.ndarray, float, float]:
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            req.deadline = self._deadlines.get(req.seq)
            self._queue.append(req)
            self._cond.notify()
        while self.inline and not req.done.is_set() and self._turn():
            pass
        req.done.wait()
        if req.error is not None:
            raise req.error
        t_first = req.t_first if req.t_first is not None else req.t_done
        return np.stack(req.out), t_first - req.t_submit, req.t_done - t_first

    def release(self, seq: int) -> None:
        """Free `seq` before the next pass; returns at once."""
        with self._cond:
            self._releases.append(seq)
            self._deadlines.pop(seq, None)
            self._cond.notify()

    def between(self, chore: Callable[[], None]) -> None:
        """Run `chore` before the next pass (the model is free then: on the batcher thread, or in
        the next `acquire`); returns at once. A chore that raises is logged; chores left at close
        are dropped."""
        with self._cond:
            self._chores.append(chore)
            self._cond.notify()

    def acquire(self, take: Callable[[], object]):
        """Run `take` (e.g. allocate a sequence) between passes, after queued releases and chores."""
        with self._model_lock:
            self._apply_releases()
            self._run_chores()
            return take()

    def _apply_releases(self) -> None:
        with self._cond:
            seqs, self._releases = self._releases, []
        for seq in seqs:
            for req in [r for r in self._active + self._waiting if r.seq == seq]:
                self._finish(req, RuntimeError(f"sequence {seq} was released mid-request"))
            self.packer.release(seq)
            if self.budget is not None:
                self.budget.forget(seq)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self.inline:
            self._turn()
        else:
            self._thread.join(timeout=30)

    # --- the batcher thread -------------------------------------------------------------------

    def _take_arrivals(self) -> list[_Request]:
        with self._cond:
            while (not self._queue and not self._active and not self._waiting and not self._releases
                   and not self._chores and not self._closed and not self.inline):
                self._cond.wait()
            if self.window_s > 0 and not self._active and self._queue and not self._closed and not self.inline:
                deadline = self._queue[0].t_submit + self.window_s
                while (left := deadline - clock.now()) > 0 and not self._closed:
                    self._cond.wait(left)
            new, self._queue = self._queue, []
        if self.budget is not None:   # live rounds first: when each session's requests arrive (think time)
            for req in new:
                self.budget.arrived(req.seq, req.t_submit)
        return new

    def _run(self) -> None:
        while self._turn():
            pass

    def _turn(self) -> bool:
        """One turn: take what arrived, prepare it, run a pass. False once closed."""
        new = self._take_arrivals()
        if self._closed:
            with self._model_lock:
                self._apply_releases()
                for req in self._active + self._waiting + new:
                    self._finish(req, RuntimeError("the verifier is shutting down"))
            self._active, self._waiting = [], []
            return False
        with self._model_lock:
            self._apply_releases()
            self._run_chores()
            pending, self._waiting = self._waiting + new, []
            for req in pending:
                try:
                    req.items = req.prepare()
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    if getattr(e, "retry_after_pass", False) and self._active:
                        self._waiting.append(req)   # what it waits for is held by active requests
                        continue
                    self._finish(req, e)
                    continue
                self._active.append(req)
            if self._active:
                self._maintain()
            if self._active:
                self._step()
        return True

    def _run_chores(self) -> None:
        with self._cond:
            chores, self._chores = self._chores, []
        for chore in chores:
            try:
                chore()
            except Exception:  # noqa: BLE001 - a chore (a checkpoint) is never worth a pass
                log.exception("a chore between passes failed")

    def _maintain(self) -> None:
        """Let the packer tidy up between passes; start over the requests that lost their state."""
        maintain = getattr(self.packer, "maintain", None)
        if maintain is None or not maintain():
            return
        for req in list(self._active):
            if req.redo_after_maintain:
                try:
                    req.items, req.cursor, req.out = req.prepare(), 0, []
                except Exception as e:  # noqa: BLE001
                    self._finish(req, e)

    def _plan(self) -> list[tuple[_Request, int]]:
        """How many pending tokens of each active request go into the next pass (none: left out)."""
        pending = [len(req.items) - req.cursor for req in self._active]
        # A prefill evaluates tokens for the cache, not for rows (a prompt, a replay, a tree round's
        # missing committed tokens): either schedule gives it at most a chunk while rounds wait.
        cache = [sum(not it.want_logits for it in req.items[req.cursor:]) for req in self._active]
        now = clock.now()
        chunk, prefill, live_chunk = self.prefill_chunk, [c > self.prefill_chunk for c in cache], None
        if self.budget is not None:   # live rounds first: the chunk from the measured cost (prefill_budget)
            live_tokens = min(self.packer.n_ubatch, sum(n for n, p in zip(pending, prefill) if not p))
            live_chunk = self.budget.chunk(self.cost.line(), live_tokens, now, self.packer.n_ubatch,
                                           self.prefill_chunk,
                                           busy={req.seq for req, p in zip(self._active, prefill) if p})
            chunk = live_chunk or self.prefill_chunk
        if self.schedule == "slack":
            slack = [(req.deadline if req.deadline is not None else req.t_submit) - now for req in self._active]
            takes = least_slack_first(pending, slack, self.packer.n_ubatch, chunk, prefill)
        else:
            takes = fair_share(pending, self.packer.n_ubatch, prefill, chunk)
        if self.budget is not None:
            takes = self._prefills_in_order(takes, pending, prefill, live_chunk)
        return [(req, n) for req, n in zip(self._active, takes) if n]

    def _prefills_in_order(self, takes: list[int], pending: list[int], prefill: list[bool],
                           live_chunk: int | None) -> list[int]:
        """The prefills' part of a pass, given to them replays first, then by arrival: `live_chunk`
        tokens while sessions are live (none if the rounds fill the pass), else what rounds leave."""
        rounds = sum(t for t, p in zip(takes, prefill) if not p)
        room = self.packer.n_ubatch - rounds
        allowed = room if live_chunk is None else (live_chunk if not rounds else min(live_chunk, room))
        at = [i for i, p in enumerate(prefill) if p]
        ranked = order([(self._active[i].seq in self.budget.replays, self._active[i].t_submit) for i in at])
        takes = cap_prefills(takes, pending, prefill, [at[k] for k in ranked], max(0, allowed))
        self.budget.observe_pass(rounds)
        if self.prefill_log is not None:
            self.prefill_log.append(PrefillPass(rounds, sum(t for t, p in zip(takes, prefill) if p), live_chunk))
        return takes

    def _step(self) -> None:
        plan = self._plan()
        items = [it for req, n in plan for it in req.items[req.cursor:req.cursor + n]]
        t0 = clock.now()
        for req, _ in plan:
            if req.t_first is None:
                req.t_first = t0
        try:
            rows = self.packer.decode(items)
        except Exception as e:  # noqa: BLE001
            log.exception("a batched pass failed; failing its %d requests", len(plan))
            for req, _ in plan:
                self._finish(req, e)
            return
        seconds = clock.now() - t0
        self.passes += 1
        self.cost.observe(len(items), seconds)
        self._price_prefill()
        at = 0
        for req, n in plan:
            wanted = sum(1 for it in req.items[req.cursor:req.cursor + n] if it.want_logits)
            req.out.extend(rows[at:at + wanted])
            at += wanted
            req.cursor += n
            if req.cursor == len(req.items):
                self._finish(req, None)
        if self.on_step is not None:
            self.on_step(BatchStep(len(items), len({req.seq for req, _ in plan}), seconds))

    def _finish(self, req: _Request, error: BaseException | None) -> None:
        if req.finish is not None:
            finish, req.finish = req.finish, None
            try:
                finish()
            except Exception as e:  # noqa: BLE001
                log.exception("cleaning up after a request failed")
                error = error or e
        req.error, req.t_done = error, clock.now()
        if error is None and self.budget is not None:
            self.budget.done(req.seq, req.t_done)
        if req in self._active:
            self._active.remove(req)
        if req in self._waiting:
            self._waiting.remove(req)
        req.done.set()
