"""The session loop and the Python API an app calls.

    async with EdgeClient("127.0.0.1:50051", drafter, tokenizer) as client:
        gen = client.generate("Write a haiku.", SamplingSettings(temperature=0.7, max_new_tokens=64))
        async for piece in gen:
            print(piece, end="")
        print(gen.stats)

Every call has a deadline. UNAVAILABLE and DEADLINE_EXCEEDED are retried with the same request
(the server answers a repeated round from its reply cache, so a retry never commits twice).
NOT_FOUND (the verifier lost the session: restart, eviction, another replica) and an
out-of-step FAILED_PRECONDITION are answered by replay: the next round carries `open` with the
prompt and every committed token, so nothing committed is lost or duplicated.
A refusal for load (RESOURCE_EXHAUSTED or UNAVAILABLE with a `retry-after-ms` hint: the verifier's
admission control, a tenant limit, a draining server) is waited out: at least the hint, plus
random jitter so that refused edges do not come back together, up to `max_wait_s` per round.

Security: `tls=True` (or any of tls_ca / tls_cert / tls_key) connects with TLS, mutual when a
client certificate and key are given; `token` (default: $HYBRIDSPEC_TOKEN) is sent on every call
as `authorization: Bearer <token>`.
"""
from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import os
import random
import time
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Protocol, Sequence

import grpc

from edge_client.drafters import Draft, Drafter, TreeDraft
from edge_client.gamma import AdaptiveGamma, FixedGamma, RoundPlan, TreePolicy
from spec_core import qcodec
from spec_core.costmodel import expected_tokens_per_round
from spec_core.drafting import QMode
from spec_core.proto import verifier_pb2 as pb
from spec_core.proto import verifier_pb2_grpc as pb_grpc
from spec_core.tree import TreeShape
from spec_core.warping import EDGE_STREAM, SamplingSettings, seeded_rng

log = logging.getLogger(__name__)

GRPC_FRAME_BYTES = 5  # gRPC length-prefixed message header
# A server shutting down cancels in-flight calls (CANCELLED); our own cancellation arrives as
# asyncio.CancelledError instead, so retrying CANCELLED is safe. Rounds are idempotent.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
RETRY_AFTER_KEY = "retry-after-ms"   # trailing metadata of a refusal for load (cloud_verifier.admission)
TOKEN_ENV = "HYBRIDSPEC_TOKEN"
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


class Tokenizer(Protocol):
    fingerprint: str
    eog_ids: frozenset[int]

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def token_bytes(self, token: int, special: bool = False) -> bytes: ...


class EdgeError(RuntimeError):
    """The verifier refused the request; `code` is the gRPC status, the message says why."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code


@dataclass
class GenerationStats:
    text: str = ""
    tokens: int = 0                 # generated tokens committed
    rounds: int = 0                 # Verify rounds that committed tokens
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0    # accepted / drafted (vLLM's "draft acceptance rate")
    alpha: float = 0.0              # per-token acceptance α = accepted / (accepted + rejections): the
                                    # geometric model's estimate; drafts after a rejection are never tested
    rejections: int = 0             # rounds that ended with a corrected token
    tokens_per_round: float = 0.0   # 1 + accepted / rounds, as committed
    expected_tokens_per_round: float = 0.0  # (1 - α^(γ+1)) / (1 - α) at the measured α and mean γ
    wall_s: float = 0.0
    ttft_s: float = 0.0             # time to the first committed token
    tokens_per_s: float = 0.0
    bytes_up: int = 0               # protobuf payload + gRPC frame header, edge -> verifier
    bytes_down: int = 0
    gamma: int | str = 0
    mean_gamma: float = 0.0
    retries: int = 0
    replays: int = 0
    backoffs: int = 0               # refusals for load waited out (RESOURCE_EXHAUSTED / UNAVAILABLE + hint)
    backoff_s: float = 0.0          # total time spent waiting them out
    draft_s: float = 0.0            # total time drafting
    server_model_s: float = 0.0     # total time in the target model (server's own timing)
    finish_reason: str = ""
    nodes_per_round: float = 0.0    # draft tokens (chain) or tree nodes sent per round
    tree_rounds: int = 0            # rounds that carried a tree
    plans: str = ""                 # how often each chain/tree plan was chosen
    reused_drafts: int = 0          # drafted tokens reused from proactive drafting (--proactive)
    discarded_rounds: int = 0       # pipelined rounds dropped because their base was not committed
    pipelined_rounds: int = 0       # pipelined rounds whose base was committed (verified, kept)
    token_ids: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class RoundEvent:
    """One committed round, as seen by the edge (for metrics: `EdgeClient(on_round=...)`)."""

    gamma: int          # draft tokens sent
    accepted: int       # of them accepted
    tokens: int         # committed this round: accepted + the corrected or bonus token
    draft_s: float      # time drafting
    rpc_s: float        # wall time of the Verify RPC, retries included (round trip + server)
    server_s: float     # the server's own time for the round


class Generation:
    """Async iterator of text pieces as they are committed; `stats` is complete at the end,
    also when the caller stops early (`aclose()`, cancellation): then the verifier's session is
    closed, so it does not hold a KV cache until its idle TTL."""

    def __init__(self, client: "EdgeClient", prompt_ids: list[int], settings: SamplingSettings):
        self._client, self.prompt_ids, self.settings = client, prompt_ids, settings
        self.stats = GenerationStats()
        self._it = self._run()

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        return await self._it.__anext__()

    async def text(self) -> str:
        return "".join([p async for p in self])

    async def aclose(self) -> None:
        """Stop generating; an unfinished session is closed on the verifier."""
        await self._it.aclose()

    async def _run(self) -> AsyncIterator[str]:
        c, st = self._client, self.stats
        settings = self.settings
        policy = AdaptiveGamma(max_gamma=c.max_gamma) if c.gamma == "adaptive" else FixedGamma(int(c.gamma))
        planner = TreePolicy(policy, c.tree, max_nodes=c.max_tree_nodes)
        rng = seeded_rng(settings.seed, EDGE_STREAM)  # never the verifier's stream (see warping)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        committed = list(self.prompt_ids)
        prompt_len = len(committed)
        session_id, last_round = "", 0
        gammas: list[int] = []
        nodes_sent = 0
        t0 = time.perf_counter()
        pieces: list[str] = []
        finished = False
        stop_ids = frozenset(settings.stop_token_ids) | (frozenset() if settings.ignore_eos else c.hidden_ids)
        ahead: _Prepared | None = None  # drafted during the last round trip, for a guessed base

        def base_rng(base: list[int]):
            # With a user seed, a round's draft depends only on the committed tokens (a stream per
            # committed length, like the verifier's): a round redone after a replay drafts the same.
            return rng if settings.seed is None else seeded_rng(settings.seed, EDGE_STREAM, len(base))

        def prepare(base: list[int], plan: RoundPlan) -> _Prepared:
            """Draft a chain or tree after `base` (in the drafting executor while a round is in flight)."""
            if plan.shape is None:
                d = c.drafter.propose(base, plan.gamma, settings, c.qmode, base_rng(base))
                return _Prepared(base, plan, d, [], len(d.tokens))
            d = c.drafter.propose_tree(base, plan.shape, settings, c.qmode, base_rng(base))
            return _Prepared(base, plan, d, d.parents, d.rows)

        def guess_and_prepare(prep: _Prepared, remaining: int) -> tuple[list[int], _Prepared] | None:
            """The most likely outcome (every draft, or the most probable branch, accepted; the next token
            the draft's argmax), and a draft after it. None when the round may end generation."""
            path = prep.guess_path()
            if not path or len(path) + 1 >= remaining or stop_ids & set(path):
                return None
            bonus = c.drafter.propose(prep.base + path, 1, GREEDY, QMode("none"), base_rng(prep.base + path)).tokens
            if not bonus or bonus[0] in stop_ids:
                return None
            guess = path + bonus
            return guess, prepare(prep.base + guess, planner.plan(remaining - len(guess)))

        def build(prep: _Prepared, round_: int, assumed: Sequence[int] = ()) -> pb.VerifyRequest:
            req = pb.VerifyRequest(session_id=session_id, round=round_, committed_length=len(prep.base),
                                   draft_token_ids=prep.draft.tokens, draft_parents=prep.parents,
                                   q=qcodec.to_proto(prep.draft.qs, c.qmode.scale_bits), assumed_tokens=list(assumed))
            if not session_id:
                req.open.CopyFrom(pb.OpenSession(
                    prompt_token_ids=self.prompt_ids, resume_token_ids=prep.base[prompt_len:],
                    sampling=sampling_proto(settings), tokenizer_fingerprint=c.drafter.fingerprint or "",
                    open_key=os.urandom(16)))
            return req

        def apply(prep: _Prepared, reply: pb.VerifyReply, round_s: float) -> list[int]:
            """Commit a reply's tokens (checked against the server's view) and learn from the round."""
            nonlocal session_id, last_round, nodes_sent
            draft, parents = prep.draft, prep.parents
            if parents:
                kept = list(reply.kept_nodes)
                is_path = len(kept) == reply.num_accepted and all(
                    k < len(draft.tokens) and draft.parents[k] == (kept[j - 1] if j else -1) for j, k in enumerate(kept))
                if not is_path:
                    raise EdgeError(grpc.StatusCode.INTERNAL, f"kept_nodes {kept} is not a path from the root of "
                                                              f"{reply.num_accepted} nodes")
                accepted = [draft.tokens[i] for i in kept]
            else:
                accepted = draft.tokens[: reply.num_accepted]
            new = accepted + ([reply.next_token_id] if reply.HasField("next_token_id") else [])
            committed.extend(new)
            if reply.committed_length != len(committed):
                raise EdgeError(grpc.StatusCode.INTERNAL, f"server committed {reply.committed_length} tokens, "
                                                          f"the edge {len(committed)}")
            session_id, last_round = reply.session_id, reply.round
            st.rounds += 1
            st.drafted += len(draft.tokens)
            st.accepted += reply.num_accepted
            depth = prep.plan.gamma if parents else len(draft.tokens)
            rejected = reply.HasField("next_token_id") and reply.num_accepted < depth
            st.rejections += rejected
            st.draft_s += draft.seconds
            st.server_model_s += reply.timings.model_ms / 1e3
            nodes_sent += len(draft.tokens)
            st.tree_rounds += bool(parents)
            gammas.append(depth)
            server_s, model_s = reply.timings.total_ms / 1e3, reply.timings.model_ms / 1e3
            if not parents:  # the chain's α and γ model; a tree round's acceptance is not geometric
                policy.observe(gamma=len(draft.tokens), num_accepted=reply.num_accepted, draft_s=draft.seconds,
                               round_s=round_s, server_s=server_s, model_s=model_s, rejected=rejected)
            planner.observe(prep.plan, nodes=len(draft.tokens), rows=prep.rows, tokens=len(new), draft_s=draft.seconds,
                            round_s=round_s, server_s=server_s, model_s=model_s)
            c.drafter.observe(committed, reply.num_accepted)
            if c.on_round is not None:
                c.on_round(RoundEvent(gamma=depth, accepted=reply.num_accepted, tokens=len(new),
                                      draft_s=draft.seconds, rpc_s=round_s, server_s=server_s))
            return new

        ahead_job = spec_task = None
        try:
            while not finished:
                remaining = settings.max_new_tokens - (len(committed) - prompt_len)
                if ahead is not None and ahead.base == committed:
                    prep = ahead  # the round trip's guess came true: this draft is ready
                    st.reused_drafts += len(prep.draft.tokens)
                else:
                    prep = await c._in_drafter(prepare, list(committed), planner.plan(remaining))
                ahead = None
                req = build(prep, last_round + 1)
                t_round = time.perf_counter()
                reply_task = asyncio.ensure_future(c._verify(req, st) if session_id else c._open_round(req, st))
                overlap = (c.proactive or c.pipeline) and session_id and prep.draft.tokens
                ahead_job = asyncio.ensure_future(c._in_drafter(guess_and_prepare, prep, remaining, thread=True)) if overlap else None
                spec_task = spec = None
                if ahead_job is not None and c.pipeline:
                    # Send the next round before this one's reply, if the draft for it is ready in time.
                    done, _ = await asyncio.wait({reply_task, ahead_job}, return_when=asyncio.FIRST_COMPLETED)
                    if ahead_job in done and not reply_task.done() and ahead_job.result() is not None:
                        guess, spec = ahead_job.result()
                        spec_req = build(spec, req.round + 1, assumed=guess)
                        # Retried like any round: a lost reply is answered from the server's cache.
                        spec_task = asyncio.ensure_future(c._verify(spec_req, st))
                try:
                    reply = await reply_task
                except EdgeError as e:
                    await _settle(ahead_job, spec_task)
                    st.discarded_rounds += spec_task is not None
                    if e.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION) and session_id \
                            and st.replays < c.max_replays:
                        log.warning("replaying %d committed tokens: %s", len(committed) - prompt_len, e)
                        st.replays += 1
                        session_id, last_round = "", 0
                        continue
                    raise
                round_s = time.perf_counter() - t_round
                guessed = await ahead_job if ahead_job is not None else None  # the drafter is free again
                new = apply(prep, reply, round_s)
                final = reply  # the last reply applied: its finish reason is the generation's
                finished = reply.finish_reason != pb.NOT_FINISHED
                if guessed is not None and not finished:
                    guess, next_prep = guessed
                    if spec_task is not None:
                        spec_reply = await _settle(None, spec_task)
                        if committed == next_prep.base and spec_reply is not None and not spec_reply.base_mismatch:
                            new += apply(next_prep, spec_reply, time.perf_counter() - t_round)
                            st.pipelined_rounds += 1
                            final = spec_reply
                            finished = spec_reply.finish_reason != pb.NOT_FINISHED
                        else:
                            st.discarded_rounds += 1
                    elif committed == next_prep.base:
                        ahead = next_prep
                elif spec_task is not None:
                    await _settle(None, spec_task)
                    st.discarded_rounds += 1
                if new and not st.ttft_s:
                    st.ttft_s = time.perf_counter() - t0
                if finished:
                    st.finish_reason = pb.FinishReason.Name(final.finish_reason).lower()
                piece = decoder.decode(b"".join(c.tokenizer.token_bytes(t) for t in new if t not in c.hidden_ids))
                if finished:
                    piece += decoder.decode(b"", final=True)
                if piece:
                    pieces.append(piece)
                    yield piece
        finally:
            await _settle(ahead_job, spec_task)
            st.wall_s = time.perf_counter() - t0
            st.text = "".join(pieces)
            st.token_ids = committed[prompt_len:]
            st.tokens = len(st.token_ids)
            st.acceptance_rate = st.accepted / st.drafted if st.drafted else 0.0
            st.alpha = st.accepted / (st.accepted + st.rejections) if st.accepted + st.rejections else 0.0
            st.tokens_per_round = st.tokens / st.rounds if st.rounds else 0.0
            st.mean_gamma = sum(gammas) / len(gammas) if gammas else 0.0
            st.gamma = policy.describe()
            st.nodes_per_round = nodes_sent / st.rounds if st.rounds else 0.0
            st.plans = planner.describe()
            st.expected_tokens_per_round = expected_tokens_per_round(st.alpha, round(st.mean_gamma))
            st.tokens_per_s = st.tokens / st.wall_s if st.wall_s else 0.0
            # A finished session needs no Close: the server frees its KV cache when generation ends.
            # One left early (the caller stopped reading, was cancelled, or a round failed) is closed
            # now; shielded, so a cancelled caller still sends it.
            if session_id and not finished:
                await asyncio.shield(c._close(session_id))


GREEDY = SamplingSettings(temperature=0.0)


@dataclass
class _Prepared:
    """A draft (chain or tree) made for one base (the committed sequence it follows)."""

    base: list[int]
    plan: RoundPlan
    draft: "Draft | TreeDraft"
    parents: list[int]      # empty for a chain
    rows: int               # draft forward rows it cost

    def guess_path(self) -> list[int]:
        """The tokens of the most likely full acceptance: every draft, or the most probable branch."""
        if not self.parents:
            return list(self.draft.tokens)
        has_child = set(self.parents)
        leaves = [i for i in range(len(self.parents)) if i not in has_child]
        if not leaves:
            return []
        node = max(leaves, key=lambda i: (self.draft.path_probs[i], -i))
        path = []
        while node != -1:
            path.append(self.draft.tokens[node])
            node = self.parents[node]
        return path[::-1]


async def _settle(job, spec_task):
    """Wait for background work we no longer need; a speculative round's failure is only a discard."""
    if job is not None:
        with contextlib.suppress(Exception):
            await job
    if spec_task is not None:
        try:
            return await spec_task
        except (EdgeError, grpc.aio.AioRpcError):
            return None
    return None


def sampling_proto(s: SamplingSettings) -> pb.SamplingParams:
    p = pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p if s.top_p < 1 else 0.0,
                          max_new_tokens=s.max_new_tokens, stop_token_ids=list(s.stop_token_ids),
                          ignore_eos=s.ignore_eos)
    if s.seed is not None:
        p.seed = s.seed
    return p


@dataclass
class CloudOnlyStats:
    """The cloud-only baseline: the target streams its own output (one request)."""

    tokens: int
    wall_s: float
    ttft_s: float
    token_ids: list[int]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


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


class EdgeClient:
    def __init__(self, server: str, drafter: Drafter, tokenizer: Tokenizer, *, gamma: int | str = 5,
                 qmode: QMode | str = "fixed", deadline_s: float = 30.0, max_retries: int = 8,
                 max_replays: int = 8, max_gamma: int = 12, channel: grpc.aio.Channel | None = None,
                 draft_executor: Executor | None = None, on_round: Callable[[RoundEvent], None] | None = None,
                 token: str | None = None, tls: bool = False, tls_ca: str | bytes | None = None,
                 tls_cert: str | bytes | None = None, tls_key: str | bytes | None = None,
                 tls_server_name: str | None = None, max_wait_s: float = 300.0,
                 tree: "str | TreeShape" = "off", max_tree_nodes: int = 64, proactive: bool = False,
                 pipeline: bool = False):
        self.server, self.drafter, self.tokenizer = server, drafter, tokenizer
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self._metadata = auth_metadata(self.token)
        self._tls = dict(tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, tls_server_name=tls_server_name)
        self.max_wait_s = max_wait_s
        self.gamma = gamma
        self.qmode = QMode.parse(qmode) if isinstance(qmode, str) else qmode
        self.deadline_s, self.max_retries, self.max_replays, self.max_gamma = deadline_s, max_retries, max_replays, max_gamma
        self._channel = channel
        self._own_channel = channel is None
        # Drafting in an executor keeps the event loop free while the draft model runs (a server
        # with many sessions); one worker serialises the sessions' drafting on the CPU.
        self.draft_executor = draft_executor
        self.on_round = on_round
        self._background: set[asyncio.Task] = set()  # Close calls that outlive a cancelled generation
        # "off": chains; "auto": the cost model picks chain or tree each round; a TreeShape: always.
        self.tree = TreeShape.parse(tree) if isinstance(tree, str) and tree not in ("off", "auto") else tree
        self.max_tree_nodes = max_tree_nodes
        # proactive: draft the next round during the round trip, from the most likely outcome;
        # pipeline: also send it before the reply (the server verifies it only on that base).
        self.proactive, self.pipeline = proactive, pipeline
        if self.tree != "off" and not drafter.supports_trees:
            raise ValueError(f"the {drafter.name} drafter does not build trees; use tree='off'")
        self._reached = False
        # Special tokens (EOS, <|im_end|>) end generation; they are not printed.
        self.hidden_ids = getattr(tokenizer, "eog_ids", frozenset())

    async def __aenter__(self) -> "EdgeClient":
        if self._channel is None:
            self._channel = open_channel(self.server, **self._tls)
        self._stub = pb_grpc.VerifierStub(self._channel)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._background:
            # Close calls of generations cancelled mid-open: let them reach the verifier before
            # the channel goes (else their sessions hold KV memory until the verifier's TTL).
            await asyncio.wait(list(self._background), timeout=self.deadline_s)
        if self._own_channel and self._channel is not None:
            await self._channel.close()
            self._channel = None

    def generate(self, prompt: str | Sequence[int], settings: SamplingSettings) -> Generation:
        ids = self.tokenizer.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        return Generation(self, ids, settings)

    async def server_info(self) -> pb.ServerInfo:
        return await self._stub.GetServerInfo(pb.ServerInfoRequest(), timeout=self.deadline_s, metadata=self._metadata)

    async def _verify(self, req: pb.VerifyRequest, st: GenerationStats, retries: int | None = None) -> pb.VerifyReply:
        delay, attempt, waited_s = 0.05, 0, 0.0
        max_retries = self.max_retries if retries is None else retries
        while True:
            st.bytes_up += req.ByteSize() + GRPC_FRAME_BYTES
            try:
                # Once a verifier has answered, wait for it to come back (restart) instead of failing fast;
                # before that, an address with nothing behind it fails within the retry budget.
                reply = await self._stub.Verify(req, timeout=self.deadline_s, wait_for_ready=self._reached,
                                                metadata=self._metadata)
                self._reached = True
                st.bytes_down += reply.ByteSize() + GRPC_FRAME_BYTES
                return reply
            except grpc.aio.AioRpcError as e:
                hint_s = retry_after_s(e)
                if hint_s is not None and e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE) \
                        and waited_s < self.max_wait_s:
                    # Refused for load: wait the hint plus up to as much again, drawn at random, so
                    # that edges refused together do not return together.
                    self._reached = True
                    wait_s = min(hint_s * (1 + random.random()), self.max_wait_s - waited_s)
                    st.backoffs += 1
                    st.backoff_s += wait_s
                    waited_s += wait_s
                    log.info("round %d: %s, backing off %.2fs: %s", req.round, e.code().name, wait_s, e.details())
                    await asyncio.sleep(wait_s)
                    continue
                if e.code() in RETRYABLE and attempt < max_retries:
                    attempt += 1
                    st.retries += 1
                    log.info("round %d: %s, retrying in %.2fs", req.round, e.code().name, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                raise EdgeError(e.code(), e.details() or "") from None

    async def _in_drafter(self, fn, *args, thread: bool = False):
        """Run drafting work in the drafting executor when there is one (a server: one worker
        serialises the sessions' drafting); else inline, or in a thread for work that overlaps a
        round trip."""
        if self.draft_executor is not None:
            return await asyncio.get_running_loop().run_in_executor(self.draft_executor, fn, *args)
        if thread:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def _open_round(self, req: pb.VerifyRequest, st: GenerationStats) -> pb.VerifyReply:
        """A round that opens a session. If the caller is cancelled while it is in flight, the
        verifier may still open the session; the round is left to finish and that session closed."""
        call = asyncio.ensure_future(self._verify(req, st))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            async def close_when_opened() -> None:
                try:
                    reply = await call
                except (Exception, asyncio.CancelledError):  # noqa: BLE001 - no session was opened
                    return
                await self._close(reply.session_id)
            task = asyncio.ensure_future(close_when_opened())
            self._background.add(task)   # leaving the client waits for it (__aexit__)
            task.add_done_callback(self._background.discard)
            raise

    async def _close(self, session_id: str) -> None:
        try:
            await self._stub.Close(pb.CloseRequest(session_id=session_id), timeout=self.deadline_s,
                                   metadata=self._metadata)
        except grpc.aio.AioRpcError as e:  # best effort: the server's TTL frees it anyway
            log.debug("close failed: %s", e.code().name)
        except grpc.aio.UsageError as e:  # the channel was closed first (a generation abandoned after its client)
            log.debug("close failed: %s", e)
