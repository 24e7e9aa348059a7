"""An in-process gRPC channel over a modelled link, for the virtual clock.

gRPC's own I/O cannot run on a virtual clock (its core has threads and real sockets), so the
virtual run puts this object where the edge's `grpc.aio.Channel` goes: the generated stub calls
`unary_unary` / `unary_stream` / `stream_stream` on it, and it hands each call to the servicer's
method handlers in the same process (`InProcessServer`, filled by the generated
`add_<Service>Servicer_to_server`). Everything above it is the shipped code: the edge's Verifier
and round stream (retries, back-off, the stream's tags), the servicer, the engine.

Every message is still serialised to bytes, and those bytes cross the profile's links
(`VirtualConnection`: netsim's own effects, netsim.link, drawn from the run's seed): a message
arrives when the link's effects say it leaves, counting its gRPC prefix and an HTTP/2 frame
header; each call also carries its HEADERS frames (`CALL_UP_BYTES`, `CALL_DOWN_BYTES`, our
estimate of HPACK-compressed headers after the first call). Not modelled: HTTP/2 flow-control
windows, TCP's congestion window and slow start, PING and WINDOW_UPDATE frames (against the proxy's
wire counts of the same runs, the synthetic pair on 3g: a few tens of bytes short a message each way,
and a few hundred a connection's set-up; none of them on a message's path). A link reset
(an outage in reset mode) fails the calls in flight on that connection UNAVAILABLE, and the next
call opens a new connection, as gRPC reconnects.

What a round costs off the link (the edge's and the verifier's host path per RPC) is charged
here from the cost table: the edge's before its request leaves, the verifier's before the handler.
"""
from __future__ import annotations

import asyncio
import collections
import random
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import grpc

from netsim.effects import LinkContext, LinkReset
from netsim.profiles import Profile
from netsim.virtual.costs import CostTable

GRPC_PREFIX_BYTES = 5     # gRPC's length-prefixed message header
FRAME_HEADER_BYTES = 9    # an HTTP/2 frame header (the message's DATA frame)
CALL_UP_BYTES = 60        # a call's request HEADERS frame (HPACK, after the first call): estimate
CALL_DOWN_BYTES = 45      # a call's response HEADERS and trailers frames: estimate


def connection_rng(seed: int, connection: int, direction: str) -> random.Random:
    """The proxy's seeding (netsim.proxy.connection_rng): connection n, one direction."""
    return random.Random(f"netsim:{seed}:{connection}:{direction}")


@dataclass
class LinkCounts:
    bytes_up: int = 0
    bytes_down: int = 0
    messages: int = 0
    resets: int = 0
    stall_s: float = 0.0


class VirtualConnection:
    """One TCP connection's two directions through a profile's links, on the loop's clock."""

    def __init__(self, profile: Profile, seed: int, number: int, epoch_s: float, counts: LinkCounts):
        self.counts, self.broken = counts, False
        rtt_s = profile.expected_rtt_ms() / 1000.0

        def record(stall_s: float) -> None:
            counts.stall_s += stall_s
        self.links = {d: link.open(LinkContext(rng=connection_rng(seed, number, d), epoch_s=epoch_s, rtt_s=rtt_s,
                                               seed=seed, record_stall=record))
                      for d, link in (("up", profile.uplink), ("down", profile.downlink))}

    def departure(self, direction: str, nbytes: int) -> float:
        """When `nbytes` sent now in `direction` arrive (loop time); LinkReset breaks the connection."""
        now = asyncio.get_running_loop().time()
        try:
            at = self.links[direction].departure_s(nbytes, now)
        except LinkReset:
            self.broken = True
            self.counts.resets += 1
            raise
        if direction == "up":
            self.counts.bytes_up += nbytes
        else:
            self.counts.bytes_down += nbytes
        self.counts.messages += 1
        return at

    async def carry(self, direction: str, nbytes: int) -> None:
        """Send `nbytes` now and return when they arrive."""
        at = self.departure(direction, nbytes)
        loop = asyncio.get_running_loop()
        if at > loop.time():
            await asyncio.sleep(at - loop.time())


def _message_bytes(data: bytes) -> int:
    return len(data) + GRPC_PREFIX_BYTES + FRAME_HEADER_BYTES


def _unavailable(why: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=why)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple):
        super().__init__(details)
        self.error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details)


class _Context:
    """What the servicer asks of grpc.aio.ServicerContext."""

    async def abort(self, code, details: str = "", trailing_metadata=()):
        raise _Abort(code, details, tuple(trailing_metadata or ()))

    def invocation_metadata(self):
        return ()

    def peer(self) -> str:
        return "in-process"

    def set_code(self, code) -> None:
        pass

    def set_details(self, details) -> None:
        pass

    def time_remaining(self):
        return None


class InProcessServer:
    """Collects a servicer's method handlers (pass it to the generated add_..._to_server)."""

    def __init__(self):
        self.handlers: dict[str, Any] = {}

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        for name, handler in handlers.items():
            self.handlers[f"/{service}/{name}"] = handler

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass   # the registered handlers above are the same ones


@dataclass(eq=False)   # hashable by identity, as a channel is (the edge keys its limits by channel)
class InProcessChannel:
    """A grpc.aio.Channel stand-in: calls go to `server`'s handlers across `profile`'s links."""

    server: InProcessServer
    profile: Profile
    costs: CostTable
    seed: int = 0
    epoch_s: float = 0.0            # the network's start on the loop's clock (outages, traces count from it)
    first_connection: int = 0
    counts: LinkCounts = field(default_factory=LinkCounts)

    def __post_init__(self):
        self._number = self.first_connection
        self._conn: VirtualConnection | None = None
        self.closed = False

    def connection(self) -> VirtualConnection:
        if self._conn is None or self._conn.broken:
            if self._conn is not None:
                self._number += 1
            self._conn = VirtualConnection(self.profile, self.seed, self._number, self.epoch_s, self.counts)
        return self._conn

    @property
    def connections(self) -> int:
        return self._number - self.first_connection + 1

    # --- the grpc.aio.Channel surface the generated stub uses ---------------------------------------
    def unary_unary(self, method: str, request_serializer=None, response_deserializer=None, **_):
        return lambda request, **kw: self._unary(method, request_serializer, response_deserializer, request,
                                                 kw.get("timeout"))

    def unary_stream(self, method: str, request_serializer=None, response_deserializer=None, **_):
        return lambda request, **kw: _ResponseStream(self, method, request_serializer, response_deserializer,
                                                     request)

    def stream_stream(self, method: str, request_serializer=None, response_deserializer=None, **_):
        return lambda **kw: _StreamCall(self, method, request_serializer, response_deserializer)

    async def close(self, grace=None) -> None:
        self.closed = True

    # --- one unary call -------------------------------------------------------------------------
    async def _unary(self, method: str, ser: Callable, deser: Callable, request, timeout: float | None):
        handler = self.server.handlers[method]
        conn = self.connection()

        async def call():
            await _sleep(self.costs.edge.host_round_s)
            data = ser(request)
            try:
                await conn.carry("up", _message_bytes(data) + CALL_UP_BYTES)
            except LinkReset:
                raise _unavailable("the link reset the connection") from None
            await _sleep(self.costs.verifier.host_round_s)
            req = handler.request_deserializer(data)
            try:
                reply = await handler.unary_unary(req, _Context())
            except _Abort as a:
                await self._carry_down(conn, CALL_DOWN_BYTES)
                raise a.error from None
            data = handler.response_serializer(reply)
            await self._carry_down(conn, _message_bytes(data) + CALL_DOWN_BYTES)
            return deser(data)
        task = asyncio.ensure_future(call())
        try:
            async with asyncio.timeout(timeout or None):
                return await asyncio.shield(task) if timeout else await task
        except asyncio.TimeoutError:
            task.cancel()
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="Deadline Exceeded") from None

    @staticmethod
    async def _carry_down(conn: VirtualConnection, nbytes: int) -> None:
        try:
            await conn.carry("down", nbytes)
        except LinkReset:
            raise _unavailable("the link reset the connection") from None


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


class _Delivery:
    """One direction of a streaming call: messages arrive in the order sent, each when the link
    lets it go; None ends the stream, an exception fails it."""

    def __init__(self):
        self.queue: collections.deque = collections.deque()
        self.ready = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.out: asyncio.Queue = asyncio.Queue()

    def send(self, at: float, item) -> None:
        self.queue.append((at, item))
        self.ready.set()
        if self.task is None:
            self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.ready.clear()
                await self.ready.wait()
            at, item = self.queue.popleft()
            if at > loop.time():
                await asyncio.sleep(at - loop.time())
            await self.out.put(item)
            if item is None or isinstance(item, BaseException):
                return

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


async def _send_replies(replies, handler, conn: VirtualConnection, down: _Delivery) -> None:
    """A streaming call's server side: each reply down the link as it is made, then the trailers; a
    status (the servicer's abort) or a link reset ends the stream."""
    try:
        async for reply in replies:
            out = handler.response_serializer(reply)
            down.send(conn.departure("down", _message_bytes(out)), out)
        down.send(conn.departure("down", CALL_DOWN_BYTES), None)
    except _Abort as a:
        down.send(conn.departure("down", CALL_DOWN_BYTES), a.error)
    except LinkReset:
        down.send(asyncio.get_running_loop().time(), _unavailable("the link reset the connection"))


async def _received(down: _Delivery, deser):
    """A streaming call's client side: the replies as they arrive; the stream's status raised."""
    while True:
        item = await down.out.get()
        if item is None:
            return
        if isinstance(item, BaseException):
            raise item
        yield deser(item)


class _ResponseStream:
    """A unary-stream call (Generate): the request up, then each response down as it is made."""

    def __init__(self, channel: InProcessChannel, method: str, ser, deser, request):
        self.channel, self.deser = channel, deser
        self.handler = channel.server.handlers[method]
        self.conn = channel.connection()
        self.down = _Delivery()
        self.task = asyncio.ensure_future(self._serve(ser(request)))

    async def _serve(self, data: bytes) -> None:
        costs = self.channel.costs

        async def replies():
            await _sleep(costs.edge.host_round_s)
            await self.conn.carry("up", _message_bytes(data) + CALL_UP_BYTES)
            await _sleep(costs.verifier.host_round_s)
            async for reply in self.handler.unary_stream(self.handler.request_deserializer(data), _Context()):
                await _sleep(costs.verifier.stream_token_s)
                yield reply
        await _send_replies(replies(), self.handler, self.conn, self.down)

    def __aiter__(self) -> AsyncIterator:
        return self._responses()

    async def _responses(self):
        try:
            async for item in _received(self.down, self.deser):
                yield item
        finally:
            self.task.cancel()
            self.down.cancel()

    def cancel(self) -> bool:
        self.task.cancel()
        self.down.cancel()
        return True


class _StreamCall:
    """A stream-stream call (VerifyStream): writes go up, replies come down, each across the link."""

    _END = object()

    def __init__(self, channel: InProcessChannel, method: str, ser, deser):
        self.channel, self.ser, self.deser = channel, ser, deser
        self.handler = channel.server.handlers[method]
        self.conn = channel.connection()
        self.up, self.down = _Delivery(), _Delivery()
        self.opened = False
        self.cancelled = False
        self.task = asyncio.ensure_future(self._serve())

    async def write(self, msg) -> None:
        if self.cancelled:
            raise asyncio.InvalidStateError("the call was cancelled")
        await _sleep(self.channel.costs.edge.host_round_s)
        extra = 0 if self.opened else CALL_UP_BYTES
        self.opened = True
        data = self.ser(msg)
        try:
            self.up.send(self.conn.departure("up", _message_bytes(data) + extra), data)
        except LinkReset:
            self.down.send(asyncio.get_running_loop().time(), _unavailable("the link reset the connection"))
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="Internal error from Core") from None

    async def done_writing(self) -> None:
        self.up.send(asyncio.get_running_loop().time(), None)

    async def _requests(self):
        costs = self.channel.costs
        while True:
            data = await self.up.out.get()
            if data is None:
                return
            await _sleep(costs.verifier.host_round_s)
            yield self.handler.request_deserializer(data)

    async def _serve(self) -> None:
        await _send_replies(self.handler.stream_stream(self._requests(), _Context()), self.handler, self.conn,
                            self.down)

    def __aiter__(self) -> AsyncIterator:
        return _received(self.down, self.deser)

    def cancel(self) -> bool:
        self.cancelled = True
        self.task.cancel()
        self.up.cancel()
        self.down.cancel()
        return True
