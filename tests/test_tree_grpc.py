"""Tree rounds through real gRPC: bad trees get INVALID_ARGUMENT, kept_nodes, retries, context cuts,
and the llama.cpp backend's single-pass tree verification (greedy = the target's greedy path)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from cloud_verifier.backends.synthetic import SyntheticBackend
from helpers import running_server, stub_for
from spec_core.proto import verifier_pb2 as pb
from spec_core.synthetic import SyntheticLM
from test_bad_input import INVALID, PRECOND, VOCAB, expect, fixed_q, open_req


def tree_req(drafts, parents, **kw):
    req = open_req(drafts=drafts, **kw)
    req.draft_parents.extend(parents)
    return req


@pytest.fixture
async def stub():
    async with running_server(SyntheticBackend(vocab=VOCAB, n_ctx=64), max_gamma=4, max_tree_nodes=8,
                              max_tree_branching=3) as server:
        async with stub_for(server) as s:
            yield s


@pytest.mark.parametrize("req, message", [
    (tree_req((3, 4), (-1,)), "draft_parents has 1 entries but draft_token_ids has 2"),
    (tree_req((3, 4), (1, -1)), "draft_parents[0] = 1 is not before node 0"),   # a parent after its child
    (tree_req((3, 4), (-1, 1)), "draft_parents[1] = 1 is not before node 1"),   # a cycle (self-loop)
    (tree_req((3, 4), (-1, -5)), "use -1"),
    (tree_req((3, 40), (-1, 0)), "draft_token_ids[1] = 40 is outside the vocabulary"),
    (tree_req((3, 3), (-1, -1)), "siblings with the same token 3"),
    (tree_req(tuple(range(2, 11)), (-1,) + tuple(range(8))), "at most 8"),  # too many nodes
    (tree_req((3, 4, 5, 6), (-1, -1, -1, -1)), "more than 3 children"),
    (tree_req((3, 4, 5, 6, 7), (-1, 0, 1, 2, 3)), "depth 5; this server's limit is 4"),
    (tree_req((3, 4), (-1, -1), q=fixed_q([([3], [100])])), "1 positions but there are 2 draft tokens"),
], ids=lambda v: v if isinstance(v, str) else None)
async def test_bad_tree_gets_invalid_argument(stub, req, message):
    await expect(stub, req, INVALID, message)


async def test_server_info_states_tree_limits(stub):
    info = await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5)
    assert (info.max_tree_nodes, info.max_tree_branching, info.max_gamma) == (8, 3, 4)


def greedy_path(prompt, n):
    lm = SyntheticLM(VOCAB, 0)
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(int(np.argmax(lm.logits(ctx))))
    return ctx[len(prompt):]


async def test_greedy_tree_round_keeps_the_matching_branch(stub):
    prompt = (0, 5, 6)
    g = greedy_path(prompt, 3)
    wrong = [t for t in range(2, VOCAB) if t not in g][:3]
    # Branch A (wrong first token), branch B = the target's greedy path for two tokens, then a leaf.
    drafts = (wrong[0], wrong[1], g[0], g[1], wrong[2])
    parents = (-1, 0, -1, 2, 2)
    r = await stub.Verify(tree_req(drafts, parents, temperature=0.0), timeout=5)
    assert list(r.kept_nodes) == [2, 3] and r.num_accepted == 2 and r.next_token_id == g[2]
    assert r.committed_length == len(prompt) + 3
    # A retried tree round is answered from the cache; changing the parents is a different round.
    again = await stub.Verify(tree_req(drafts, parents, temperature=0.0), timeout=5)
    assert again == r
    req = pb.VerifyRequest(session_id=r.session_id, round=2, committed_length=r.committed_length,
                           draft_token_ids=[3, 4], draft_parents=[-1, -1])
    r2 = await stub.Verify(req, timeout=5)
    assert await stub.Verify(req, timeout=5) == r2
    changed = pb.VerifyRequest(session_id=r.session_id, round=2, committed_length=r.committed_length,
                               draft_token_ids=[3, 4], draft_parents=[-1, 0])
    await expect(stub, changed, PRECOND, "already verified with different drafts")


async def test_tree_that_does_not_fit_the_context_is_cut():
    prompt = tuple(range(2, 10))  # 8 tokens; n_ctx 10: room for 1 more draft and its next token
    async with running_server(SyntheticBackend(vocab=VOCAB, n_ctx=10), max_gamma=4) as server:
        async with stub_for(server) as stub:
            g = greedy_path(prompt, 2)
            other = next(t for t in range(2, VOCAB) if t != g[0])
            # Room for 1 node: node 2 (depth 2) goes with the deep cut, node 1 with the count cut.
            r = await stub.Verify(tree_req((g[0], other, 5), (-1, -1, 1), prompt=prompt, temperature=0.0), timeout=5)
            assert list(r.kept_nodes) == [0] and r.next_token_id == g[1] and r.committed_length == 10
            assert r.finish_reason == pb.CONTEXT


async def test_stop_token_inside_the_kept_path(stub):
    """The target's second greedy token is made a stop token: the kept path ends there, finished."""
    prompt = (0, 5, 6)
    g = greedy_path(prompt, 2)
    other = next(t for t in range(2, VOCAB) if t not in g)
    req = tree_req((g[0], g[1], other, other), (-1, 0, 1, -1), temperature=0.0)
    req.open.sampling.stop_token_ids.append(g[1])
    r = await stub.Verify(req, timeout=5)
    assert list(r.kept_nodes) == [0, 1] and r.num_accepted == 2 and r.finish_reason == pb.STOP
    assert not r.HasField("next_token_id") and r.committed_length == len(prompt) + 2


async def test_chains_only_backend_refuses_trees():
    backend = SyntheticBackend(vocab=VOCAB)
    backend.caps = dataclasses.replace(backend.caps, trees=False)
    async with running_server(backend) as server:
        async with stub_for(server) as stub:
            await expect(stub, tree_req((3, 4), (-1, -1)), INVALID, "verifies chains only")
            info = await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5)
            assert info.max_tree_nodes == 0


async def test_llama_cpp_tree_round_follows_the_target_greedy(tiny_models):
    """One pass for the tree on llama.cpp; the kept branch is the target's greedy path, and the next
    round (a chain, on the cache the tree round left) continues it."""
    backend = LlamaCppBackend(str(tiny_models["target"]), n_ctx=128, n_threads=1, max_tree_leaves=8)
    prompt = [1, 17, 42, 99, 7]
    async with running_server(backend) as server:
        async with stub_for(server) as stub:
            gen = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
                temperature=0, max_new_tokens=6, ignore_eos=True))
            ref = [t async for c in stub.Generate(gen, timeout=60) for t in c.token_ids]
            wrong = [t for t in range(3, 50) if t not in ref][:3]
            drafts = (wrong[0], ref[0], wrong[1], ref[1], ref[2], wrong[2])
            parents = (-1, -1, 1, 1, 3, 3)
            req = pb.VerifyRequest(round=1, committed_length=len(prompt), draft_token_ids=drafts,
                                   draft_parents=parents, open=pb.OpenSession(
                                       prompt_token_ids=prompt, open_key=b"t" * 16,
                                       sampling=pb.SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)))
            r = await stub.Verify(req, timeout=60)
            assert list(r.kept_nodes) == [1, 3, 4] and r.next_token_id == ref[3]
            r2 = await stub.Verify(pb.VerifyRequest(session_id=r.session_id, round=2, committed_length=r.committed_length,
                                                    draft_token_ids=[ref[4]]), timeout=60)
            assert r2.num_accepted == 1 and r2.next_token_id == ref[5]
    backend.close()
