"""One generation's session on the verifier, as the edge sees it: the rounds it sends and the replies it
reads, in plain values for the round loop (edge_client.loop).

`RemoteSession.send` builds a round's VerifyRequest from its drafts (the first round also opens the
session: the prompt, the sampling settings, the tokenizers' fingerprints), sends it on the session's
VerifyStream when the verifier offers one (edge_client.stream) or as a unary Verify call, with the
transport's retries (edge_client.transport), and answers a `Reply`. The session's id, its last round,
the verifier's last draft budget and the replay rule (`replay_after`) live here too; a reply that
does not fit what the edge sent is an EdgeError (INTERNAL: `bad_reply`).
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Sequence

import grpc

from edge_client.crossvocab import PromptPlan
from edge_client.pairing import Pairing
from edge_client.rounds import Continuation, Prepared
from edge_client.stats import GenerationStats
from edge_client.stream import RoundStream, verify_on_stream
from edge_client.transport import EdgeError, sampling_proto
from spec_core.proto import qpayload
from spec_core.proto import verifier_pb2 as pb
from spec_core.qcodec import EncodedQ
from spec_core.warping import REJECTION, SamplingSettings
from spec_core.wire import OPEN_KEY_BYTES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reply:
    """A VerifyReply in plain values."""

    session_id: str
    round: int
    base_mismatch: bool           # the round assumed an outcome that was not committed: nothing ran
    continuation: int             # which of the round's continuations ran (0: the request's own draft)
    accepted: int
    kept_nodes: tuple[int, ...]   # a tree's kept path (a chain's: the first `accepted`)
    next_token: int | None        # the corrected or bonus token
    committed_length: int
    finish: str | None            # why generation ended ("stop", "length", ...); None: it goes on
    prompt_ids: tuple[int, ...]   # a text open's: the target's ids of the prompt
    model_s: float                # the verifier's target pass
    queue_s: float                # waiting for it
    server_s: float               # the verifier's own time in all
    budget: tuple[int, int] | None   # the verifier's draft budget: (max γ, max tree nodes)
    next_round: "Reply | None"    # round r + 1, answered in this pass (a fused continuation ran)

    @classmethod
    def read(cls, r: pb.VerifyReply) -> "Reply":
        t = r.timings
        return cls(r.session_id, r.round, r.base_mismatch, r.continuation, r.num_accepted, tuple(r.kept_nodes),
                   r.next_token_id if r.HasField("next_token_id") else None, r.committed_length,
                   None if r.finish_reason == pb.NOT_FINISHED else pb.FinishReason.Name(r.finish_reason).lower(),
                   tuple(r.prompt_token_ids), t.model_ms / 1e3, t.queue_ms / 1e3, t.total_ms / 1e3,
                   (r.budget.max_gamma, r.budget.max_tree_nodes) if r.HasField("budget") else None,
                   cls.read(r.next_round) if r.HasField("next_round") else None)


def bad_reply(message: str) -> EdgeError:
    """A reply that does not fit what the edge sent (the verifier's bug, or another verifier's)."""
    return EdgeError(grpc.StatusCode.INTERNAL, message)


def continuation_message(c: Continuation, scale_bits: int) -> pb.Continuation:
    p = c.prep
    return pb.Continuation(assumed_tokens=c.tokens, draft_token_ids=p.tree.tokens, draft_parents=p.wire_parents(),
                           q=qpayload.to_proto(p.qs, scale_bits))


def continuation_bytes(c: Continuation, scale_bits: int) -> int:
    return continuation_message(c, scale_bits).ByteSize()


def payload_bytes(qs: Sequence[EncodedQ] | None, scale_bits: int) -> int:
    """The bytes of a draft's q on the wire."""
    return qpayload.to_proto(qs, scale_bits).ByteSize()


class RemoteSession:
    """The verifier's side of one generation (module docstring). `link`: the loop's EdgeLink."""

    def __init__(self, link, spec, settings: SamplingSettings, pairing: Pairing, prompt: PromptPlan,
                 stats: GenerationStats):
        self.verifier, self.max_replays = link.verifier, link.transport.max_replays
        self.spec, self.settings, self.pairing, self.prompt, self.st = spec, settings, pairing, prompt, stats
        self.prompt_ids = list(prompt.ids)
        self.session_id, self.last_round = "", 0
        self.budget: tuple[int, int] | None = None   # the verifier's last draft budget
        self.replays_in_a_row, self.replayed_at = 0, -1   # for max_replays (replay_after)
        # Rounds after the first on one VerifyStream call when the verifier offers it (edge_client.stream).
        info = self.verifier.known_info() if self.verifier is not None else None
        self.stream = RoundStream(self.verifier.stub, self.verifier.metadata, link.transport.deadline_s) \
            if info is not None and info.verify_stream and link.transport.stream else None

    @property
    def opened(self) -> bool:
        return bool(self.session_id)

    def send(self, round_: int, continuations: list[Continuation], base_len: int, pipelined: bool,
             fused: Sequence[Continuation] = ()) -> tuple[asyncio.Future, int, int]:
        """Send a round (retried like any round: a lost reply is answered from the verifier's cache):
        (the future of its Reply, the request's bytes, its draft nodes). Each continuation is keyed by
        what it assumes beyond the first `base_len` committed tokens; a round not `pipelined` travels
        as its own draft (`continuations[0]`, keyed by nothing), with `fused` for its own pass."""
        own = continuations[0].prep
        req = self.request(own, round_, own.base[base_len:] if pipelined else ())
        bits = self.spec.qmode.scale_bits
        for c in continuations[1:]:
            req.continuations.append(continuation_message(Continuation(c.prep.base[base_len:], c.prep), bits))
        req.next_continuations.extend(continuation_message(c, bits) for c in fused)
        nodes = sum(len(c.prep.tree) for c in continuations) + sum(len(c.prep.tree) for c in fused)
        return asyncio.ensure_future(self._round(req)), req.ByteSize(), nodes

    async def _round(self, req: pb.VerifyRequest) -> Reply:
        if not req.session_id:
            if self.st.replays and self.settings.coupling != REJECTION:
                # A replay may reach another verifier than the one negotiated with (a restart, a replica
                # move): its ServerInfo is asked again before the open (Verifier.verify refuses one that
                # does not list the coupling). One call per replay, with a coupling other than the default.
                self.verifier.forget_limits()
            reply = await self.verifier.open_round(req, self.st)
        elif self.stream is None:
            reply = await self.verifier.verify(req, self.st)
        else:
            self.stream.follow(self.verifier.stub)   # the replica the session was (re)opened on
            reply = await verify_on_stream(self.verifier, self.stream, req, self.st)
        return Reply.read(reply)

    def request(self, prep: Prepared, round_: int, assumed: Sequence[int] = ()) -> pb.VerifyRequest:
        """The VerifyRequest of a round's own draft (keyed by `assumed`; the first also opens the session)."""
        req = pb.VerifyRequest(session_id=self.session_id, round=round_, committed_length=len(prep.base),
                               draft_token_ids=prep.tree.tokens, draft_parents=prep.wire_parents(),
                               q=qpayload.to_proto(prep.qs, self.spec.qmode.scale_bits), assumed_tokens=list(assumed))
        if self.session_id:
            return req
        req.open.CopyFrom(pb.OpenSession(
            prompt_token_ids=self.prompt_ids, resume_token_ids=prep.base[len(self.prompt_ids):],
            sampling=sampling_proto(self.settings), tokenizer_fingerprint=self.pairing.drafter.fingerprint or "",
            open_key=os.urandom(OPEN_KEY_BYTES), draft_tokenizer_fingerprint=self.pairing.draft_fingerprint))
        if self.spec.slo_tpot_ms or self.spec.slo_ttft_ms:
            req.open.slo.CopyFrom(pb.SessionSlo(tpot_ms=self.spec.slo_tpot_ms, ttft_ms=self.spec.slo_ttft_ms))
        if not self.prompt_ids and self.prompt.text_open is not None:
            req.open.MergeFrom(self.prompt.text_open)   # committed_length counts what follows the prompt
        return req

    def committed(self, reply: Reply, committed_length: int) -> None:
        """A reply's tokens were committed: the edge now holds `committed_length` tokens, as the verifier must."""
        if reply.committed_length != committed_length:
            raise bad_reply(f"server committed {reply.committed_length} tokens, the edge {committed_length}")
        self.session_id, self.last_round = reply.session_id, reply.round
        if reply.budget is not None:
            self.budget = reply.budget

    def replay_after(self, e: EdgeError, committed_length: int) -> bool:
        """Whether to replay the committed tokens in a new session: the verifier lost ours (NOT_FOUND:
        a restart, an eviction, a draining verifier's "moved") or is out of step with it
        (FAILED_PRECONDITION). A first round (it carries `open`) answered NOT_FOUND opened a session
        that was evicted before its round ran: it is sent again, as a replay; FAILED_PRECONDITION
        there is a refusal (e.g. the tokenizer) that replaying cannot fix. The replay is the next
        round with `open`: the prompt, the committed tokens and that round's draft, nothing more.
        `max_replays` bounds replays in a row with nothing committed between them (a verifier that
        keeps losing the session), not a long generation's restarts and drains."""
        lost = e.code == grpc.StatusCode.NOT_FOUND or (
            e.code == grpc.StatusCode.FAILED_PRECONDITION and bool(self.session_id))
        if committed_length != self.replayed_at:
            self.replays_in_a_row = 0   # the last replay got somewhere
        if not lost or self.replays_in_a_row >= self.max_replays:
            return False
        log.warning("replaying %d committed tokens: %s", committed_length - len(self.prompt_ids), e)
        self.st.replays += 1
        self.replays_in_a_row += 1
        self.replayed_at = committed_length
        self.session_id, self.last_round = "", 0
        if self.stream is not None:
            self.stream.reset()   # the new session's rounds go on a new call, to where it opens
        return True

    async def close(self, finished: bool) -> None:
        """Close the session if the generation stopped before it finished, then the stream."""
        try:
            # A finished session needs no Close: the server frees its KV cache when generation ends.
            # One left early (the caller stopped reading, was cancelled, or a round failed) is closed
            # now; shielded, so a cancelled caller still sends it.
            if self.session_id and not finished:
                await asyncio.shield(self.verifier.close_session(self.session_id))
        finally:
            if self.stream is not None:   # after the Close: ending the stream may wait for the verifier
                await self.stream.close()
