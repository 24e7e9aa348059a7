"""Recovery from verifier restarts (issue 28): the pieces, and a rolling restart of two replicas
under load.

- the edge's channel: a comma list of replicas becomes one pick_first target, gRPC's reconnect
  back-off is capped, and a lost call's retry waits a jittered, capped delay;
- the verifier: a draining server answers its sessions' rounds "moved" (NOT_FOUND, which the edge
  replays on at once) and refuses new sessions with a short retry hint; replays are admitted
  before new sessions;
- two replicas on loopback, 16 edges given both addresses, each replica drained (graceful stop)
  and restarted on its port in turn while the edges generate: every edge finishes with exactly
  its requested tokens, equal to a fault-free run's, and moved by replay. The longest wait
  between two commits is printed (`-s`); its figures under load are bench/recovery.py's.
"""
from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from cloud_verifier import metrics
from cloud_verifier.admission import Refused, ReplaysFirst, ServerPolicy
from cloud_verifier.backends.synthetic import SyntheticBackend
from cloud_verifier.engine import Limits
from cloud_verifier.server import VerifierServer
from edge_client import EdgeClient
from edge_client.drafters import SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from edge_client.transport import (CHANNEL_OPTIONS, RETRY_CAP_S, EdgeError, channel_target, moved, replica_targets,
                                   retry_after_s, retry_delay_s)
from helpers import edge_options
from spec_core.proto import verifier_pb2 as pb
from spec_core.proto import verifier_pb2_grpc as pb_grpc
from spec_core.synthetic import synthetic_fingerprint
from spec_core.warping import SamplingSettings

VOCAB = 40
FP = synthetic_fingerprint(VOCAB)


# --- the edge's channel -------------------------------------------------------------------------

def test_a_comma_list_of_replicas_is_one_ip_address_list_target():
    assert channel_target("127.0.0.1:50051") == "127.0.0.1:50051"
    assert channel_target("verifier.svc:50051") == "verifier.svc:50051"   # DNS: every record, pick_first
    assert channel_target("127.0.0.1:1, 10.0.0.2:2") == "ipv4:127.0.0.1:1,10.0.0.2:2"
    assert channel_target("localhost:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target("[::1]:1,[::2]:2") == "ipv6:[::1]:1,[::2]:2"
    with pytest.raises(ValueError, match="not an IP address"):
        channel_target("a.example:1,b.example:2")
    with pytest.raises(ValueError, match="mixes IPv4 and IPv6"):
        channel_target("127.0.0.1:1,[::1]:2")


def test_each_replica_channel_prefers_its_own_replica():
    assert replica_targets("127.0.0.1:1") == ["127.0.0.1:1"]
    assert replica_targets("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3") == [
        "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "127.0.0.1:2,127.0.0.1:3,127.0.0.1:1",
        "127.0.0.1:3,127.0.0.1:1,127.0.0.1:2"]


def test_reconnect_back_off_is_capped_at_a_second():
    options = dict(CHANNEL_OPTIONS)
    # gRPC's default cap is 120 s: a verifier back after a few seconds was found up to a minute late.
    assert options["grpc.max_reconnect_backoff_ms"] <= 1000
    assert options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"]
    assert options["grpc.lb_policy_name"] == "pick_first"


def test_retry_delays_are_jittered_and_capped():
    random.seed(3)
    for attempt in range(1, 12):
        delays = [retry_delay_s(attempt) for _ in range(200)]
        assert 0 <= min(delays) and max(delays) <= min(RETRY_CAP_S, 0.05 * 2 ** attempt)
    late = [retry_delay_s(10) for _ in range(200)]
    # Spread, not one instant: 200 draws over [0, 1 s] fill it (a fixed delay would not).
    assert max(late) - min(late) > 0.8 * RETRY_CAP_S


# --- the verifier ------------------------------------------------------------------------------

def test_replays_go_before_new_sessions():
    first = ReplaysFirst(retry_after_s=0.25)
    assert first.admit(replay=False) is False        # nothing pending: a new session is admitted
    assert first.admit(replay=True) is True
    with pytest.raises(Refused) as e:
        first.admit(replay=False)
    assert e.value.reason == "replays_first" and e.value.retry_after_ms == 250
    first.done()
    assert first.admit(replay=False) is False


def open_req(key: bytes, prompt=(0, 5, 6), resume=()):
    return pb.VerifyRequest(round=1, committed_length=len(prompt) + len(resume), open=pb.OpenSession(
        prompt_token_ids=list(prompt), resume_token_ids=list(resume), tokenizer_fingerprint=FP, open_key=key,
        sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)))


async def test_a_draining_verifier_moves_its_sessions_and_refuses_new_ones():
    server = VerifierServer(SyntheticBackend(vocab=VOCAB), "127.0.0.1", 0, Limits(), grace_s=2.0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            reply = await stub.Verify(open_req(b"a" * 16), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as unknown:   # the control: an ordinary NOT_FOUND
                await stub.Verify(pb.VerifyRequest(session_id="nobody", round=2, committed_length=3), timeout=5)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and not moved(unknown.value)
            server.servicer.drain()   # what stop() does first
            with pytest.raises(grpc.aio.AioRpcError) as moved_:
                await stub.Verify(pb.VerifyRequest(session_id=reply.session_id, round=2,
                                                   committed_length=reply.committed_length), timeout=5)
            assert moved_.value.code() == grpc.StatusCode.NOT_FOUND and "moved" in moved_.value.details()
            assert moved(moved_.value)   # the edge's cue to go to the next replica
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Verify(open_req(b"b" * 16), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
            assert retry_after_s(refused.value) == pytest.approx(ServerPolicy().drain_retry_after_s)
            assert moved(refused.value)
    finally:
        await server.stop()


# --- a rolling restart of two replicas -----------------------------------------------------------

EDGES, TOKENS = 16, 150


class Replicas:
    """Two in-process verifiers on fixed loopback ports; `restart(k)` drains replica k (its
    graceful stop: what SIGTERM runs) and starts a fresh one on the same port."""

    def __init__(self, policy: ServerPolicy = ServerPolicy()):
        self.servers: list[VerifierServer] = []
        self.policy = policy

    def _new(self, port: int) -> VerifierServer:
        # Slow enough passes (the batching backend, 3 ms each) that a drain finds rounds in flight.
        return VerifierServer(SyntheticBackend(vocab=VOCAB, step_ms=3.0, batching=True), "127.0.0.1", port,
                              Limits(max_sessions=EDGES), grace_s=5.0, policy=self.policy)

    async def start(self) -> "Replicas":
        for _ in range(2):
            self.servers.append(await self._new(0).start())
        return self

    @property
    def address(self) -> str:
        return ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    async def restart(self, k: int) -> tuple[int, int]:
        """Drain replica k and start it again; the sessions it held when draining began, and those
        it handed back ("moved")."""
        old = self.servers[k]
        held = len(old.engine.sessions)
        await old.stop()
        self.servers[k] = await self._new(old.port).start()
        return held, len(old.servicer.moved)

    async def stop(self) -> None:
        for s in self.servers:
            await s.stop()


async def generate_all(address: str, progress: list[int] | None = None, commits: list[list[float]] | None = None):
    """EDGES edges (even: greedy; odd: seeded T = 0.7), each with its own channel to `address`."""
    async def one(k: int) -> tuple[list[int], int]:
        client = EdgeClient(edge_options(address, gamma=4, deadline_s=20),
                            SyntheticDrafter(VOCAB, seed=k, noise=1.0), SyntheticTokenizer(VOCAB),
                            on_round=lambda e: commits[k].append(time.perf_counter()) if commits else None)
        settings = SamplingSettings(temperature=0.0 if k % 2 == 0 else 0.7, max_new_tokens=TOKENS,
                                    ignore_eos=True, seed=500 + k)
        async with client:
            gen = client.generate([0, 3 + k % 7, 9, 11 + k % 5], settings)
            async for _ in gen:
                if progress is not None:
                    progress[k] = gen.stats.accepted + gen.stats.rounds
            return gen.stats.token_ids, gen.stats.replays
    return await asyncio.gather(*(one(k) for k in range(EDGES)))


@pytest.mark.parametrize("drain_sessions_per_s", [0.0, 8.0], ids=["all-at-once", "paced"])
async def test_rolling_restart_of_two_replicas_loses_no_token(drain_sessions_per_s):
    reference = await Replicas().start()
    try:
        expected = [ids for ids, _ in await generate_all(reference.address)]
    finally:
        await reference.stop()

    replicas = await Replicas(ServerPolicy(drain_sessions_per_s=drain_sessions_per_s)).start()
    progress, commits = [0] * EDGES, [[] for _ in range(EDGES)]
    held = []
    try:
        run = asyncio.ensure_future(generate_all(replicas.address, progress, commits))

        async def when_committed(share: float) -> None:
            while sum(progress) < share * EDGES * TOKENS and not run.done():
                await asyncio.sleep(0.005)

        # pick_first: every edge starts on the first replica; draining it moves them to the second,
        # draining that one moves them back to the restarted first.
        for k, share in ((0, 0.3), (1, 0.6)):
            await when_committed(share)
            held.append(await replicas.restart(k))
        results = await run
    finally:
        await replicas.stop()

    assert not any(not ids for ids in expected)
    assert all(len(ids) == TOKENS for ids in expected)
    outputs = [ids for ids, _ in results]
    assert outputs == expected   # nothing lost, nothing committed twice, the same draws
    replays = [n for _, n in results]
    # Both drains found sessions to move and handed them back ("moved"; all at once, some may
    # have been cut by the port closing instead), and each cost an edge at most one replay.
    assert all(h > 0 and m > 0 for h, m in held), held
    if drain_sessions_per_s:
        assert all(m >= h - 2 for h, m in held), held   # paced: handed back, not cut (a session may finish)
    assert sum(replays) >= 1 and max(replays) <= 2, replays
    gaps = [max(b - a for a, b in zip(c, c[1:])) for c in commits if len(c) > 1]
    print(f"\nrolling restart of 2 replicas under {EDGES} edges, {drain_sessions_per_s:g} sessions/s handed back "
          f"(0: at once): (held, moved) {held}, replays {sum(replays)}, "
          f"longest wait between commits {max(gaps) * 1000:.0f} ms (median edge {sorted(gaps)[len(gaps) // 2] * 1000:.0f} ms)")


# --- moving to a replica that answers ---------------------------------------------------------

def _synthetic(port: int = 0, **policy) -> VerifierServer:
    return VerifierServer(SyntheticBackend(vocab=VOCAB), "127.0.0.1", port, Limits(), grace_s=1.0,
                          policy=ServerPolicy(**policy))


async def test_a_moved_session_reaches_the_other_replica_though_its_channel_had_gone_on_to_the_draining_one():
    """An edge's channel for replica B was used while B was down, so pick_first went on to A and
    stays there; when A drains, the moved session must reach B (A keeps its port open here: the
    edge cannot wait for it to close) — in a bench, such edges waited for A to exit, 17-30 s."""
    a, b = await _synthetic(drain_sessions_per_s=0).start(), await _synthetic().start()
    b_port = b.port
    await b.stop()
    b = None
    try:
        rounds = []

        def drain_a_after_3_rounds(_) -> None:
            rounds.append(1)
            if len(rounds) == 3:
                a.servicer.drain()   # what SIGTERM does first; its port stays open here
        client = EdgeClient(edge_options(f"127.0.0.1:{a.port},127.0.0.1:{b_port}", gamma=2, deadline_s=5),
                            SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB),
                            on_round=drain_a_after_3_rounds)
        async with client:
            # The setup: B's channel answers while B is down, so it went on to A (the one listening).
            await pb_grpc.VerifierStub(client.verifier.channels[1]).GetServerInfo(
                pb.ServerInfoRequest(), timeout=5, wait_for_ready=True)
            b = await _synthetic(b_port).start()
            gen = client.generate([0, 5, 6], SamplingSettings(temperature=0.0, max_new_tokens=40, ignore_eos=True))
            ids = await asyncio.wait_for(gen.text(), 10) and gen.stats.token_ids
        assert a.servicer.draining and a.servicer.moved   # A handed the session back ...
        assert len(ids) == 40 and gen.stats.replays == 1  # ... and B finished it
        assert len(b.engine.sessions) == 1
    finally:
        await a.stop()
        if b is not None:
            await b.stop()


async def test_a_move_to_a_replica_that_is_down_falls_back_to_the_list_and_finds_a_restart():
    """A move goes to the next replica alone; when that one is down (here: never restarted), the
    edge does not wait for it but goes back to its replica list, and finishes on the drained
    replica's restart."""
    a, b = await _synthetic(drain_sessions_per_s=0).start(), await _synthetic().start()
    a_port, b_port = a.port, b.port
    await b.stop()
    restarted: list[VerifierServer] = []

    async def restart_a() -> None:
        await asyncio.sleep(0.5)
        await a.stop()
        restarted.append(await _synthetic(a_port).start())
    tasks = []
    rounds = []

    def drain_a_after_3_rounds(_) -> None:
        rounds.append(1)
        if len(rounds) == 3:
            a.servicer.drain()
            tasks.append(asyncio.ensure_future(restart_a()))
    try:
        client = EdgeClient(edge_options(f"127.0.0.1:{a_port},127.0.0.1:{b_port}", gamma=2, deadline_s=5),
                            SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB), on_round=drain_a_after_3_rounds)
        async with client:
            gen = client.generate([0, 5, 6], SamplingSettings(temperature=0.0, max_new_tokens=40, ignore_eos=True))
            ids = await asyncio.wait_for(gen.text(), 20) and gen.stats.token_ids
        assert len(ids) == 40 and gen.stats.replays >= 1
        assert restarted and len(restarted[0].engine.sessions) == 1   # finished on A's restart
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)
        await a.stop()
        for r in restarted:
            await r.stop()


async def test_an_edge_whose_replicas_all_drain_waits_out_their_hint_between_moves():
    """Every replica refuses "moved": the edge goes from one to the next, waiting the hint between
    moves (not round and round at once), and gives up after max_wait_s. The count of refusals is
    the measure: 0.6 s with a 100-200 ms wait each is at most ~8; without waiting, thousands."""
    a, b = await _synthetic().start(), await _synthetic().start()
    try:
        a.servicer.drain()
        b.servicer.drain()
        refused = metrics.REFUSED.labels("draining")
        before = refused._value.get()
        client = EdgeClient(edge_options(f"127.0.0.1:{a.port},127.0.0.1:{b.port}", gamma=2, deadline_s=5,
                                         max_wait_s=0.6), SyntheticDrafter(VOCAB), SyntheticTokenizer(VOCAB))
        async with client:
            gen = client.generate([0, 5, 6], SamplingSettings(temperature=0.0, max_new_tokens=8, ignore_eos=True))
            with pytest.raises(EdgeError) as e:
                await asyncio.wait_for(gen.text(), 10)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in str(e.value)
        assert 2 <= refused._value.get() - before <= 12
        assert gen.stats.backoffs >= 1
    finally:
        await a.stop()
        await b.stop()


# --- the replay budget ---------------------------------------------------------------------------

async def test_a_long_generation_survives_more_restarts_than_max_replays():
    """max_replays bounds replays in a row; a generation that commits between losses goes on."""
    server = VerifierServer(SyntheticBackend(vocab=VOCAB), "127.0.0.1", 0, Limits(), grace_s=1.0)
    await server.start()
    try:
        # The verifier loses every session after each committed round (a restart between rounds).
        client = EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=2, max_replays=1),
                            SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB),
                            on_round=lambda _: server.engine.sessions.clear())
        async with client:
            gen = client.generate([0, 5, 6], SamplingSettings(temperature=0.0, max_new_tokens=30, ignore_eos=True))
            ids = [t async for t in gen] and gen.stats.token_ids
        assert len(ids) == 30 and gen.stats.replays >= 5
    finally:
        await server.stop()


def test_replays_in_a_row_without_progress_are_bounded():
    """The control: the same budget stops a verifier that loses the session before anything commits."""
    import types

    from edge_client.crossvocab import PromptPlan
    from edge_client.options import Speculation
    from edge_client.remote import RemoteSession
    from edge_client.stats import GenerationStats
    from edge_client.transport import EdgeError
    link = types.SimpleNamespace(verifier=None, transport=edge_options("x:1", max_replays=3).transport)
    remote = RemoteSession(link, Speculation(plan="off"), SamplingSettings(), None, PromptPlan([0, 5, 6], None),
                           GenerationStats())
    remote.session_id, remote.last_round = "s", 4
    lost = EdgeError(grpc.StatusCode.NOT_FOUND, "session 's' is unknown here")
    assert [remote.replay_after(lost, 4) for _ in range(4)] == [True, True, True, False]
    assert remote.replay_after(lost, 5) is True   # a round committed: the budget starts again
    assert remote.replay_after(EdgeError(grpc.StatusCode.INVALID_ARGUMENT, "bad"), 5) is False
