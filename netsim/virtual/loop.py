"""An asyncio event loop whose time is virtual, and the clock that charges inline work to it.

`VirtualLoop` is a SelectorEventLoop whose `time()` is a number it keeps: when nothing is ready it
jumps to the next timer instead of waiting, so sleeps, timeouts and `call_later` take no real time
and fire in the order their virtual times say. Blocking work runs inline (`run_in_executor` too:
nothing runs beside the loop, so the order of events never depends on the machine's timing). What the work stands
for is charged to `VirtualClock` (spec_core.clock) from a cost table, and the caller waits that
out on the loop (spec_core.clock.run_inline) while the rest of the run moves on.

Why not looptime (the pytest plugin from Kopf, which fakes a loop's clock the same way): it lets
executor calls run in real threads beside the loop, so which event comes first would depend on
how fast this machine ran them, and it has no notion of charging inline work. The part it shares
with this module (a loop whose select jumps to the next timer) is a few lines.

Work that watches for something to stop it (drafting during a round trip stops when the reply is
in) runs stepped: on a helper thread in strict lock step with the loop, each charge waited out as it
is made (VirtualClock.run_stepped); one of the two runs at a time, so nothing depends on timing.

A loop that has nothing scheduled and nothing ready would wait forever: it raises VirtualStall
instead (a bug in the run, never a slow machine). Real I/O is not supported on it.
"""
from __future__ import annotations

import asyncio
import contextvars
import selectors
import threading
from typing import Any, Callable

from spec_core import clock as clock_mod


class VirtualStall(RuntimeError):
    """The virtual loop has nothing to run and nothing scheduled: the run waits for itself."""


class VirtualClock:
    """spec_core.clock's Clock for a VirtualLoop: `now()` is the loop's time plus what inline work
    charged since its caller last settled."""

    inline = True

    def __init__(self, loop: "VirtualLoop"):
        self.loop = loop
        self.owed = 0.0
        self._stepping = threading.local()   # .stepper: the _Stepper whose work runs on this thread

    def now(self) -> float:
        return self.loop.time() + self.owed

    def charge(self, seconds: float) -> None:
        stepper = getattr(self._stepping, "stepper", None)
        if stepper is not None:
            stepper.hand_back(seconds)
        elif seconds > 0:
            self.owed += seconds

    def settle(self) -> float:
        owed, self.owed = self.owed, 0.0
        return owed

    async def run_stepped(self, fn: Callable[..., Any], *args):
        """`fn(*args)` on a helper thread in lock step with the loop: the loop's thread waits while
        the work runs; each charge hands control back, and the work goes on once the loop has waited
        the charge out (other tasks running meanwhile). One of the two runs at a time, so the order
        of events is the same on every run; the thread only lends the work a stack of its own."""
        stepper = _Stepper(self, fn, args)
        cancelled = None
        while True:
            kind, value = stepper.resume()
            if kind == "charge":
                if cancelled is None and value > 0:
                    try:
                        await asyncio.sleep(value)
                    except asyncio.CancelledError as e:   # finish the work at once (its result is dropped)
                        cancelled = e
                continue
            if cancelled is not None:
                raise cancelled
            if kind == "error":
                raise value
            return value


class _Stepper:
    """The helper thread of VirtualClock.run_stepped and the hand-offs between it and the loop."""

    def __init__(self, clock: VirtualClock, fn, args):
        self.clock, self.fn, self.args = clock, fn, args
        self.ctx = contextvars.copy_context()
        self._to_work, self._to_loop = threading.Semaphore(0), threading.Semaphore(0)
        self._message: tuple[str, Any] = ("", None)
        self._thread: threading.Thread | None = None

    def resume(self) -> tuple[str, Any]:
        """Let the work run until it charges or ends (the loop's thread waits meanwhile)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="virtual-stepper", daemon=True)
            self._thread.start()
        else:
            self._to_work.release()
        self._to_loop.acquire()
        kind, value = self._message
        if kind in ("done", "error"):
            self._thread.join()
        return kind, value

    def hand_back(self, seconds: float) -> None:
        """On the work's thread: give the loop `seconds` to wait out, and wait until it has."""
        self._message = ("charge", seconds)
        self._to_loop.release()
        self._to_work.acquire()

    def _work(self) -> None:
        self.clock._stepping.stepper = self
        try:
            self._message = ("done", self.ctx.run(self.fn, *self.args))
        except BaseException as e:  # noqa: BLE001 - handed to the loop's thread
            self._message = ("error", e)
        self._to_loop.release()


class _JumpingSelector(selectors.BaseSelector):
    """The loop's selector: where the loop would wait for `timeout` seconds it moves virtual time on
    by that much instead. No real file is ever read on a virtual loop (nothing runs beside it to
    write its wake-up pipe), so the real selector is only kept for registration."""

    def __init__(self, loop: "VirtualLoop", real: selectors.BaseSelector):
        self._loop, self._real = loop, real

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def get_key(self, fileobj):
        return self._real.get_key(fileobj)

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None):
        loop = self._loop
        if loop.clock.owed:
            raise RuntimeError(f"{loop.clock.owed:.6f} s of inline work were charged outside "
                               "spec_core.clock.run_inline: nobody waits them out")
        if timeout == 0:
            return []   # nothing is read from real files on a virtual loop (its own wake-up pipe is not written)
        if timeout is None:
            raise VirtualStall("the virtual loop has nothing ready and nothing scheduled (every task waits for "
                               "another): the run cannot go on")
        loop._advance(timeout)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time (module docstring); `clock` is its spec_core.clock."""

    def __init__(self, start_s: float = 0.0):
        super().__init__(selectors.DefaultSelector())
        self._selector = _JumpingSelector(self, self._selector)
        self._now = start_s
        self.clock = VirtualClock(self)

    def time(self) -> float:
        return self._now

    def _advance(self, seconds: float) -> None:
        # To the next timer exactly (asyncio computed `seconds` as its time minus ours).
        target = self._now + seconds
        if self._scheduled:
            target = max(target, self._scheduled[0].when())
        self._now = target

    def run_in_executor(self, executor, func: Callable[..., Any], *args) -> asyncio.Future:
        """Inline (no threads on a virtual loop): the future is done once what `func` charged is
        waited out."""
        fut = self.create_future()
        try:
            result = func(*args)
        except BaseException as e:  # noqa: BLE001 - delivered through the future, as an executor would
            owed = self.clock.settle()
            self.call_later(owed, _set, fut, None, e)
            return fut
        self.call_later(self.clock.settle(), _set, fut, result, None)
        return fut


def _set(fut: asyncio.Future, result, error) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def run(main: Callable[[], Any], start_s: float = 0.0):
    """Run the coroutine `main()` to completion on a fresh VirtualLoop, with its VirtualClock in
    force for every task it starts; the loop is closed after."""
    loop = VirtualLoop(start_s)
    ctx = contextvars.copy_context()

    def go():
        with clock_mod.use(loop.clock):
            return loop.run_until_complete(main())
    try:
        return ctx.run(go)
    finally:
        closing = loop.shutdown_asyncgens()
        try:
            loop.run_until_complete(closing)
        except Exception:  # noqa: BLE001 - the run's own error is the one to raise
            closing.close()
        finally:
            loop.close()
