"""An asyncio TCP proxy that carries real bytes (gRPC/HTTP2) through emulated links.

    client --> 127.0.0.1:listen --[uplink]--> upstream
    client <--                  <-[downlink]-- upstream

Each accepted connection opens its own upstream connection and its own state for both links,
with a random generator seeded from (seed, connection number, direction), so a run is
reproducible given the order in which connections arrive. Connections therefore do not share
bandwidth (a gRPC channel uses one connection); time-based schedules (outages, traces,
handovers) are shared, counted from the proxy's start (`epoch_s`). Each read is stamped with its
arrival time, cut into chunks of at most `max_chunk_bytes` (so a slow link releases a large
read piece by piece instead of all at its end), and queued with the departure time its link
computes; a writer sends each chunk at that time. Nothing is dropped: an endpoint's EOF or
reset is passed on after the data in front of it, and `stop()` writes out whatever is still
queued before closing. Only an emulated reset discards queued data, as a real reset would,
and data queued for an endpoint that has gone away has nowhere to go.

The sending side is a TCP connection in steady state: the proxy reads from the sender as fast
as the link's queue allows (its backlog limit plus the link's bandwidth-delay product), so a
bulk transfer takes one propagation delay plus size/rate, as with a congestion window that has
already opened to the path's BDP. Slow start is not imitated (the endpoints' own TCP runs on
loopback); the flow control of the protocols on top (HTTP/2 windows, gRPC's BDP probe) is,
because their frames cross the emulated links.

What a proxy cannot emulate (shared/reference/network-emulation-anchors.md, section 4.1):
the TCP handshake is not delayed (the kernel accepts at once), congestion control and TCP
timers of the endpoints never see the emulated path, and the kernel's own socket buffers
add a little unshaped queue.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import dataclasses
import logging
import os
import random
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass

from .effects import LinkContext, LinkReset
from .link import Link, LinkState
from .profiles import Profile

log = logging.getLogger(__name__)

READ_BYTES = 65536   # most bytes taken from a socket per read
TIMER_RESOLUTION_S = 0.001   # asyncio waits in epoll, whose timeout is whole milliseconds, rounded up


class _TimerFd(ctypes.Structure):
    _fields_ = [("interval_sec", ctypes.c_long), ("interval_nsec", ctypes.c_long),
                ("value_sec", ctypes.c_long), ("value_nsec", ctypes.c_long)]


def _load_timerfd():
    """libc's timerfd calls (Linux), or None where there are none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create.argtypes, create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_TimerFd), ctypes.c_void_p]
    settime.restype = ctypes.c_int
    return create, settime


_TIMERFD = _load_timerfd() if sys.platform.startswith("linux") else None
_CLOCK_MONOTONIC, _TFD_NONBLOCK, _TFD_CLOEXEC, _TFD_TIMER_ABSTIME = 1, 0o4000, 0o2000000, 1


WAKE_LEAD_MAX_S = 0.005   # never aim a wake-up more than this ahead of a departure


class WakeLatency:
    """How late this process's timer wake-ups run, learned as it goes (one per event loop).

    On a busy machine the kernel runs a woken process some time after its timer fires
    (milliseconds on an oversubscribed 2-core box); every delayed chunk pays that. Aiming each
    wake-up that much early makes the mean departure right again; each one is still off by
    the wake-up's own variation. The estimate is a moving average of observed lateness.
    """

    def __init__(self, weight: float = 0.05) -> None:
        self.weight = weight   # of each new observation
        self.lead_s = 0.0      # mean lateness (s), in [0, WAKE_LEAD_MAX_S]

    def observe(self, late_s: float) -> None:
        self.lead_s += self.weight * (min(max(late_s, 0.0), WAKE_LEAD_MAX_S) - self.lead_s)


class PreciseSleeper:
    """Sleep until a loop time with sub-millisecond precision.

    asyncio waits in epoll, whose timeout is whole milliseconds rounded up, so a sub-millisecond
    sleep lasts a millisecond or more, which is the whole of the lan profile's round trip (the
    measured figures are on the docs' benchmarks page). A Linux timerfd
    armed at an absolute CLOCK_MONOTONIC time (the clock `loop.time()` reads) wakes the loop
    within tens of microseconds instead, and it is aimed early by the loop's learned wake-up
    latency (WakeLatency). Elsewhere the fallback sleeps whole milliseconds and sends a
    sub-millisecond rest early (under half a millisecond) or one millisecond late.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, latency: WakeLatency | None = None) -> None:
        self.loop = loop
        self.latency = latency or WakeLatency()
        self.fd = -1
        self.waiter: asyncio.Future | None = None
        if _TIMERFD is not None and isinstance(loop, asyncio.SelectorEventLoop) \
                and time.get_clock_info("monotonic").implementation.startswith("clock_gettime(CLOCK_MONOTONIC)"):
            fd = _TIMERFD[0](_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
            if fd >= 0:
                self.fd = fd
                loop.add_reader(fd, self._fired)

    def _fired(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            return
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def send_ahead_s(self) -> float:
        """How far ahead of its departure time a chunk is sent rather than slept for.

        Half the expected wake-up latency: sleeping for a chunk due sooner than that would land
        later than sending it now does.
        """
        return TIMER_RESOLUTION_S / 2.0 if self.fd < 0 else self.latency.lead_s / 2.0

    async def sleep_until(self, when_s: float) -> None:
        """Return at about loop time `when_s`; at once if it is within send_ahead_s()."""
        now_s = self.loop.time()
        wait_s = when_s - now_s
        if wait_s <= self.send_ahead_s():
            return
        if self.fd < 0:
            if wait_s >= TIMER_RESOLUTION_S:
                await asyncio.sleep(TIMER_RESOLUTION_S * int(wait_s / TIMER_RESOLUTION_S))
            else:
                await asyncio.sleep(wait_s)
            return
        # Aim early by the expected wake-up latency, but not before now (the wake-up itself takes
        # about that long, so a chunk due within it lands up to half of it late, on average less).
        target_s = max(when_s - self.latency.lead_s, now_s + 1e-6)
        seconds = int(target_s)
        spec = _TimerFd(0, 0, seconds, int((target_s - seconds) * 1e9))
        if _TIMERFD[1](self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            await asyncio.sleep(wait_s)
            return
        self.waiter = self.loop.create_future()
        await self.waiter
        self.latency.observe(self.loop.time() - target_s)

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1


@dataclass
class ProxyStats:
    """Counters over the proxy's life; plain numbers, safe to read from another thread."""

    connections: int = 0    # connections accepted
    active: int = 0         # connections open now
    bytes_up: int = 0       # bytes delivered client -> upstream
    bytes_down: int = 0     # bytes delivered upstream -> client
    chunks: int = 0         # chunks delivered, both directions
    stalls: int = 0         # chunks held back by a loss stall or an outage
    stall_s: float = 0.0    # total of those stalls (s)
    resets: int = 0         # connections reset by the emulated link
    late_s: float = 0.0     # total lateness of chunk deliveries past their departure time (s)
    late_max_s: float = 0.0  # the largest such lateness (s): how far the proxy fell behind its links

    def record_stall(self, stall_s: float) -> None:
        self.stalls += 1
        self.stall_s += stall_s
        log.debug("stall of %.3f s", stall_s)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def connection_rng(seed: int, connection: int, direction: str) -> random.Random:
    """The generator for one connection's link in one direction ("up" or "down")."""
    return random.Random(f"netsim:{seed}:{connection}:{direction}")


class _Pipe:
    """One direction of one connection: read, stamp, queue, and write at departure time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: LinkState,
                 stats: ProxyStats, byte_counter: str, max_chunk_bytes: int, max_queue_bytes: int,
                 wake_latency: WakeLatency) -> None:
        self.reader = reader
        self.wake_latency = wake_latency
        self.writer = writer
        self.link = link
        self.stats = stats
        self.byte_counter = byte_counter
        self.max_chunk_bytes = max_chunk_bytes
        self.max_queue_bytes = max_queue_bytes
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()   # (departure_s, data)
        self.queued_bytes = 0
        self.eof = False           # the sender finished (EOF or reset); deliver the queue, then pass it on
        self.peer_reset = False    # ... and it finished with a reset, not an EOF
        self.ready = asyncio.Event()   # something was queued, or EOF
        self.space = asyncio.Event()   # the queue shrank

    async def read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await self.reader.read(READ_BYTES):
                arrival_s = loop.time()
                for start in range(0, len(data), self.max_chunk_bytes):
                    piece = data[start:start + self.max_chunk_bytes]
                    self.queue.append((self.link.departure_s(len(piece), arrival_s), piece))
                    self.queued_bytes += len(piece)
                self.ready.set()
                # Stop reading while the link is backed up, so the sender's TCP feels the backpressure.
                while self.queued_bytes > self.max_queue_bytes:
                    self.space.clear()
                    await self.space.wait()
        except ConnectionError:
            # The sender reset. On a real path its RST would arrive after the data already
            # in flight, so it is passed on the same way as an EOF: behind the queue.
            self.peer_reset = True
        self.eof = True
        self.ready.set()

    def _send(self, piece: bytes, late_s: float = 0.0) -> None:
        if late_s > 0.0:
            self.stats.late_s += late_s
            self.stats.late_max_s = max(self.stats.late_max_s, late_s)
        self.queued_bytes -= len(piece)
        self.writer.write(piece)
        setattr(self.stats, self.byte_counter, getattr(self.stats, self.byte_counter) + len(piece))
        self.stats.chunks += 1

    async def write_loop(self) -> None:
        self.sleeper = PreciseSleeper(asyncio.get_running_loop(), self.wake_latency)
        try:
            await self._write_loop()
        finally:
            self.sleeper.close()

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.queue:
                if self.eof:
                    break
                self.ready.clear()
                await self.ready.wait()
                continue
            due_s = self.queue[0][0]
            if due_s > loop.time():
                await self.sleeper.sleep_until(due_s)
            # Woken early on purpose (see PreciseSleeper): send what is due by then.
            send_until_s = loop.time() + self.sleeper.send_ahead_s()
            now_s = loop.time()
            while self.queue and self.queue[0][0] <= send_until_s:
                departure_s, piece = self.queue.popleft()
                self._send(piece, now_s - departure_s)
            self.space.set()
            await self.writer.drain()
        if self.peer_reset:
            _reset_socket(self.writer)
        elif self.writer.can_write_eof():
            self.writer.write_eof()

    def flush(self) -> None:
        """Write out everything queued now, departure times notwithstanding (we are stopping)."""
        while self.queue:
            self._send(self.queue.popleft()[1])


def in_flight_bytes(link: Link) -> int:
    """Bytes a link holds when it runs full: its rate times twice its mean one-way delay.

    The queue of a direction holds both the bytes waiting for the bottleneck and the bytes
    "on the wire" (in their propagation delay), so its backpressure limit must leave room for
    the bandwidth-delay product, or a long fat link (geo-sat down: 18.75 Mbit/s x 0.3 s =
    0.7 MB) would be throttled by the limit instead of its rate. Twice the delay leaves room
    for jitter and loss stalls. A link without a rate limit gets no extra room.
    """
    rate_kbit_s = link.rate_kbit_s()
    if rate_kbit_s is None:
        return 0
    return int(rate_kbit_s * 1000.0 / 8.0 * 2.0 * link.mean_delay_ms() / 1000.0)


CHUNK_S = 0.002   # a chunk carries at most this much of its link's transmission time, or max_chunk_bytes


def chunk_bytes(link: Link, max_chunk_bytes: int) -> int:
    """The largest piece a direction schedules as one chunk.

    Each chunk costs a timer wake-up, so on fast links (lan's 1 Gbit/s: 8 kB every 65 us) the
    proxy's own work, not the link, would set the rate; a chunk may therefore grow to 2 ms of
    transmission time (up to the 64 kB of one read), which keeps a slow link's pacing at
    `max_chunk_bytes` and a fast link's pacing at 2 ms.
    """
    rate_kbit_s = link.rate_kbit_s()
    if rate_kbit_s is None:
        return READ_BYTES
    return int(min(READ_BYTES, max(max_chunk_bytes, rate_kbit_s * 1000.0 / 8.0 * CHUNK_S)))


def _reset_socket(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN: SO_LINGER on with a zero timeout, then abort."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass   # already closed
    writer.transport.abort()


class _Connection:
    def __init__(self, proxy: LinkProxy, number: int, client_reader: asyncio.StreamReader,
                 client_writer: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.number = number
        self.client_reader = client_reader
        self.client_writer = client_writer
        self.upstream_writer: asyncio.StreamWriter | None = None
        profile = proxy.profile
        self.links = {direction: link.open(LinkContext(
            rng=connection_rng(proxy.seed, number, direction), epoch_s=proxy.epoch_s,
            rtt_s=profile.rtt_ms() / 1000.0, seed=proxy.seed, record_stall=proxy.stats.record_stall))
            for direction, link in (("up", profile.uplink), ("down", profile.downlink))}
        self.pipes: list[_Pipe] = []
        self.tasks: list[asyncio.Task] = []
        self.interrupted = False

    def _reset_due(self) -> float | None:
        now_s = asyncio.get_running_loop().time()
        times = [t for link in self.links.values() if (t := link.reset_at_s(now_s)) is not None]
        return min(times) if times else None

    async def _watch_resets(self) -> None:
        loop = asyncio.get_running_loop()
        while (due_s := self._reset_due()) is not None:
            if due_s <= loop.time():
                raise LinkReset("outage")
            await asyncio.sleep(due_s - loop.time())

    async def run(self) -> None:
        due_s = self._reset_due()
        if due_s is not None and due_s <= asyncio.get_running_loop().time():
            self.reset("refused during an outage")
            return
        try:
            upstream_reader, self.upstream_writer = await asyncio.open_connection(*self.proxy.upstream)
        except OSError as exc:
            log.warning("connection %d: upstream %s:%d unreachable: %s", self.number, *self.proxy.upstream, exc)
            _reset_socket(self.client_writer)
            return
        if self.interrupted:   # the proxy stopped while we were connecting
            self.upstream_writer.close()
            return
        stats = self.proxy.stats
        profile = self.proxy.profile
        up_queue, down_queue = (self.proxy.max_queue_bytes + in_flight_bytes(link)
                                for link in (profile.uplink, profile.downlink))
        up_chunk, down_chunk = (chunk_bytes(link, self.proxy.max_chunk_bytes) for link in (profile.uplink, profile.downlink))
        self.pipes = [
            _Pipe(self.client_reader, self.upstream_writer, self.links["up"], stats, "bytes_up", up_chunk, up_queue,
                  self.proxy.wake_latency),
            _Pipe(upstream_reader, self.client_writer, self.links["down"], stats, "bytes_down", down_chunk, down_queue,
                  self.proxy.wake_latency),
        ]
        writers = [asyncio.create_task(pipe.write_loop()) for pipe in self.pipes]
        self.tasks = writers + [asyncio.create_task(pipe.read_loop()) for pipe in self.pipes]
        self.tasks.append(asyncio.create_task(self._watch_resets()))
        pending = set(self.tasks)
        while not all(task.done() for task in writers):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if self.interrupted:
                return   # interrupt() owns the cleanup
            for task in done:
                exc = None if task.cancelled() else task.exception()
                if isinstance(exc, LinkReset):
                    self.reset(str(exc))
                    return
                if isinstance(exc, OSError):
                    # A writer's destination is gone, and what was queued for it with it. The
                    # other direction carries on; that peer's own reader passes its end along.
                    log.debug("connection %d: %r", self.number, exc)
                elif exc is not None:
                    self._abort()
                    raise exc
        # Both directions delivered their EOF (or reset).
        self._cancel_tasks()
        self.client_writer.close()
        self.upstream_writer.close()

    def _cancel_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()

    def _abort(self) -> None:
        self._cancel_tasks()
        _reset_socket(self.client_writer)
        if self.upstream_writer is not None:
            _reset_socket(self.upstream_writer)

    def reset(self, why: str) -> None:
        self.proxy.stats.resets += 1
        log.info("connection %d reset by the link: %s", self.number, why)
        self._abort()

    async def interrupt(self) -> None:
        """Stop at once, but deliver what is in flight before closing."""
        self.interrupted = True
        self._cancel_tasks()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for pipe in self.pipes:
            try:
                pipe.flush()
                if pipe.writer.can_write_eof():
                    pipe.writer.write_eof()
            except (ConnectionError, RuntimeError, OSError):
                pass   # that side is gone; nothing can be delivered to it
        for writer in (self.client_writer, self.upstream_writer):
            if writer is not None:
                writer.close()   # close() still sends what the transport has buffered


class LinkProxy:
    """A TCP proxy whose two directions follow a profile's uplink and downlink.

        async with LinkProxy(upstream=("127.0.0.1", port), profile=get_profile("3g"), seed=1) as proxy:
            connect to ("127.0.0.1", proxy.port)

    For callers without an event loop of their own, `start_in_thread()` runs it in a thread.
    """

    def __init__(self, *, upstream: tuple[str, int], profile: Profile,
                 listen: tuple[str, int] = ("127.0.0.1", 0), seed: int = 0,
                 max_chunk_bytes: int = 8192, max_queue_bytes: int = 1 << 20) -> None:
        self.upstream = upstream
        self.profile = profile
        self.listen = listen
        self.seed = seed
        self.max_chunk_bytes = max_chunk_bytes   # largest piece scheduled as one chunk (bytes)
        self.max_queue_bytes = max_queue_bytes   # a direction stops reading beyond this backlog plus its bytes in flight
        self.stats = ProxyStats()
        self.wake_latency = WakeLatency()   # shared by this proxy's connections (one event loop)
        self.epoch_s = 0.0       # loop time at start(): outages, traces and handovers count from here
        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        self._connections: set[_Connection] = set()
        self._next_number = 0

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) it listens on; kept after stop() for logs."""
        if self._address is None:
            raise RuntimeError("the proxy is not started")
        return self._address

    @property
    def port(self) -> int:
        return self.address[1]

    async def start(self) -> None:
        self.epoch_s = asyncio.get_running_loop().time()
        self._server = await asyncio.start_server(self._handle, *self.listen)
        self._address = self._server.sockets[0].getsockname()[:2]
        log.info("netsim proxy on %s:%d -> %s:%d, profile %s, seed %d",
                 *self.address, *self.upstream, self.profile.name, self.seed)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(self, self._next_number, reader, writer)
        self._next_number += 1
        self.stats.connections += 1
        self.stats.active += 1
        self._connections.add(connection)
        try:
            await connection.run()
        finally:
            self._connections.discard(connection)
            self.stats.active -= 1

    async def stop(self) -> None:
        """Stop accepting; deliver what is in flight on every connection, then close them."""
        if self._server is None:
            return
        self._server.close()
        await asyncio.gather(*(connection.interrupt() for connection in list(self._connections)))
        await self._server.wait_closed()
        log.info("netsim proxy stopped: %s", self.stats.as_dict())

    async def __aenter__(self) -> LinkProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    def start_in_thread(self) -> ProxyThread:
        """Run the proxy on its own event loop in a daemon thread; returns once it listens."""
        return ProxyThread(self)


class ProxyThread:
    """A LinkProxy running in a background thread: `.port`, `.stats`, `.stop()`."""

    def __init__(self, proxy: LinkProxy) -> None:
        self.proxy = proxy
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="netsim-proxy", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.proxy.start())
        except BaseException as exc:   # hand any start failure to the caller's thread
            self._error = exc
            self._started.set()
            self._loop.close()
            return
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            leftovers = asyncio.all_tasks(self._loop)
            for task in leftovers:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            self._loop.close()

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def address(self) -> tuple[str, int]:
        return self.proxy.address

    @property
    def stats(self) -> ProxyStats:
        return self.proxy.stats

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

    def __enter__(self) -> ProxyThread:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
