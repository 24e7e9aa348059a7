"""The worker threads that backend calls run in, off the event loop."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor

from spec_core import clock

# Backend calls block their worker thread while a batching backend gathers a pass: every session
# and stream in flight needs a thread of its own, or rounds queue here instead of in the batch
# (asyncio's default pool has min(32, cores + 4) threads). Threads are made on demand.
_WORKERS = ThreadPoolExecutor(max_workers=512, thread_name_prefix="verifier-worker")


async def run_in_thread(fn, *args):
    """Run a backend call in a worker thread. If the RPC is cancelled (client gone, deadline), wait
    for the thread to finish before giving up the caller's locks and state: freeing a KV cache
    that a thread is still decoding into crashes the process. On a virtual clock (spec_core.clock) the
    call runs inline and its charged time is waited out on the loop."""
    if clock.inline():
        return await clock.run_inline(fn, *args)
    fut = asyncio.get_running_loop().run_in_executor(   # in the call's context: the backend reads its tenant
        _WORKERS, contextvars.copy_context().run, functools.partial(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await fut
        raise
