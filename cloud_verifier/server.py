"""The grpc.aio server: the servicer adapts protobuf to the engine; TLS, tokens, tenants,
admission control, health, metrics, graceful drain.

Transport: with a certificate (`ServerTLS`) the port is TLS, mutual when a client CA is given.
Without one the server speaks plain text, and only on a loopback address unless `insecure=True`:
a token sent in plain text over a real network is a token given away.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cloud_verifier import metrics
from cloud_verifier.first_token import Admitted, FirstTokens
from cloud_verifier.admission import (InflightGate, Queued, Refused, ReplaysFirst, RoundLimiter, ServerPolicy,
                                     TokenBucket, RETRY_AFTER_KEY)
from cloud_verifier.auth import TokenFile
from cloud_verifier.backends.base import Backend
from cloud_verifier.engine import VerifierEngine
from cloud_verifier.guard import CallGuard
from cloud_verifier.sessions import current_tenant
from cloud_verifier.validation import Limits, RequestError, ValidOpen, quoted
from cloud_verifier.workers import run_in_thread
from spec_core import __version__, clock
from spec_core.proto import verifier_pb2 as pb
from spec_core.proto import verifier_pb2_grpc as pb_grpc
from spec_core.wire import MESSAGE_SIZE_OPTIONS, MOVED_KEY, REPLICAS_KEY, is_loopback

log = logging.getLogger(__name__)

SERVICE_NAME = "hybridspec.v1.Verifier"


class InsecureBindError(ValueError):
    pass


class BindError(OSError):
    """The server could not listen on its address: the port is in use, or the address is not this machine's."""


@dataclass(frozen=True)
class ServerTLS:
    """PEM bytes: the server's certificate chain and key; a client CA turns on mutual TLS.

    Made `from_files`, it reads the files again when they change (checked when a client
    connects, through grpcio's dynamic_ssl_server_credentials), so a renewed certificate
    (cert-manager, a rotated secret) takes effect for new connections without a restart."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None
    paths: tuple[str, str, str | None] | None = None   # (cert, key, client CA) to watch

    @classmethod
    def from_files(cls, cert: str, key: str, client_ca: str | None = None) -> "ServerTLS":
        pems = _read_pems(cert, key, client_ca)
        return cls(pems["certificate"], pems["key"], pems.get("client CA"), paths=(cert, key, client_ca))

    def credentials(self) -> grpc.ServerCredentials:
        require_client_auth = self.client_ca is not None
        if self.paths is None:
            return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
                                               require_client_auth=require_client_auth)
        initial = grpc.ssl_server_certificate_configuration([(self.private_key, self.cert_chain)],
                                                            root_certificates=self.client_ca)
        return grpc.dynamic_ssl_server_credentials(initial, _CertificateWatch(self.paths),
                                                   require_client_authentication=require_client_auth)

    def describe(self) -> str:
        return "mutual TLS" if self.client_ca else "TLS"


def _read_pems(cert: str, key: str, client_ca: str | None) -> dict[str, bytes]:
    pems = {}
    for what, path in (("certificate", cert), ("key", key), ("client CA", client_ca)):
        if path is None:
            continue
        data = Path(path).read_bytes()
        # grpc would only fail at the first handshake; say what is wrong at start instead.
        if b"-----BEGIN " not in data or b"-----END " not in data:
            raise ValueError(f"{path}: the TLS {what} is not in PEM format (-----BEGIN ...-----)")
        pems[what] = data
    return pems


class _CertificateWatch:
    """grpc calls this before each TLS handshake: a new configuration when the files changed, else None.
    A half-written or broken set keeps the current one (logged once); the next change is tried again."""

    def __init__(self, paths: tuple[str, str, str | None]):
        self.paths = paths
        self._stamp = self._files_stamp()

    def _files_stamp(self) -> tuple:
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in (Path(p).stat() for p in self.paths if p))

    def __call__(self):
        try:
            stamp = self._files_stamp()
            if stamp == self._stamp:
                return None
            self._stamp = stamp   # one log line per change, not one per connection
            pems = _read_pems(*self.paths)
        except (OSError, ValueError) as e:
            log.error("TLS files not reloaded, keeping the current certificate: %s", e)
            return None
        log.info("TLS certificate reloaded from %s", self.paths[0])
        return grpc.ssl_server_certificate_configuration([(pems["key"], pems["certificate"])],
                                                         root_certificates=pems.get("client CA"))


class _Moved(Exception):
    """A draining verifier hands a session back: the edge replays it on another replica."""

    def __init__(self, session_id: str):
        self.message = (f"session {quoted(session_id)} moved: this verifier is draining (shutting down); resend the "
                        "round with `open` to replay the committed tokens on another replica")
        super().__init__(self.message)


class VerifierServicer(pb_grpc.VerifierServicer):
    """protobuf <-> engine, plus what belongs to the call rather than the round: the tenant's
    right to the session it names, per-tenant limits, admission control, draining."""

    def __init__(self, engine: VerifierEngine, policy: ServerPolicy = ServerPolicy()):
        self.engine, self.policy = engine, policy
        self.rounds = RoundLimiter(policy.tenant_rounds_per_s, policy.tenant_burst)
        self.inflight = InflightGate(policy.max_inflight_rounds or 4 * engine.limits.max_sessions)
        self.replays = ReplaysFirst(policy.replay_first_retry_after_s)
        # A new session predicted to wait past its first-token target is told at once: queued, or refused.
        self.first_tokens = FirstTokens(engine.backend.prefill_rate, policy.admit_ttft_s)
        self.draining = False
        self.moved: set[str] = set()             # sessions handed back while draining
        self._saving: dict[str, asyncio.Future] = {}   # their KV checkpoints being written
        self._handback: TokenBucket | None = None   # paces them (policy.drain_sessions_per_s)
        self._opening: collections.defaultdict[str, list[bytes]] = collections.defaultdict(list)  # open keys admitted
        self._going_on: set[asyncio.Task] = set()   # queued opens' rounds, answered already (_go_on)

    async def _fail(self, context, e: RequestError):
        metrics.ERRORS.labels(e.code.name).inc()
        if e.retry_after_s is None:
            await context.abort(e.code, e.message)
        err = _stream_error(e.code, e.message, e.retry_after_s)
        await context.abort(e.code, err.message, trailing_metadata=((RETRY_AFTER_KEY, str(err.retry_after_ms)),))

    async def _refuse(self, context, r: Refused):
        metrics.REFUSED.labels(r.reason).inc()
        metrics.ERRORS.labels(r.code.name).inc()
        await context.abort(r.code, r.message, trailing_metadata=r.trailing_metadata())

    def _check_owner(self, session_id: str) -> None:
        s = self.engine.session(session_id)
        if s is not None and s.tenant != current_tenant.get():
            metrics.PERMISSION_DENIED.inc()
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               f"session {quoted(session_id)} was opened by another tenant; open a session of your own")

    def _admit_open(self, o: pb.OpenSession) -> bool:
        """Refuse a new session for load; False for a retried first round (its session exists)."""
        engine = self.engine
        if o.open_key and (engine.open_key_known(o.open_key) or o.open_key in self._opening.get(current_tenant.get(), ())):
            return False   # asked again: the session exists, or its open is under way (a queued one goes on)
        cap, tenant = self.policy.tenant_max_sessions, current_tenant.get()
        # Opens admitted but not stored yet (making their KV cache) count too, or concurrent opens
        # would all pass. (A keyless open counts twice while it runs: edges always send a key.)
        pending = sum(1 for key in self._opening[tenant] if not engine.open_key_known(key))
        if cap and engine.unfinished_sessions(tenant) + pending >= cap:
            raise Refused(f"this tenant already has {cap} unfinished sessions (its limit)",
                          self.policy.session_retry_after_s, "tenant_sessions")
        if not engine.has_session_room():
            raise Refused(f"all {self.engine.limits.max_sessions} session slots are in use",
                          self.policy.session_retry_after_s, "slots", elsewhere=True)
        return True

    def _admit_first_token(self, o: pb.OpenSession, valid: ValidOpen, replay: bool, context) -> Admitted | None:
        """An open's first token admitted (FirstTokens: queued when predicted past its TTFT target, its
        SLO's, else the server's, else policy.admit_ttft_s), or Refused where another replica may serve
        it now: the edge says it knows others (REPLICAS_KEY), or policy.admission is "refuse"."""
        if self.policy.admit_ttft_s <= 0:
            return None
        ttft_s = valid.slo.ttft_s if valid.slo is not None and valid.slo.ttft_s else None
        if ttft_s is None and self.engine.default_slo is not None and self.engine.default_slo.ttft_s:
            ttft_s = self.engine.default_slo.ttft_s
        elsewhere = self.policy.admission == "refuse" or (self.policy.admission == "auto"
                                                           and _replicas(context) > 1)
        return self.first_tokens.admit(len(valid.prompt) + len(valid.resume), replay, ttft_s, bytes(o.open_key),
                                       elsewhere)

    async def Verify(self, request, context):
        try:
            return await self._verify_round(request, context)
        except _Moved as m:
            metrics.ERRORS.labels(grpc.StatusCode.NOT_FOUND.name).inc()
            await context.abort(grpc.StatusCode.NOT_FOUND, m.message, trailing_metadata=((MOVED_KEY, "1"),))
        except Refused as r:
            await self._refuse(context, r)
        except RequestError as e:
            await self._fail(context, e)

    def drain(self) -> None:
        """Take no new session from now on, and hand back the sessions held here, paced."""
        self.draining = True
        rate = self.policy.drain_sessions_per_s
        # A second's worth at once: the rounds of a busy verifier come back in clumps (those of one
        # pass together), and with room for one, the rate was one a pass whatever it was set to.
        self._handback = TokenBucket(rate, max(1.0, rate)) if rate > 0 else None

    def to_hand_back(self, idle_s: float = 2.0) -> int:
        """Sessions still generating here, with a round inside now or used within `idle_s`, that were
        not handed back yet (an idle one is not waited for: its edge replays wherever it goes next).
        A round queued behind many others counts as use: on a busy verifier it can wait longer than
        `idle_s`, and a session left out then would be cut by the port closing instead of handed back."""
        now = clock.now()   # the sessions' clock (spec_core.clock)
        return sum(1 for s in self.engine.held_sessions()
                   if s.state is not None and s.id not in self.moved
                   and (s.lock.locked() or now - s.last_used < idle_s))

    async def _drained(self, request) -> None:
        """A round reaching a draining verifier. A round of a session held here is answered
        NOT_FOUND "moved" when its turn to leave has come (all at once, or
        policy.drain_sessions_per_s, so that the replica they go to prefills their replays as it
        can) and served here until then; the edge answers "moved" with a replay on the next replica
        it knows. Before that answer the session's KV checkpoint is written (with --kv-store), so
        that the replica restores its cells instead of prefilling them. A new session is refused
        with a short hint. Both carry MOVED_KEY."""
        sid = request.session_id
        session = self.engine.session(sid) if sid else None
        if session is not None:
            if sid not in self.moved and self._handback is not None and self._handback.take() > 0:
                return   # not its turn: served here
            if sid not in self.moved:
                self.moved.add(sid)
                if session.state is not None:
                    self._saving[sid] = asyncio.ensure_future(self._checkpoint(session.state))
            if sid in self._saving:   # every round of the session waits for it (pipelined ones too)
                await asyncio.shield(self._saving[sid])
            raise _Moved(sid)
        raise Refused("this verifier is draining (shutting down) and takes no new sessions; retry, another replica "
                      "or the restarted one will take it", self.policy.drain_retry_after_s, "draining",
                      code=grpc.StatusCode.UNAVAILABLE, moved=True)
    async def _checkpoint(self, state) -> None:
        try:
            await run_in_thread(self.engine.backend.checkpoint, state)
        except Exception:  # noqa: BLE001 - without it the replica prefills the replay: slower, not wrong
            log.exception("writing a handed-back session's KV checkpoint failed")

    async def _verify_round(self, request: pb.VerifyRequest, context=None) -> pb.VerifyReply:
        """One round, as Verify and VerifyStream both run it; Refused / RequestError / _Moved for its status.
        `context`: a unary call's. An open queued past its first-token target on such a call is answered
        at once (`Queued`: its edge is told how long) while its round goes on here (`_go_on`); its edge
        asks again with the same open and gets the reply when the round is done. A stream's rounds are
        never answered so (an edge opens with a unary call)."""
        if self.draining:
            await self._drained(request)
        self.rounds.admit(current_tenant.get())
        with self.inflight:
            metrics.INFLIGHT.set(self.inflight.inflight)
            tenant, opening, replay, first, handed = current_tenant.get(), None, False, None, False
            try:
                # Content first: a malformed round is INVALID_ARGUMENT whatever the load.
                valid = self.engine.validate(request)
                if request.session_id:
                    self._check_owner(request.session_id)
                elif self._admit_open(request.open):
                    opening = request.open.open_key
                    self._opening[tenant].append(opening)
                    replay = self.replays.admit(bool(request.open.resume_token_ids))
                    await self.engine.lifecycle.tokenize(valid.open)   # a text prompt counts in tokens
                    first = self._admit_first_token(request.open, valid.open, replay, context)
                    if first is not None and first.queued and context is not None:
                        self._go_on(valid, first, replay, opening, tenant)
                        handed = True
                        raise Queued(first)
                return await self.engine.verify(valid)
            finally:
                if not handed:
                    self._opened(first, replay, opening, tenant)
                metrics.INFLIGHT.set(self.inflight.inflight - 1)

    def _opened(self, first: Admitted | None, replay: bool, opening: bytes | None, tenant: str) -> None:
        """An admitted open's round has ended (answered or failed): its bookkeeping goes."""
        if first is not None:
            self.first_tokens.done(first.ticket)
        if replay:
            self.replays.done()
        if opening is not None:
            self._opening[tenant].remove(opening)
            if not self._opening[tenant]:
                del self._opening[tenant]

    def _go_on(self, valid, first: Admitted, replay: bool, opening: bytes | None, tenant: str) -> None:
        """A queued open's round, run without its call (answered at once): counted in flight until it
        ends; its reply waits in the session's reply cache for the edge's next ask (a failure: that ask
        runs the round again and gets the status itself)."""
        self.inflight.inflight += 1

        async def run() -> None:
            try:
                await self.engine.verify(valid)
            except Exception as e:  # noqa: BLE001 - see above
                log.info("a queued open's round failed (its edge's next ask runs it again): %s", e)
            finally:
                self.inflight.inflight -= 1
                self._opened(first, replay, opening, tenant)
        task = asyncio.ensure_future(run())
        self._going_on.add(task)
        task.add_done_callback(self._going_on.discard)

    async def VerifyStream(self, request_iterator, context):
        """A session's rounds over one stream: each goes through `_verify_round`, as a unary Verify
        would, concurrently (a pipelined round waits for its predecessor inside the engine, so the
        rounds of a window must not wait for each other here), and is answered as soon as it is done,
        its status in the reply (StreamError). The stream ends when the client has sent its last
        round and every round is answered."""
        replies: asyncio.Queue[pb.StreamReply | None] = asyncio.Queue()
        rounds: set[asyncio.Task] = set()

        async def answer(msg: pb.StreamRound) -> None:
            try:
                reply = pb.StreamReply(tag=msg.tag, reply=await self._verify_round(msg.request))
            except _Moved as m:   # no metadata on a stream's error: NOT_FOUND, the edge replays via unary Verify
                metrics.ERRORS.labels(grpc.StatusCode.NOT_FOUND.name).inc()
                reply = pb.StreamReply(tag=msg.tag, error=_stream_error(grpc.StatusCode.NOT_FOUND, m.message, None))
            except Refused as r:
                metrics.REFUSED.labels(r.reason).inc()
                metrics.ERRORS.labels(r.code.name).inc()
                reply = pb.StreamReply(tag=msg.tag, error=pb.StreamError(code=r.code.value[0], message=r.message,
                                                                         retry_after_ms=r.retry_after_ms))
            except RequestError as e:
                metrics.ERRORS.labels(e.code.name).inc()
                reply = pb.StreamReply(tag=msg.tag, error=_stream_error(e.code, e.message, e.retry_after_s))
            except Exception:  # noqa: BLE001 - a bug: this round INTERNAL (as the guard answers Verify), the rest go on
                metrics.ERRORS.labels(grpc.StatusCode.INTERNAL.name).inc()
                log.exception("unexpected error in a VerifyStream round")
                reply = pb.StreamReply(tag=msg.tag, error=_stream_error(
                    grpc.StatusCode.INTERNAL, "internal error in VerifyStream (logged by the server)", None))
            await replies.put(reply)

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    task = asyncio.ensure_future(answer(msg))
                    rounds.add(task)
                    task.add_done_callback(rounds.discard)
                if rounds:
                    await asyncio.wait(set(rounds))
            finally:
                await replies.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (reply := await replies.get()) is not None:
                yield reply
            await reader   # a failure reading the requests ends the stream with it
        finally:
            # The client went away (or the call was cancelled): rounds already inside the engine
            # finish there (their replies are cached for a retry); nothing more is read.
            reader.cancel()

    async def Close(self, request, context):
        try:
            self._check_owner(request.session_id)
        except RequestError as e:
            await self._fail(context, e)
        return pb.CloseReply(closed=self.engine.close(request.session_id))

    async def Generate(self, request, context):
        try:
            self.rounds.admit(current_tenant.get())
            if self.draining:
                raise Refused("this verifier is draining (shutting down); retry on another replica", 0.5, "draining",
                              code=grpc.StatusCode.UNAVAILABLE)
            async for chunk in self.engine.generate(request):
                yield chunk
        except Refused as r:
            await self._refuse(context, r)
        except RequestError as e:
            await self._fail(context, e)

    async def GetServerInfo(self, request, context):
        return self.engine.server_info()

    async def GetVocabulary(self, request, context):
        try:
            self.rounds.admit(current_tenant.get())
            return await self.engine.vocabulary(request)
        except Refused as r:
            await self._refuse(context, r)
        except RequestError as e:
            await self._fail(context, e)


def _replicas(context) -> int:
    """The replicas the calling edge can go to (its REPLICAS_KEY request metadata; 1 when it says none)."""
    for key, value in (context.invocation_metadata() or ()) if context is not None else ():
        if key == REPLICAS_KEY:
            try:
                return max(1, int(value))
            except ValueError:
                return 1
    return 1


def _stream_error(code: grpc.StatusCode, message: str, retry_after_s: float | None) -> pb.StreamError:
    """A round's status as a message: VerifyStream's per-round error, and the wording (with the retry
    hint in ms) unary Verify aborts with."""
    if retry_after_s is None:
        return pb.StreamError(code=code.value[0], message=message)
    ms = max(1, math.ceil(retry_after_s * 1000))
    return pb.StreamError(code=code.value[0], message=f"{message} (retry after {ms} ms)", retry_after_ms=ms)


class VerifierServer:
    """Owns the grpc.aio server. `await start()`, then `.port`; `await stop()` drains gracefully.

    tls: serve TLS (None: plain text, on loopback only unless `insecure`). tokens: require bearer
    tokens (None: open, every caller is the tenant ""). policy: per-tenant limits and admission.
    """

    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int = 0, limits: Limits = Limits(),
                 grace_s: float = 5.0, *, tls: ServerTLS | None = None, tokens: TokenFile | None = None,
                 policy: ServerPolicy = ServerPolicy(), insecure: bool = False):
        if tls is None and not insecure and not is_loopback(host):
            raise InsecureBindError(
                f"refusing to serve plain text on {host}: give a certificate (--tls-cert/--tls-key), bind a "
                "loopback address, or pass --insecure if a trusted proxy or mesh does TLS in front of this server")
        self.engine = VerifierEngine(backend, limits, version=__version__, evict_idle_after_s=policy.evict_idle_after_s)
        self.host, self.requested_port, self.grace_s = host, port, grace_s
        self.tls, self.tokens, self.policy = tls, tokens, policy
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.servicer = VerifierServicer(self.engine, policy)
        self.port = 0

    async def start(self) -> "VerifierServer":
        self.server = grpc.aio.server(interceptors=[CallGuard(self.tokens)], options=[
            *MESSAGE_SIZE_OPTIONS,   # a round carries at most a dense float q per draft: big, not absurd
            # Edges on weak links keep connections alive with pings; let them.
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # gRPC sets SO_REUSEPORT by default: a second verifier on the same port would start and
            # take half of the new connections (sessions it does not hold). Refuse it instead.
            ("grpc.so_reuseport", 0),
        ])
        pb_grpc.add_VerifierServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"{self.host}:{self.requested_port}"
        try:   # grpc raises RuntimeError("Failed to bind ...") or returns port 0, by version
            self.port = (self.server.add_secure_port(address, self.tls.credentials()) if self.tls is not None
                         else self.server.add_insecure_port(address))
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise BindError(f"could not bind {address}: the port is in use (another verifier, or one still shutting "
                            "down) or the address is not this machine's; pick another --port (0: a free one)")
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("verifier listening on %s:%d (%s, %s, %s, model %s, vocab %d, ctx %d)", self.host, self.port,
                 self.tls.describe() if self.tls else "plain text",
                 f"bearer tokens of {len(self.tokens.tenants)} tenants" if self.tokens else "no auth",
                 self.engine.info.name, self.engine.info.model, self.engine.info.n_vocab, self.engine.info.n_ctx)
        return self

    async def stop(self) -> None:
        """Drain, then exit. Health NOT_SERVING at once; new sessions are refused with a short hint,
        and the sessions held here are handed back ("moved": the edge replays on another replica),
        all at once or paced by policy.drain_sessions_per_s, within policy.drain_timeout_s
        (VerifierServicer._drained); the rounds in flight finish (up to grace_s); then grpc's own
        graceful stop closes the port and sends GOAWAY, so the edges' next calls go out on a new
        connection: to another replica they were given, or to the restart."""
        if self.server is None:
            return
        servicer = self.servicer
        servicer.drain()
        await self.health.enter_graceful_shutdown()
        t0 = time.monotonic()
        handing_back = t0 + self.policy.drain_timeout_s
        while servicer.to_hand_back() and time.monotonic() < handing_back:
            await asyncio.sleep(0.02)
        # The cells of the sessions not handed back to the KV store (with --kv-store): idle ones,
        # whose edges are not waited for and replay wherever they go next. (A handed-back session's
        # were written just before its "moved"; writing every session's first held the first of
        # those answers up by 5.6 s, 32 sessions on a loaded machine.)
        left = [s.state for s in self.engine.held_sessions() if s.state is not None and s.id not in servicer.moved]
        try:
            await run_in_thread(self.engine.backend.checkpoint_all, left)
        except Exception:  # noqa: BLE001 - the sessions' replays prefill instead
            log.exception("writing the sessions' KV checkpoints failed")
        deadline = time.monotonic() + self.grace_s
        while servicer.inflight.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self.server.stop(max(0.0, deadline - time.monotonic()))
        log.info("drained in %.2f s (%d sessions handed back)", time.monotonic() - t0, len(servicer.moved))
        self.engine.drop_sessions()
        self.server = None

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()


async def serve_forever(backend: Backend, host: str, port: int, limits: Limits, metrics_port: int | None,
                        on_ready=None, *, tls: ServerTLS | None = None, tokens: TokenFile | None = None,
                        policy: ServerPolicy = ServerPolicy(), insecure: bool = False, grace_s: float = 5.0) -> None:
    server = VerifierServer(backend, host, port, limits, grace_s, tls=tls, tokens=tokens, policy=policy,
                            insecure=insecure)
    if metrics_port is not None:
        from prometheus_client import start_http_server
        start_http_server(metrics_port, addr=host)
        log.info("metrics on http://%s:%d/metrics", host, metrics_port)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if tokens is not None:
        loop.add_signal_handler(signal.SIGHUP, tokens.reload)
    if on_ready is not None:
        on_ready(server.port)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await server.stop()
        backend.close()
