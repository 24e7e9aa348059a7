"""The edge's calls to the verifier: the channel (plain or TLS), the bearer token, the retry and
back-off rules, the errors it raises (EdgeError), and the wire form of the sampling settings."""
from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import Sequence

import grpc

from edge_client.options import ServerLimits
from edge_client.stats import CloudOnlyStats
from spec_core.proto import verifier_pb2 as pb
from spec_core.proto import verifier_pb2_grpc as pb_grpc
from spec_core.warping import SamplingSettings

GRPC_FRAME_BYTES = 5  # gRPC length-prefixed message header
# A server shutting down cancels in-flight calls (CANCELLED); our own cancellation arrives as
# asyncio.CancelledError instead, so retrying CANCELLED is safe. Rounds are idempotent.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
RETRY_AFTER_KEY = "retry-after-ms"   # trailing metadata of a refusal for load (cloud_verifier.admission)
# The verifier's limits, per channel (one connection to one verifier): asked once, shared by the
# clients on that channel.
_SERVER_LIMITS: "weakref.WeakKeyDictionary[grpc.aio.Channel, ServerLimits]" = weakref.WeakKeyDictionary()
_SERVER_INFOS: "weakref.WeakKeyDictionary[grpc.aio.Channel, pb.ServerInfo]" = weakref.WeakKeyDictionary()
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.enable_retries", 0),  # we retry ourselves, idempotently
]


def _pem(value: str | bytes | None) -> bytes | None:
    """PEM bytes, or a path to a PEM file."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def open_channel(server: str, *, tls: bool = False, tls_ca: str | bytes | None = None,
                 tls_cert: str | bytes | None = None, tls_key: str | bytes | None = None,
                 tls_server_name: str | None = None, options=()) -> grpc.aio.Channel:
    """A channel to a verifier: plain text, or TLS (mutual with a client cert and key).
    tls_ca: CA bundle to trust (None: the system's roots); tls_server_name: the name to check the
    server's certificate against when it differs from the address (e.g. through a proxy)."""
    options = list(CHANNEL_OPTIONS) + list(options)
    if not (tls or tls_ca or tls_cert or tls_key):
        return grpc.aio.insecure_channel(server, options=options)
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together (a client certificate for mutual TLS)")
    creds = grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca), private_key=_pem(tls_key),
                                         certificate_chain=_pem(tls_cert))
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return grpc.aio.secure_channel(server, creds, options=options)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def retry_after_s(e: grpc.aio.AioRpcError) -> float | None:
    """The server's retry hint of a refusal for load, in seconds; None when there is none."""
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, float(value) / 1000)
            except ValueError:
                return None
    return None



class EdgeError(RuntimeError):
    """The verifier refused the request; `code` is the gRPC status, the message says why.
    `retry_after_s`: the server's retry hint, set only when it refused for load (the same request
    may succeed later); a refusal without one is about the request itself."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code, self.retry_after_s = code, retry_after_s



def sampling_proto(s: SamplingSettings) -> pb.SamplingParams:
    p = pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,  # 1.0 = off, as the wire says
                          max_new_tokens=s.max_new_tokens, stop_token_ids=list(s.stop_token_ids),
                          ignore_eos=s.ignore_eos)
    if s.seed is not None:
        p.seed = s.seed
    return p



async def stream_cloud_only(stub: pb_grpc.VerifierStub, prompt_ids: Sequence[int], settings: SamplingSettings,
                            timeout_s: float = 600.0, token: str | None = None) -> CloudOnlyStats:
    """Run the Generate stream and time it (wall from the request, TTFT at the first token)."""
    t0 = time.perf_counter()
    ttft, ids = 0.0, []
    async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=list(prompt_ids),
                                                        sampling=sampling_proto(settings)), timeout=timeout_s,
                                     metadata=auth_metadata(token)):
        ids.extend(chunk.token_ids)
        ttft = ttft or time.perf_counter() - t0
    return CloudOnlyStats(len(ids), time.perf_counter() - t0, ttft, ids)
