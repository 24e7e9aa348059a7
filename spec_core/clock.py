"""The one clock that every time read on the round path uses: the wall clock, or a virtual one.

Both ends time their rounds (drafting, round trips, passes, queues) and plan from those times. On
the wall clock (the default) `now()` is `time.perf_counter()` and blocking work (drafting, a
backend call) runs in threads, taking the time it takes. A virtual clock (netsim.virtual) runs the
same code in one process on one event loop whose time is virtual: blocking work runs inline
(`inline()`), whatever it stands for is charged to the clock (`charge`) from a cost table, and the
caller waits that charge out on the loop (`run_inline`) so that everything else (the link, the
other end) moves on meanwhile.

The clock in force is a context variable: the virtual run sets it before it starts its loop, so
every task and every inline call sees it, and any other thread (a wall-clock verifier's batcher)
keeps the wall clock.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from typing import Callable, Iterator, Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    inline: bool        # blocking work runs inline on the event loop (no threads)

    def now(self) -> float:
        """Seconds on this clock (only differences mean anything)."""

    def charge(self, seconds: float) -> None:
        """Inline work stands for `seconds` of time (a virtual clock moves `now()` on by it; the wall
        clock ignores it: the work took its own time)."""

    def settle(self) -> float:
        """The seconds charged since the last settle, now owed to the loop (0 on the wall clock)."""

    async def run_stepped(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)`, each of its charges waited out on the loop as it is made (run_inline)."""


class WallClock:
    inline = False

    def now(self) -> float:
        return time.perf_counter()

    def charge(self, seconds: float) -> None:
        pass

    def settle(self) -> float:
        return 0.0

    async def run_stepped(self, fn: Callable[..., T], *args) -> T:
        return fn(*args)


WALL = WallClock()
_CLOCK: contextvars.ContextVar[Clock] = contextvars.ContextVar("hybridspec_clock", default=WALL)


def current() -> Clock:
    return _CLOCK.get()


def now() -> float:
    """The time on the clock in force (time.perf_counter() on the wall clock)."""
    return _CLOCK.get().now()


def inline() -> bool:
    """Whether blocking work runs inline on the event loop (a virtual clock) instead of in a thread."""
    return _CLOCK.get().inline


def charge(seconds: float) -> None:
    """Inline work stands for `seconds` (virtual clock); nothing on the wall clock."""
    _CLOCK.get().charge(seconds)


async def run_inline(fn: Callable[..., T], *args, stepped: bool = False) -> T:
    """`fn(*args)` inline, then wait on the loop for what it charged (also when it raised): the
    caller is busy that long while the rest of the run goes on.

    `stepped`: work that watches for something to stop it (drafting during a round trip stops when
    the reply is in) waits out each charge as it is made, so that what happens meanwhile on the loop
    (the reply arriving) is there for its next look (the clock's `run_stepped`)."""
    clock = _CLOCK.get()
    if stepped:
        return await clock.run_stepped(fn, *args)
    try:
        return fn(*args)
    finally:
        owed = clock.settle()
        if owed > 0:
            await asyncio.sleep(owed)


@contextlib.contextmanager
def use(clock: Clock) -> Iterator[Clock]:
    """Make `clock` the clock in force for this context (and the tasks started in it)."""
    token = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)
