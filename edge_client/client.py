"""The Python API an app calls: EdgeClient, and the generations it runs.

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

The parts: `transport` (the Verifier's calls: channel, token, retries, limits; EdgeError),
`pairing` (same tokenizer or across vocabularies, decided once before the first round), `session`
(Generation), `loop` (the round loop it runs: one commit, a window of rounds in flight), `stats` (GenerationStats, RoundEvent), `protocols` (the
interfaces it works against).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Callable, Sequence

import grpc

from edge_client.crossvocab import Chat
from edge_client.drafters import Drafter
from edge_client.options import EdgeOptions, Speculation, Transport, refuse_drafter_conflicts
from edge_client.pairing import Pairing, pair
from edge_client.protocols import Tokenizer
from edge_client.session import Generation
from edge_client.stats import CloudOnlyStats, GenerationStats, RoundEvent
from edge_client.transport import (_SERVER_LIMITS, EdgeError, Verifier, auth_metadata, open_channel, sampling_proto,
                                   stream_cloud_only)
from spec_core import clock
from spec_core.proto import verifier_pb2 as pb
from spec_core.proto import verifier_pb2_grpc as pb_grpc
from spec_core.warping import SamplingSettings

# What other modules and tests import from here.
__all__ = ["CloudOnlyStats", "EdgeClient", "EdgeError", "Generation", "GenerationStats", "RoundEvent", "Tokenizer",
           "_SERVER_LIMITS", "auth_metadata", "open_channel", "sampling_proto", "stream_cloud_only"]


class EdgeClient:
    """Generations against one verifier. `options`: EdgeOptions (or just the verifier's address);
    `channel`: share an open channel instead of opening one; `draft_executor`: where drafting runs
    (a server: one worker serialises the sessions' drafting); `on_round`: called with each
    committed round (metrics).

    `drafter`, `tokenizer` and `hidden_ids` are what generations use: from the first generation on,
    the pairing's (a CrossVocabDrafter and the target's text when the tokenizers differ)."""

    def __init__(self, options: EdgeOptions | str, drafter: Drafter, tokenizer: Tokenizer, *,
                 channel: grpc.aio.Channel | None = None, draft_executor: Executor | None = None,
                 on_round: Callable[[RoundEvent], None] | None = None):
        self.options = EdgeOptions(Transport(options)) if isinstance(options, str) else options
        self.transport, self.speculation = self.options.transport, self.options.speculation
        self.drafter, self.tokenizer = drafter, tokenizer
        self.verifier = Verifier(self.transport, self.options.security, channel)
        self.token = self.verifier.token
        self.draft_executor = draft_executor
        self.on_round = on_round
        # OptionConflict (a ValueError), before any round; a planned tree is a chain for a chain drafter
        self.speculation = refuse_drafter_conflicts(self.speculation, drafter)
        self._pairing: Pairing | None = None   # decided at the first generation, before its first round
        self._pairing_lock = asyncio.Lock()
        # Special tokens (EOS, <|im_end|>) end generation; they are not printed.
        self.hidden_ids = tokenizer.eog_ids

    # The verifier's stub and channel, under the names callers (tests, benchmarks) have used.
    @property
    def _stub(self) -> pb_grpc.VerifierStub:
        return self.verifier.stub

    @_stub.setter
    def _stub(self, stub) -> None:
        self.verifier.stub = stub

    @property
    def _channel(self) -> grpc.aio.Channel | None:
        return self.verifier.channel

    async def __aenter__(self) -> "EdgeClient":
        await self.verifier.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.verifier.aclose()

    def generate(self, prompt: "str | Chat | Sequence[int]", settings: SamplingSettings) -> Generation:
        """`prompt`: text, a conversation (edge_client.crossvocab.Chat: the model's chat template), or
        the TARGET's token ids."""
        return Generation(self, prompt, settings)

    def generate_cloud_only(self, prompt: "str | Chat | Sequence[int]",
                            settings: SamplingSettings) -> "CloudOnlyGeneration":
        """The verifier's own sampling of `prompt` (its Generate stream), as text pieces: the
        reference a generation with coupling "gumbel" equals at the same seed (edge_client.cloudonly)."""
        from edge_client.cloudonly import CloudOnlyGeneration
        return CloudOnlyGeneration(self, prompt, settings)

    async def server_info(self) -> pb.ServerInfo:
        return await self.verifier.server_info()

    # --- before a generation's first round ----------------------------------------------------------

    async def speculation_for(self, st: GenerationStats) -> Speculation:
        """The speculation options within the verifier's limits (asked once per channel)."""
        return self.speculation.within(await self.verifier.limits(st))

    def coupling_refusal(self, coupling: str) -> str | None:
        """Why the verifier (its limits, asked by speculation_for) cannot check drafts with `coupling`."""
        limits = _SERVER_LIMITS.get(self.verifier.channel)
        return None if limits is None else limits.coupling_refusal(coupling)

    def forget_server_limits(self) -> None:
        self.verifier.forget_limits()

    async def pairing_for(self, st: GenerationStats) -> Pairing:
        """Same tokenizer or across vocabularies (edge_client.pairing): decided once, at the first
        generation (after the verifier's limits were asked, which brings its tokenizer's fingerprint);
        a refusal is raised to that generation and the next one asks again."""
        if self._pairing is None:
            async with self._pairing_lock:   # generations started together pair once
                if self._pairing is None:
                    pairing = await pair(self.drafter, self.tokenizer, self.speculation, self.verifier, st,
                                         self.run_drafting)
                    self.drafter, self.tokenizer, self.hidden_ids = pairing.drafter, pairing.tokenizer, \
                        pairing.hidden_ids
                    self._pairing = pairing
        return self._pairing

    async def run_drafting(self, fn, *args, thread: bool = False):
        """Run drafting work in the drafting executor when there is one (a server: one worker
        serialises the sessions' drafting); else inline, or in a thread for work that overlaps a
        round trip. On a virtual clock (spec_core.clock) always inline, its charged time waited out (as
        it is charged, for work that overlaps a round trip)."""
        if clock.inline():
            return await clock.run_inline(fn, *args, stepped=thread)
        if self.draft_executor is not None:
            return await asyncio.get_running_loop().run_in_executor(self.draft_executor, fn, *args)
        if thread:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)
