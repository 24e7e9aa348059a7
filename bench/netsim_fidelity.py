"""netsim measured from outside: ping round trips and bulk downloads through a proxy process.

Prints, side by side in one run, the figures of the netsim in this checkout and of a baseline
commit (default: the one before issue 10's netsim fixes), each proxy in its own process and a
plain blocking-socket client in this one:

- 64-byte pings written in one piece, and in three pieces `--gap-ms` apart (as gRPC may write
  a message's HTTP/2 frames): mean, p50 and p95 against the profile's RTT and expected RTT
  (with loss stalls; the pieces' gaps add to the round trip, which counts from the first);
- 200 kB downloads: seconds against RTT + size / downlink rate (no loss) and its expected
  value with loss stalls.

    python bench/netsim_fidelity.py [--baseline dd70c89] [--pings 60]
"""
from __future__ import annotations

import argparse
import os
import socket
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hybridspec.machine import announce
from netsim import get_profile  # noqa: E402

# Runs one LinkProxy in its own process; works with the old package too (no new API used).
RUNNER = r"""
import asyncio, sys
from netsim import get_profile, Link, Profile, LinkProxy
name, port, strip = sys.argv[1], int(sys.argv[2]), set(filter(None, sys.argv[3].split(",")))
p = get_profile(name)
cut = lambda link: Link(tuple(e for e in link.effects if e.kind not in strip))
profile = Profile(p.name, cut(p.uplink), cut(p.downlink))
async def main():
    async with LinkProxy(upstream=("127.0.0.1", port), profile=profile, seed=1) as proxy:
        print(proxy.port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""


class _Server(socketserver.BaseRequestHandler):
    """64-byte requests: "GET n" sends n bytes back, anything else is echoed."""

    def handle(self) -> None:
        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = b""
        while data := sock.recv(65536):
            buffer += data
            while len(buffer) >= 64:
                message, buffer = buffer[:64], buffer[64:]
                sock.sendall(b"x" * int(message[4:].rstrip(b"\0")) if message.startswith(b"GET ") else message)


def start_server() -> int:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Server)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]


def start_proxy(root: Path, profile: str, upstream: int, strip: str) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(root))
    # cwd=root as well: `python -c` puts the working directory first on sys.path.
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, profile, str(upstream), strip], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=root)
    return proc, int(proc.stdout.readline())


def receive(sock: socket.socket, n: int) -> None:
    got = 0
    while got < n:
        got += len(sock.recv(1 << 20))


def pings_ms(port: int, count: int, pieces: int, gap_s: float = 0.0003) -> list[float]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"p" * 64)
        receive(sock, 64)   # warm-up
        out = []
        size = 64 // pieces
        for _ in range(count):
            start = time.perf_counter()
            for i in range(pieces):
                sock.sendall(b"p" * (size if i < pieces - 1 else 64 - size * (pieces - 1)))
                if i < pieces - 1:
                    time.sleep(gap_s)
            receive(sock, 64)
            out.append((time.perf_counter() - start) * 1000)
            time.sleep(0.01)
        return out


def downloads_s(port: int, count: int, size: int) -> list[float]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for _ in range(count):
            start = time.perf_counter()
            sock.sendall(f"GET {size}".encode().ljust(64, b"\0"))
            receive(sock, size)
            out.append(time.perf_counter() - start)
        return out


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    return (f"mean {statistics.fmean(values):8.2f}  p50 {statistics.median(values):8.2f}  "
            f"p95 {ordered[int(0.95 * (len(values) - 1))]:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="dd70c89", help="git commit whose netsim is measured alongside")
    parser.add_argument("--pings", type=int, default=60)
    parser.add_argument("--downloads", type=int, default=5)
    parser.add_argument("--gap-ms", type=float, default=1.0, help="between the pieces of a 3-piece ping")
    parser.add_argument("--only", help="run only this case of the ping table, e.g. 3g:loss:3 (no downloads)")
    args = parser.parse_args()
    announce()
    old = Path(tempfile.mkdtemp(prefix="netsim-baseline-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline, "netsim"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    upstream = start_server()
    cases = [("lan", "", 1), ("3g", "loss", 1), ("3g", "loss", 3), ("3g", "", 1), ("geo-sat", "", 1)]
    if args.only:
        name, strip, pieces = args.only.split(":")
        cases = [(name, strip, int(pieces))]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.pings} pings per row\n")
    print("64-byte ping round trips (ms)")
    for name, strip, pieces in cases:
        profile = get_profile(name).without(*filter(None, strip.split(",")))
        count = args.pings * (4 if name == "lan" else 1)
        print(f"  {name}{' without ' + strip if strip else ''}, {pieces} write(s): profile RTT "
              f"{profile.rtt_ms():g}, expected {profile.expected_rtt_ms():.2f}")
        for label, root in (("baseline", old), ("this", REPO)):
            proc, port = start_proxy(root, name, upstream, strip)
            try:
                print(f"    {label:9s} {summary(pings_ms(port, count, pieces, args.gap_ms / 1000))}")
            finally:
                proc.stdin.close()
                proc.wait(10)
    if args.only:
        return
    print("\n200 kB downloads (s)")
    size = 200_000
    for name, strip in (("geo-sat", "loss"), ("geo-sat", ""), ("3g", "loss")):
        profile = get_profile(name).without(*filter(None, strip.split(",")))
        no_loss = profile.rtt_ms() / 1000 + size * 8 / (profile.downlink.rate_kbit_s() * 1000)
        expected = profile.expected_rtt_ms(64, size) / 1000
        print(f"  {name}{' without ' + strip if strip else ''}: RTT + size/rate {no_loss:.3f}, expected with "
              f"loss stalls {expected:.3f}")
        for label, root in (("baseline", old), ("this", REPO)):
            proc, port = start_proxy(root, name, upstream, strip)
            try:
                times = downloads_s(port, args.downloads, size)
                print(f"    {label:9s} " + " ".join(f"{t:.3f}" for t in times) + f"   ({summary(times)})")
            finally:
                proc.stdin.close()
                proc.wait(10)


if __name__ == "__main__":
    main()
