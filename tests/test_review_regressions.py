"""Regressions found in review: seeds, cancellation, orphan sessions, the context's end, open keys."""
from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
from scipy.stats import chisquare

from cloud_verifier.backends.synthetic import SyntheticBackend
from edge_client import EdgeClient
from edge_client.drafters import SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from helpers import edge_options, running_server, stub_for
from hybridspec.testing import exactness
from spec_core.proto import verifier_pb2 as pb
from spec_core.synthetic import synthetic_fingerprint
from spec_core.warping import SamplingSettings
from chain_round import chain_round


def first_tokens_with_user_seeds(edge_rng, verifier_rng, n=20_000):
    """One γ = 1 round per user seed 0..n-1 with the q of Leviathan-style worst cases: the draft
    prefers what the target does not."""
    from spec_core.qcodec import encode_float

    target = np.array([0.5, 0.3, 0.15, 0.05])
    draft = np.array([0.1, 0.2, 0.3, 0.4])
    counts = np.zeros(4)
    for seed in range(n):
        q = encode_float(draft)
        x = q.sample(edge_rng(seed))
        res = chain_round(np.stack([target, target]), [x], [q], verifier_rng(seed))
        counts[x if res.num_accepted else res.next_token] += 1
    return counts, target * n


def test_same_user_seed_on_both_ends_keeps_the_output_exact():
    """Edge and verifier get the same user seed; their streams (spec_core.warping.seeded_rng) must
    be independent. N = 20000 seeds, chi-square p > 1e-4; the negative control (one shared stream,
    the bug this guards against) must fail the same test."""
    from spec_core.warping import EDGE_STREAM, VERIFIER_STREAM, seeded_rng
    obs, exp = first_tokens_with_user_seeds(lambda s: seeded_rng(s, EDGE_STREAM),
                                            lambda s: seeded_rng(s, VERIFIER_STREAM, 3))
    exactness.note_seed("seeds", "range(20000), streams EDGE and VERIFIER(3)")
    assert exactness.noted_p(chisquare(obs, exp).pvalue) > 1e-4, obs
    obs, exp = first_tokens_with_user_seeds(np.random.default_rng, np.random.default_rng)
    assert exactness.noted_p(chisquare(obs, exp).pvalue, "control") < 1e-4, obs


class WatchedBackend(SyntheticBackend):
    """Records any release of a state while a model call on it is still running."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.in_flight: dict[int, int] = {}
        self.violations = 0
        self.mu = threading.Lock()

    def target_logits(self, state, tokens, rows):
        with self.mu:
            self.in_flight[id(state)] = self.in_flight.get(id(state), 0) + 1
        try:
            return super().target_logits(state, tokens, rows)
        finally:
            with self.mu:
                self.in_flight[id(state)] -= 1

    def release(self, state):
        with self.mu:
            if self.in_flight.get(id(state), 0):
                self.violations += 1


def open_req(key: bytes, drafts=(), q=None, prompt=(0, 5, 6)):
    return pb.VerifyRequest(round=1, committed_length=len(prompt), draft_token_ids=list(drafts),
                            q=q or pb.QPayload(),
                            open=pb.OpenSession(prompt_token_ids=list(prompt), open_key=key,
                                                tokenizer_fingerprint=synthetic_fingerprint(64),
                                                sampling=pb.SamplingParams(temperature=1.0, max_new_tokens=20,
                                                                           ignore_eos=True)))


async def test_cancelled_calls_never_free_a_state_in_use():
    backend = WatchedBackend(step_ms=300)
    async with running_server(backend, max_sessions=1) as server:
        async with stub_for(server) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(pb.GenerateRequest(prompt_token_ids=[0, 5],
                                                                sampling=pb.SamplingParams(temperature=1)),
                                             timeout=0.05):
                    pass
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Verify(open_req(b"a" * 16), timeout=0.05)      # times out mid-round
            with pytest.raises(grpc.aio.AioRpcError) as e:                # its round still runs: no slot
                await stub.Verify(open_req(b"b" * 16), timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # The timed-out Generate call, then that round, run on (300 ms each): once they end, the
            # one place frees by evicting the first session. Polled, not slept: on a loaded machine
            # they end later, and a refusal before then is the same RESOURCE_EXHAUSTED.
            deadline = asyncio.get_running_loop().time() + 20
            while True:
                try:
                    ok = await stub.Verify(open_req(b"b" * 16), timeout=5)
                    break
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert asyncio.get_running_loop().time() < deadline, "the place was never freed"
                    await asyncio.sleep(0.1)
            assert ok.committed_length == 4
            await asyncio.sleep(0.7)
    assert backend.violations == 0


async def test_refused_first_round_leaves_no_session_behind():
    bad_q = pb.QPayload(format=pb.QPayload.FLOAT32, positions=[pb.DraftDist(token_ids=[3], probs=[float("nan")])])
    async with running_server(SyntheticBackend(), max_sessions=2) as server:
        async with stub_for(server) as stub:
            good = await stub.Verify(open_req(b"g" * 16), timeout=5)
            for k in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Verify(open_req(bytes([k]) * 16, drafts=[3], q=bad_q), timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(server.engine.sessions) == 1
            nxt = await stub.Verify(pb.VerifyRequest(session_id=good.session_id, round=2,
                                                     committed_length=good.committed_length), timeout=5)
            assert nxt.round == 2


async def test_generation_runs_to_the_end_of_the_context():
    async with running_server(SyntheticBackend(vocab=64, n_ctx=40)) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=6), SyntheticDrafter(64),
                              SyntheticTokenizer(64)) as c:
            gen = c.generate([0, 5, 6], SamplingSettings(temperature=1.0, max_new_tokens=100, ignore_eos=True,
                                                         seed=2))
            await gen.text()
    assert gen.stats.finish_reason == "context"
    assert len(gen.stats.token_ids) == 40 - 3


async def test_open_key_must_be_sixteen_bytes_and_not_reused_for_another_prompt():
    async with running_server(SyntheticBackend()) as server:
        async with stub_for(server) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(open_req(b"short"), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "16 random bytes" in e.value.details()
            await stub.Verify(open_req(b"k" * 16), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(open_req(b"k" * 16, prompt=(0, 9, 9)), timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "already used" in e.value.details()


async def test_a_generation_cancelled_mid_open_is_closed_before_the_client_exits():
    """A generation cancelled while its first round (the open) is still being verified: leaving
    the EdgeClient waits for the background Close, so the verifier does not keep the session (and
    its KV memory) until its TTL. Before, the channel closed first and the Close was lost."""
    backend = SyntheticBackend(vocab=16, step_ms=300)
    async with running_server(backend) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=2), SyntheticDrafter(16, noise=1.0),
                              SyntheticTokenizer(16)) as c:
            gen = c.generate([0, 3], SamplingSettings(temperature=0.0, max_new_tokens=50, ignore_eos=True))
            task = asyncio.ensure_future(gen.text())
            await asyncio.sleep(0.1)            # the open round is in the verifier's pass
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert len(server.engine.sessions) == 0


@pytest.mark.parametrize("options", [
    {"gamma": "adaptive", "max_gamma": 12},
    {"gamma": 8},
    {"gamma": 4, "tree": "budget=12,depth=5,branching=2,width=2"},
], ids=["adaptive", "fixed-above-the-limit", "tree-above-the-limits"])
async def test_the_edge_keeps_its_rounds_within_the_verifier_limits(options):
    """The edge reads the verifier's ServerInfo: against `--max-gamma 3` (and at most 6 tree nodes)
    adaptive γ (which starts at 4), a fixed γ of 8 and a 12-node tree used to be refused with
    RESOURCE_EXHAUSTED every round, failing the generation."""
    events = []
    async with running_server(SyntheticBackend(vocab=64), max_gamma=3, max_tree_nodes=6) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", **options), SyntheticDrafter(64, noise=1.0),
                              SyntheticTokenizer(64), on_round=events.append) as c:
            gen = c.generate([0, 5, 6], SamplingSettings(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=3))
            await gen.text()
    assert gen.stats.tokens == 40 and events
    assert max(e.gamma for e in events) <= 3  # chain length, or tree depth
    assert gen.stats.nodes_per_round <= 6
    if "tree" in options:
        assert gen.stats.tree_rounds > 0


async def test_limits_are_asked_again_after_a_refusal_for_them():
    """The limits are asked once per channel; a verifier restarted behind it with smaller ones
    (here: a stale answer) fails one generation, and the next asks again instead of failing too."""
    from edge_client.client import _SERVER_LIMITS, EdgeError
    from edge_client.options import ServerLimits
    async with running_server(SyntheticBackend(vocab=64), max_gamma=3) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=8), SyntheticDrafter(64, noise=1.0),
                              SyntheticTokenizer(64)) as c:
            _SERVER_LIMITS[c._channel] = ServerLimits(max_gamma=16)  # what the verifier said before its restart
            settings = SamplingSettings(temperature=0.0, max_new_tokens=20, ignore_eos=True)
            with pytest.raises(EdgeError) as e:
                await c.generate([0, 5, 6], settings).text()
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.retry_after_s is None
            gen = c.generate([0, 5, 6], settings)
            await gen.text()
    assert gen.stats.tokens == 20


async def test_a_first_round_answered_not_found_is_replayed():
    """The session a first round opened can be evicted before that round runs (a full server under
    load): the verifier answers NOT_FOUND to a request that carries `open`. The edge must open again
    (a replay), not fail; the text is the same as without the eviction. The control: a first round
    refused with FAILED_PRECONDITION (e.g. another tokenizer) is not retried."""
    from cloud_verifier.engine import RequestError

    async def run(fail_first_with):
        async with running_server(SyntheticBackend(), max_sessions=4) as server:
            engine, calls = server.engine, []
            real = engine.verify

            async def flaky(valid):   # engine.verify takes the round engine.validate passed
                calls.append(valid.req.HasField("open"))
                if fail_first_with is not None and len(calls) == 1:
                    raise RequestError(fail_first_with, "session was evicted: resend the round with `open`")
                return await real(valid)
            engine.verify = flaky
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=2), SyntheticDrafter(64),
                                  SyntheticTokenizer(64)) as client:
                gen = client.generate([0, 5, 7], SamplingSettings(temperature=0, max_new_tokens=12, ignore_eos=True))
                text = await gen.text()
            return gen.stats, calls

    clean, _ = await run(None)
    stats, calls = await run(grpc.StatusCode.NOT_FOUND)
    assert calls[:2] == [True, True] and stats.replays == 1
    assert stats.token_ids == clean.token_ids and len(stats.token_ids) == 12
    from edge_client.client import EdgeError
    with pytest.raises(EdgeError) as e:
        await run(grpc.StatusCode.FAILED_PRECONDITION)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
