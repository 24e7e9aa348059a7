"""Faults: lost replies are retried idempotently; a restarted verifier is survived by replay.
Nothing committed is lost or duplicated: the greedy output equals the target's own, token for token."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from cloud_verifier.backends.synthetic import SyntheticBackend
from cloud_verifier.engine import Limits
from cloud_verifier.server import VerifierServer
from edge_client import EdgeClient
from edge_client.drafters import GGUFDrafter, SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from helpers import edge_options
from spec_core.synthetic import SyntheticLM
from spec_core.warping import SamplingSettings

VOCAB, N = 48, 60


def synthetic_greedy(prompt, n):
    lm = SyntheticLM(VOCAB, 0)
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(lm.logits(seq))))
    return seq[len(prompt):]


class LosingReplies:
    """Wraps the stub: every `every`-th Verify reaches the server but its reply is 'lost'."""

    def __init__(self, stub, every=3):
        self._stub, self.every, self.calls, self.lost = stub, every, 0, 0

    async def Verify(self, req, **kw):
        reply = await self._stub.Verify(req, **kw)
        self.calls += 1
        if self.calls % self.every == 0:
            self.lost += 1
            raise _unavailable()
        return reply

    def __getattr__(self, name):
        return getattr(self._stub, name)


def _unavailable():
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="reply lost (injected)")


# plan "auto": the default edge, every round's shape the planner's (rounds in flight included)
SHAPES = {"off": dict(gamma=4), "auto": dict(plan="auto")}


@pytest.mark.parametrize("plan", ["off", "auto"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_lost_replies_are_retried_without_double_commit(temperature, plan):
    backend = SyntheticBackend(vocab=VOCAB)
    async with VerifierServer(backend, "127.0.0.1", 0, Limits()) as server:
        # stream=False: the faults are injected into unary Verify (the stream's own: tests/test_window.py)
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", stream=False, **SHAPES[plan]),
                              SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB)) as c:
            c._stub = LosingReplies(c._stub)
            gen = c.generate("5 6 7", SamplingSettings(temperature=temperature, max_new_tokens=N, ignore_eos=True,
                                                       seed=3))
            await gen.text()
    st = gen.stats
    assert c._stub.lost >= 3 and st.retries == c._stub.lost and st.replays == 0
    assert st.tokens == N
    if temperature == 0.0:
        assert st.token_ids == synthetic_greedy([0, 5, 6, 7], N)


async def generate_across_a_restart(client_for, settings: SamplingSettings):
    """Generate "5 6 7" on a synthetic verifier (15 ms per pass) that dies after the session's
    4th round (sessions gone) and comes back on the same port; returns the generation's stats.
    client_for(port) makes the EdgeClient."""
    server = await VerifierServer(SyntheticBackend(vocab=VOCAB, step_ms=15), "127.0.0.1", 0, Limits(),
                                  grace_s=0).start()
    port = server.port
    async with client_for(port) as c:
        gen = c.generate("5 6 7", settings)
        task = asyncio.create_task(gen.text())
        while not any(s.round >= 4 for s in server.engine.sessions.sessions()):
            await asyncio.sleep(0.005)
        await server.stop()                       # the verifier dies mid-generation, sessions gone
        await asyncio.sleep(0.2)
        server = await VerifierServer(SyntheticBackend(vocab=VOCAB, step_ms=15), "127.0.0.1", port, Limits()).start()
        try:
            await asyncio.wait_for(task, 60)
        finally:
            await server.stop()
    return gen.stats


@pytest.mark.parametrize("plan", ["off", "auto"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_verifier_restart_is_survived_by_replay(temperature, plan):
    st = await generate_across_a_restart(
        lambda port: EdgeClient(edge_options(f"127.0.0.1:{port}", deadline_s=10,
                                             **({"gamma": 3} if plan == "off" else {"plan": "auto"})),
                                SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB)),
        SamplingSettings(temperature=temperature, max_new_tokens=N, ignore_eos=True, seed=4))
    assert st.replays >= 1
    assert st.tokens == N == len(st.token_ids)
    if temperature == 0.0:
        assert st.token_ids == synthetic_greedy([0, 5, 6, 7], N)


async def test_restart_with_real_gguf_target_keeps_greedy_output(tiny_models):
    """The same on llama.cpp: a fresh verifier re-prefills prompt + committed tokens and goes on."""
    drafter = GGUFDrafter(str(tiny_models["draft"]), n_threads=1, n_ctx=512)
    make = lambda: LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1)  # noqa: E731
    settings = SamplingSettings(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    async with VerifierServer(make(), "127.0.0.1", 0, Limits()) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=4), drafter, drafter.model) as c:
            reference = c.generate("hello world", settings)
            await reference.text()
    server = await VerifierServer(make(), "127.0.0.1", 0, Limits(), grace_s=0).start()
    port = server.port
    rounds = 0

    original = drafter.propose

    def propose(*a, **kw):
        nonlocal rounds
        rounds += 1
        return original(*a, **kw)
    drafter.propose = propose
    try:
        async with EdgeClient(edge_options(f"127.0.0.1:{port}", gamma=4, deadline_s=10), drafter, drafter.model) as c:
            gen = c.generate("hello world", settings)
            it = gen.__aiter__()
            await it.__anext__()
            while rounds < 3:
                await it.__anext__()
            await server.stop()
            server = await VerifierServer(make(), "127.0.0.1", port, Limits()).start()
            async for _ in it:
                pass
    finally:
        await server.stop()
        drafter.close()
    assert gen.stats.replays == 1
    assert gen.stats.token_ids == reference.stats.token_ids
