"""Small helpers for the gRPC and batching tests."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from typing import Callable

import grpc

from cloud_verifier.backends.base import Backend
from cloud_verifier.engine import Limits
from cloud_verifier.server import VerifierServer
from edge_client.options import EdgeOptions, Security, Speculation, Transport
from spec_core.proto import verifier_pb2_grpc as pb_grpc


@contextlib.asynccontextmanager
async def running_server(backend: Backend, port: int = 0, **limits):
    server = VerifierServer(backend, "127.0.0.1", port, Limits(**limits), grace_s=0.5)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def stub_for(server: VerifierServer):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield pb_grpc.VerifierStub(ch)


class HeldPasses:
    """Drives a Batcher deterministically instead of by the scheduler's luck: before it takes the
    arrivals for a pass, the batcher waits (outside its model lock, so sessions can still open)
    until it holds `want(pass_index)` requests, queued, waiting or unfinished, so that requests the
    test knows are coming share that pass whatever the machine's load. `max_wait_s` only keeps a
    broken test from hanging (`timed_out` counts those waits). It also wraps the packer to record
    how many sessions each pass held (`sessions_per_pass`) and when the first pass began
    (`entered`)."""

    def __init__(self, batcher, want: Callable[[int], int], max_wait_s: float = 60.0):
        self.batcher, self.want, self.max_wait_s = batcher, want, max_wait_s
        self.inner = batcher.packer
        self.sessions_per_pass: list[int] = []
        self.timed_out = 0
        self.entered = threading.Event()
        self._take_arrivals = batcher._take_arrivals
        batcher._take_arrivals = self._take_arrivals_when_held
        batcher.packer = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def held(self) -> int:
        b = self.batcher
        return len(b._queue) + len(b._waiting) + len(b._active)

    def _take_arrivals_when_held(self):
        deadline = time.monotonic() + self.max_wait_s
        while self.held() < self.want(len(self.sessions_per_pass)) and not self.batcher._closed:
            if time.monotonic() > deadline:
                self.timed_out += 1
                break
            time.sleep(0.0005)
        return self._take_arrivals()

    def decode(self, items):
        self.entered.set()
        self.sessions_per_pass.append(len({it[0] for it in items}))
        return self.inner.decode(items)


def edge_options(server: str, **fields) -> EdgeOptions:
    """EdgeOptions for the verifier at `server`, each keyword given to the record with that field
    (gamma=4, qmode="none": Speculation; deadline_s=10: Transport; token="t": Security). The tests
    pin each round's shape by the options they give (plan="off": options not given keep their fixed
    defaults) unless they ask for the planner (plan="auto")."""
    fields.setdefault("plan", "off")
    parts = {}
    for record in (Transport, Speculation, Security):
        names = {f.name for f in dataclasses.fields(record)}
        parts[record] = {k: fields.pop(k) for k in list(fields) if k in names}
    if fields:
        raise TypeError(f"no edge option named {sorted(fields)}")
    return EdgeOptions(Transport(server, **parts[Transport]), Speculation(**parts[Speculation]),
                       Security(**parts[Security]))


async def generate_many(client, n: int, settings, concurrency: int, prompt: tuple[int, ...] = (0,)) -> list:
    """`n` generations from `prompt` on an open EdgeClient, at most `concurrency` at a time; each
    one's stats (`token_ids` holds what it generated), in the order they finished."""
    sem, stats = asyncio.Semaphore(concurrency), []

    async def one():
        async with sem:
            gen = client.generate(list(prompt), settings)
            await gen.text()
            stats.append(gen.stats)
    await asyncio.gather(*[one() for _ in range(n)])
    return stats


async def crash_or_drain_first(servers: list, fault: str, restart):
    """Fault servers[0] of a replica set: "crash" (its store flushed, then the port closed with no drain
    and nothing more written; `restart()` starts its replacement on the same port) or a drain (it
    stops and leaves the set). Returns the old server, whose backend the caller closes at the end."""
    old = servers[0]
    if fault == "crash":
        old.engine.backend.checkpoints.flush()
        await old.server.stop(None)
        old.server = None
        servers[0] = await restart(old.port)
    else:
        await old.stop()
        servers.pop(0)
    return old
