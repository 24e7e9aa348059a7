"""Drafting while the round is in flight: --proactive (reuse the draft when the guess comes true) and
--pipeline (send the next round before the reply; the server verifies it only on a committed base).

Nothing committed is lost or doubled when a speculative round is dropped, retried, answered out of
order, or arrives after a verifier restart: greedy outputs equal the target's own, token for token.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from cloud_verifier.backends.synthetic import SyntheticBackend
from edge_client import EdgeClient
from edge_client.drafters import GGUFDrafter, SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from helpers import edge_options, running_server, stub_for
from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import SamplingSettings
from test_e2e_grpc import PROMPTS, check_same_or_near_tie, target_greedy
from test_faults import VOCAB, LosingReplies, generate_across_a_restart, synthetic_greedy

N = 60


def synthetic_client(port, noise=0.3, **kw):
    return EdgeClient(edge_options(f"127.0.0.1:{port}", **kw), SyntheticDrafter(VOCAB, noise=noise),
                      SyntheticTokenizer(VOCAB))


@pytest.mark.parametrize("mode", [{"proactive": True}, {"pipeline": True},
                                  {"pipeline": True, "tree": "budget=8,depth=3,branching=2,width=2"}],
                         ids=["proactive", "pipeline", "pipeline-tree"])
async def test_greedy_synthetic_equals_target_and_reuses_work(mode):
    # A 10 ms verifier pass: the draft made during the round trip is ready before the reply.
    async with running_server(SyntheticBackend(vocab=VOCAB, step_ms=10)) as server:
        async with synthetic_client(server.port, noise=0.3, gamma=3, **mode) as c:
            gen = c.generate("5 6 7", SamplingSettings(temperature=0.0, max_new_tokens=N, ignore_eos=True))
            await gen.text()
    st = gen.stats
    assert st.token_ids == synthetic_greedy([0, 5, 6, 7], N)
    if mode.get("pipeline"):
        assert st.pipelined_rounds > 0, st
    else:
        assert st.reused_drafts > 0, st
    assert st.tokens == N


@pytest.mark.parametrize("mode", [{"proactive": True}, {"pipeline": True},
                                  {"pipeline": True, "tree": "budget=8,depth=4,branching=2,width=2"}],
                         ids=["proactive", "pipeline", "pipeline-tree"])
@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_gguf_hybrid_with_rounds_in_flight_equals_target(tiny_models, mode, prompt):
    n = 40
    backend = LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1, max_tree_leaves=16)
    drafter = GGUFDrafter(str(tiny_models["draft"]), n_threads=1, n_ctx=512, max_tree_nodes=16)
    try:
        async with running_server(backend) as server:
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=4, qmode="none", **mode),
                                  drafter, drafter.model) as c:
                gen = c.generate(prompt, SamplingSettings(temperature=0.0, max_new_tokens=n, ignore_eos=True))
                await gen.text()
            ids = drafter.model.tokenize(prompt)
            reference = await target_greedy(server, ids, n)
    finally:
        drafter.close()
        backend.close()
    st = gen.stats
    assert st.tokens == n
    # Continuations are drafted for the outcomes the draft ranks first; with these tiny random models
    # (α ≈ 0.4) those are rejections whose corrected token the draft often misjudges, so a hit is not
    # certain in 40 tokens: drafting ahead is.
    assert st.continuation_rounds + st.pipelined_rounds + st.discarded_rounds > 0, "nothing was drafted ahead"
    check_same_or_near_tie(str(tiny_models["target"]), ids, st.token_ids, reference)


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_gguf_default_edge_equals_cloud_only(tiny_models, prompt):
    """The default edge (every shape the planner's) on llama.cpp: greedy output is the target's own
    (the verifier's cloud-only stream), up to near-ties."""
    n = 40
    backend = LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1, max_tree_leaves=16)
    drafter = GGUFDrafter(str(tiny_models["draft"]), n_threads=1, n_ctx=512, max_tree_nodes=64)
    try:
        async with running_server(backend) as server:
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", plan="auto"), drafter, drafter.model) as c:
                gen = c.generate(prompt, SamplingSettings(temperature=0.0, max_new_tokens=n, ignore_eos=True))
                await gen.text()
            ids = drafter.model.tokenize(prompt)
            reference = await target_greedy(server, ids, n)
    finally:
        drafter.close()
        backend.close()
    st = gen.stats
    assert st.tokens == n and st.planned and sum(st.shapes.values()) >= st.rounds - st.fused_hits   # rounds sent
    check_same_or_near_tie(str(tiny_models["target"]), ids, st.token_ids, reference)


async def test_sampled_pipeline_commits_every_token_once():
    """T = 1 with lost replies (retried, pipelined rounds too) and pipelining: the count adds up,
    nothing doubled. A 10 ms verifier pass lets the next round leave before the reply."""
    async with running_server(SyntheticBackend(vocab=VOCAB, step_ms=10)) as server:
        async with synthetic_client(server.port, noise=0.3, gamma=3, pipeline=True, stream=False) as c:
            c._stub = LosingReplies(c._stub, every=4)
            gen = c.generate("5 6 7", SamplingSettings(temperature=1.0, max_new_tokens=N, ignore_eos=True, seed=2))
            await gen.text()
    st = gen.stats
    assert st.tokens == N == len(st.token_ids) and c._stub.lost > 0
    assert st.pipelined_rounds + st.discarded_rounds > 0, "no round left before its predecessor's reply"
    assert st.tokens == st.rounds + st.accepted  # every applied round adds accepted + 1


async def test_restart_with_rounds_in_flight_keeps_greedy_output():
    st = await generate_across_a_restart(
        lambda port: synthetic_client(port, noise=0.3, gamma=3, pipeline=True, deadline_s=10),
        SamplingSettings(temperature=0.0, max_new_tokens=N, ignore_eos=True))
    assert st.replays >= 1
    assert st.token_ids == synthetic_greedy([0, 5, 6, 7], N)


# --- the server's side of a pipelined round -----------------------------------------------------

def open_round(drafts=()):
    return pb.VerifyRequest(round=1, committed_length=4, draft_token_ids=list(drafts), open=pb.OpenSession(
        prompt_token_ids=[0, 5, 6, 7], open_key=b"p" * 16,
        sampling=pb.SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True)))


async def test_pipelined_round_waits_for_its_predecessor_and_checks_the_base():
    g = synthetic_greedy([0, 5, 6, 7], 8)
    async with running_server(SyntheticBackend(vocab=VOCAB, step_ms=20)) as server:
        async with stub_for(server) as stub:
            first = await stub.Verify(open_round(), timeout=5)  # commits g[0]
            sid = first.session_id
            # Round 2 (drafts g[1], g[2]; greedy keeps both + g[3]); round 3 assumes exactly that.
            r2 = pb.VerifyRequest(session_id=sid, round=2, committed_length=5, draft_token_ids=g[1:3])
            r3 = pb.VerifyRequest(session_id=sid, round=3, committed_length=8, draft_token_ids=[g[4]],
                                  assumed_tokens=g[1:4])
            t3 = asyncio.ensure_future(stub.Verify(r3, timeout=5))  # sent first: it must wait for round 2
            await asyncio.sleep(0.05)
            a2 = await stub.Verify(r2, timeout=5)
            a3 = await t3
            assert (a2.num_accepted, a2.next_token_id, a2.committed_length) == (2, g[3], 8)
            assert not a3.base_mismatch and a3.num_accepted == 1 and a3.committed_length == 10
            assert await stub.Verify(r3, timeout=5) == a3  # a retry is answered from the cache
            # Round 4 assumes a wrong base: answered, not verified, nothing committed, round 4 stays free;
            # its retry gets the same answer.
            bad = pb.VerifyRequest(session_id=sid, round=4, committed_length=11, draft_token_ids=[3],
                                   assumed_tokens=[g[6] + 1])
            m1 = await stub.Verify(bad, timeout=5)
            m2 = await stub.Verify(bad, timeout=5)
            assert m1.base_mismatch and m2 == m1 and m1.committed_length == 10 and m1.num_accepted == 0
            ok = await stub.Verify(pb.VerifyRequest(session_id=sid, round=4, committed_length=10), timeout=5)
            assert ok.committed_length == 11 and ok.next_token_id == g[6]
            # A speculative round that arrives after the fresh round took its number is refused, not applied.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(bad, timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_pipelined_round_for_an_unknown_session_is_not_found():
    async with running_server(SyntheticBackend(vocab=VOCAB)) as server:
        async with stub_for(server) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(pb.VerifyRequest(session_id="gone", round=3, committed_length=8,
                                                   assumed_tokens=[1, 2]), timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("assumed, message", [([2] * 28, "at most (max_window - 1) x (max_gamma + 1) = 27"),
                                              ([3, 999], "assumed_tokens[1] = 999 is outside the vocabulary")])
async def test_bad_assumed_tokens_are_refused(assumed, message):
    async with running_server(SyntheticBackend(vocab=VOCAB), max_gamma=8) as server:
        async with stub_for(server) as stub:
            first = await stub.Verify(open_round(), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(pb.VerifyRequest(session_id=first.session_id, round=3, committed_length=7,
                                                   assumed_tokens=assumed), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
            ok = await stub.Verify(pb.VerifyRequest(session_id=first.session_id, round=2, committed_length=5),
                                   timeout=5)
            assert ok.committed_length == 6  # the session goes on
