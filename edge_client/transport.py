"""The edge's calls to the verifier: the channel (plain or TLS), the bearer token, the retry and
back-off rules, the errors it raises (EdgeError), and the wire form of the sampling settings."""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import weakref
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import grpc

from edge_client.options import Security, ServerLimits, Transport
from edge_client.stats import CloudOnlyStats, GenerationStats
from spec_core import clock
from spec_core.proto import couplings
from spec_core.proto import verifier_pb2 as pb
from spec_core.proto import verifier_pb2_grpc as pb_grpc
from spec_core.warping import REJECTION, SamplingSettings
from spec_core.wire import (ELSEWHERE_KEY, HELD_KEY, MESSAGE_SIZE_OPTIONS, MOVED_KEY, QUEUED_KEY, REPLICAS_KEY,
                            RETRY_AFTER_KEY)

log = logging.getLogger(__name__)

GRPC_FRAME_BYTES = 5  # gRPC length-prefixed message header
# A server shutting down cancels in-flight calls (CANCELLED); our own cancellation arrives as
# asyncio.CancelledError instead, so retrying CANCELLED is safe. Rounds are idempotent.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# The verifier's limits, per channel (one connection to one verifier): asked once, shared by the
# clients on that channel.
_SERVER_LIMITS: "weakref.WeakKeyDictionary[grpc.aio.Channel, ServerLimits]" = weakref.WeakKeyDictionary()
_SERVER_INFOS: "weakref.WeakKeyDictionary[grpc.aio.Channel, pb.ServerInfo]" = weakref.WeakKeyDictionary()
CHANNEL_OPTIONS = [
    *MESSAGE_SIZE_OPTIONS,
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.enable_retries", 0),  # we retry ourselves, idempotently
    # After a verifier goes away, calls wait (wait_for_ready) on the channel's reconnect timer.
    # gRPC's default grows it from 1 s by 1.6x up to 120 s, so an edge found a restarted verifier
    # up to a minute late (docs/operations.md has the measurement); a verifier is one known
    # address, and a connect attempt to a closed port costs a refused SYN: try every 0.1-1 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    # Not grpc.min_reconnect_backoff_ms: gRPC core also takes it as the shortest time a connection
    # attempt may last (min connect timeout, 20 s by default), and at 100 ms a handshake over a
    # 300 ms link (3g) timed out: the first call failed UNAVAILABLE and was retried.
    ("grpc.max_reconnect_backoff_ms", 1_000),
    # Several addresses (replicas): keep one connection, to the first that answers, and move to
    # the next when it goes (a drained or dead replica); round robin would spread one session's
    # rounds over replicas that do not hold it.
    ("grpc.lb_policy_name", "pick_first"),
]
RETRY_BASE_S, RETRY_CAP_S = 0.05, 1.0   # a lost call's retry: full-jitter exponential back-off, capped
MAX_QUEUED_ASKS = 3   # "queued" answers to one call asked again at once; beyond, the hint is waited out


def channel_target(server: str) -> str:
    """The gRPC target for `server`: one host:port (a DNS name with several records gives every
    address to pick_first), or a comma list of IP host:port addresses, the replicas to move between
    ("127.0.0.1:50051,127.0.0.1:50052" becomes gRPC's "ipv4:" address list)."""
    addresses = [a.strip() for a in server.split(",") if a.strip()]
    if len(addresses) <= 1:
        return server.strip()
    hosts = [a.rpartition(":")[0].strip("[]") for a in addresses]
    families = set()
    for address, host in zip(addresses, hosts):
        try:
            families.add(ipaddress.ip_address("127.0.0.1" if host == "localhost" else host).version)
        except ValueError:
            raise ValueError(f"{address!r} in the server list {server!r} is not an IP address and port: a list "
                             "takes IP addresses (several names: give one DNS name with a record per replica)") from None
    if len(families) > 1:
        raise ValueError(f"the server list {server!r} mixes IPv4 and IPv6 addresses: gRPC takes one family per list")
    scheme = "ipv4" if families == {4} else "ipv6"
    return scheme + ":" + ",".join(a.replace("localhost:", "127.0.0.1:") for a in addresses)


def replica_targets(server: str) -> list[str]:
    """One channel's `server` per replica of a comma list, each listing every replica with its own
    first (pick_first then prefers it, and still falls over to the others when it is gone); a single
    address is itself."""
    addresses = [a.strip() for a in server.split(",") if a.strip()]
    return [",".join(addresses[k:] + addresses[:k]) for k in range(len(addresses))] or [server]


def moved(e: grpc.aio.AioRpcError) -> bool:
    """Whether a draining verifier answered: the session moved, or a new one is refused there."""
    return any(key == MOVED_KEY for key, _ in e.trailing_metadata() or ())


def elsewhere(e: grpc.aio.AioRpcError) -> bool:
    """Whether a verifier too busy for a new session said another replica may take it now (a first
    token predicted too late there, no session slot, replays first)."""
    return any(key == ELSEWHERE_KEY for key, _ in e.trailing_metadata() or ())


def held(e: grpc.aio.AioRpcError) -> bool:
    """Whether a refusal for a first token came with the place kept until its hint: come back then
    (with a little jitter), not at a random multiple of it."""
    return any(key == HELD_KEY for key, _ in e.trailing_metadata() or ())


def _ms_as_s(metadata, wanted: str) -> float | None:
    """A metadata value in milliseconds as seconds (never negative); None when absent or unreadable."""
    for key, value in metadata or ():
        if key == wanted:
            try:
                return max(0.0, float(value) / 1000)
            except ValueError:
                return None
    return None


def queued_s(metadata) -> float | None:
    """The predicted seconds to the first token of an open the verifier queued (the trailing metadata
    of its answer); None when it was not queued."""
    return _ms_as_s(metadata, QUEUED_KEY)


def hint_wait_s(hint_s: float, kept: bool) -> float:
    """How long to wait out a refusal's hint: the hint plus up to as much again, drawn at random, so
    that edges refused together do not return together; a kept place (HELD_KEY) waits the hint plus
    at most 5 %: the verifier admits it then, whoever came since."""
    return hint_s * (1 + (0.05 if kept else 1.0) * random.random())


def retry_delay_s(attempt: int) -> float:
    """The wait before retry number `attempt` (from 1) of a lost call: uniform in [0, cap] with the
    cap doubling from RETRY_BASE_S to RETRY_CAP_S ("full jitter"), so edges that lost a verifier
    together do not come back together."""
    return random.uniform(0.0, min(RETRY_CAP_S, RETRY_BASE_S * 2 ** attempt))


def _pem(value: str | bytes | None) -> bytes | None:
    """PEM bytes, or a path to a PEM file."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def open_channel(server: str, *, tls: bool = False, tls_ca: str | bytes | None = None,
                 tls_cert: str | bytes | None = None, tls_key: str | bytes | None = None,
                 tls_server_name: str | None = None, options=(), interceptors=None) -> grpc.aio.Channel:
    """A channel to a verifier (`server`: host:port, or a comma list of replicas: channel_target):
    plain text, or TLS (mutual with a client cert and key). tls_ca: CA bundle to trust (None: the system's roots); tls_server_name: the name to check the
    server's certificate against when it differs from the address (e.g. through a proxy)."""
    options = list(CHANNEL_OPTIONS) + list(options)
    server = channel_target(server)
    if not (tls or tls_ca or tls_cert or tls_key):
        return grpc.aio.insecure_channel(server, options=options, interceptors=interceptors)
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together (a client certificate for mutual TLS)")
    creds = grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca), private_key=_pem(tls_key),
                                         certificate_chain=_pem(tls_cert))
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return grpc.aio.secure_channel(server, creds, options=options, interceptors=interceptors)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def retry_after_s(e: grpc.aio.AioRpcError) -> float | None:
    """The server's retry hint of a refusal for load, in seconds; None when there is none."""
    return _ms_as_s(e.trailing_metadata(), RETRY_AFTER_KEY)



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
                          ignore_eos=s.ignore_eos, coupling=couplings.TO_WIRE[s.coupling])
    if s.seed is not None:
        p.seed = s.seed
    return p



async def stream_cloud_only(stub: pb_grpc.VerifierStub, prompt_ids: Sequence[int], settings: SamplingSettings,
                            timeout_s: float = 600.0, token: str | None = None) -> CloudOnlyStats:
    """Run the Generate stream and time it (wall from the request, TTFT at the first token)."""
    t0 = clock.now()
    ttft, ids = 0.0, []
    async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=list(prompt_ids),
                                                        sampling=sampling_proto(settings)), timeout=timeout_s,
                                     metadata=auth_metadata(token)):
        ids.extend(chunk.token_ids)
        ttft = ttft or clock.now() - t0
    return CloudOnlyStats(len(ids), clock.now() - t0, ttft, ids)


class Verifier:
    """One verifier behind a channel, as the edge calls it: every call carries the transport's
    deadline and the bearer token; a refusal for load is waited out and a lost call retried (`call`);
    the verifier's limits are asked once per channel and shared by the clients on it; a session that
    a cancelled open may have opened is closed before the channel goes (`aclose`)."""

    def __init__(self, transport: Transport, security: Security, channel: grpc.aio.Channel | None = None):
        self.transport, self.security = transport, security
        self.token = security.bearer_token()
        self.metadata = auth_metadata(self.token)
        self.channel = channel
        self._own_channel = channel is None
        # Own channels: one per replica of a comma list (replica_targets); a draining replica's
        # "moved" sends the calls to the next one. A shared channel stays the one channel.
        self.channels: list[grpc.aio.Channel] = [] if channel is None else [channel]
        self._targets: list[str] = []
        self._pinned: set[grpc.aio.Channel] = set()   # channels to one replica only, opened by a move
        self._addresses: dict[grpc.aio.Channel, str] = {}   # what each own channel was opened to
        self._retired: set[asyncio.Task] = set()   # channels replaced, closing
        self.stub: pb_grpc.VerifierStub | None = None
        self.reached = False   # the verifier has answered once: from then on calls wait for it to come back
        self._background: set[asyncio.Task] = set()  # Close calls that outlive a cancelled generation
        # An open queued past its first-token target: called with the predicted seconds (the CLI prints it).
        self.on_queued: Callable[[float], None] | None = None

    async def open(self) -> None:
        if self.channel is None:
            self._targets = replica_targets(self.transport.server)
            self.channels = [open_channel(target, **self.security.channel_kwargs()) for target in self._targets]
            self._addresses = dict(zip(self.channels, self._targets))
            self.channel = self.channels[0]
        self.stub = pb_grpc.VerifierStub(self.channel)

    @property
    def wait_for_ready(self) -> bool:
        """Whether a call waits for the channel to (re)connect instead of failing: once the verifier
        has answered, except on a channel to one replica opened by a move, whose failure to connect
        is the cue to fall back to the replica list (_unpin)."""
        return self.reached and self.channel not in self._pinned

    def _move_from(self, channel: grpc.aio.Channel) -> bool:
        """The replica behind `channel` is draining: use the next replica (once, however many calls
        learn it). False when there is no other replica to go to.

        The next replica is reached on a new channel to its address alone. pick_first over the list
        does not say which replica it reaches: a channel that connected while its own replica was
        down went on to the next address and stays there, and a new one goes on to the next address
        when the first does not complete its connection at once (a list whose first verifier was
        stopped, SIGSTOP, was answered by the second within 0.1 s), as a loaded replica may not — in
        both cases often the very replica draining now, which refuses the moved sessions until it
        exits (a 64-edge rolling restart: edges waited 17-30 s so). If the replica does not answer,
        the call falls back to the list (_unpin)."""
        if len(self.channels) < 2:
            return False
        if self.channel is channel:
            k = (self.channels.index(channel) + 1) % len(self.channels)
            new = open_channel(self._targets[k].split(",")[0], **self.security.channel_kwargs())
            self._addresses[new] = self._targets[k].split(",")[0]
            self._pinned.add(new)
            self._replace(k, new)
        return True

    def _unpin(self, channel: grpc.aio.Channel) -> bool:
        """A call on a channel a move opened to one replica failed to reach it: that replica's
        channel is its replica list again (pick_first goes on to the next that answers)."""
        if channel is not self.channel or channel not in self._pinned:
            return False
        k = self.channels.index(channel)
        new = open_channel(self._targets[k], **self.security.channel_kwargs())
        self._addresses[new] = self._targets[k]
        self._replace(k, new)
        return True

    def _replace(self, k: int, new: grpc.aio.Channel) -> None:
        """Channel k is `new` from now on, and the calls go there; the old one is closed."""
        old = self.channels[k]
        for known in (_SERVER_LIMITS, _SERVER_INFOS):   # the same replica's: not asked again
            if old in known:
                known[new] = known[old]
        self.channels[k] = self.channel = new
        self.stub = pb_grpc.VerifierStub(new)
        self._pinned.discard(old)
        self._addresses.pop(old, None)
        # Nothing of ours waits on the old one (the calls follow `stub`): close it, briefly.
        task = asyncio.ensure_future(old.close(grace=1.0))
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def aclose(self) -> None:
        if self._background:
            # Close calls of generations cancelled mid-open: let them reach the verifier before
            # the channel goes (else their sessions hold KV memory until the verifier's TTL).
            await asyncio.wait(list(self._background), timeout=self.transport.deadline_s)
        if self._retired:
            await asyncio.wait(list(self._retired))
        if self._own_channel and self.channel is not None:
            for channel in self.channels:
                await channel.close()
            self.channel, self.channels = None, []

    async def server_info(self) -> pb.ServerInfo:
        info = await self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=self.transport.deadline_s,
                                             metadata=self.metadata)
        _SERVER_LIMITS[self.channel] = ServerLimits.from_info(info)
        _SERVER_INFOS[self.channel] = info
        return info

    def known_info(self) -> pb.ServerInfo | None:
        """What the verifier said of itself when its limits were asked (None: not asked, or it does not say)."""
        return _SERVER_INFOS.get(self.channel)

    async def limits(self, st: GenerationStats) -> ServerLimits:
        """The verifier's limits (its ServerInfo, asked once per channel: clients that share a
        channel share the answer)."""
        limits = _SERVER_LIMITS.get(self.channel)
        if limits is None:
            async def ask() -> pb.ServerInfo:
                info = await self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=self.transport.deadline_s,
                                                     wait_for_ready=self.wait_for_ready, metadata=self.metadata)
                _SERVER_INFOS[self.channel] = info
                return info
            try:
                limits = ServerLimits.from_info(await self.call(ask, st, "server info"))
            except EdgeError as e:
                if e.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                limits = ServerLimits()  # a verifier that does not say: nothing to cap by
            _SERVER_LIMITS[self.channel] = limits
        return limits

    def forget_limits(self) -> None:
        _SERVER_LIMITS.pop(self.channel, None)

    def address(self) -> str:
        """Where the calls go now: the replica a move went to, else the address (or replica list) given."""
        return self._addresses.get(self.channel, self.transport.server)

    async def verify(self, req: pb.VerifyRequest, st: GenerationStats, retries: int | None = None) -> pb.VerifyReply:
        coupling = couplings.from_wire(req.open.sampling.coupling) if req.HasField("open") else None

        async def attempt() -> pb.VerifyReply:
            if coupling not in (None, REJECTION):
                await self._check_coupling(coupling, st)
            st.bytes_up += req.ByteSize() + GRPC_FRAME_BYTES
            # Once a verifier has answered, wait for it to come back (restart) instead of failing fast;
            # before that, an address with nothing behind it fails within the retry budget.
            if req.HasField("open"):
                reply = await self._open(req, st)
            else:
                reply = await self.stub.Verify(req, timeout=self.transport.deadline_s,
                                               wait_for_ready=self.wait_for_ready, metadata=self.metadata)
            st.bytes_down += reply.ByteSize() + GRPC_FRAME_BYTES
            return reply
        return await self.call(attempt, st, f"round {req.round}", retries)

    async def _open(self, req: pb.VerifyRequest, st: GenerationStats) -> pb.VerifyReply:
        """A round that opens a session: it tells the verifier how many replicas this edge can go to
        (REPLICAS_KEY: with one, a verifier too busy queues it instead of refusing it). Once the
        verifier said it queued the open (`call`: QUEUED_KEY), the call may last that long twice over
        beyond the deadline."""
        replicas = len(replica_targets(self.transport.server))
        return await self.stub.Verify(req, timeout=self.transport.deadline_s + 2 * st.queued_s,
                                      wait_for_ready=self.wait_for_ready,
                                      metadata=(*(self.metadata or ()), (REPLICAS_KEY, str(replicas))))

    async def _check_coupling(self, coupling: str, st: GenerationStats) -> None:
        """An open that asks for `coupling` goes only to a verifier that lists it in ServerInfo.couplings
        (asked once per channel: after a replica move, the replica's; the edge asks again after a
        restart, RoundLoop._open): one that does not, e.g. a verifier from before the field, would
        check by rejection sampling without a word. FAILED_PRECONDITION, naming the replica."""
        refusal = (await self.limits(st)).coupling_refusal(coupling)
        if refusal:
            raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"the verifier at {self.address()} cannot open this generation: {refusal}")

    async def vocabulary(self, fingerprint: str, st: GenerationStats) -> pb.Vocabulary:
        async def ask() -> pb.Vocabulary:
            return await self.stub.GetVocabulary(pb.VocabularyRequest(fingerprint=fingerprint),
                                                 timeout=max(self.transport.deadline_s, 60.0), metadata=self.metadata)
        return await self.call(ask, st, "vocabulary")

    async def call(self, attempt: Callable[[], Awaitable], st: GenerationStats, what: str,
                   retries: int | None = None):
        """`attempt()`, one RPC, until it answers: a refusal for load (a retry hint) is waited out,
        UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED are retried after retry_delay_s; anything else, or
        running out of patience, raises EdgeError."""
        attempts, waited_s, moves, asks = 0, 0.0, 0, 0
        max_retries = self.transport.max_retries if retries is None else retries
        while True:
            channel = self.channel
            try:
                answer = await attempt()
                self.reached = True
                return answer
            except grpc.aio.AioRpcError as e:
                hint_s = retry_after_s(e)
                queued = queued_s(e.trailing_metadata()) if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                if queued is not None and asks < MAX_QUEUED_ASKS:
                    # Queued: the round goes on there; ask again at once (the same request) for its reply.
                    asks += 1
                    self.reached = True
                    st.queued_s = queued
                    log.info("%s: queued, first token in about %.0f s", what, queued)
                    if self.on_queued is not None:
                        self.on_queued(queued)
                    continue
                if (moved(e) or elsewhere(e)) and self._move_from(channel):
                    # A draining replica: a session it handed back is replayed on the next replica
                    # (the caller replays on NOT_FOUND); a refused new session goes there at once
                    # (also from a replica too busy to give it a first token in time: "elsewhere"),
                    # but not round and round: from the second move of one call on (every replica
                    # it tried drains, is busy, or is down), the hint is waited out first.
                    moves += 1
                    log.info("%s: %s, moving to the next replica: %s", what, e.code().name, e.details())
                    if e.code() == grpc.StatusCode.NOT_FOUND:
                        raise EdgeError(e.code(), e.details() or "") from None
                    if moves > 1:
                        if waited_s >= self.transport.max_wait_s:
                            raise EdgeError(e.code(), e.details() or "", retry_after_s=hint_s) from None
                        wait_s = min(hint_wait_s(hint_s or RETRY_BASE_S, held(e)), self.transport.max_wait_s - waited_s)
                        st.backoffs += 1
                        st.backoff_s += wait_s
                        waited_s += wait_s
                        await asyncio.sleep(wait_s)
                    continue
                if hint_s is not None and e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE) \
                        and waited_s < self.transport.max_wait_s:
                    # Refused for load: wait the hint, with jitter (hint_wait_s).
                    self.reached = True
                    wait_s = min(hint_wait_s(hint_s, held(e)), self.transport.max_wait_s - waited_s)
                    st.backoffs += 1
                    st.backoff_s += wait_s
                    waited_s += wait_s
                    log.info("%s: %s, backing off %.2fs: %s", what, e.code().name, wait_s, e.details())
                    await asyncio.sleep(wait_s)
                    continue
                if e.code() == grpc.StatusCode.UNAVAILABLE and self._unpin(channel):
                    log.info("%s: the replica moved to does not answer (%s), back to the replica list", what,
                             e.details())
                if e.code() in RETRYABLE and attempts < max_retries:
                    attempts += 1
                    st.retries += 1
                    delay = retry_delay_s(attempts)
                    log.info("%s: %s, retrying in %.2fs", what, e.code().name, delay)
                    await asyncio.sleep(delay)
                    continue
                raise EdgeError(e.code(), e.details() or "", retry_after_s=hint_s) from None

    async def open_round(self, req: pb.VerifyRequest, st: GenerationStats) -> pb.VerifyReply:
        """A round that opens a session. If the caller is cancelled while it is in flight, the
        verifier may still open the session; the round is left to finish and that session closed."""
        call = asyncio.ensure_future(self.verify(req, st))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            async def close_when_opened() -> None:
                try:
                    reply = await call
                except (Exception, asyncio.CancelledError):  # noqa: BLE001 - no session was opened
                    return
                await self.close_session(reply.session_id)
            task = asyncio.ensure_future(close_when_opened())
            self._background.add(task)   # leaving the client waits for it (aclose)
            task.add_done_callback(self._background.discard)
            raise

    async def close_session(self, session_id: str) -> None:
        try:
            await self.stub.Close(pb.CloseRequest(session_id=session_id), timeout=self.transport.deadline_s,
                                  metadata=self.metadata)
        except grpc.aio.AioRpcError as e:  # best effort: the server's TTL frees it anyway
            log.debug("close failed: %s", e.code().name)
        except grpc.aio.UsageError as e:  # the channel was closed first (a generation abandoned after its client)
            log.debug("close failed: %s", e)
