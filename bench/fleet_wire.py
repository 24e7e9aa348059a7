"""What a round puts on the wire: the pieces the netsim proxy reads, per direction, for one edge.

One edge (the load test's synthetic drafter and prompts, γ = 4, q fixed:16:16) talks to a
synthetic verifier through a lan proxy in this process; every read the proxy schedules is
recorded. Prints, per mode, the pieces per request and per round (or streamed token) and their
sizes: the figures behind netsim.fleet.links.ROUND_BYTES and STREAM_BYTES. The 17-byte pieces are
HTTP/2 PING and PING ACK frames (gRPC's BDP probe).

    python bench/fleet_wire.py [--requests 3] [--batching on]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from hybridspec.machine import announce
import netsim.link  # noqa: E402
from edge_client.client import EdgeClient, sampling_proto  # noqa: E402
from hybridspec.launch import spawn_verifier  # noqa: E402
from netsim.load import DraftCost, Edges, LoadConfig, Request, Window, _one_request  # noqa: E402
from netsim.profiles import get_profile  # noqa: E402
from netsim.proxy import LinkProxy  # noqa: E402
from spec_core.proto import verifier_pb2 as pb  # noqa: E402
from spec_core.proto import verifier_pb2_grpc as pb_grpc  # noqa: E402

PIECES: list[tuple[str, int]] = []   # (direction, bytes) of every read the proxy scheduled


def _recording_links(profile) -> None:
    """Wrap Link.open so that each link state reports what it is given (up = the profile's uplink)."""
    open_link = netsim.link.Link.open

    def open_recorded(link, ctx):
        state = open_link(link, ctx)
        direction = "up" if link is profile.uplink else "down"
        departure_s = state.departure_s

        def recorded(size_bytes, arrival_s):
            PIECES.append((direction, size_bytes))
            return departure_s(size_bytes, arrival_s)
        state.departure_s = recorded
        return state
    netsim.link.Link.open = open_recorded


async def main(requests: int, batching: str) -> None:
    profile = get_profile("lan")
    _recording_links(profile)
    proc, address = spawn_verifier(["--backend", "synthetic", "--synthetic-vocab", "64", "--synthetic-step-ms", "5",
                                    "--batching", batching])
    cfg = LoadConfig(edges=[1], profiles=["lan"], modes=["hybrid"], duration_s=1.0, out=Path("."), synthetic=True)
    edges = Edges(cfg)
    try:
        async with LinkProxy(upstream=("127.0.0.1", int(address.rsplit(":", 1)[1])), profile=profile, seed=1) as proxy:
            cost = DraftCost()
            drafter = edges.drafter(cost, 0)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}", interceptors=[cost]) as channel:
                stub = pb_grpc.VerifierStub(channel)
                await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=60)
                for mode in ("hybrid", "cloud-only"):
                    PIECES.clear()
                    units = 0
                    for number in range(requests):
                        request = Request(0, 0.0)
                        await _one_request(mode, stub, channel, drafter, edges, edges.prompt(0, number),
                                           edges.settings_for(0, number), request, Window(1, 0.0, 1.0), EdgeClient,
                                           sampling_proto, pb)
                        units += request.rounds if mode == "hybrid" else len(request.token_times)
                    unit = "round" if mode == "hybrid" else "streamed token"
                    print(f"{mode}: {requests} requests, {units} {unit}s")
                    for direction in ("up", "down"):
                        sizes = [size for d, size in PIECES if d == direction]
                        control = sum(1 for size in sizes if size == 17)
                        data = [size for size in sizes if size != 17]
                        common = collections.Counter(data).most_common(3)
                        print(f"  {direction:4s} {len(sizes) / units:.2f} pieces per {unit} ({control} of 17 B); other "
                              f"pieces: median {statistics.median(data):.0f} B, range {min(data)}–{max(data)} B, "
                              f"most common {common}")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--batching", choices=["on", "off"], default="off")
    args = parser.parse_args()
    announce()
    asyncio.run(main(args.requests, args.batching))
