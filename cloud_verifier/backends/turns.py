"""The serial verifier's model, taken in turns: a long prefill never holds other sessions back.

A serial backend (batching off) evaluates one request at a time. Under a plain lock a 1,500-token
prompt holds the model for its whole prefill, and every other session's round waits behind it;
a plain lock is not even first come, first served (a thread that lets go and takes it again
may win over the threads woken to take it, each time). `Turns` hands the model out in arrival order,
and `Turns.run` cuts what a request evaluates for the cache (a prompt, a replay) into turns of
`chunk` tokens: a round that arrives during a prefill waits for one chunk, then has its turn.
The batching backends do the same inside their passes (spec_core.batchplan.chunk_prefills).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Callable, NamedTuple, TypeVar

T = TypeVar("T")


class Timed(NamedTuple):
    """What a run returned, the seconds it waited for turns, and the seconds it held the model."""
    value: object
    queue_s: float
    model_s: float


class Turns:
    def __init__(self, chunk: int):
        if chunk < 1:
            raise ValueError(f"the prefill chunk must be >= 1 token, got {chunk}")
        self.chunk = chunk
        self._cond = threading.Condition()
        self._tickets = itertools.count()
        self._serving = 0
        self.turns = 0   # turns taken so far (tests count the ones a round waited for)

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
            prefix: Callable[[int], None] | None = None) -> Timed:
        """`fn()` in a turn, after `prefix(n)` has brought the state's cache from `held` tokens to
        within a chunk of `upto`, a chunk a turn (prefix(n): make the cache hold the first n
        tokens of the request; without it, or for a short prefill, fn does it all)."""
        t0 = time.perf_counter()
        model_s = 0.0
        steps: list[Callable[[], object]] = []
        if prefix is not None:
            steps = [lambda n=n: prefix(n) for n in range(held + self.chunk, upto, self.chunk)]
        for step in steps + [fn]:
            with self.turn():
                t1 = time.perf_counter()
                value = step()
                model_s += time.perf_counter() - t1
        return Timed(value, time.perf_counter() - t0 - model_s, model_s)
