"""The server interceptor every call passes: bytes that do not decode, bearer tokens, the tenant.

grpc.aio decodes a request before any handler or interceptor sees it; a deserializer that
raises makes grpc answer UNKNOWN ("Unexpected DecodeError") and log a full stack trace, so a
stranger could flood the log at will. The interceptor therefore hands grpc a copy of each
method handler whose deserializer never raises: bytes that do not parse become an
`Undecodable` value, and the wrapped handler answers it with INVALID_ARGUMENT and a one-line
message, counts it (`hybridspec_undecodable_requests`) and logs at most one line per
interval (`QuietLog`).

With a token file, a call without a valid `authorization: Bearer <token>` is answered
UNAUTHENTICATED before its bytes are even decoded; an authenticated call runs with its tenant
in `sessions.current_tenant`, which the session store uses to bind new sessions to it and to
keep other tenants' sessions out of reach. The health service stays open (probes carry no
token).

A handler that raises anything else is a bug: the caller gets INTERNAL with a one-line
message, the log gets the stack trace at most once per interval.
"""
from __future__ import annotations

import contextlib
import logging
import time

import grpc

from cloud_verifier import metrics
from cloud_verifier.auth import TokenFile, bearer_token
from cloud_verifier.sessions import current_tenant

log = logging.getLogger(__name__)

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


class QuietLog:
    """At most one log line per `every_s`; the next line says how many were held back."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0):
        self.logger, self.every_s = logger, every_s
        self._last = -float("inf")
        self.held_back = 0

    def log(self, level: int, msg: str, *args, exc_info=None) -> bool:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self.held_back += 1
            return False
        if self.held_back:
            msg += f" ({self.held_back} more like it in the last {now - self._last:.0f} s not logged)"
        self._last, self.held_back = now, 0
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True


class Undecodable:
    """What the guarded deserializer returns for bytes that are not the method's request type."""

    __slots__ = ("n_bytes", "reason")

    def __init__(self, n_bytes: int, reason: str):
        self.n_bytes, self.reason = n_bytes, reason


def _safe_deserializer(deserialize):
    def guarded(raw: bytes):
        try:
            return deserialize(raw) if deserialize is not None else raw
        except Exception as e:  # noqa: BLE001 - any parse failure is the caller's bad bytes
            return Undecodable(len(raw), (str(e).splitlines() or [type(e).__name__])[0][:200])
    return guarded


class CallGuard(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: TokenFile | None = None, log_every_s: float = 10.0):
        self.tokens = tokens
        self._undecodable_log = QuietLog(log, log_every_s)
        self._auth_log = QuietLog(log, log_every_s)
        self._bug_log = QuietLog(log, log_every_s)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        tenant = ""
        if self.tokens is not None:
            token = bearer_token(details.invocation_metadata)
            tenant = self.tokens.tenant_for(token)
            if tenant is None:
                reason = "missing" if token is None else "invalid"
                metrics.AUTH_FAILURES.labels(reason).inc()
                metrics.ERRORS.labels(grpc.StatusCode.UNAUTHENTICATED.name).inc()
                self._auth_log.log(logging.WARNING, "refused a call to %s: %s bearer token", details.method, reason)
                return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                                 "a valid bearer token is required (call metadata `authorization: Bearer <token>`)"
                                 if token is None else "the bearer token is not valid here")
        return self._guarded(handler, details.method, tenant)

    async def _refuse_undecodable(self, context, method: str, bad: Undecodable):
        metrics.UNDECODABLE.labels(method).inc()
        metrics.ERRORS.labels(grpc.StatusCode.INVALID_ARGUMENT.name).inc()
        self._undecodable_log.log(logging.WARNING, "undecodable request to %s (%d bytes): %s", method, bad.n_bytes,
                                  bad.reason)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid protobuf message for {method}: {bad.reason}")

    async def _internal(self, context, method: str):
        metrics.ERRORS.labels(grpc.StatusCode.INTERNAL.name).inc()
        self._bug_log.log(logging.ERROR, "unexpected error in %s", method, exc_info=True)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method} (logged by the server)")

    def _guarded(self, handler: grpc.RpcMethodHandler, method: str, tenant: str):
        deserialize = _safe_deserializer(handler.request_deserializer)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, Undecodable):
                    await self._refuse_undecodable(context, method, request)
                reset = current_tenant.set(tenant)
                try:
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception:  # noqa: BLE001 - a bug: answer INTERNAL, log quietly
                    await self._internal(context, method)
                finally:
                    with contextlib.suppress(ValueError):
                        current_tenant.reset(reset)
            return grpc.unary_unary_rpc_method_handler(unary, deserialize, handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                if isinstance(request, Undecodable):
                    await self._refuse_undecodable(context, method, request)
                async for item in self._as_tenant(tenant, inner_stream(request, context), context, method):
                    yield item
            return grpc.unary_stream_rpc_method_handler(stream, deserialize, handler.response_serializer)
        if handler.stream_stream is not None:
            inner_bidi = handler.stream_stream

            async def bidi(request_iterator, context):
                async def requests():
                    async for request in request_iterator:
                        if isinstance(request, Undecodable):   # the stream has no tag to answer it by
                            await self._refuse_undecodable(context, method, request)
                        yield request
                async for item in self._as_tenant(tenant, inner_bidi(requests(), context), context, method):
                    yield item
            return grpc.stream_stream_rpc_method_handler(bidi, deserialize, handler.response_serializer)
        return handler  # client-streaming methods: none in this service

    async def _as_tenant(self, tenant, replies, context, method):
        """A streaming handler's replies, run as `tenant` (tasks the handler starts inherit it); an
        unexpected error ends the call INTERNAL with a log line, an abort passes through."""
        reset = current_tenant.set(tenant)
        try:
            async for item in replies:
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception:  # noqa: BLE001
            await self._internal(context, method)
        finally:
            with contextlib.suppress(ValueError):
                current_tenant.reset(reset)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A handler that answers every call with `code`, without decoding the request."""
    async def refuse(request, context):
        await context.abort(code, message)

    async def refuse_stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    identity = lambda raw: raw  # noqa: E731
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, identity, handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, identity, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, identity, handler.response_serializer)
