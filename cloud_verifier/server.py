"""The grpc.aio server: the servicer adapts protobuf to the engine; health, metrics, shutdown."""
from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cloud_verifier import metrics
from cloud_verifier.backends.base import Backend
from cloud_verifier.engine import Limits, RequestError, VerifierEngine
from spec_core import __version__
from spec_core.proto import verifier_pb2 as pb
from spec_core.proto import verifier_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "hybridspec.v1.Verifier"
# A round carries at most a dense float q per draft: allow big messages, refuse absurd ones.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine):
        self.engine = engine

    async def _fail(self, context, e: RequestError):
        metrics.ERRORS.labels(e.code.name).inc()
        await context.abort(e.code, e.message)

    async def Verify(self, request, context):
        try:
            return await self.engine.verify(request)
        except RequestError as e:
            await self._fail(context, e)

    async def Close(self, request, context):
        return pb.CloseReply(closed=self.engine.close(request.session_id))

    async def Generate(self, request, context):
        try:
            async for chunk in self.engine.generate(request):
                yield chunk
        except RequestError as e:
            await self._fail(context, e)

    async def GetServerInfo(self, request, context):
        return self.engine.server_info()


class VerifierServer:
    """Owns the grpc.aio server. `await start()`, then `.port`; `await stop()` drains gracefully."""

    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int = 0, limits: Limits = Limits(),
                 grace_s: float = 5.0):
        self.engine = VerifierEngine(backend, limits, version=__version__)
        self.host, self.requested_port, self.grace_s = host, port, grace_s
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0

    async def start(self) -> "VerifierServer":
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Edges on weak links keep connections alive with pings; let them.
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ])
        pb_grpc.add_VerifierServicer_to_server(VerifierServicer(self.engine), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{self.host}:{self.requested_port}")
        if not self.port:
            raise OSError(f"could not bind {self.host}:{self.requested_port}")
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("verifier listening on %s:%d (%s, model %s, vocab %d, ctx %d)", self.host, self.port,
                 self.engine.info.name, self.engine.info.model, self.engine.info.n_vocab, self.engine.info.n_ctx)
        return self

    async def stop(self) -> None:
        if self.server is None:
            return
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace_s)
        self.engine.sessions.clear()
        self.server = None

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()


async def serve_forever(backend: Backend, host: str, port: int, limits: Limits, metrics_port: int | None,
                        on_ready=None) -> None:
    if metrics_port is not None:
        from prometheus_client import start_http_server
        start_http_server(metrics_port, addr=host)
        log.info("metrics on http://%s:%d/metrics", host, metrics_port)
    server = VerifierServer(backend, host, port, limits)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(server.port)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await server.stop()
        backend.close()
