"""A window of rounds in flight (edge_client.window) over VerifyStream (edge_client.stream).

Exactness, end to end: one unseeded session of N_TOKENS = 3000 tokens at T = 1 on the synthetic
pair over V = 5 tokens (order 1, draft noise 1.0), γ = 2, q as float, up to 8 continuations per
round, with a window of k = 2 and k = 3 rounds, chains and trees; the depth is forced to k (the cost
model would keep one pipelined round on loopback, where the round trip is nothing), so rounds
r + 1 and r + 2 travel while r is unanswered. The statistic is tests/test_continuations.transition_p
(one chi-square over the 25 (previous, next) cells against the target's transition probabilities),
threshold P_MIN = 1e-4. Negative control: the same window against a verifier that accepts every
draft (biased toward the draft): it must fail at the same sample size.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

import edge_client.remote as remote
import edge_client.planner as planner
from cloud_verifier.backends.synthetic import SyntheticBackend
from edge_client import EdgeClient
from edge_client.drafters import SyntheticDrafter
from edge_client.options import OptionError, ServerLimits, Speculation
from edge_client.planner import WindowCosts, best_depth
from edge_client.text import SyntheticTokenizer
from helpers import edge_options, generate_many, running_server, stub_for
from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import SamplingSettings
from test_batching import AcceptEverything
from test_continuations import transition_p
from test_exactness_stats import P_MIN

V = 5
N_TOKENS = 3000
TREE = "budget=4,depth=2,branching=2,width=2"


# --- the cost model ---------------------------------------------------------------------------------

def test_a_slow_link_with_good_guesses_fills_the_window():
    c = WindowCosts(rtt_s=0.6, verify_s=0.02, draft_s=0.01, up_s=0.001, hit=0.8)
    assert best_depth(c, 4) == 4


def test_bad_guesses_keep_one_round_in_flight():
    c = WindowCosts(rtt_s=0.6, verify_s=0.02, draft_s=0.05, up_s=0.01, hit=0.05)
    assert best_depth(c, 4) == 1


def test_a_saturated_uplink_stops_the_window_early():
    """The uplink is the slowest stage: more rounds in flight only queue on it."""
    fast_link = WindowCosts(rtt_s=0.6, verify_s=0.02, draft_s=0.01, up_s=0.005, hit=0.9)
    slow_link = WindowCosts(rtt_s=0.6, verify_s=0.02, draft_s=0.01, up_s=0.3, hit=0.9)
    assert best_depth(fast_link, 4) == 4
    assert best_depth(slow_link, 4) == 2


def test_a_loopback_link_needs_no_window():
    c = WindowCosts(rtt_s=0.0005, verify_s=0.005, draft_s=0.001, up_s=0.0, hit=0.5)
    assert best_depth(c, 4) <= 2


# --- options ----------------------------------------------------------------------------------------

def test_window_implies_pipeline_and_is_capped_by_the_verifier():
    spec = Speculation(window=3, plan="off")
    assert spec.pipeline
    assert spec.within(ServerLimits(max_gamma=8)).window == 2          # a verifier that does not say: 2
    assert spec.within(ServerLimits(max_gamma=8, max_window=4)).window == 3
    with pytest.raises(OptionError, match="window"):
        Speculation(window=0, plan="off")


# --- the stream's semantics ---------------------------------------------------------------------------

def _open(seed: int = 3) -> pb.VerifyRequest:
    return pb.VerifyRequest(round=1, committed_length=2, draft_token_ids=[1, 2], open=pb.OpenSession(
        prompt_token_ids=[0, 1],
        sampling=pb.SamplingParams(temperature=1.0, seed=seed, max_new_tokens=64, ignore_eos=True),
        open_key=b"k" * 16))


async def _stream_rounds(stub, requests):
    """Send `requests` on one VerifyStream (tags 1..n) and return the replies by tag."""
    async def gen():
        for i, r in enumerate(requests, 1):
            yield pb.StreamRound(tag=i, request=r)
    out = {}
    async for msg in stub.VerifyStream(gen(), timeout=10):
        out[msg.tag] = msg
    return out


async def test_the_stream_answers_as_unary_verify_does():
    """The same seeded rounds, unary on one verifier and on a stream on another: the same replies;
    a malformed round is answered INVALID_ARGUMENT on its own and the stream goes on; a retried
    round gets its cached reply."""
    async def session(use_stream: bool):
        async with running_server(SyntheticBackend(vocab=V, seed=0)) as server:
            async with stub_for(server) as stub:
                first = await stub.Verify(_open(), timeout=5)
                nxt = pb.VerifyRequest(session_id=first.session_id, round=2, committed_length=first.committed_length,
                                       draft_token_ids=[3, 4])
                bad = pb.VerifyRequest(session_id=first.session_id, round=3, committed_length=0,
                                       draft_token_ids=[99])
                if not use_stream:
                    second = await stub.Verify(nxt, timeout=5)
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Verify(bad, timeout=5)
                    return second, e.value.code(), e.value.details(), await stub.Verify(nxt, timeout=5)
                replies = await _stream_rounds(stub, [nxt, bad])
                again = await _stream_rounds(stub, [nxt])
                err = replies[2].error
                return replies[1].reply, grpc.StatusCode.INVALID_ARGUMENT if err.code == 3 else err.code, \
                    err.message, again[1].reply
    unary, streamed = await asyncio.gather(session(False), session(True))
    assert streamed[0].committed_length == unary[0].committed_length
    assert streamed[0].num_accepted == unary[0].num_accepted and streamed[0].next_token_id == unary[0].next_token_id
    assert streamed[1] == unary[1] == grpc.StatusCode.INVALID_ARGUMENT and streamed[2] == unary[2]
    assert streamed[3].committed_length == streamed[0].committed_length   # the retry: its cached reply
    assert streamed[3].next_token_id == streamed[0].next_token_id


async def test_the_edge_uses_the_stream_when_offered_and_unary_otherwise(monkeypatch):
    used = []
    orig = remote.RemoteSession._round

    def spy(self, req):
        used.append(self.stream is not None)
        return orig(self, req)
    monkeypatch.setattr(remote.RemoteSession, "_round", spy)
    for offered in (True, False):
        used.clear()
        backend = SyntheticBackend(vocab=V, seed=0)
        async with running_server(backend) as server:
            if not offered:   # an older verifier: no VerifyStream in its ServerInfo
                info = server.engine.server_info
                monkeypatch.setattr(server.engine, "server_info",
                                    lambda: pb.ServerInfo(**{**_fields(info()), "verify_stream": False}))
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=2, window=2),
                                  SyntheticDrafter(V, seed=0), SyntheticTokenizer(V)) as c:
                gen = c.generate([0], SamplingSettings(temperature=1.0, max_new_tokens=40, ignore_eos=True))
                await gen.text()
        assert gen.stats.tokens == 40
        assert any(used) == offered and used


def _fields(msg) -> dict:
    return {f.name: v for f, v in msg.ListFields()}


# --- exactness ----------------------------------------------------------------------------------------

async def _windowed(backend, k: int, tree: str, tokens: int = N_TOKENS):
    settings = SamplingSettings(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)   # unseeded
    async with running_server(backend, max_new_tokens_cap=tokens) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=2, qmode="float:0", window=k,
                                           max_continuations=8, tree=tree),
                              SyntheticDrafter(V, seed=0, noise=1.0), SyntheticTokenizer(V)) as c:
            gen = c.generate([0], settings)
            await gen.text()
    return [0] + gen.stats.token_ids, gen.stats


@pytest.fixture
def forced_depth(monkeypatch):
    """The window kept full (the cost model would not on loopback): exactness must not rest on it."""
    monkeypatch.setattr(planner, "best_depth", lambda costs, max_window: max_window)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("tree", ["off", TREE])
async def test_a_window_of_rounds_follows_the_target(forced_depth, k, tree):
    backend = SyntheticBackend(vocab=V, seed=0, step_ms=5.0, n_ctx=N_TOKENS + 64)
    seq, st = await _windowed(backend, k, tree)
    p = transition_p([seq])
    print(f"k={k} tree={tree}: {st.rounds} rounds, {st.pipelined_rounds} pipelined kept, {st.discarded_rounds} "
          f"discarded, mean depth {st.window_depth:.2f}; chi-square p = {p:.3g}")
    assert st.tokens == N_TOKENS
    assert st.pipelined_rounds > 100, st
    if k == 3:
        assert st.window_depth > 2.2, "round r + 2 rarely travelled behind r + 1"
    assert p > P_MIN


async def test_the_window_test_catches_a_biased_verifier(forced_depth):
    seq, st = await _windowed(AcceptEverything(vocab=V, seed=0, step_ms=5.0, n_ctx=N_TOKENS + 64), 3, "off")
    assert st.tokens == N_TOKENS
    assert transition_p([seq]) < P_MIN


# --- the planner (the default edge) -------------------------------------------------------------------

async def _planned(backend, sessions: int, tokens: int):
    """`sessions` generations (8: together, batched by the verifier) of the default edge: every shape
    option the planner's (only q pinned, as float, so that the synthetic pair's q is exact)."""
    settings = SamplingSettings(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)   # unseeded
    async with running_server(backend, max_new_tokens_cap=tokens, max_sessions=16) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", plan="auto", qmode="float:0"),
                              SyntheticDrafter(V, seed=0, noise=1.0), SyntheticTokenizer(V)) as c:
            stats = await generate_many(c, sessions, settings, concurrency=sessions)
    return [[0] + st.token_ids for st in stats], stats


@pytest.mark.parametrize("sessions, batching", [(1, False), (8, True)])
async def test_the_planners_rounds_follow_the_target(forced_depth, sessions, batching):
    """N_TOKENS tokens in all (one session, or eight batched by the verifier), every shape the
    planner's, with the window kept full: the token transitions against the target's by chi-square
    (p > P_MIN); the stats say which shapes it chose."""
    backend = SyntheticBackend(vocab=V, seed=0, step_ms=5.0, n_ctx=N_TOKENS + 64, batching=batching)
    seqs, stats = await _planned(backend, sessions, N_TOKENS // sessions)
    p = transition_p(seqs)
    shapes: dict[str, int] = {}
    for st in stats:
        for k, v in st.shapes.items():
            shapes[k] = shapes.get(k, 0) + v
    print(f"sessions={sessions}: shapes {shapes}; chi-square p = {p:.3g}")
    assert all(st.tokens == N_TOKENS // sessions for st in stats)
    assert all(set(st.planned) == {"gamma", "tree", "window", "proactive", "pipeline", "fuse"} for st in stats)
    assert sum(shapes.values()) >= sum(st.rounds - st.fused_hits for st in stats)   # every round sent has a shape
    assert p > P_MIN


async def test_the_planner_test_catches_a_biased_verifier(forced_depth):
    seqs, stats = await _planned(AcceptEverything(vocab=V, seed=0, step_ms=5.0, n_ctx=N_TOKENS + 64), 1, N_TOKENS)
    assert stats[0].tokens == N_TOKENS
    assert transition_p(seqs) < P_MIN


# --- faults through the stream ------------------------------------------------------------------------

class BreakingStreams:
    """Wraps the edge's stub: every VerifyStream call is cancelled (as a dropped connection) shortly
    after its `every`-th round was written, with rounds still unanswered on it."""

    def __init__(self, stub, every: int):
        self._stub, self.every, self.broken = stub, every, 0

    def VerifyStream(self, **kw):
        return _BreakingCall(self, self._stub.VerifyStream(**kw))

    def __getattr__(self, name):
        return getattr(self._stub, name)


class _BreakingCall:
    def __init__(self, owner: BreakingStreams, call):
        self._owner, self._call, self._written = owner, call, 0

    async def write(self, msg):
        await self._call.write(msg)
        self._written += 1
        if self._written == self._owner.every:
            self._owner.broken += 1
            asyncio.get_running_loop().call_later(0.001, self._call.cancel)

    def __getattr__(self, name):
        return getattr(self._call, name)

    def __aiter__(self):
        return self._call.__aiter__()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_broken_streams_are_retried_without_double_commit(forced_depth, temperature):
    """Rounds unanswered on a dropped stream are retried on a new one; the verifier answers those it
    committed from its reply cache: the count adds up, and greedy output is the target's own."""
    from test_faults import VOCAB as FV, synthetic_greedy
    async with running_server(SyntheticBackend(vocab=FV, step_ms=5.0)) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3, window=3, deadline_s=10),
                              SyntheticDrafter(FV, noise=1.0), SyntheticTokenizer(FV)) as c:
            c._stub = stub = BreakingStreams(c._stub, every=3)
            gen = c.generate("5 6 7", SamplingSettings(temperature=temperature, max_new_tokens=60, ignore_eos=True,
                                                       seed=3))
            await gen.text()
    st = gen.stats
    assert stub.broken >= 3 and st.retries >= 1 and st.replays == 0, (stub.broken, st)
    assert st.tokens == 60 == len(st.token_ids)
    if temperature == 0.0:
        assert st.token_ids == synthetic_greedy([0, 5, 6, 7], 60)


async def test_a_window_survives_a_verifier_restart_by_replay(forced_depth):
    from test_faults import VOCAB as FV, generate_across_a_restart, synthetic_greedy
    st = await generate_across_a_restart(
        lambda port: EdgeClient(edge_options(f"127.0.0.1:{port}", gamma=3, window=3, deadline_s=10),
                                SyntheticDrafter(FV, noise=1.0), SyntheticTokenizer(FV)),
        SamplingSettings(temperature=0.0, max_new_tokens=60, ignore_eos=True, seed=4))
    assert st.replays >= 1
    assert st.tokens == 60 == len(st.token_ids)
    assert st.token_ids == synthetic_greedy([0, 5, 6, 7], 60)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_window_on_the_stream_replays_after_evictions(forced_depth, monkeypatch, temperature):
    """The verifier drops the session every 7th round while rounds are in flight on the stream: the
    evicted round comes back NOT_FOUND in its StreamError, the edge replays (the open travels as
    unary Verify, later rounds on the stream again), and the output is the target's (greedy: its own
    text; T = 1: every token once)."""
    from test_faults import VOCAB as FV, synthetic_greedy
    on_stream = []
    orig = remote.RemoteSession._round

    def spy(self, req):
        on_stream.append(bool(req.session_id) and self.stream is not None)
        return orig(self, req)
    monkeypatch.setattr(remote.RemoteSession, "_round", spy)
    async with running_server(SyntheticBackend(vocab=FV, step_ms=5.0)) as server:
        verify, calls, evicted = server.engine.verify, [0], []

        async def evicting(valid):
            calls[0] += 1
            if calls[0] % 7 == 0 and valid.req.session_id:
                evicted.append(valid.req.session_id)
                server.engine.close(valid.req.session_id)
            return await verify(valid)
        server.engine.verify = evicting
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3, window=3, deadline_s=10,
                                           max_replays=3), SyntheticDrafter(FV, noise=1.0), SyntheticTokenizer(FV)) as c:
            gen = c.generate("5 6 7", SamplingSettings(temperature=temperature, max_new_tokens=60, ignore_eos=True,
                                                       seed=5))
            await gen.text()
    st = gen.stats
    assert len(evicted) >= 2 and 1 <= st.replays <= len(evicted), (evicted, st)
    assert sum(on_stream) > len(evicted)   # the rounds after each open went on the stream
    assert st.tokens == 60 == len(st.token_ids)
    if temperature == 0.0:
        assert st.token_ids == synthetic_greedy([0, 5, 6, 7], 60)


# --- the stream at the boundary -------------------------------------------------------------------------

async def test_the_stream_needs_a_token_and_survives_a_bug_in_one_round(tmp_path, monkeypatch):
    """VerifyStream is behind the same bearer-token check as Verify; a bug in one round answers that
    round INTERNAL and the stream goes on."""
    from cloud_verifier.auth import TokenFile
    from cloud_verifier.engine import Limits
    from cloud_verifier.server import VerifierServer
    path = tmp_path / "tokens"
    path.write_text("a " + "t" * 40 + "\n")
    async with VerifierServer(SyntheticBackend(vocab=V, seed=0), "127.0.0.1", 0, Limits(), grace_s=0.5,
                              tokens=TokenFile(path)) as server:
        async with stub_for(server) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.VerifyStream(iter([pb.StreamRound(tag=1, request=_open())]), timeout=5):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            md = (("authorization", "Bearer " + "t" * 40),)
            verify = server.engine.verify

            async def broken_once(valid):
                if valid.req.round == 2:
                    raise RuntimeError("a bug")
                return await verify(valid)
            monkeypatch.setattr(server.engine, "verify", broken_once)
            first = await stub.Verify(_open(), timeout=5, metadata=md)
            nxt = [pb.VerifyRequest(session_id=first.session_id, round=2, committed_length=first.committed_length),
                   pb.VerifyRequest(session_id=first.session_id, round=9, committed_length=first.committed_length)]
            out = {}
            async for msg in stub.VerifyStream(iter([pb.StreamRound(tag=i, request=r) for i, r in enumerate(nxt)]),
                                               timeout=5, metadata=md):
                out[msg.tag] = msg
            assert out[0].error.code == grpc.StatusCode.INTERNAL.value[0] and "logged" in out[0].error.message
            assert out[1].error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "out of step" in \
                out[1].error.message
