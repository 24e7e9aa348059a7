"""Constants both ends of the wire must agree on, in one place (pure values: no gRPC, no protobuf).

The .proto (proto/) is the contract for messages; these are the parts of the contract that live
outside the messages: a gRPC metadata key, a size limit the channel options carry, and a field's
required length.
"""
from __future__ import annotations

import ipaddress

# Trailing metadata of a refusal for load (RESOURCE_EXHAUSTED or UNAVAILABLE): milliseconds to wait
# before retrying, as a decimal string. The verifier sets it (cloud_verifier.admission); the edge obeys it.
RETRY_AFTER_KEY = "retry-after-ms"

# Trailing metadata of a draining verifier's answer (a session "moved", a new session refused): the
# edge that knows other replicas goes to the next one at once. The value says nothing ("1").
MOVED_KEY = "hybridspec-moved"

# Trailing metadata of a refusal that another replica may not share (a verifier too busy to give a
# new session its first token in time): the edge that knows other replicas tries the next one at
# once; with none, it waits the retry hint. The value says nothing ("1").
ELSEWHERE_KEY = "hybridspec-try-elsewhere"

# Trailing metadata of a first-token refusal (cloud_verifier.first_token) whose place the verifier
# keeps: the edge comes back at the hint, not at a random multiple of it. The value says nothing ("1").
HELD_KEY = "hybridspec-place-held"

# Trailing metadata of the answer to an open the verifier queued past its first-token target (no
# other replica to send it to): the predicted milliseconds to its first token, as a decimal string.
# The round goes on there; the edge asks again with the same open for the reply.
QUEUED_KEY = "hybridspec-queued-ms"

# Request metadata of an open: how many replicas the edge can go to (its --server list), so that a
# verifier too busy for a new session refuses it (try elsewhere) only when there is somewhere else.
REPLICAS_KEY = "hybridspec-replicas"

# The largest gRPC message either end sends or receives (gRPC's default is 4 MiB): a long prompt's
# replay, a wide tree with float q, a vocabulary.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Channel/server options that raise gRPC's limits to MAX_MESSAGE_BYTES both ways.
MESSAGE_SIZE_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)

# OpenSession.open_key: random bytes the edge picks for a session's first round, so a retried open
# finds the session it created instead of opening a second one.
OPEN_KEY_BYTES = 16


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address) is this machine's loopback: the one place both servers (the
    verifier's gRPC port, the edge's OpenAI endpoint) may listen without TLS or a key."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
