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
"""
from __future__ import annotations

import asyncio
import codecs
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator, Protocol, Sequence

import grpc

from edge_client.drafters import Drafter
from edge_client.gamma import AdaptiveGamma, FixedGamma, TreePolicy
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
    draft_s: float = 0.0            # total time drafting
    server_model_s: float = 0.0     # total time in the target model (server's own timing)
    finish_reason: str = ""
    nodes_per_round: float = 0.0    # draft tokens (chain) or tree nodes sent per round
    tree_rounds: int = 0            # rounds that carried a tree
    plans: str = ""                 # how often each chain/tree plan was chosen
    reused_drafts: int = 0          # drafted tokens reused from proactive drafting (--proactive)
    discarded_rounds: int = 0       # pipelined rounds dropped because their base was not committed
    token_ids: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


class Generation:
    """Async iterator of text pieces as they are committed; `stats` is complete at the end."""

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

    async def _run(self) -> AsyncIterator[str]:
        c, st = self._client, self.stats
        settings = self.settings
        policy = AdaptiveGamma(max_gamma=c.max_gamma) if c.gamma == "adaptive" else FixedGamma(int(c.gamma))
        planner = TreePolicy(policy, c.tree, max_nodes=c.max_tree_nodes)
        nodes_sent = 0
        rng = seeded_rng(settings.seed, EDGE_STREAM)  # never the verifier's stream (see warping)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        committed = list(self.prompt_ids)
        prompt_len = len(committed)
        session_id, last_round = "", 0
        gammas: list[int] = []
        t0 = time.perf_counter()
        pieces: list[str] = []
        finished = False
        while not finished:
            remaining = settings.max_new_tokens - (len(committed) - prompt_len)
            plan = planner.plan(remaining)
            if plan.shape is None:
                draft = c.drafter.propose(committed, plan.gamma, settings, c.qmode, rng)
                parents, rows = [], len(draft.tokens)
            else:
                draft = c.drafter.propose_tree(committed, plan.shape, settings, c.qmode, rng)
                parents, rows = draft.parents, draft.rows
            req = pb.VerifyRequest(session_id=session_id, round=last_round + 1, committed_length=len(committed),
                                   draft_token_ids=draft.tokens, draft_parents=parents,
                                   q=qcodec.to_proto(draft.qs, c.qmode.scale_bits))
            if not session_id:
                req.open.CopyFrom(pb.OpenSession(
                    prompt_token_ids=self.prompt_ids, resume_token_ids=committed[prompt_len:],
                    sampling=sampling_proto(settings), tokenizer_fingerprint=c.drafter.fingerprint or "",
                    open_key=os.urandom(16)))
            t_round = time.perf_counter()
            try:
                reply = await c._verify(req, st)
            except EdgeError as e:
                if e.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION) and session_id \
                        and st.replays < c.max_replays:
                    log.warning("replaying %d committed tokens: %s", len(committed) - prompt_len, e)
                    st.replays += 1
                    session_id, last_round = "", 0
                    continue
                raise
            round_s = time.perf_counter() - t_round
            if parents:
                kept = list(reply.kept_nodes)
                is_path = len(kept) == reply.num_accepted and all(
                    k < len(draft.tokens) and draft.parents[k] == (kept[j - 1] if j else -1) for j, k in enumerate(kept))
                if not is_path:
                    raise EdgeError(grpc.StatusCode.INTERNAL, f"kept_nodes {list(reply.kept_nodes)} is not a path "
                                                              f"from the root of {reply.num_accepted} nodes")
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
            depth = plan.gamma if parents else len(draft.tokens)
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
            planner.observe(plan, nodes=len(draft.tokens), rows=rows, tokens=len(new), draft_s=draft.seconds,
                            round_s=round_s, server_s=server_s, model_s=model_s)
            c.drafter.observe(committed, reply.num_accepted)
            if new and not st.ttft_s:
                st.ttft_s = time.perf_counter() - t0
            finished = reply.finish_reason != pb.NOT_FINISHED
            if finished:
                st.finish_reason = pb.FinishReason.Name(reply.finish_reason).lower()
            piece = decoder.decode(b"".join(c.tokenizer.token_bytes(t) for t in new if t not in c.hidden_ids))
            if finished:
                piece += decoder.decode(b"", final=True)
            if piece:
                pieces.append(piece)
                yield piece
        # A finished session needs no Close: the server frees its KV cache when generation ends.
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
                            timeout_s: float = 600.0) -> CloudOnlyStats:
    """Run the Generate stream and time it (wall from the request, TTFT at the first token)."""
    t0 = time.perf_counter()
    ttft, ids = 0.0, []
    async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=list(prompt_ids),
                                                        sampling=sampling_proto(settings)), timeout=timeout_s):
        ids.extend(chunk.token_ids)
        ttft = ttft or time.perf_counter() - t0
    return CloudOnlyStats(len(ids), time.perf_counter() - t0, ttft, ids)


class EdgeClient:
    def __init__(self, server: str, drafter: Drafter, tokenizer: Tokenizer, *, gamma: int | str = 5,
                 qmode: QMode | str = "fixed", deadline_s: float = 30.0, max_retries: int = 8,
                 max_replays: int = 8, max_gamma: int = 12, channel: grpc.aio.Channel | None = None,
                 tree: "str | TreeShape" = "off", max_tree_nodes: int = 64):
        self.server, self.drafter, self.tokenizer = server, drafter, tokenizer
        self.gamma = gamma
        self.qmode = QMode.parse(qmode) if isinstance(qmode, str) else qmode
        self.deadline_s, self.max_retries, self.max_replays, self.max_gamma = deadline_s, max_retries, max_replays, max_gamma
        self._channel = channel
        self._own_channel = channel is None
        # "off": chains; "auto": the cost model picks chain or tree each round; a TreeShape: always.
        self.tree = TreeShape.parse(tree) if isinstance(tree, str) and tree not in ("off", "auto") else tree
        self.max_tree_nodes = max_tree_nodes
        if self.tree != "off" and not drafter.supports_trees:
            raise ValueError(f"the {drafter.name} drafter does not build trees; use tree='off'")
        self._reached = False
        # Special tokens (EOS, <|im_end|>) end generation; they are not printed.
        self.hidden_ids = getattr(tokenizer, "eog_ids", frozenset())

    async def __aenter__(self) -> "EdgeClient":
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.server, options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.enable_retries", 0),  # we retry ourselves, idempotently
            ])
        self._stub = pb_grpc.VerifierStub(self._channel)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._own_channel and self._channel is not None:
            await self._channel.close()
            self._channel = None

    def generate(self, prompt: str | Sequence[int], settings: SamplingSettings) -> Generation:
        ids = self.tokenizer.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        return Generation(self, ids, settings)

    async def server_info(self) -> pb.ServerInfo:
        return await self._stub.GetServerInfo(pb.ServerInfoRequest(), timeout=self.deadline_s)

    async def _verify(self, req: pb.VerifyRequest, st: GenerationStats) -> pb.VerifyReply:
        delay = 0.05
        for attempt in range(self.max_retries + 1):
            st.bytes_up += req.ByteSize() + GRPC_FRAME_BYTES
            try:
                # Once a verifier has answered, wait for it to come back (restart) instead of failing fast;
                # before that, an address with nothing behind it fails within the retry budget.
                reply = await self._stub.Verify(req, timeout=self.deadline_s, wait_for_ready=self._reached)
                self._reached = True
                st.bytes_down += reply.ByteSize() + GRPC_FRAME_BYTES
                return reply
            except grpc.aio.AioRpcError as e:
                if e.code() in RETRYABLE and attempt < self.max_retries:
                    st.retries += 1
                    log.info("round %d: %s, retrying in %.2fs", req.round, e.code().name, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                raise EdgeError(e.code(), e.details() or "") from None
        raise AssertionError("unreachable")

    async def _close(self, session_id: str) -> None:
        try:
            await self._stub.Close(pb.CloseRequest(session_id=session_id), timeout=self.deadline_s)
        except grpc.aio.AioRpcError as e:  # best effort: the server's TTL frees it anyway
            log.debug("close failed: %s", e.code().name)
