"""The proxy measured against what its profile says, through real sockets on 127.0.0.1.

Tolerances: asyncio timers here overshoot by about 0.1–4 ms and the 2-core machine may be
busy, so a delay d is accepted in [d - 1 ms, d + 25 ms] and a rate within 15%.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netsim import Link, LinkContext, LinkProxy, Profile, connection_rng, get_profile
from netsim.effects import Bandwidth, Delay, Jitter, Loss, Outage, Trace

LATE_MS = 25.0    # allowed overshoot of a timed delivery
EARLY_MS = 1.0    # allowed undershoot (clock reads on two sides of a socket)
REPO_ROOT = Path(__file__).resolve().parents[2]


async def round_trip_ms(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> float:
    """Send `payload`, wait for all of it to come back, and return the elapsed milliseconds."""
    start = time.monotonic()
    writer.write(payload)
    await writer.drain()
    echoed = await reader.readexactly(len(payload))
    elapsed_ms = (time.monotonic() - start) * 1000.0
    assert echoed == payload
    return elapsed_ms


def one_way(*uplink_effects, downlink=()) -> Profile:
    return Profile("test", uplink=Link(tuple(uplink_effects)), downlink=Link(tuple(downlink)))


async def connect(proxy: LinkProxy):
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except ConnectionError:
        pass


@pytest.mark.timing
async def test_one_way_delay(echo_port, record_property):
    async with LinkProxy(upstream=("127.0.0.1", echo_port), profile=one_way(Delay(100))) as proxy:
        reader, writer = await connect(proxy)
        rtts_ms = [await round_trip_ms(reader, writer, b"ping %d" % i) for i in range(5)]
        await close(writer)
    record_property("delay_100ms_measured_ms", rtts_ms)
    assert min(rtts_ms) >= 100 - EARLY_MS, rtts_ms
    assert statistics.median(rtts_ms) <= 100 + LATE_MS, rtts_ms


@pytest.mark.timing
async def test_two_delays_compose(echo_port, record_property):
    profile = one_way(Delay(100), Delay(100))
    async with LinkProxy(upstream=("127.0.0.1", echo_port), profile=profile) as proxy:
        reader, writer = await connect(proxy)
        rtts_ms = [await round_trip_ms(reader, writer, b"ping %d" % i) for i in range(3)]
        await close(writer)
    record_property("delay_2x100ms_measured_ms", rtts_ms)
    assert min(rtts_ms) >= 200 - EARLY_MS, rtts_ms
    assert statistics.median(rtts_ms) <= 200 + LATE_MS, rtts_ms


async def bulk_echo_s(proxy: LinkProxy, payload: bytes) -> float:
    """Send `payload` through the proxy to the echo server; seconds until all of it is back."""
    reader, writer = await connect(proxy)
    start = time.monotonic()

    async def send() -> None:
        writer.write(payload)
        await writer.drain()

    sender = asyncio.create_task(send())
    echoed = await reader.readexactly(len(payload))
    elapsed_s = time.monotonic() - start
    await sender
    await close(writer)
    assert echoed == payload
    return elapsed_s


@pytest.mark.timing
async def test_bulk_throughput_matches_the_link_rate(echo_port, record_property):
    payload = random.Random(1).randbytes(200_000)
    profile = one_way(Bandwidth(1000))   # 1 Mbit/s: 1.6 s for 200 kB
    async with LinkProxy(upstream=("127.0.0.1", echo_port), profile=profile) as proxy:
        elapsed_s = await bulk_echo_s(proxy, payload)
    rate_kbit_s = len(payload) * 8 / elapsed_s / 1000
    record_property("throughput_1mbit_measured_kbit_s", rate_kbit_s)
    assert rate_kbit_s == pytest.approx(1000, rel=0.15)


@pytest.mark.timing
async def test_loss_stalls_match_the_seeded_model(echo_port, record_property):
    # 30% loss so that a dozen pings certainly meet a few stalls of RTT + 200 ms = 250 ms.
    profile = one_way(Delay(20), Loss(0.3, rtt_ms=50))
    seed = 3
    model = profile.uplink.open(LinkContext(rng=connection_rng(seed, 0, "up"), rtt_s=0.05, seed=seed))
    # Pings are sequential, so none waits behind another: each one's extra delay is its own.
    expected_ms = [(model.departure_s(32, 100.0 * i) - 100.0 * i) * 1000 for i in range(12)]
    assert sum(e > 100 for e in expected_ms) >= 2, "the seed should give this test some stalls"
    async with LinkProxy(upstream=("127.0.0.1", echo_port), profile=profile, seed=seed) as proxy:
        reader, writer = await connect(proxy)
        measured_ms = [await round_trip_ms(reader, writer, b"%032d" % i) for i in range(12)]
        await close(writer)
        stalls = proxy.stats.stalls
    record_property("loss_expected_ms", expected_ms)
    record_property("loss_measured_ms", measured_ms)
    assert stalls == sum(e > 20.5 for e in expected_ms)
    for expected, measured in zip(expected_ms, measured_ms):
        assert expected - EARLY_MS <= measured <= expected + LATE_MS, (expected_ms, measured_ms)


async def sleep_until(proxy: LinkProxy, t_s: float) -> None:
    """Sleep until `t_s` seconds after the proxy started (its outage and trace clock)."""
    await asyncio.sleep(proxy.epoch_s + t_s - asyncio.get_running_loop().time())


def since_start_s(proxy: LinkProxy) -> float:
    return asyncio.get_running_loop().time() - proxy.epoch_s


@pytest.mark.timing
async def test_outage_stall_holds_data_until_the_link_returns(echo_port, record_property):
    profile = one_way(Outage(windows_s=((0.3, 0.4),)))   # down from 0.3 s to 0.7 s
    async with LinkProxy(upstream=("127.0.0.1", echo_port), profile=profile) as proxy:
        reader, writer = await connect(proxy)
        assert await round_trip_ms(reader, writer, b"before") < LATE_MS
        await sleep_until(proxy, 0.4)
        writer.write(b"during")
        assert await reader.readexactly(6) == b"during"
        delivered_s = since_start_s(proxy)
        await close(writer)
        stalls = proxy.stats.stalls
    record_property("outage_release_measured_s", delivered_s)
    assert 0.7 - EARLY_MS / 1000 <= delivered_s <= 0.7 + LATE_MS / 1000
    assert stalls == 1


@pytest.mark.timing
async def test_outage_reset_resets_and_refuses_until_it_ends(echo_port, record_property):
    outage = Outage(windows_s=((0.3, 0.3),), mode="reset")   # down from 0.3 s to 0.6 s
    profile = one_way(outage, downlink=(outage,))
    async with LinkProxy(upstream=("127.0.0.1", echo_port), profile=profile) as proxy:
        reader, writer = await connect(proxy)
        assert await round_trip_ms(reader, writer, b"before") < LATE_MS
        with pytest.raises(ConnectionResetError):
            await reader.read(100)   # nothing is sent: the reset itself ends the read
        reset_s = since_start_s(proxy)
        await close(writer)

        await sleep_until(proxy, 0.4)
        reader, writer = await connect(proxy)   # the kernel accepts; the proxy resets at once
        with pytest.raises(ConnectionResetError):
            writer.write(b"during")
            await writer.drain()
            await reader.read(100)
        await close(writer)

        await sleep_until(proxy, 0.65)
        reader, writer = await connect(proxy)
        assert await round_trip_ms(reader, writer, b"after") < LATE_MS
        await close(writer)
        resets = proxy.stats.resets
    record_property("outage_reset_measured_s", reset_s)
    assert 0.3 - EARLY_MS / 1000 <= reset_s <= 0.3 + LATE_MS / 1000
    assert resets == 2


@pytest.mark.timing
async def test_trace_replay_paces_at_the_trace_rate(echo_port, tmp_path, record_property):
    trace = tmp_path / "every-10ms.trace"
    trace.write_text("".join(f"{t}\n" for t in range(10, 1001, 10)))   # 1500 B / 10 ms = 1.2 Mbit/s
    payload = random.Random(2).randbytes(150_000)
    async with LinkProxy(upstream=("127.0.0.1", echo_port), profile=one_way(Trace(str(trace)))) as proxy:
        elapsed_s = await bulk_echo_s(proxy, payload)
    rate_kbit_s = len(payload) * 8 / elapsed_s / 1000
    record_property("trace_1200kbit_measured_kbit_s", rate_kbit_s)
    assert rate_kbit_s == pytest.approx(1200, rel=0.15)


async def test_jitter_keeps_the_stream_in_order(echo_port):
    profile = one_way(Delay(5), Jitter(20))
    async with LinkProxy(upstream=("127.0.0.1", echo_port), profile=profile, seed=5) as proxy:
        reader, writer = await connect(proxy)
        messages = [b"%06d\n" % i for i in range(200)]
        for message in messages:
            writer.write(message)
            await asyncio.sleep(0.001)   # separate reads, so separate chunks with separate draws
        received = await reader.readexactly(sum(map(len, messages)))
        await close(writer)
        chunks = proxy.stats.chunks
    assert received == b"".join(messages)
    assert chunks >= 2 * 100   # both directions; proves the draws really were per message


async def test_no_data_lost_on_a_rough_link(echo_port):
    rough = (Delay(5), Jitter(5), Bandwidth(20_000), Loss(0.05, rtt_ms=10))
    profile = Profile("rough", uplink=Link(rough), downlink=Link(rough))
    rng = random.Random(3)
    payloads = [rng.randbytes(rng.choice([1, 7, 1448, 1449, 8191, 8193, 65536, 100_001])) for _ in range(24)]
    async with LinkProxy(upstream=("127.0.0.1", echo_port), profile=profile, seed=9) as proxy:
        reader, writer = await connect(proxy)
        for payload in payloads:
            await round_trip_ms(reader, writer, payload)   # asserts the echo is byte-exact
        writer.write_eof()
        assert await reader.read() == b""   # the EOF came through after the data
        await close(writer)
        assert proxy.stats.bytes_up == proxy.stats.bytes_down == sum(map(len, payloads))
        assert proxy.stats.stalls > 0


async def test_stop_delivers_what_is_in_flight():
    received = bytearray()
    finished = asyncio.Event()

    async def sink(reader, writer):
        while data := await reader.read(65536):
            received.extend(data)
        finished.set()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    payload = random.Random(4).randbytes(100_000)
    proxy = LinkProxy(upstream=server.sockets[0].getsockname()[:2], profile=one_way(Delay(5000)))
    await proxy.start()
    reader, writer = await connect(proxy)
    writer.write(payload)
    await writer.drain()
    await asyncio.sleep(0.2)
    assert not received   # still inside the 5 s delay
    await proxy.stop()
    await asyncio.wait_for(finished.wait(), timeout=2.0)
    await close(writer)
    server.close()
    assert bytes(received) == payload


async def test_a_peer_reset_follows_the_data_in_flight():
    received = bytearray()
    ended_by: list[str] = []
    ended = asyncio.Event()

    async def sink(reader, writer):
        try:
            while data := await reader.read(65536):
                received.extend(data)
            ended_by.append("eof")
        except ConnectionResetError:
            ended_by.append("reset")
        ended.set()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    payload = random.Random(5).randbytes(20_000)
    async with LinkProxy(upstream=server.sockets[0].getsockname()[:2], profile=one_way(Delay(300))) as proxy:
        reader, writer = await connect(proxy)
        writer.write(payload)
        await writer.drain()
        await asyncio.sleep(0.05)   # the proxy holds the payload now
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()    # the client resets
        await asyncio.wait_for(ended.wait(), timeout=2.0)
    server.close()
    assert bytes(received) == payload
    assert ended_by == ["reset"]


@pytest.mark.timing
async def test_grpc_calls_cross_the_proxy(record_property):
    grpc = pytest.importorskip("grpc")
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        profile = Profile("test", uplink=Link((Delay(50),)), downlink=Link((Delay(50),)))
        async with LinkProxy(upstream=("127.0.0.1", port), profile=profile) as proxy:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)   # connection set-up
                rtts_ms = []
                for _ in range(3):
                    start = time.monotonic()
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                    rtts_ms.append((time.monotonic() - start) * 1000)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)
    record_property("grpc_unary_100ms_rtt_measured_ms", rtts_ms)
    assert min(rtts_ms) >= 100 - EARLY_MS, rtts_ms
    assert statistics.median(rtts_ms) <= 100 + LATE_MS, rtts_ms


@pytest.mark.timing
def test_proxy_in_a_thread_for_synchronous_callers(threaded_echo_port, record_property):
    profile = Profile("test", uplink=Link((Delay(50),)), downlink=Link((Delay(50),)))
    handle = LinkProxy(upstream=("127.0.0.1", threaded_echo_port), profile=profile).start_in_thread()
    with handle:
        with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
            start = time.monotonic()
            sock.sendall(b"hello")
            assert sock.recv(100) == b"hello"
            rtt_ms = (time.monotonic() - start) * 1000
        assert handle.stats.bytes_up == 5
    record_property("thread_rtt_measured_ms", rtt_ms)
    assert 100 - EARLY_MS <= rtt_ms <= 100 + LATE_MS
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", handle.port), timeout=1)


def test_cli_proxy_runs_and_stops_on_ctrl_c(threaded_echo_port):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "netsim", "proxy", "--profile", "lan", "--listen", "127.0.0.1:0",
               "--upstream", f"127.0.0.1:{threaded_echo_port}", "--seed", "1"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    try:
        port = None
        for line in process.stderr:
            if "listening on 127.0.0.1:" in line:
                port = int(line.split("listening on 127.0.0.1:")[1].split()[0])
                break
        assert port is not None, "the proxy never logged its address"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"via the cli")
            assert sock.recv(100) == b"via the cli"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
        assert "stopped" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def test_profiles_run_through_the_proxy(threaded_echo_port):
    """Every named profile carries bytes intact (a smoke test, not a timing one)."""
    for name in ("lan", "cable", "lte"):
        with LinkProxy(upstream=("127.0.0.1", threaded_echo_port), profile=get_profile(name)).start_in_thread() as handle:
            with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
                sock.sendall(b"x" * 1000)
                got = b""
                while len(got) < 1000:
                    got += sock.recv(1000)
                assert got == b"x" * 1000
