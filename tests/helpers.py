"""Small helpers for the gRPC tests."""
from __future__ import annotations

import contextlib
import dataclasses

import grpc

from cloud_verifier.backends.base import Backend
from cloud_verifier.engine import Limits
from cloud_verifier.server import VerifierServer
from edge_client.options import EdgeOptions, Security, Speculation, Transport
from spec_core.proto import verifier_pb2_grpc as pb_grpc


@contextlib.asynccontextmanager
async def running_server(backend: Backend, port: int = 0, **limits):
    server = VerifierServer(backend, "127.0.0.1", port, Limits(**limits), grace_s=0.5)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def stub_for(server: VerifierServer):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield pb_grpc.VerifierStub(ch)


def edge_options(server: str, **fields) -> EdgeOptions:
    """EdgeOptions for the verifier at `server`, each keyword given to the record with that field
    (gamma=4, qmode="none": Speculation; deadline_s=10: Transport; token="t": Security)."""
    parts = {}
    for record in (Transport, Speculation, Security):
        names = {f.name for f in dataclasses.fields(record)}
        parts[record] = {k: fields.pop(k) for k in list(fields) if k in names}
    if fields:
        raise TypeError(f"no edge option named {sorted(fields)}")
    return EdgeOptions(Transport(server, **parts[Transport]), Speculation(**parts[Speculation]),
                       Security(**parts[Security]))
