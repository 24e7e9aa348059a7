"""The links between an edge and its verifier in the simulator: the proxy's own.

Each edge's connection opens its profile's uplink and downlink as `LinkProxy` does (`Link.open`,
a generator per connection and direction from `netsim.proxy.connection_rng`), and each message
is cut into the proxy's chunks and leaves when its link says. So jitter is the proxy's delay curve
(independent values every 4 × the spread, linear in between, never reordering), bandwidth keeps
each connection busy for size/rate, loss is the proxy's recovery stall (tail-loss probe or fast
retransmit, RTO backoff) that holds the rest of the stream behind it, and outages, traces and
handovers act as they do in the proxy. A reset connection is reopened and the message sent again
after the client's first retry delay.
"""
from __future__ import annotations

from netsim.effects import LinkContext, LinkReset
from netsim.profiles import Profile
from netsim.proxy import chunk_bytes, connection_rng

MAX_CHUNK_BYTES = 8192   # LinkProxy's max_chunk_bytes default
RECONNECT_S = 0.05       # the edge client's first retry delay (edge_client.transport.Verifier.call)

# Bytes a message puts on the wire (gRPC and HTTP/2 framing included), as the proxy read them with
# the synthetic pair, γ = 4 and q fixed:16:16 (bench/fleet_wire.py): a Verify request median 251 B
# (432 B with the prompt), its reply 111–113 B; a Generate request 137 B, a streamed token 22 B.
# Left out: about one 17-byte HTTP/2 PING or its ACK per ten rounds each way (gRPC's BDP probe).
ROUND_BYTES = (250, 112)
STREAM_BYTES = (137, 22)


class EdgeLink:
    """One edge's connection through its proxy, both directions, opened as LinkProxy opens one."""

    def __init__(self, profile: Profile, seed: int) -> None:
        self.profile, self.seed = profile, seed
        self.chunk = {"up": chunk_bytes(profile.uplink, MAX_CHUNK_BYTES),
                      "down": chunk_bytes(profile.downlink, MAX_CHUNK_BYTES)}
        self.connection = -1
        self.resets = 0
        self._open()

    def _open(self) -> None:
        self.connection += 1
        rtt_s = self.profile.rtt_ms() / 1000.0
        self.states = {direction: link.open(LinkContext(rng=connection_rng(self.seed, self.connection, direction),
                                                        epoch_s=0.0, rtt_s=rtt_s, seed=self.seed))
                       for direction, link in (("up", self.profile.uplink), ("down", self.profile.downlink))}

    def arrival_s(self, direction: str, size_bytes: int, sent_s: float) -> float:
        """When a message of `size_bytes` written at `sent_s` has crossed ("up" or "down").

        Calls for one direction come in the order of their `sent_s`, as the proxy reads them.
        """
        while True:
            try:
                arrival_s = sent_s
                chunk = self.chunk[direction]
                for start in range(0, max(size_bytes, 1), chunk):
                    arrival_s = self.states[direction].departure_s(min(chunk, size_bytes - start), sent_s)
                return arrival_s
            except LinkReset:
                # A new connection, and the message again after the client's retry delay.
                self.resets += 1
                self._open()
                sent_s += RECONNECT_S
