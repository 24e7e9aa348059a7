"""A retry of a committed round gets that round's reply, whatever committed after it (issue 24).

The bug this guards against (invariant 1): with rounds in flight, round r commits and its reply is
lost; the pipelined round r + 1 commits (its continuation guessed r's outcome); the edge's retry of
round r was answered FAILED_PRECONDITION "out of step", the edge replayed, and round r's outcome was
drawn again. Which outcomes get redrawn then depends on the outcome (r + 1 commits only when its
continuation guessed it), so the guessed outcomes come out too rarely.

The statistical test: one unseeded session (the verifier's and the edge's streams are fresh each
run, as in production; seeded runs redraw the same outcome and hide the bug) of N_TOKENS = 5000
tokens at T = 1 on the synthetic pair over V = 5 tokens (order 1, draft noise 0.5), γ = 1,
pipelined, one continuation, q as float. Four in five replies of ordinary rounds (drawn per round) are
lost after the verifier committed them, and their retry reaches the verifier only after the round
pipelined behind them was answered: the order that exposed the bug. Two statistics, both with
the threshold P_MIN = 1e-4:
  - the transition test (tests/test_continuations.transition_p): counts of (previous, next)
    token pairs against the target's transition probabilities, one chi-square over the 25 cells;
  - the guess test, aimed at this bug (chosen from the pair alone, before any data): how often
    the token after a is b*(a), the draft's argmax after a (the bonus the one continuation
    guesses). Under the target, sum_t (1[x_t+1 = b*(x_t)] - p_t) / sqrt(sum_t p_t (1 - p_t)) with
    p_t = p(b*(x_t) | x_t) is a martingale sum, standard normal for large N; two-sided p.
The session must pass both. The negative control runs the same session, but its retries of a
round that a later round already followed are answered as the old verifier did
(FAILED_PRECONDITION, so the edge replays): it must fail one of them at the same sample size,
so the test has the power to see this bug. On the verifier before the fix the session itself
failed: see the commit that added this file.
"""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from scipy.stats import norm

from cloud_verifier.backends.synthetic import SyntheticBackend
from edge_client import EdgeClient
from edge_client.drafters import SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from helpers import edge_options, running_server, stub_for
from spec_core.proto import verifier_pb2 as pb
from spec_core.synthetic import synthetic_pair
from spec_core.warping import SamplingSettings, processed_probs
from test_continuations import transition_p
from test_exactness_stats import P_MIN
from test_faults import VOCAB, synthetic_greedy

V = 5
N_TOKENS = 5000
NOISE = 0.5            # the draft's blur (spec_core.synthetic): with it a continuation hits often
LOSE = 0.8            # share of ordinary rounds whose reply is lost (after the verifier committed them)
FOLLOWER_WAIT_S = 1.0  # how long a lost reply's retry waits for the pipelined round behind it


class LosingCommittedReplies:
    """Wraps the edge's stub. Each Verify reaches the verifier; the reply of an ordinary round (not
    a first or a pipelined one) is lost with probability `lose`, and the edge's retry (the same
    request) is sent once the round pipelined behind it has been answered (or FOLLOWER_WAIT_S
    passed: none was sent). `lost_then_followed` counts lost replies whose round a pipelined round
    committed after. `old_server=True` is the negative control: a retry of a round that a
    later round of its session already followed is answered as the verifier before the fix did,
    FAILED_PRECONDITION "out of step"."""

    def __init__(self, stub, lose: float, rng: np.random.Generator, old_server: bool = False):
        self._stub, self.lose, self.rng, self.old_server = stub, lose, rng, old_server
        self.lost = self.lost_then_followed = 0
        self._answered: dict[tuple[str, int], asyncio.Event] = {}
        self._committed: set[tuple[str, int]] = set()

    def _event(self, session_id: str, round_: int) -> asyncio.Event:
        return self._answered.setdefault((session_id, round_), asyncio.Event())

    async def Verify(self, req, **kw):
        reply = await self._stub.Verify(req, **kw)
        if not reply.base_mismatch:
            self._committed.add((reply.session_id, reply.round))
        self._event(reply.session_id, reply.round).set()
        if not req.session_id or req.assumed_tokens or self.rng.random() >= self.lose:
            return reply
        self.lost += 1
        try:
            await asyncio.wait_for(self._event(req.session_id, req.round + 1).wait(), FOLLOWER_WAIT_S)
        except asyncio.TimeoutError:
            pass
        followed = (req.session_id, req.round + 1) in self._committed
        self.lost_then_followed += followed
        if self.old_server and followed:
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details=f"round {req.round} is out of step (the old verifier's answer)")
        return await self._stub.Verify(req, **kw)   # the edge's retry: the same request

    def __getattr__(self, name):
        return getattr(self._stub, name)


async def _lossy_session(old_server: bool = False):
    settings = SamplingSettings(temperature=1.0, max_new_tokens=N_TOKENS, ignore_eos=True)   # unseeded
    async with running_server(SyntheticBackend(vocab=V, seed=0, n_ctx=N_TOKENS + 8), max_new_tokens_cap=N_TOKENS) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=1, qmode="float:0", pipeline=True, stream=False,
                                           max_continuations=1, max_replays=10_000),
                              SyntheticDrafter(V, seed=0, noise=NOISE), SyntheticTokenizer(V)) as c:
            c._stub = stub = LosingCommittedReplies(c._stub, LOSE, np.random.default_rng(), old_server)
            gen = c.generate([0], settings)
            await gen.text()
    return [0] + gen.stats.token_ids, gen.stats, stub


def guess_p(seq: list[int]) -> float:
    """The guess test's two-sided p (module docstring)."""
    target, draft = synthetic_pair(V, 0, NOISE, 1)
    guessed = [int(np.argmax(draft.logits([a]))) for a in range(V)]
    p_guess = np.array([processed_probs(target.logits([a]), 1.0, 0, 1.0)[guessed[a]] for a in range(V)])
    prev, nxt = np.asarray(seq[:-1]), np.asarray(seq[1:])
    hits = nxt == np.asarray(guessed)[prev]
    z = float(np.sum(hits - p_guess[prev]) / np.sqrt(np.sum(p_guess[prev] * (1 - p_guess[prev]))))
    return float(2 * norm.sf(abs(z)))


async def test_lost_replies_with_continuations_follow_the_target():
    # The session and its control run side by side (each with its own verifier), to halve the wall time.
    (seq, st, stub), (seq_bad, st_bad, _) = await asyncio.gather(_lossy_session(), _lossy_session(old_server=True))
    p = min(transition_p([seq]), guess_p(seq))
    p_control = min(transition_p([seq_bad]), guess_p(seq_bad))
    print(f"{stub.lost} replies lost, {stub.lost_then_followed} of them followed by a pipelined round, "
          f"{st.replays} replays; p = {transition_p([seq]):.3g} (transitions), {guess_p(seq):.3g} (guess); "
          f"control ({st_bad.replays} replays): {transition_p([seq_bad]):.3g}, {guess_p(seq_bad):.3g}")
    assert len(seq) == N_TOKENS + 1
    # The situation the bug needs happened often: a lost reply whose round a pipelined one followed.
    assert stub.lost_then_followed > 300 and st.pipelined_rounds > 300, (stub.lost_then_followed, st)
    assert p > P_MIN, f"p = {p:.2e}: lost replies bias the output"
    assert st.replays == 0, "a retried round was answered out of step"
    assert st_bad.replays > 300, st_bad
    assert p_control < P_MIN, f"the control passed (p = {p_control:.2e}): the test has no power"


# --- the verifier's side, literal -----------------------------------------------------------------

def open_round():
    return pb.VerifyRequest(round=1, committed_length=4, open=pb.OpenSession(
        prompt_token_ids=[0, 5, 6, 7], open_key=b"c" * 16,
        sampling=pb.SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)))


async def test_a_retry_of_a_round_is_answered_after_later_rounds_committed():
    g = synthetic_greedy([0, 5, 6, 7], 60)
    async with running_server(SyntheticBackend(vocab=VOCAB)) as server:
        async with stub_for(server) as stub:
            first = await stub.Verify(open_round(), timeout=5)   # commits g[0]
            sid = first.session_id
            r2 = pb.VerifyRequest(session_id=sid, round=2, committed_length=5, draft_token_ids=g[1:3])
            a2 = await stub.Verify(r2, timeout=5)                  # keeps g[1], g[2], adds g[3]
            r3 = pb.VerifyRequest(session_id=sid, round=3, committed_length=8, draft_token_ids=[g[4]],
                                  assumed_tokens=g[1:4])           # pipelined: its base came true
            a3 = await stub.Verify(r3, timeout=5)
            assert not a3.base_mismatch and a3.committed_length == 10
            assert await stub.Verify(r2, timeout=5) == a2          # round 2's own reply, after round 3
            assert await stub.Verify(open_round(), timeout=5) == first   # the first round's too
            with pytest.raises(grpc.aio.AioRpcError) as e:         # not another draft's
                await stub.Verify(pb.VerifyRequest(session_id=sid, round=2, committed_length=5,
                                                   draft_token_ids=[g[1]]), timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "different drafts" in e.value.details()
            # Rounds beyond the cache's reach: their retries are out of step, and the message says why.
            length, round_ = 10, 4
            size = server.engine.sessions.get(sid).replies.size
            while round_ <= size + 3:
                reply = await stub.Verify(pb.VerifyRequest(session_id=sid, round=round_, committed_length=length),
                                          timeout=5)
                length, round_ = reply.committed_length, round_ + 1
            assert await stub.Verify(pb.VerifyRequest(session_id=sid, round=round_ - size, committed_length=length
                                                      - size), timeout=5) is not None
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(r2, timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no longer kept" in e.value.details()
