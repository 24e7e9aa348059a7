"""Fused continuations (spec_core.continuations.fuse_tree): round r + 1 verified in round r's pass.

Statistics, as in tests/test_continuations.py (and tests/test_exactness_stats.py): the synthetic
target over V = 5 tokens (order 1, exact probabilities) and its blurred draft; N = 6000 sequences
of L = 3 tokens per setting from the prompt [0], against the exact probabilities of all 125
sequences by a chi-square test (cells with expected count < 5 pooled); a setting passes if
p > 1e-4. Seeds are fixed, so each test is deterministic. Each sequence: round r (a chain of 2
drafts, or a tree of 4 nodes), and before it is verified continuations (chains of 2, or trees)
drafted after up to K = 6 of its outcomes (tests/test_continuations.py's choice of outcomes); the
backend's one entry (`Backend.verify_round` with continuations) verifies round r and, when round
r commits a key, that continuation, in one pass; then plain rounds to L. The verifier's uniforms
come from their own generator, never the edge's.

Negative controls, each must fail at the same N: (1) a continuation run on the rows of another
key of the same length (rows computed after a key other than what committed), its tokens
committed after what really committed; (2) a continuation that reuses round r's uniforms.
"""
from __future__ import annotations

import copy
import dataclasses
import threading

import numpy as np
import pytest

import cloud_verifier.backends.base as backend_base
from cloud_verifier.backends.base import FusedContinuation
from cloud_verifier.backends.synthetic import SyntheticBackend
from helpers import HeldPasses
from spec_core.continuations import Placement, fuse_tree, key_parent
from spec_core.synthetic import synthetic_pair
from spec_core.tree import ROOT, DraftTree
from spec_core.verify import RoundResult, commit_round
from spec_core.warping import SamplingSettings
from test_continuations import FIXED, FLOAT, _draft, _outcomes, _verify
from hybridspec.testing import exactness
from test_exactness_stats import L, N, P_MIN, V, chi_square_p, exact_sequence_probs

# --- literal cases ----------------------------------------------------------------------------


def test_keys_are_placed_after_the_outcome_they_assume():
    chain = DraftTree.chain([3, 4])              # round r: drafts 3, 4
    keys = [(5,), (3, 6), (3, 4, 7), (3, 4), (9, 9)]   # reject at 0; at 1; bonus; 4 is a child; no such path
    conts = [DraftTree.chain([8]), DraftTree.chain([8, 8]), DraftTree((1, 2), (ROOT, ROOT)),
             DraftTree.chain([1]), DraftTree.chain([1])]
    fused = fuse_tree(chain, keys, conts)
    assert fused.placements == (Placement(2, 3), Placement(4, 5), Placement(7, 8), None, None)
    assert fused.tree.tokens == (3, 4, 5, 8, 6, 8, 8, 7, 1, 2)
    assert fused.tree.parents == (-1, 0, -1, 2, 0, 4, 5, 1, 7, 7)
    # Continuation 1 ([8, 8] after 3, 6): row after 6, then after its two nodes.
    assert fused.continuation_rows(1, 2) == [5, 6, 7]
    assert fused.tree.path_to(6) == [0, 4, 5, 6]   # 3, 6, 8, 8: its context is base + key + drafts


def test_a_key_ending_in_a_tested_child_is_no_outcome():
    tree = DraftTree((3, 5, 4), (ROOT, ROOT, 0))   # 3 and 5 at the root, 4 after 3
    assert key_parent(tree, (5,)) is None          # a rejected 5 leaves no mass on 5
    assert key_parent(tree, (3, 4)) is None
    assert key_parent(tree, (6,)) == ROOT
    assert key_parent(tree, (3, 6)) == 0
    assert key_parent(tree, (3, 4, 1)) == 2
    assert key_parent(tree, (5, 1)) == 1
    assert key_parent(tree, ()) is None


def test_continuations_that_do_not_fit_are_left_out_in_order():
    fused = fuse_tree(DraftTree.chain([3]), [(4,), (3, 5), (3, 6)],
                      [DraftTree.chain([1, 1]), DraftTree.chain([1, 1, 1]), DraftTree.chain([1])],
                      fits=lambda t: len(t) <= 6)
    assert fused.placements == (Placement(1, 2), None, Placement(4, 5))


# --- statistics ---------------------------------------------------------------------------------

K = 6


def fused_sequence(backend, state, draft, s, first, then, qmode, rng, vrng, control: str = "",
                   hits: list | None = None) -> tuple[int, ...]:
    prompt = [0]
    committed = list(prompt)

    def commit(tokens) -> bool:
        done = commit_round(tokens[:-1], RoundResult(len(tokens) - 1, tokens[-1]), frozenset(),
                            remaining=L - (len(committed) - len(prompt)), context_left=10_000)
        committed.extend(done.tokens)
        return done.finish_reason.value == "not_finished"

    round_r = _draft(draft, committed, s, first, rng, qmode)
    keys = _outcomes(draft, round_r, s, rng)
    conts = [_draft(draft, committed + list(k), s, then, rng, qmode) for k in keys]
    fused = [FusedContinuation(tuple(k), c.tree, c.qs) for k, c in zip(keys, conts)]
    before = copy.deepcopy(vrng)   # round r's uniforms, for the control that reuses them
    next_rng = (lambda n: copy.deepcopy(before)) if control == "same uniforms" else (lambda n: vrng)
    out = backend.verify_round(state, committed, round_r.tree, round_r.qs, s, vrng, fused, next_rng)
    res = out.result
    going = commit([round_r.tree.tokens[i] for i in res.path] + [res.next_token])
    if hits is not None:
        hits.append(out.following is not None)
    if going and out.following is not None:
        c, nxt = conts[out.following.index], out.following.result
        commit([c.tree.tokens[i] for i in nxt.path] + [nxt.next_token])
    while len(committed) - len(prompt) < L:
        commit(_verify(backend.lm, _draft(draft, committed, s, "chain", rng, qmode), s, vrng))
    return tuple(committed[len(prompt):])


def _length_only(committed, base_length, keys):
    """The control's matcher: any placed key of the committed length, not the one committed."""
    tail = list(committed[base_length:])
    wrong = [i for i, k in enumerate(keys) if len(k) == len(tail) and list(k) != tail]
    right = [i for i, k in enumerate(keys) if list(k) == tail]
    return (wrong or right or [None])[0]


def _run(first, then, temperature, qmode, control="", n=N, sessions=1, batching=False, monkeypatch=None):
    target, draft = synthetic_pair(vocab=V, seed=3, noise=1.5)
    backend = SyntheticBackend(vocab=V, seed=3, batching=batching)
    assert np.array_equal(backend.lm.logits([0, 2]), target.logits([0, 2]))
    held = HeldPasses(backend.batcher, lambda _: sessions, max_wait_s=0.005) if batching else None
    if control == "other key":
        monkeypatch.setattr(backend_base, "pick_continuation", _length_only)
    s = SamplingSettings(temperature=temperature)
    counts: dict[tuple, int] = {}
    hits: list[bool] = []
    lock = threading.Lock()

    def one(k: int):
        rng, vrng = np.random.default_rng([7, k]), np.random.default_rng([11, k])
        exactness.note_seed("sequences", [[7, k], [11, k]])
        state = backend.new_state()
        try:
            for _ in range(n // sessions):
                seq = fused_sequence(backend, state, draft, s, first, then, qmode, rng, vrng, control, hits)
                with lock:
                    counts[seq] = counts.get(seq, 0) + 1
        finally:
            backend.release(state)
    threads = [threading.Thread(target=one, args=(k,)) for k in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    backend.close()
    return chi_square_p(counts, exact_sequence_probs(target, [0], s), sum(counts.values())), hits, held


@pytest.mark.parametrize("first, then, temperature, qmode", [
    ("chain", "chain", 1.0, FLOAT), ("chain", "chain", 0.7, FIXED), ("chain", "tree", 1.0, FIXED),
    ("tree", "chain", 1.0, FLOAT), ("tree", "tree", 0.7, FIXED)])
def test_fused_rounds_follow_the_target(first, then, temperature, qmode):
    p, hits, _ = _run(first, then, temperature, qmode)
    assert p > P_MIN, f"chi-square p = {p:.2e} ({first} round, {then} continuations, T={temperature})"
    assert sum(hits) > 0.2 * len(hits), f"continuations hit in {sum(hits)} of {len(hits)} sequences: too few to test"


def test_fused_rounds_of_many_sessions_in_shared_batches_follow_the_target():
    """8 sessions at once on the batching backend (each its own state and generators); passes wait
    briefly for all 8, so fused trees of several sessions share passes."""
    p, hits, held = _run("tree", "chain", 1.0, FLOAT, sessions=8, batching=True)
    assert p > P_MIN, f"chi-square p = {p:.2e}"
    assert sum(hits) > 0.2 * len(hits)
    assert any(k > 1 for k in held.sessions_per_pass), "no pass held rounds of two sessions"


@pytest.mark.parametrize("control", ["other key", "same uniforms"])
def test_the_controls_fail(control, monkeypatch):
    """'same uniforms' is a small bias: at N over 70 seeds, 10 passed (log10 p up to -1.5), so a change
    in how the stream is drawn could turn it green; at 3N, 8 seeds: worst log10 p -17.4."""
    n = 3 * N if control == "same uniforms" else N
    p, _, _ = _run("chain", "chain", 1.0, FLOAT, control=control, n=n, monkeypatch=monkeypatch)
    assert p < P_MIN, f"the control {control!r} passed (p = {p:.2e}): the test has no power"


def test_a_backend_that_does_not_fuse_runs_the_hit_as_a_second_round():
    """vLLM's way (Capabilities.fuses False): the same rule, the continuation on a pass of its own."""
    backend = SyntheticBackend(vocab=V, seed=3)
    backend.caps = dataclasses.replace(backend.caps, fuses=False)
    _, draft = synthetic_pair(vocab=V, seed=3, noise=1.5)
    rng, vrng = np.random.default_rng(1), np.random.default_rng(2)
    exactness.note_seed("sequences", [1, 2])
    s, hits, state = SamplingSettings(temperature=1.0), [], backend.new_state()
    counts: dict[tuple, int] = {}
    for _ in range(N):
        seq = fused_sequence(backend, state, draft, s, "chain", "chain", FLOAT, rng, vrng, hits=hits)
        counts[seq] = counts.get(seq, 0) + 1
    p = chi_square_p(counts, exact_sequence_probs(backend.lm, [0], s), N)
    assert p > P_MIN and sum(hits) > 0.2 * len(hits), (p, sum(hits))


# --- the wire: one reply for both rounds, retries, evictions, bad input -------------------------

import grpc  # noqa: E402

from helpers import running_server, stub_for  # noqa: E402
from spec_core.proto import verifier_pb2 as pb  # noqa: E402
from test_faults import VOCAB, synthetic_greedy  # noqa: E402

PROMPT = [0, 5, 6, 7]


def _fused_open(g, **open_fields) -> pb.VerifyRequest:
    """Round 1 with drafts g[0:2] (greedy, so it commits g[0:3]) and three continuations: one for
    that outcome (drafts g[3:5]), one for a rejection at the first draft, one no outcome at all."""
    return pb.VerifyRequest(round=1, committed_length=len(PROMPT), draft_token_ids=g[0:2], open=pb.OpenSession(
        prompt_token_ids=PROMPT, open_key=b"f" * 16,
        sampling=pb.SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True), **open_fields),
        next_continuations=[pb.Continuation(assumed_tokens=[(g[0] + 1) % VOCAB], draft_token_ids=[3]),
                            pb.Continuation(assumed_tokens=g[0:3], draft_token_ids=g[3:5]),
                            pb.Continuation(assumed_tokens=[g[0], g[1]], draft_token_ids=[3])])


async def test_one_reply_answers_both_rounds_and_a_retry_gets_it_again():
    g = synthetic_greedy(PROMPT, 20)
    async with running_server(SyntheticBackend(vocab=VOCAB)) as server:
        async with stub_for(server) as stub:
            req = _fused_open(g)
            reply = await stub.Verify(req, timeout=5)
            nxt = reply.next_round
            assert (reply.round, reply.num_accepted, reply.next_token_id, reply.committed_length) == (1, 2, g[2], 7)
            assert reply.HasField("next_round") and nxt.continuation == 2   # next_continuations[1]
            assert (nxt.round, nxt.num_accepted, nxt.next_token_id, nxt.committed_length) == (2, 2, g[5], 10)
            session = server.engine.sessions.get(reply.session_id)
            assert session.tokens == PROMPT + g[:6] and session.round == 2
            # The reply was lost: the retry gets both rounds again, after later rounds too.
            assert await stub.Verify(req, timeout=5) == reply
            r3 = await stub.Verify(pb.VerifyRequest(session_id=reply.session_id, round=3, committed_length=10,
                                                    draft_token_ids=g[6:8]), timeout=5)
            assert r3.committed_length == 13 and not r3.HasField("next_round")
            assert await stub.Verify(req, timeout=5) == reply
            with pytest.raises(grpc.aio.AioRpcError) as e:   # round 2 ran fused: no request names it
                await stub.Verify(pb.VerifyRequest(session_id=reply.session_id, round=2, committed_length=7,
                                                   draft_token_ids=g[3:5]), timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "different drafts" in e.value.details()


async def test_a_stale_pipelined_round_whose_number_a_fused_continuation_took_is_refused_and_applies_nothing():
    """A window's round r + 1, pipelined for an outcome of round r that did not come true, is still
    unanswered when the edge sends round r again with continuations fused into its pass; the hit
    commits as round r + 1. The stale round is refused ("verified with different drafts", as after a
    fresh round took its number: tests/test_pipeline.py) and changes nothing; the edge discards it as
    a miss. (The exactness hunt meets this about once in 2,000 rounds with the planner on.)"""
    g = synthetic_greedy(PROMPT, 20)
    async with running_server(SyntheticBackend(vocab=VOCAB)) as server:
        async with stub_for(server) as stub:
            reply = await stub.Verify(_fused_open(g), timeout=5)
            assert reply.next_round.round == 2 and reply.next_round.committed_length == 10
            sid = reply.session_id
            stale = pb.VerifyRequest(session_id=sid, round=2, committed_length=5, draft_token_ids=[3],
                                     assumed_tokens=[(g[0] + 1) % VOCAB])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(stale, timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "different drafts" in e.value.details()
            session = server.engine.sessions.get(sid)
            assert session.tokens == PROMPT + g[:6] and session.round == 2


async def test_no_hit_leaves_the_next_round_free_and_an_evicted_session_replays():
    g = synthetic_greedy(PROMPT, 20)
    async with running_server(SyntheticBackend(vocab=VOCAB)) as server:
        async with stub_for(server) as stub:
            req = _fused_open(g)
            del req.next_continuations[1]          # no continuation for what round 1 commits
            reply = await stub.Verify(req, timeout=5)
            assert reply.committed_length == 7 and not reply.HasField("next_round")
            sid = reply.session_id
            r2 = pb.VerifyRequest(session_id=sid, round=2, committed_length=7, draft_token_ids=g[3:5],
                                  next_continuations=[pb.Continuation(assumed_tokens=g[3:6], draft_token_ids=[g[6]])])
            server.engine.close(sid)               # evicted (or the verifier restarted)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(r2, timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            # The replay: round 1 of a new session with the committed tokens, fused as before.
            replay = pb.VerifyRequest(round=1, committed_length=7, draft_token_ids=g[3:5],
                                      next_continuations=r2.next_continuations, open=pb.OpenSession(
                                          prompt_token_ids=PROMPT, resume_token_ids=g[:3], open_key=b"r" * 16,
                                          sampling=req.open.sampling))
            again = await stub.Verify(replay, timeout=5)
            assert again.committed_length == 10 and again.next_round.committed_length == 12
            assert server.engine.sessions.get(again.session_id).tokens == PROMPT + g[:8]


async def test_the_last_round_cuts_and_ends_without_its_continuation():
    g = synthetic_greedy(PROMPT, 20)
    async with running_server(SyntheticBackend(vocab=VOCAB)) as server:
        async with stub_for(server) as stub:
            req = _fused_open(g)
            req.open.sampling.max_new_tokens = 3   # round 1 commits exactly 3: LENGTH
            reply = await stub.Verify(req, timeout=5)
            assert reply.finish_reason == pb.LENGTH and not reply.HasField("next_round")


@pytest.mark.parametrize("change, message", [
    (lambda r: r.next_continuations.append(pb.Continuation(assumed_tokens=r.next_continuations[0].assumed_tokens)),
     "next_continuations[3].assumed_tokens"),                                     # a key twice
    (lambda r: r.next_continuations[0].draft_token_ids.append(VOCAB), "next_continuations[0].draft_token_ids"),
    (lambda r: r.next_continuations.extend([pb.Continuation(assumed_tokens=[i, i]) for i in range(20)]),
     "next_continuations; this server takes at most"),
])
async def test_bad_next_continuations_are_refused(change, message):
    g = synthetic_greedy(PROMPT, 20)
    async with running_server(SyntheticBackend(vocab=VOCAB)) as server:
        async with stub_for(server) as stub:
            req = _fused_open(g)
            change(req)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(req, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), e.value.details()


# --- end to end: the edge with --fuse over gRPC, one session and many -----------------------------
# tests/test_continuations.py's transition test (counts of (previous, next) pairs at T = 1, V = 5,
# one chi-square over 25 cells, p > 1e-4) with its control (a verifier that accepts every draft).

from edge_client import EdgeClient  # noqa: E402
from edge_client.drafters import SyntheticDrafter  # noqa: E402
from edge_client.text import SyntheticTokenizer  # noqa: E402
from helpers import edge_options, generate_many  # noqa: E402
from test_batching import AcceptEverything  # noqa: E402
from test_continuations import transition_p  # noqa: E402


class LosingReplies:
    """Wraps the edge's stub: a reply (after the verifier committed its round) is lost with
    probability `lose` and the same request sent again, as the edge's retry; the retry's reply must
    be the lost one, fused next round included (`different` counts those that were not)."""

    def __init__(self, stub, lose: float, rng: np.random.Generator):
        self._stub, self.lose, self.rng = stub, lose, rng
        self.lost = self.lost_fused = self.different = 0

    async def Verify(self, req, **kw):
        reply = await self._stub.Verify(req, **kw)
        if not req.session_id or self.rng.random() >= self.lose:
            return reply
        self.lost += 1
        self.lost_fused += reply.HasField("next_round")
        again = await self._stub.Verify(req, **kw)   # NOT_FOUND when evicted meanwhile: the edge replays
        self.different += again != reply
        return again

    def __getattr__(self, name):
        return getattr(self._stub, name)


async def _generate(backend, sessions: int, tokens: int, concurrency: int, lose: float = 0.0, evict_every: int = 0,
                    **kw):
    """`sessions` generations of `tokens` tokens from [0] with fused continuations: sequences, stats.
    lose: share of replies lost after the verifier committed them (the edge retries); evict_every:
    every that many rounds the verifier drops a session (the edge replays)."""
    settings = SamplingSettings(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
    losing = None
    async with running_server(backend, max_sessions=concurrency + 8, max_new_tokens_cap=tokens) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=2, qmode="float:0", fuse=True,
                                           max_continuations=8, max_replays=10_000, **kw),
                              SyntheticDrafter(V, seed=0, noise=1.0), SyntheticTokenizer(V)) as c:
            if lose:
                c._stub = losing = LosingReplies(c._stub, lose, np.random.default_rng(5))
            if evict_every:
                verify, calls = server.engine.verify, [0]

                async def evicting(valid):
                    calls[0] += 1
                    if calls[0] % evict_every == 0 and valid.req.session_id:
                        server.engine.close(valid.req.session_id)
                    return await verify(valid)
                server.engine.verify = evicting

            stats = await generate_many(c, sessions, settings, concurrency)
    return [[0] + st.token_ids for st in stats], stats, losing


import asyncio  # noqa: E402


class AcceptEverythingUnfused(AcceptEverything):
    """The control verifier, running a hit continuation as a second round (Capabilities.fuses False)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.caps = dataclasses.replace(self.caps, fuses=False)


@pytest.mark.parametrize("tree", ["off", "budget=4,depth=2,branching=2,width=2"])
async def test_one_fused_session_follows_the_target(tree):
    """One session of 3000 tokens (a 5 ms verifier pass: a fused round saves more than it costs),
    its rounds after the open on the VerifyStream."""
    seqs, stats, _ = await _generate(SyntheticBackend(vocab=V, seed=0, step_ms=5.0), 1, 3000, 1, tree=tree)
    st = stats[0]
    sent = st.rounds - st.fused_hits   # requests (a fused hit is answered with the round before)
    assert st.tokens == 3000 and st.fused_rounds > 0.5 * sent and st.fused_hits > 0.2 * st.fused_rounds, st
    p = transition_p(seqs)
    bad, _, _ = await _generate(AcceptEverythingUnfused(vocab=V, seed=0, step_ms=5.0), 1, 3000, 1, tree="off")
    p_control = transition_p(bad)
    print(f"fused {st.fused_rounds} of {st.rounds} rounds, hits {st.fused_hits}; p = {p:.3g}, control {p_control:.3g}")
    assert p > P_MIN
    assert p_control < P_MIN


async def test_fused_sessions_in_shared_batches_under_lost_replies_and_evictions_follow_the_target():
    """48 sessions of 64 tokens, 16 at a time on a batching target whose passes wait for 8 rounds;
    three in ten replies lost after commit (retried), and a session evicted every 25 rounds."""
    backend = SyntheticBackend(vocab=V, seed=0, step_ms=2.0, batching=True)
    held = HeldPasses(backend.batcher, lambda _: 8, max_wait_s=0.02)
    # Unary Verify (the lost replies are the stub's): the stream's own retries are tests/test_window.py's.
    seqs, stats, losing = await _generate(backend, 48, 64, 16, lose=0.3, evict_every=25, stream=False)
    backend.close()
    assert sum(s.tokens for s in stats) == 48 * 64
    assert losing.lost_fused > 50 and losing.different == 0, vars(losing)
    assert sum(s.fused_hits for s in stats) > 100 and sum(s.replays for s in stats) > 0
    assert any(k > 1 for k in held.sessions_per_pass), "no pass held rounds of two sessions"
    assert transition_p(seqs) > P_MIN


class CountingPasses(SyntheticBackend):
    """Counts the target passes rounds take (a chain's or a tree's)."""
    passes = 0

    def target_logits(self, *a, **kw):
        self.passes += 1
        return super().target_logits(*a, **kw)

    def tree_logits(self, *a, **kw):
        self.passes += 1
        return super().tree_logits(*a, **kw)


async def test_a_pipelined_round_waiting_when_its_predecessor_starts_shares_its_pass():
    g = synthetic_greedy(PROMPT, 20)
    backend = CountingPasses(vocab=VOCAB)
    async with running_server(backend) as server:
        async with stub_for(server) as stub:
            first = await stub.Verify(pb.VerifyRequest(round=1, committed_length=4, open=pb.OpenSession(
                prompt_token_ids=PROMPT, open_key=b"p" * 16,
                sampling=pb.SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True))), timeout=5)
            sid, before = first.session_id, backend.passes
            r2 = pb.VerifyRequest(session_id=sid, round=2, committed_length=5, draft_token_ids=g[1:3])
            # Round 3 arrives first (alternative 0 for a wrong outcome, continuations[0] for the true one).
            r3 = pb.VerifyRequest(session_id=sid, round=3, committed_length=7, draft_token_ids=[5],
                                  assumed_tokens=[g[1], (g[2] + 1) % VOCAB],
                                  continuations=[pb.Continuation(assumed_tokens=g[1:4], draft_token_ids=g[4:6])])
            t3 = asyncio.ensure_future(stub.Verify(r3, timeout=5))
            while (sid, 3) not in server.engine._waiting:
                await asyncio.sleep(0.001)
            a2 = await stub.Verify(r2, timeout=5)
            a3 = await t3
            assert a2.committed_length == 8 and not a2.HasField("next_round")
            assert (a3.continuation, a3.num_accepted, a3.next_token_id, a3.committed_length) == (1, 2, g[6], 11)
            assert backend.passes == before + 1, "round 3 took a pass of its own"
            assert await stub.Verify(r3, timeout=5) == a3   # its retry: the same reply
            # A pipelined round for an outcome that did not come true waits, then is not verified.
            r5 = pb.VerifyRequest(session_id=sid, round=5, committed_length=14, draft_token_ids=[5],
                                  assumed_tokens=[g[7], g[8], (g[9] + 1) % VOCAB])
            t5 = asyncio.ensure_future(stub.Verify(r5, timeout=5))
            while (sid, 5) not in server.engine._waiting:
                await asyncio.sleep(0.001)
            a4 = await stub.Verify(pb.VerifyRequest(session_id=sid, round=4, committed_length=11,
                                                    draft_token_ids=g[7:9]), timeout=5)
            assert a4.committed_length == 14 and (await t5).base_mismatch
            assert server.engine._waiting == {}


def test_fused_chains_with_several_continuations_are_timing_dependent():
    from edge_client.options import Speculation
    assert Speculation(gamma=4, fuse=True, max_continuations=8, plan="off").timing_dependent() == ("max_continuations",)
    assert Speculation(gamma=4, fuse=True, max_continuations=1, plan="off").timing_dependent() == ()


# --- a pipelined round waiting when its predecessor's pass starts: statistics over the wire ------
# One unseeded session at T = 1 on the synthetic pair (V = 5): each step drafts round r (2 drafts,
# q float) and continuations for up to K of its outcomes (test_continuations' ranking), sends them
# as the pipelined round r + 1 FIRST and round r once r + 1 is waiting, so round r's pass takes in
# r + 1's alternatives. 1500 tokens; the transition test (p > 1e-4); the control runs the
# continuation on the rows of another key of the same length (it must fail).

from spec_core.proto import qpayload  # noqa: E402


async def _waiting_round_session(monkeypatch, control: bool, tokens: int = 1500):
    if control:
        monkeypatch.setattr(backend_base, "pick_continuation", _length_only)
    _, draft = synthetic_pair(vocab=V, seed=0, noise=1.0)
    s = SamplingSettings(temperature=1.0)
    rng = np.random.default_rng(3)
    exactness.note_seed("sequence", 3)
    backend = CountingPasses(vocab=V, seed=0)
    merged = 0
    async with running_server(backend, max_new_tokens_cap=tokens + 8) as server:
        async with stub_for(server) as stub:
            committed = [0]
            first = await stub.Verify(pb.VerifyRequest(round=1, committed_length=1, open=pb.OpenSession(
                prompt_token_ids=[0], open_key=b"w" * 16,
                sampling=pb.SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True))), timeout=5)
            sid, round_ = first.session_id, 2
            committed.append(first.next_token_id)
            while len(committed) - 1 < tokens - 8:
                r = _draft(draft, committed, s, "chain", rng, FLOAT)
                keys = _outcomes(draft, r, s, rng)
                conts = [_draft(draft, committed + list(k), s, "chain", rng, FLOAT) for k in keys]
                wire = [pb.Continuation(assumed_tokens=k, draft_token_ids=c.tree.tokens, q=qpayload.to_proto(c.qs))
                        for k, c in zip(keys, conts)]
                nxt = pb.VerifyRequest(session_id=sid, round=round_ + 1, committed_length=len(committed) + len(keys[0]),
                                       draft_token_ids=wire[0].draft_token_ids, q=wire[0].q,
                                       assumed_tokens=keys[0], continuations=wire[1:])
                t_next = asyncio.ensure_future(stub.Verify(nxt, timeout=10))
                while (sid, round_ + 1) not in server.engine._waiting:
                    await asyncio.sleep(0)
                passes = backend.passes
                a = await stub.Verify(pb.VerifyRequest(session_id=sid, round=round_, committed_length=len(committed),
                                                       draft_token_ids=r.tree.tokens, q=qpayload.to_proto(r.qs)),
                                      timeout=10)
                committed += list(r.tree.tokens[:a.num_accepted]) + [a.next_token_id]
                b = await t_next
                if b.base_mismatch:
                    round_ += 1
                    continue
                merged += backend.passes == passes + 1
                c = conts[b.continuation]
                committed += list(c.tree.tokens[:b.num_accepted]) + [b.next_token_id]
                assert b.committed_length == len(committed)
                round_ += 2
    return committed, merged


@pytest.mark.parametrize("control", [False, True], ids=["fused", "control"])
async def test_pipelined_rounds_fused_into_the_pass_before_follow_the_target(control, monkeypatch):
    seq, merged = await _waiting_round_session(monkeypatch, control)
    p = transition_p([seq])
    print(f"{merged} pipelined rounds verified in their predecessor's pass; p = {p:.3g}")
    assert merged > 200
    assert (p < P_MIN) if control else (p > P_MIN), p
