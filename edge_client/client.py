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

The parts: `transport` (channel, token, retries, EdgeError), `session` (the session loop and
Generation), `stats` (GenerationStats, RoundEvent), `protocols` (the interfaces it works against).
"""
from __future__ import annotations

import asyncio
import logging
import random
from concurrent.futures import Executor
from typing import Awaitable, Callable, Sequence

import grpc

from edge_client import crossvocab
from edge_client.crossvocab import Chat, PromptPlan
from edge_client.drafters import Drafter
from edge_client.options import EdgeOptions, ServerLimits, Speculation, Transport
from edge_client.protocols import Tokenizer
from edge_client.session import Generation
from edge_client.stats import CloudOnlyStats, GenerationStats, RoundEvent
from edge_client.transport import (_SERVER_INFOS, _SERVER_LIMITS, GRPC_FRAME_BYTES, RETRYABLE, EdgeError, auth_metadata,
                                   open_channel, retry_after_s, sampling_proto, stream_cloud_only)
from spec_core.proto import verifier_pb2 as pb
from spec_core.proto import verifier_pb2_grpc as pb_grpc
from spec_core.warping import SamplingSettings

log = logging.getLogger(__name__)

# What other modules and tests import from here.
__all__ = ["CloudOnlyStats", "EdgeClient", "EdgeError", "Generation", "GenerationStats", "RoundEvent", "Tokenizer",
           "auth_metadata", "open_channel", "sampling_proto", "stream_cloud_only"]


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
