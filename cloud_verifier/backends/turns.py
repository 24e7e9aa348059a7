"""The serial verifier's model, taken in turns: a long prefill never holds other sessions back.

A serial backend (batching off) evaluates one request at a time. Under a plain lock a 1,500-token
prompt holds the model for its whole prefill, and every other session's round waits behind it;
a plain lock is not even first come, first served (a thread that lets go and takes it again
may win over the threads woken to take it, each time). `Turns` hands the model out in arrival order,
and `Turns.run` cuts what a request evaluates for the cache (a prompt, a replay) into turns of
`chunk` tokens: a round that arrives during a prefill waits for one chunk, then has its turn.
The batching backends do the same inside their passes (spec_core.batchplan.chunk_prefills).

Live rounds first (`live_first`, when no chunk is fixed): the batchers' rule and record
(cloud_verifier.backends.prefill_budget.PrefillBudget) size each turn of a prefill while another
session is live, from the cost line of the turns measured here: a turn of a prefill is a pass
without rounds, so it runs until the next live round is due (the live sessions' think times), and
never holds less than the rule's share of their time per round (when a round waits, or is due,
that is all it holds: a live round waits for at most that). With nobody live, `chunk` a turn. The
chunk is sized again before every turn, so a session that becomes live mid-prefill is served from
the next one.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Callable, Hashable, NamedTuple, TypeVar

from cloud_verifier.backends.prefill_budget import PrefillBudget
from spec_core.steering import PassCostLine

T = TypeVar("T")


class Timed(NamedTuple):
    """What a run returned, the seconds it waited for turns, and the seconds it held the model."""
    value: object
    queue_s: float
    model_s: float


class PrefillTurn(NamedTuple):
    """One turn of a prefill, as planned (Turns.prefill_log): its tokens, and the rule's chunk
    (None: nobody was live, or the chunk is fixed)."""
    tokens: int
    chunk: int | None


class Turns:
    def __init__(self, chunk: int, live_first: bool = False, pass_tokens: int | None = None):
        """`chunk`: a prefill's tokens a turn (with `live_first`, while nobody is live or the cost is
        not measured yet); `pass_tokens`: the most one turn evaluates (default `chunk`)."""
        if chunk < 1:
            raise ValueError(f"the prefill chunk must be >= 1 token, got {chunk}")
        self.chunk = chunk
        self.pass_tokens = max(chunk, pass_tokens or chunk)
        self.budget: PrefillBudget | None = PrefillBudget() if live_first else None
        self.cost = PassCostLine()   # the seconds of the turns' evaluations (`observe`)
        self.prefill_log: list[PrefillTurn] | None = None   # set to a list to record every prefill turn
        self._cond = threading.Condition()
        self._tickets = itertools.count()
        self._serving = 0
        self.turns = 0   # turns taken so far (tests count the ones a round waited for)
        self._observed = 0   # tokens evaluated in turns so far (`observe`)

    # --- live rounds first (prefill_budget) -------------------------------------------------------
    def observe(self, tokens: int, seconds: float) -> None:
        """One evaluation of `tokens` took `seconds` (in a turn: the backend's call it runs)."""
        self.cost.observe(tokens, seconds)
        self._observed += tokens

    def note_open(self, key: Hashable, tpot_s: float | None) -> None:
        """A session opens: `tpot_s`, its SLO's time per output token, paces prefills once it is live."""
        if self.budget is not None and tpot_s:
            with self._cond:
                self.budget.pace[key] = tpot_s

    def forget(self, key: Hashable) -> None:
        if self.budget is not None:
            with self._cond:
                self.budget.forget(key)

    def prefill_rate(self) -> float | None:
        """Prefill tokens a second a new session gets now (cloud_verifier.first_token): `chunk` a turn
        while nobody is live, else the rule's share of the live rounds' time and the idle time
        between them (PrefillBudget.rate); None until measured."""
        cost = self.cost.line()
        base_s, per_token_s = cost
        if per_token_s <= 0:
            return None
        live = None
        if self.budget is not None:
            with self._cond:
                live = self.budget.rate(cost, time.perf_counter(), self.pass_tokens)
        return live or self.chunk / (base_s + per_token_s * self.chunk)

    def _next_chunk(self, key: Hashable | None = None) -> PrefillTurn:
        if self.budget is None:
            return PrefillTurn(self.chunk, None)
        with self._cond:
            rule = self.budget.chunk(self.cost.line(), 0, time.perf_counter(), self.pass_tokens, self.chunk,
                                     busy=() if key is None else (key,))
        return PrefillTurn(rule or self.chunk, rule)

    @contextlib.contextmanager
    def turn(self):
        """Hold the model, after everyone who asked before."""
        with self._cond:
            ticket = next(self._tickets)
            while ticket != self._serving:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self.turns += 1
                self._cond.notify_all()

    def run(self, fn: Callable[[], T], held: int = 0, upto: int = 0,
            prefix: Callable[[int], None] | None = None, key: Hashable | None = None) -> Timed:
        """`fn()` in a turn, after `prefix(n)` has brought the state's cache from `held` tokens to
        within a chunk of `upto`, a chunk a turn (prefix(n): make the cache hold the first n
        tokens of the request; without it, or for a short prefill, fn does it all). `key`: the
        session, live once fn has run."""
        t0 = time.perf_counter()
        if self.budget is not None and key is not None:
            with self._cond:
                self.budget.arrived(key, t0)
        model_s, n, round_tokens = 0.0, held, 0
        while True:
            with self.turn():   # the chunk is sized in the turn: who is live now
                t1, mark = time.perf_counter(), self._observed
                plan = self._next_chunk(key) if prefix is not None else None
                if plan is None or upto - n <= plan.tokens:
                    value = fn()
                    model_s += time.perf_counter() - t1
                    round_tokens = self._observed - mark if n == held else 0   # a round's pass, not a prompt's tail
                    break
                n += plan.tokens
                if self.prefill_log is not None:
                    self.prefill_log.append(plan)
                prefix(n)
                model_s += time.perf_counter() - t1
        if self.budget is not None and key is not None:
            with self._cond:
                self.budget.done(key)
                self.budget.observe_pass(round_tokens)
        return Timed(value, time.perf_counter() - t0 - model_s, model_s)
