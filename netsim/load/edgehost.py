"""A Locust worker's edges, in a process of their own: `python -m netsim.load.edgehost`.

Locust runs its users as gevent greenlets in a process whose standard library gevent has patched
(sockets, threads, select). grpc.aio cannot run there: its completion-queue poller is a thread,
which the patched `threading` turns into a greenlet that never runs when the event loop that waits
on it is asyncio (a grpc.aio call from a real thread of a patched process hangs), and grpcio's own
gevent mode (`grpc.experimental.gevent`) serves grpcio's synchronous API, while the edge
(edge_client) is asyncio code. So a worker's edges run here, as
`netsim load` runs them: one asyncio event loop, the same `Edge` code (netsim.load.edges), every
link in a proxy process of its own (netsim.proxyhost). The worker (netsim.load.locustfile) talks
to this process over its stdin and stdout, one JSON array per line; the rounds are timed here, on
the edges' own loop, so the pipe and Locust's bookkeeping add nothing to what is measured.

Commands (stdin), after a first line holding the LoadConfig fields, the mode and the upstream:
    ["open", edge, seed_edge, profile]   a device: its drafter, its link, its channel
    ["request", edge, number, arrival]   run its `number`-th request; arrival on time.monotonic()
    ["close", edge]                      cut its request off (if one runs) and close its channel
Events (stdout):
    ["opened", edge, error]              error None, or why the device could not start
    ["round", edge, ms, tokens, t]       a committed round: its time on the wire and tokens
    ["ttft", edge, ms, tokens, t]        a request's first commit
    ["done", edge, tpot_ms, tokens, met, code, message, cut, t]
                                         a request ended: TPOT (None with fewer than two commits),
                                         tokens committed, its SLO verdict (None: nothing to judge),
                                         the gRPC status name and message when it failed, whether
                                         it was cut off by a close
                                         (t: when, time.time(): the master's window is in wall time)
    ["closed", edge]                     every event of the edge is out
    ["meter", -1, seconds, rounds]       every second: this loop's seconds spent reporting so far, and
                                         the rounds reported (what the harness costs the edges' loop)
End of stdin cuts every request off, closes the channels and stops the links.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class _Device:
    edge: object                      # netsim.load.edges.Edge, entered
    running: asyncio.Task | None = None
    cut: bool = False


@dataclass
class EdgeHost:
    """The edges of one worker and what they report (`emit`: one event, a list)."""
    cfg: object                       # LoadConfig
    mode: str
    upstream: tuple[str, int]
    emit: object                      # Callable[[list], None]
    devices: dict[int, _Device] = field(default_factory=dict)
    opening: dict[int, asyncio.Task] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from netsim.load.edges import Edges
        from netsim.proxyhost import ProxyHost
        self.edges = Edges(self.cfg)
        self.links = ProxyHost([])
        self._links_lock = asyncio.Lock()

    async def open(self, index: int, seed_edge: int, profile_name: str) -> None:
        from netsim.load.edges import DraftCost, Edge
        from netsim.profiles import get_profile
        from netsim.proxyhost import LinkSpec
        try:
            spec = LinkSpec(get_profile(profile_name), self.upstream, seed=self.cfg.seed * 100_003 + seed_edge)
            async with self._links_lock:   # one line each way with the proxy process at a time
                (port,) = await asyncio.get_running_loop().run_in_executor(None, self.links.add, [spec])
            cost = DraftCost()
            edge = Edge(self.edges, self.mode, seed_edge, port, cost, self.edges.drafter(cost, seed_edge))
            await edge.__aenter__()
        except Exception as exc:   # reported to the user that asked, which fails its start
            log.warning("edge %d could not start: %s", index, exc)
            self.emit(["opened", index, f"{type(exc).__name__}: {exc}"])
            return
        self.devices[index] = _Device(edge)
        self.emit(["opened", index, None])

    def request(self, index: int, number: int, arrival: float) -> None:
        device = self.devices.get(index)
        if device is None:   # its user asks only once it opened: a worker out of step
            self.emit(["done", index, None, 0, None, "FAILED_PRECONDITION", f"edge {index} is not open", False,
                       time.time()])
            return
        device.running = asyncio.create_task(self._request(index, device, number, arrival))

    async def _request(self, index: int, device: _Device, number: int, arrival: float) -> None:
        from netsim.load.edges import Request, error_code
        from spec_core.slo import meets_slo
        cfg, loop = self.cfg, asyncio.get_running_loop()
        request = Request(device.edge.index, arrival, start_s=loop.time())
        tokens = 0

        def on_round(seconds: float, committed: int) -> None:
            nonlocal tokens
            if tokens == 0 and committed:
                self.emit(["ttft", index, 1e3 * (loop.time() - arrival), committed, time.time()])
            tokens += committed
            self.emit(["round", index, 1e3 * seconds, committed, time.time()])
        code = message = None
        try:
            await device.edge.request(request, number, on_round=on_round)
        except asyncio.CancelledError:
            if not device.cut:
                raise
        except Exception as exc:
            code = error_code(exc)
            if code is None:
                code, message = "UNKNOWN", f"{type(exc).__name__}: {exc}"
                log.exception("edge %d: request %d failed", index, number)
            else:
                message = str(getattr(exc, "details", lambda: None)() or exc)
        tpot = request.tpot_s(-float("inf"), float("inf"))
        met = meets_slo(tpot, request.ttft_s(), cfg.slo_tpot_ms / 1e3, cfg.slo_ttft_ms / 1e3)
        self.emit(["done", index, None if tpot is None else 1e3 * tpot, tokens, met, code, message, device.cut,
                   time.time()])

    async def close(self, index: int) -> None:
        if index in self.opening:   # a user stopped while its edge was starting
            await asyncio.gather(self.opening[index], return_exceptions=True)
        device = self.devices.pop(index, None)
        if device is not None:
            if device.running is not None and not device.running.done():
                device.cut = True
                device.running.cancel()
                await asyncio.gather(device.running, return_exceptions=True)
            try:
                await device.edge.__aexit__(None, None, None)
            except Exception as exc:   # a channel that fails to close has nothing left to report
                log.debug("edge %d: closing its channel: %s", index, exc)
        self.emit(["closed", index])

    async def close_all(self) -> None:
        await asyncio.gather(*(self.close(index) for index in list(self.devices)), return_exceptions=True)
        self.links.stop()


class _Writer:
    """Events to stdout: buffered, written once per turn of the event loop. It meters itself:
    `seconds` on this loop spent encoding and writing events (the harness's cost to the edges'
    loop), `rounds` reported; a ["meter", -1, seconds, rounds] event every METER_EVERY_S."""

    METER_EVERY_S = 1.0

    def __init__(self, stream) -> None:
        self.stream, self.lines, self.loop = stream, [], asyncio.get_running_loop()
        self.seconds, self.rounds = 0.0, 0

    def __call__(self, event: list) -> None:
        t0 = time.perf_counter()
        if not self.lines:
            self.loop.call_soon(self.flush)
        self.lines.append(json.dumps(event, separators=(",", ":")))
        self.rounds += event[0] == "round"
        self.seconds += time.perf_counter() - t0

    def flush(self) -> None:
        if self.lines:
            t0 = time.perf_counter()
            self.stream.write(("\n".join(self.lines) + "\n").encode())
            self.stream.flush()
            self.lines.clear()
            self.seconds += time.perf_counter() - t0

    async def meter(self) -> None:
        while True:
            await asyncio.sleep(self.METER_EVERY_S)
            self(["meter", -1, self.seconds, self.rounds])


async def serve(stdin=None, stdout=None) -> None:
    from netsim.load.config import LoadConfig
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), stdin or sys.stdin)
    first = json.loads(await reader.readline())
    mode, upstream = first.pop("mode"), tuple(first.pop("upstream"))
    cfg = LoadConfig(**first)
    emit = _Writer(stdout or sys.stdout.buffer)
    host = EdgeHost(cfg, mode, (upstream[0], int(upstream[1])), emit)
    pending: set[asyncio.Task] = set()
    metering = asyncio.create_task(emit.meter())
    try:
        while line := await reader.readline():
            command = json.loads(line)
            op = command[0]
            if op == "request":
                host.request(*command[1:])
            elif op in ("open", "close"):
                task = asyncio.create_task(getattr(host, op)(*command[1:]))
                pending.add(task)
                task.add_done_callback(pending.discard)
                if op == "open":
                    host.opening[command[1]] = task
                    task.add_done_callback(lambda _, index=command[1]: host.opening.pop(index, None))
            else:
                log.warning("unknown command %r", command)
    finally:
        metering.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await host.close_all()
        emit.flush()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s edgehost: %(message)s")
    asyncio.run(serve())


if __name__ == "__main__":
    main()
