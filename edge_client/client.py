"""The session loop and the Python API an app calls.

    options = EdgeOptions(Transport("127.0.0.1:50051"), Speculation(gamma="adaptive"))
    async with EdgeClient(options, drafter, tokenizer) as client:
        gen = client.generate("Write a haiku.", SamplingSettings(temperature=0.7, max_new_tokens=64))
        async for piece in gen:
            print(piece, end="")
        print(gen.stats)

The options (edge_client.options) say how to speculate, how to reach the verifier and how to
prove who we are; the verifier's own limits (ServerInfo: largest γ, tree nodes) cap what is sent,
asked once per channel before the first round.
Every call has a deadline. UNAVAILABLE and DEADLINE_EXCEEDED are retried with the same request
(the server answers a repeated round from its reply cache, so a retry never commits twice).
NOT_FOUND (the verifier lost the session: restart, eviction, another replica) and an
out-of-step FAILED_PRECONDITION are answered by replay: the next round carries `open` with the
prompt and every committed token, so nothing committed is lost or duplicated.
A refusal for load (RESOURCE_EXHAUSTED or UNAVAILABLE with a `retry-after-ms` hint: the verifier's
admission control, a tenant limit, a draining server) is waited out: at least the hint, plus
random jitter so that refused edges do not come back together, up to `max_wait_s` per round.

Security (`Security` in the options): `tls=True` (or any of tls_ca / tls_cert / tls_key) connects
with TLS, mutual when a client certificate and key are given; `token` (default: $HYBRIDSPEC_TOKEN)
is sent on every call as `authorization: Bearer <token>`.
"""
from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import os
import random
import threading
import time
import weakref
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, NamedTuple, Protocol, Sequence

import grpc
import numpy as np

from edge_client import crossvocab
from edge_client.crossvocab import Chat, PromptPlan
from edge_client.continuations import ContinuationBudget, UplinkFit, choose_length, ranked_outcomes
from edge_client.drafters import Draft, Drafter, TreeDraft
from edge_client.gamma import AdaptiveGamma, FixedGamma, RoundPlan, TreePolicy
from edge_client.options import ADAPTIVE, EdgeOptions, ServerLimits, Speculation, Transport
from spec_core import qcodec
from spec_core.continuations import MAX_CONTINUATION_NODES, MAX_CONTINUATIONS, Outcome
from spec_core.costmodel import expected_tokens_per_round
from spec_core.drafting import QMode
from spec_core.proto import verifier_pb2 as pb
from spec_core.proto import verifier_pb2_grpc as pb_grpc
from spec_core.warping import EDGE_STREAM, SamplingSettings, seeded_rng

log = logging.getLogger(__name__)

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


class Tokenizer(Protocol):
    fingerprint: str
    eog_ids: frozenset[int]

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def token_bytes(self, token: int, special: bool = False) -> bytes: ...


class EdgeError(RuntimeError):
    """The verifier refused the request; `code` is the gRPC status, the message says why.
    `retry_after_s`: the server's retry hint, set only when it refused for load (the same request
    may succeed later); a refusal without one is about the request itself."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code, self.retry_after_s = code, retry_after_s


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
    draft_rolled_back: int = 0      # across tokenizers: draft tokens re-tokenized away (KV rolled back)
    draft_retokenized: int = 0      # across tokenizers: draft tokens tokenized anew from committed text
    continuation_rounds: int = 0    # rounds during whose flight continuations were drafted
    continuations_sent: int = 0     # alternatives shipped in pipelined rounds (each drafted for one outcome)
    continuation_hits: int = 0      # rounds whose outcome a continuation had been drafted for (sent or reused)
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

    def __init__(self, client: "EdgeClient", prompt: "str | Chat | Sequence[int]", settings: SamplingSettings):
        self._client, self._prompt, self.settings = client, prompt, settings
        self.prompt_ids = None if isinstance(prompt, (str, Chat)) else list(prompt)  # the target's, once known
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
        spec = await self._client._speculation(self.stats)  # within the verifier's limits
        plan = await self._client._plan_prompt(self._prompt, self.stats)
        loop = _SessionLoop(self._client, spec, plan.ids, self.settings, self.stats, plan)
        try:
            while not loop.finished:
                piece = await loop.step()
                if piece:
                    yield piece
        except EdgeError as e:
            if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after_s is None:
                self._client._forget_server_limits()  # a verifier restarted with other limits: ask again
            raise
        finally:
            self.prompt_ids = loop.prompt_ids or self.prompt_ids   # a text open's: from the verifier
            await loop.close()


class _Guess(NamedTuple):
    """A continuation: one likely outcome of a round in flight, and the draft made after it."""

    tokens: list[int]       # what it assumes the round commits (kept drafts + corrected or bonus token)
    prep: "_Prepared"       # the next round's draft, for base = this round's base + tokens


class _SessionLoop:
    """One generation's rounds on one verifier session: draft, send, commit what the verifier
    kept, learn. While a round is in flight it may draft the next round from the most likely
    outcome (proactive) and send it before the reply (pipeline); `ahead` holds such a draft for
    the next round, kept only if its base comes true."""

    def __init__(self, client: "EdgeClient", spec: Speculation, prompt_ids: list[int], settings: SamplingSettings,
                 stats: GenerationStats, plan: PromptPlan | None = None):
        self.c, self.spec, self.settings, self.st = client, spec, settings, stats
        self.prompt_ids = prompt_ids
        self.plan = plan or PromptPlan(prompt_ids, None)   # a text open: the target's ids come with the first reply
        if spec.gamma == ADAPTIVE:
            self.policy = AdaptiveGamma(max_gamma=spec.max_gamma,
                                        start_gamma=min(AdaptiveGamma.start_gamma, spec.max_gamma))
        else:
            self.policy = FixedGamma(spec.gamma)
        self.planner = TreePolicy(self.policy, spec.tree, max_nodes=spec.max_tree_nodes)
        self.rng = seeded_rng(settings.seed, EDGE_STREAM)  # never the verifier's stream (see warping)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.committed = list(prompt_ids)
        self.prompt_len = len(self.committed)
        self.session_id, self.last_round = "", 0
        self.gammas: list[int] = []
        self.nodes_sent = 0
        self.t0 = time.perf_counter()
        self.pieces: list[str] = []
        self.finished = False
        self.final: pb.VerifyReply | None = None  # the last reply applied: its finish reason is the generation's
        self.stop_ids = frozenset(settings.stop_token_ids) | (frozenset() if settings.ignore_eos else client.hidden_ids)
        self.ahead: _Prepared | None = None  # drafted during the last round trip, for a guessed base
        self.ahead_job: asyncio.Future | None = None  # drafting `ahead` during the round trip
        self.spec_task: asyncio.Future | None = None  # the pipelined round, sent before the reply
        self.view0 = self.c.drafter.retokenization()   # across tokenizers: the draft view's counters so far
        self.uplink = UplinkFit()  # the uplink's time per request byte, for the continuations' cost

    # --- one round ----------------------------------------------------------------------------

    async def step(self) -> str:
        """One round (and the pipelined one after it, when its base came true): its text."""
        remaining = self.settings.max_new_tokens - (len(self.committed) - self.prompt_len)
        prep = await self._next_draft(remaining)
        req = self._request(prep, self.last_round + 1)
        t_round = time.perf_counter()
        reply_task = asyncio.ensure_future(self.c._verify(req, self.st) if self.session_id
                                           else self.c._open_round(req, self.st))
        await self._work_during_round_trip(prep, remaining, reply_task, req.round)
        try:
            reply = await reply_task
        except EdgeError as e:
            await _settle(self.ahead_job, self.spec_task)
            self.st.discarded_rounds += self.spec_task is not None
            if not self._replay_after(e):
                raise
            return ""
        round_s = time.perf_counter() - t_round
        guesses = await self.ahead_job if self.ahead_job is not None else []  # the drafter is free again
        self.st.continuation_rounds += bool(guesses)
        self.uplink.observe(req.ByteSize(), round_s - reply.timings.total_ms / 1e3)
        new = self._apply(prep, reply, round_s)
        self.final = reply
        self.finished = reply.finish_reason != pb.NOT_FINISHED
        if guesses and not self.finished:
            new += await self._use_guess(guesses, t_round)
        elif self.spec_task is not None:
            await _settle(None, self.spec_task)
            self.st.discarded_rounds += 1
        return self._text(new)

    async def _next_draft(self, remaining: int) -> "_Prepared":
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.base == self.committed:
            self.st.reused_drafts += len(ahead.draft.tokens)
            return ahead  # the round trip's guess came true: this draft is ready
        return await self.c._in_drafter(self._prepare, list(self.committed), self.planner.plan(remaining))

    async def _work_during_round_trip(self, prep: "_Prepared", remaining: int, reply_task: asyncio.Future,
                                      round_: int) -> None:
        """Draft continuations, next rounds for this one's likely outcomes (proactive), and send them
        as one round before the reply when they are ready first (pipeline): alternative 0 in the
        request's own fields, the others in `continuations`."""
        self.ahead_job = self.spec_task = None
        if not ((self.spec.proactive or self.spec.pipeline) and self.session_id and prep.draft.tokens):
            return
        stop = threading.Event()  # the reply is here: stop drafting for outcomes, one is known
        reply_task.add_done_callback(lambda _: stop.set())
        self.ahead_job = asyncio.ensure_future(self.c._in_drafter(
            self._draft_continuations, prep, remaining, self._budget(prep, time.perf_counter()), stop, thread=True))
        if not self.spec.pipeline:
            return
        done, _ = await asyncio.wait({reply_task, self.ahead_job}, return_when=asyncio.FIRST_COMPLETED)
        if self.ahead_job in done and not reply_task.done() and self.ahead_job.result():
            guesses = self.ahead_job.result()
            spec_req = self._request(guesses[0].prep, round_ + 1, assumed=guesses[0].tokens)
            spec_req.continuations.extend(self._continuation(g) for g in guesses[1:])
            self.st.continuations_sent += len(guesses)
            # Retried like any round: a lost reply is answered from the server's cache.
            self.spec_task = asyncio.ensure_future(self.c._verify(spec_req, self.st))

    def _replay_after(self, e: EdgeError) -> bool:
        """Whether to replay the committed tokens in a new session: the verifier lost ours (NOT_FOUND)
        or is out of step with it (FAILED_PRECONDITION). A first round (it carries `open`) answered
        NOT_FOUND opened a session that was evicted before its round ran: it is sent again, as a
        replay; FAILED_PRECONDITION there is a refusal (e.g. the tokenizer) that replaying cannot fix."""
        lost = e.code == grpc.StatusCode.NOT_FOUND or (
            e.code == grpc.StatusCode.FAILED_PRECONDITION and bool(self.session_id))
        if lost and self.st.replays < self.c.transport.max_replays:
            log.warning("replaying %d committed tokens: %s", len(self.committed) - self.prompt_len, e)
            self.st.replays += 1
            self.session_id, self.last_round = "", 0
            return True
        return False

    async def _use_guess(self, guesses: list[_Guess], t_round: float) -> list[int]:
        """After a reply: commit the pipelined round if one alternative's base came true (its tokens),
        or keep the continuation drafted for what was committed for the next round."""
        if self.spec_task is None:
            for guess in guesses:
                if self.committed == guess.prep.base:
                    self.ahead = guess.prep
                    self.st.continuation_hits += 1
                    break
            return []
        spec_reply = await _settle(None, self.spec_task)
        guess = guesses[spec_reply.continuation] if spec_reply is not None and not spec_reply.base_mismatch \
            and spec_reply.continuation < len(guesses) else None
        if guess is not None and self.committed == guess.prep.base:
            new = self._apply(guess.prep, spec_reply, time.perf_counter() - t_round)
            self.st.pipelined_rounds += 1
            self.st.continuation_hits += 1
            self.final = spec_reply
            self.finished = spec_reply.finish_reason != pb.NOT_FINISHED
            return new
        self.st.discarded_rounds += 1
        return []

    def _text(self, new: list[int]) -> str:
        """The text of newly committed tokens (special tokens hidden; UTF-8 split across tokens kept
        until complete)."""
        st, c = self.st, self.c
        if new and not st.ttft_s:
            st.ttft_s = time.perf_counter() - self.t0
        if self.finished:
            st.finish_reason = pb.FinishReason.Name(self.final.finish_reason).lower()
        piece = self.decoder.decode(b"".join(c.tokenizer.token_bytes(t) for t in new if t not in c.hidden_ids))
        if self.finished:
            piece += self.decoder.decode(b"", final=True)
        if piece:
            self.pieces.append(piece)
        return piece

    # --- drafts and requests --------------------------------------------------------------------

    def _base_rng(self, base: list[int]) -> np.random.Generator:
        # With a user seed, a round's draft depends only on the committed tokens (a stream per
        # committed length, like the verifier's): a round redone after a replay drafts the same.
        seed = self.settings.seed
        return self.rng if seed is None else seeded_rng(seed, EDGE_STREAM, len(base))

    def _prepare(self, base: list[int], plan: RoundPlan) -> "_Prepared":
        """Draft a chain or tree after `base` (in the drafting executor while a round is in flight)."""
        drafter = self.c.drafter
        if plan.shape is None:
            d = drafter.propose(base, plan.gamma, self.settings, self.spec.qmode, self._base_rng(base))
            return _Prepared(base, plan, d, [], len(d.tokens))
        d = drafter.propose_tree(base, plan.shape, self.settings, self.spec.qmode, self._base_rng(base))
        return _Prepared(base, plan, d, d.parents, d.rows)

    def _budget(self, prep: "_Prepared", now: float) -> ContinuationBudget:
        """When the reply is expected and what a hit saves, from the planner's measured costs."""
        pl = self.planner
        draft_s = prep.rows * (pl.t_row_s or 0.0)
        return ContinuationBudget(t_reply=now + max(0.0, pl.predicted_round_s(prep.plan) - draft_s),
                                  rtt_s=pl.rtt_s or 0.0, fresh_draft_s=draft_s,
                                  s_per_byte=self.uplink.seconds_per_byte())

    def _draft_continuations(self, prep: "_Prepared", remaining: int, budget: ContinuationBudget,
                             stop: threading.Event) -> list[_Guess]:
        """Continuations for the round's likely outcomes, most probable first, while one more pays
        (edge_client.continuations) and the reply is not in. Empty when the round may end generation.
        With max_continuations 1: the one guess that every draft is accepted, then the draft's argmax."""
        path = prep.guess_path()
        if not path or len(path) + 1 >= remaining or self.stop_ids & set(path):
            return []
        plan = self.planner.plan(remaining - len(path) - 1)
        out: list[_Guess] = []
        covered, spent, nodes, nbytes = 0.0, [prep.draft.seconds], 0, self._request(prep, 0).q.ByteSize()
        outcomes = self._outcomes(prep, path)
        if self.spec.pipeline and plan.shape is None and len(outcomes) > 1 and plan.gamma > 1:
            # How long: as many outcomes covered as pay, times what a hit commits (edge_client.continuations).
            t_row = self.planner.t_row_s or prep.draft.seconds / max(prep.rows, 1)
            gamma = choose_length(outcomes, self._alpha(), plan.gamma, t_row, nbytes / max(len(prep.draft.tokens), 1),
                                  budget, time.perf_counter())
            plan = RoundPlan(plan.arm, gamma)
            spent = [(gamma + 1) * t_row]
        for outcome in outcomes:
            if out and stop.is_set() or len(out) > MAX_CONTINUATIONS:  # the first is drafted in any case
                break
            tokens = list(outcome.tokens)
            if self.stop_ids & set(tokens) or len(tokens) + 1 >= remaining:
                continue
            if out and self.spec.pipeline and not budget.worth(outcome.prob, covered, time.perf_counter(),
                                                               sum(spent) / len(spent), nbytes):
                break
            t0 = time.perf_counter()
            nxt = self._prepare(prep.base + tokens, plan)
            spent.append(time.perf_counter() - t0)
            if out:
                nodes += len(nxt.draft.tokens)
                if nodes > MAX_CONTINUATION_NODES:
                    break
            if nxt.draft.tokens:
                out.append(_Guess(tokens, nxt))
                covered += outcome.prob
                nbytes = self._continuation(out[-1]).ByteSize()
        return out

    def _outcomes(self, prep: "_Prepared", path: list[int]) -> list[Outcome]:
        """The round's outcomes ranked by the draft's estimate (spec_core.continuations), at most
        max_continuations of them."""
        drafter, after = self.c.drafter, prep.base + path
        if self.spec.max_continuations <= 1:
            bonus = drafter.propose(after, 1, GREEDY, QMode("none"), self._base_rng(after)).tokens
            return [Outcome(tuple(path + bonus), 1.0)] if bonus else []
        # The draft's distribution where the verifier draws a token (greedy sessions rank by T = 1).
        est = self.settings if not self.settings.greedy else SamplingSettings(temperature=1.0)

        def probe(seq: list[int]):
            qs = drafter.propose(seq, 1, est, QMode("float", 16), np.random.default_rng(0)).qs
            return qs[0] if qs else None
        nodes = prep.guess_nodes()
        shipped = prep.draft.qs
        if prep.parents:
            children = [[prep.draft.tokens[c] for c in range(len(prep.parents)) if prep.parents[c] == prep.parents[n]]
                        for n in nodes]
        else:
            children = [[] for _ in nodes]
        position_q = (lambda j: shipped[nodes[j]]) if shipped is not None else (lambda j: probe(prep.base + path[:j]))
        return ranked_outcomes(path, self._alpha(), position_q, probe(after), self.spec.max_continuations,
                               excluded=lambda j: children[j])

    def _alpha(self) -> float:
        """The per-token acceptance estimate: the γ policy's, or the session's so far (Beta(1, 1) prior)."""
        alpha = getattr(self.policy, "alpha", None)
        return alpha if alpha is not None else (self.st.accepted + 1) / (self.st.accepted + self.st.rejections + 2)

    def _continuation(self, guess: _Guess) -> pb.Continuation:
        p = guess.prep
        return pb.Continuation(assumed_tokens=guess.tokens, draft_token_ids=p.draft.tokens, draft_parents=p.parents,
                               q=qcodec.to_proto(p.draft.qs, self.spec.qmode.scale_bits))

    def _request(self, prep: "_Prepared", round_: int, assumed: Sequence[int] = ()) -> pb.VerifyRequest:
        req = pb.VerifyRequest(session_id=self.session_id, round=round_, committed_length=len(prep.base),
                               draft_token_ids=prep.draft.tokens, draft_parents=prep.parents,
                               q=qcodec.to_proto(prep.draft.qs, self.spec.qmode.scale_bits),
                               assumed_tokens=list(assumed))
        if not self.session_id:
            req.open.CopyFrom(pb.OpenSession(
                prompt_token_ids=self.prompt_ids, resume_token_ids=prep.base[self.prompt_len:],
                sampling=sampling_proto(self.settings), tokenizer_fingerprint=self.c.drafter.fingerprint or "",
                open_key=os.urandom(16), draft_tokenizer_fingerprint=getattr(self.c.drafter, "draft_fingerprint", "")))
            if self.spec.slo_tpot_ms or self.spec.slo_ttft_ms:
                req.open.slo.CopyFrom(pb.SessionSlo(tpot_ms=self.spec.slo_tpot_ms, ttft_ms=self.spec.slo_ttft_ms))
            if not self.prompt_ids and self.plan.text_open is not None:
                req.open.MergeFrom(self.plan.text_open)   # committed_length counts what follows the prompt
        return req

    # --- replies --------------------------------------------------------------------------------

    def _apply(self, prep: "_Prepared", reply: pb.VerifyReply, round_s: float) -> list[int]:
        """Commit a reply's tokens (checked against the server's view) and learn from the round."""
        new = self._accepted(prep, reply) + ([reply.next_token_id] if reply.HasField("next_token_id") else [])
        if not self.prompt_ids and reply.prompt_token_ids:
            self._prompt_known(list(reply.prompt_token_ids))
        self.committed.extend(new)
        if reply.committed_length != len(self.committed):
            raise EdgeError(grpc.StatusCode.INTERNAL, f"server committed {reply.committed_length} tokens, "
                                                      f"the edge {len(self.committed)}")
        self.session_id, self.last_round = reply.session_id, reply.round
        self._learn(prep, reply, round_s, len(new))
        return new

    def _prompt_known(self, ids: list[int]) -> None:
        """A text open's reply: the target's prompt ids become the committed prefix (replays send them)."""
        self.prompt_ids = ids
        self.committed[:0] = ids
        self.prompt_len = len(ids)
        self.c.drafter.anchor_prompt(ids, self.plan.draft_ids)

    @staticmethod
    def _accepted(prep: "_Prepared", reply: pb.VerifyReply) -> list[int]:
        """The draft tokens the verifier kept: a prefix of a chain, or a path from a tree's root."""
        draft = prep.draft
        if not prep.parents:
            return draft.tokens[: reply.num_accepted]
        kept = list(reply.kept_nodes)
        is_path = len(kept) == reply.num_accepted and all(
            k < len(draft.tokens) and draft.parents[k] == (kept[j - 1] if j else -1) for j, k in enumerate(kept))
        if not is_path:
            raise EdgeError(grpc.StatusCode.INTERNAL, f"kept_nodes {kept} is not a path from the root of "
                                                      f"{reply.num_accepted} nodes")
        return [draft.tokens[i] for i in kept]

    def _learn(self, prep: "_Prepared", reply: pb.VerifyReply, round_s: float, n_new: int) -> None:
        """Count the round, and teach γ, the tree planner and the drafter what it cost and kept."""
        st, draft, parents = self.st, prep.draft, prep.parents
        st.rounds += 1
        st.drafted += len(draft.tokens)
        st.accepted += reply.num_accepted
        depth = prep.plan.gamma if parents else len(draft.tokens)
        rejected = reply.HasField("next_token_id") and reply.num_accepted < depth
        st.rejections += rejected
        st.draft_s += draft.seconds
        st.server_model_s += reply.timings.model_ms / 1e3
        self.nodes_sent += len(draft.tokens)
        st.tree_rounds += bool(parents)
        self.gammas.append(depth)
        server_s, model_s = reply.timings.total_ms / 1e3, reply.timings.model_ms / 1e3
        if not parents:  # the chain's α and γ model; a tree round's acceptance is not geometric
            self.policy.observe(gamma=len(draft.tokens), num_accepted=reply.num_accepted, draft_s=draft.seconds,
                                round_s=round_s, server_s=server_s, model_s=model_s, rejected=rejected)
        self.planner.observe(prep.plan, nodes=len(draft.tokens), rows=prep.rows, tokens=n_new,
                             draft_s=draft.seconds, round_s=round_s, server_s=server_s, model_s=model_s)
        self.c.drafter.observe(self.committed, reply.num_accepted)
        if reply.HasField("budget") and self.spec.steer and self.spec.gamma == ADAPTIVE:
            self.planner.steer(reply.budget.max_gamma, reply.budget.max_tree_nodes)
        if self.c.on_round is not None:
            self.c.on_round(RoundEvent(gamma=depth, accepted=reply.num_accepted, tokens=n_new,
                                       draft_s=draft.seconds, rpc_s=round_s, server_s=server_s))

    # --- the end --------------------------------------------------------------------------------

    async def close(self) -> None:
        """Settle background work, complete the stats, and close the session if it is unfinished."""
        await _settle(self.ahead_job, self.spec_task)
        self._complete_stats()
        # A finished session needs no Close: the server frees its KV cache when generation ends.
        # One left early (the caller stopped reading, was cancelled, or a round failed) is closed
        # now; shielded, so a cancelled caller still sends it.
        if self.session_id and not self.finished:
            await asyncio.shield(self.c._close(self.session_id))

    def _complete_stats(self) -> None:
        st = self.st
        st.wall_s = time.perf_counter() - self.t0
        st.text = "".join(self.pieces)
        st.token_ids = self.committed[self.prompt_len:]
        st.tokens = len(st.token_ids)
        st.acceptance_rate = st.accepted / st.drafted if st.drafted else 0.0
        st.alpha = st.accepted / (st.accepted + st.rejections) if st.accepted + st.rejections else 0.0
        st.tokens_per_round = st.tokens / st.rounds if st.rounds else 0.0
        st.mean_gamma = sum(self.gammas) / len(self.gammas) if self.gammas else 0.0
        st.gamma = self.policy.describe()
        st.nodes_per_round = self.nodes_sent / st.rounds if st.rounds else 0.0
        st.plans = self.planner.describe()
        st.expected_tokens_per_round = expected_tokens_per_round(st.alpha, round(st.mean_gamma))
        st.tokens_per_s = st.tokens / st.wall_s if st.wall_s else 0.0
        view = self.c.drafter.retokenization()
        if view is not None and self.view0 is not None:
            st.draft_rolled_back = view.rolled_back - self.view0.rolled_back
            st.draft_retokenized = view.retokenized - self.view0.retokenized


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
        return [self.draft.tokens[i] for i in self.guess_nodes()]

    def guess_nodes(self) -> list[int]:
        """The nodes of that path, root first."""
        if not self.parents:
            return list(range(len(self.draft.tokens)))
        has_child = set(self.parents)
        leaves = [i for i in range(len(self.parents)) if i not in has_child]
        if not leaves:
            return []
        node = max(leaves, key=lambda i: (self.draft.path_probs[i], -i))
        path = []
        while node != -1:
            path.append(node)
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
    p = pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,  # 1.0 = off, as the wire says
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
    """Generations against one verifier. `options`: EdgeOptions (or just the verifier's address);
    `channel`: share an open channel instead of opening one; `draft_executor`: where drafting runs
    (a server: one worker serialises the sessions' drafting); `on_round`: called with each
    committed round (metrics)."""

    def __init__(self, options: EdgeOptions | str, drafter: Drafter, tokenizer: Tokenizer, *,
                 channel: grpc.aio.Channel | None = None, draft_executor: Executor | None = None,
                 on_round: Callable[[RoundEvent], None] | None = None):
        self.options = EdgeOptions(Transport(options)) if isinstance(options, str) else options
        self.transport, self.speculation = self.options.transport, self.options.speculation
        self.drafter, self.tokenizer = drafter, tokenizer
        self.token = self.options.security.bearer_token()
        self._metadata = auth_metadata(self.token)
        self._channel = channel
        self._own_channel = channel is None
        self.draft_executor = draft_executor
        self.on_round = on_round
        self._background: set[asyncio.Task] = set()  # Close calls that outlive a cancelled generation
        if self.speculation.tree != "off" and not drafter.supports_trees:
            raise ValueError(f"the {drafter.name} drafter does not build trees; use tree='off'")
        self._reached = False
        self._cross: bool | None = None   # drafting across vocabularies (decided at the first generation)
        self._cross_lock = asyncio.Lock()
        # Special tokens (EOS, <|im_end|>) end generation; they are not printed.
        self.hidden_ids = getattr(tokenizer, "eog_ids", frozenset())

    async def __aenter__(self) -> "EdgeClient":
        if self._channel is None:
            self._channel = open_channel(self.transport.server, **self.options.security.channel_kwargs())
        self._stub = pb_grpc.VerifierStub(self._channel)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._background:
            # Close calls of generations cancelled mid-open: let them reach the verifier before
            # the channel goes (else their sessions hold KV memory until the verifier's TTL).
            await asyncio.wait(list(self._background), timeout=self.transport.deadline_s)
        if self._own_channel and self._channel is not None:
            await self._channel.close()
            self._channel = None

    def generate(self, prompt: "str | Chat | Sequence[int]", settings: SamplingSettings) -> Generation:
        """`prompt`: text, a conversation (edge_client.crossvocab.Chat: the model's chat template), or
        the TARGET's token ids."""
        return Generation(self, prompt, settings)

    async def server_info(self) -> pb.ServerInfo:
        info = await self._stub.GetServerInfo(pb.ServerInfoRequest(), timeout=self.transport.deadline_s,
                                              metadata=self._metadata)
        _SERVER_LIMITS[self._channel] = ServerLimits.from_info(info)
        _SERVER_INFOS[self._channel] = info
        return info

    # --- drafting across tokenizers (edge_client.crossvocab) -------------------------------------

    async def _plan_prompt(self, prompt: "str | Chat | Sequence[int]", st: GenerationStats) -> PromptPlan:
        """The prompt as target ids, or as a text open when the draft has another tokenizer."""
        if not await self._cross_vocabulary(st):
            if isinstance(prompt, str):
                return PromptPlan(self.tokenizer.tokenize(prompt), None)
            if isinstance(prompt, Chat):
                from edge_client.text import render_messages
                return PromptPlan(render_messages(self.tokenizer, list(prompt.messages)), None)
            return PromptPlan(list(prompt), None)
        if isinstance(prompt, (str, Chat)):
            draft_ids = await self._in_drafter(crossvocab.draft_prompt_ids, self._draft_tokenizer, prompt)
            self.drafter.anchor_prompt([], draft_ids)
            return PromptPlan([], crossvocab.open_fields(prompt), draft_ids)
        self.drafter.anchor_prompt([], [])   # target ids: the draft sees their text
        return PromptPlan(list(prompt), None)

    async def _cross_vocabulary(self, st: GenerationStats) -> bool:
        """Whether this client drafts across vocabularies; the first time, set it up: the target's
        vocabulary (cache or GetVocabulary), the wrapped drafter, the target's text."""
        if self._cross is not None:
            return self._cross
        async with self._cross_lock:   # generations started together set it up once
            if self._cross is None:
                await self._set_up_cross_vocabulary(st)
        return self._cross

    async def _set_up_cross_vocabulary(self, st: GenerationStats) -> None:
        info = _SERVER_INFOS.get(self._channel)
        target_fp = info.tokenizer_fingerprint if info is not None else ""
        if not target_fp or self.drafter.fingerprint in (None, target_fp) or self.speculation.strict_tokenizer:
            self._cross = False   # same tokenizer, a drafter without one, or the strict check (the verifier's)
            return
        if not self.drafter.supports_cross_vocab or not hasattr(self.tokenizer, "tokenize_bytes"):
            raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"the target ({info.model}) has another tokenizer and the {self.drafter.name} drafter "
                            "cannot draft across vocabularies; use a GGUF draft model or one with the target's tokenizer")
        target = crossvocab.known_vocabulary(target_fp)
        if target is None and self.speculation.target_vocab:
            target = await asyncio.to_thread(crossvocab.load_vocabulary_file, self.speculation.target_vocab)
            if target.fingerprint != target_fp:
                raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{self.speculation.target_vocab} is not the verifier's tokenizer ({info.model})")
            crossvocab.remember_vocabulary(target)
        if target is None:
            if not info.text_prompts:
                raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the draft's tokenizer differs from the target's ({info.model}) and this verifier "
                                "does not serve its vocabulary or take text prompts; use a draft with the target's "
                                "tokenizer")
            target = await self._fetch_vocabulary(target_fp, st)
        try:
            wrapper = await self._in_drafter(crossvocab.wrap, self.drafter, self.tokenizer, target, thread=True)
        except ValueError as e:   # vocabularies with nothing in common
            raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION, f"cannot draft for {info.model}: {e}") from None
        log.info("the target's tokenizer differs from the draft's: drafting across vocabularies (%s)",
                 wrapper.token_map.describe())
        self._draft_tokenizer = self.tokenizer
        self.drafter, self.tokenizer = wrapper, crossvocab.TargetText(target)
        self.hidden_ids = target.eog_ids
        self._cross = True

    async def _fetch_vocabulary(self, fingerprint: str, st: GenerationStats):
        async def ask() -> pb.Vocabulary:
            return await self._stub.GetVocabulary(pb.VocabularyRequest(fingerprint=fingerprint),
                                                  timeout=max(self.transport.deadline_s, 60.0), metadata=self._metadata)
        msg = await self._call(ask, st, "vocabulary")
        try:
            vocab = await asyncio.to_thread(crossvocab.vocabulary_from_proto, msg)
        except ValueError as e:
            raise EdgeError(grpc.StatusCode.INTERNAL, f"the verifier's vocabulary does not decode: {e}") from None
        if vocab.fingerprint != fingerprint:
            raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION, "the verifier sent the vocabulary of another tokenizer")
        await asyncio.to_thread(crossvocab.store_vocabulary, msg)
        crossvocab.remember_vocabulary(vocab)
        return vocab

    async def _speculation(self, st: GenerationStats) -> Speculation:
        """The speculation options within the verifier's limits (its ServerInfo, asked once per
        channel: clients that share a channel share the answer)."""
        limits = _SERVER_LIMITS.get(self._channel)
        if limits is None:
            async def ask() -> pb.ServerInfo:
                info = await self._stub.GetServerInfo(pb.ServerInfoRequest(), timeout=self.transport.deadline_s,
                                                      wait_for_ready=self._reached, metadata=self._metadata)
                _SERVER_INFOS[self._channel] = info
                return info
            try:
                limits = ServerLimits.from_info(await self._call(ask, st, "server info"))
            except EdgeError as e:
                if e.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                limits = ServerLimits()  # a verifier that does not say: nothing to cap by
            _SERVER_LIMITS[self._channel] = limits
        return self.speculation.within(limits)

    def _forget_server_limits(self) -> None:
        _SERVER_LIMITS.pop(self._channel, None)

    async def _verify(self, req: pb.VerifyRequest, st: GenerationStats, retries: int | None = None) -> pb.VerifyReply:
        async def attempt() -> pb.VerifyReply:
            st.bytes_up += req.ByteSize() + GRPC_FRAME_BYTES
            # Once a verifier has answered, wait for it to come back (restart) instead of failing fast;
            # before that, an address with nothing behind it fails within the retry budget.
            reply = await self._stub.Verify(req, timeout=self.transport.deadline_s, wait_for_ready=self._reached,
                                            metadata=self._metadata)
            st.bytes_down += reply.ByteSize() + GRPC_FRAME_BYTES
            return reply
        return await self._call(attempt, st, f"round {req.round}", retries)

    async def _call(self, attempt: Callable[[], Awaitable], st: GenerationStats, what: str,
                    retries: int | None = None):
        """`attempt()`, one RPC, until it answers: a refusal for load (a retry hint) is waited out,
        UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED are retried with backoff; anything else, or
        running out of patience, raises EdgeError."""
        delay, attempts, waited_s = 0.05, 0, 0.0
        max_retries = self.transport.max_retries if retries is None else retries
        while True:
            try:
                answer = await attempt()
                self._reached = True
                return answer
            except grpc.aio.AioRpcError as e:
                hint_s = retry_after_s(e)
                if hint_s is not None and e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE) \
                        and waited_s < self.transport.max_wait_s:
                    # Refused for load: wait the hint plus up to as much again, drawn at random, so
                    # that edges refused together do not return together.
                    self._reached = True
                    wait_s = min(hint_s * (1 + random.random()), self.transport.max_wait_s - waited_s)
                    st.backoffs += 1
                    st.backoff_s += wait_s
                    waited_s += wait_s
                    log.info("%s: %s, backing off %.2fs: %s", what, e.code().name, wait_s, e.details())
                    await asyncio.sleep(wait_s)
                    continue
                if e.code() in RETRYABLE and attempts < max_retries:
                    attempts += 1
                    st.retries += 1
                    log.info("%s: %s, retrying in %.2fs", what, e.code().name, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                raise EdgeError(e.code(), e.details() or "", retry_after_s=hint_s) from None

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
            await self._stub.Close(pb.CloseRequest(session_id=session_id), timeout=self.transport.deadline_s,
                                   metadata=self._metadata)
        except grpc.aio.AioRpcError as e:  # best effort: the server's TTL frees it anyway
            log.debug("close failed: %s", e.code().name)
        except grpc.aio.UsageError as e:  # the channel was closed first (a generation abandoned after its client)
            log.debug("close failed: %s", e)
