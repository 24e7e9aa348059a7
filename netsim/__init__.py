"""netsim: a user-space link emulator for the edge <-> cloud gRPC path.

A TCP proxy (`LinkProxy`) passes the real bytes through two emulated links, one per
direction, each a sequence of effects (delay, jitter, bandwidth, loss as retransmission
stalls, outages, Mahimahi trace replay, LEO handovers) named in `netsim.effects.EFFECTS`.
Named profiles with their sources are in `netsim.profiles`.
"""
from .effects import EFFECTS, Chunk, Effect, LinkContext, LinkReset, effect_from_dict
from .link import Link, LinkState
from .profiles import PROFILES, Profile, get_profile
from .proxy import LinkProxy, ProxyStats, ProxyThread, connection_rng

__all__ = [
    "EFFECTS", "Chunk", "Effect", "LinkContext", "LinkReset", "effect_from_dict",
    "Link", "LinkState", "PROFILES", "Profile", "get_profile",
    "LinkProxy", "ProxyStats", "ProxyThread", "connection_rng",
]
