"""`Generation`, what EdgeClient.generate returns: the text of one generation as it is committed,
and its stats. Its rounds run in the session's round loop (edge_client.loop)."""
from __future__ import annotations

from typing import AsyncIterator, Protocol, Sequence

import grpc

from edge_client.crossvocab import Chat
from edge_client.loop import EdgeLink, RoundLoop
from edge_client.options import Speculation
from edge_client.pairing import Pairing, plan_prompt
from edge_client.stats import GenerationStats
from edge_client.transport import EdgeError
from spec_core.warping import SamplingSettings


class GenerationHost(EdgeLink, Protocol):
    """What a generation needs of its client before the first round, besides the loop's EdgeLink."""

    async def speculation_for(self, st: GenerationStats) -> Speculation: ...
    def coupling_refusal(self, coupling: str) -> str | None: ...
    async def pairing_for(self, st: GenerationStats) -> Pairing: ...
    def forget_server_limits(self) -> None: ...


class Generation:
    """Async iterator of text pieces as they are committed; `stats` is complete at the end,
    also when the caller stops early (`aclose()`, cancellation): then the verifier's session is
    closed, so it does not hold a KV cache until its idle TTL."""

    def __init__(self, client: GenerationHost, prompt: "str | Chat | Sequence[int]", settings: SamplingSettings):
        # The gumbel coupling: both ends read noise keyed by the seed; without one, one drawn here
        # (settings.seed says which) and kept for every round and replay of this generation.
        self._client, self._prompt, self.settings = client, prompt, settings.with_session_seed()
        self.prompt_ids = None if isinstance(prompt, (str, Chat)) else list(prompt)  # the target's, once known
        self.stats = GenerationStats(coupling=self.settings.coupling, seed=self.settings.seed)
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

    async def _negotiate(self) -> Speculation:
        """Before the first round: the speculation options within the verifier's limits (asked once
        per channel), and a refusal of a coupling the verifier does not offer."""
        spec = await self._client.speculation_for(self.stats)
        refusal = self._client.coupling_refusal(self.settings.coupling)
        if refusal:
            raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        return spec

    async def _run(self) -> AsyncIterator[str]:
        client = self._client
        spec = await self._negotiate()
        pairing = await client.pairing_for(self.stats)   # decided once per client, before its first round
        plan = await plan_prompt(pairing, self._prompt, client.run_drafting)
        loop = RoundLoop(client, spec, plan.ids, self.settings, self.stats, pairing, plan)
        try:
            while not loop.finished:
                piece = await loop.step()
                if piece:
                    yield piece
        except EdgeError as e:
            if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after_s is None:
                self._client.forget_server_limits()  # a verifier restarted with other limits: ask again
            raise
        finally:
            self.prompt_ids = loop.prompt_ids or self.prompt_ids   # a text open's: from the verifier
            await loop.close()
