"""Parking idle sessions' KV cells in host memory (llama_runtime.SharedKV.park/restore,
cloud_verifier.backends.kvpark, spec_core.kvpark): a restored session's logits are bit for bit
those it would have had unparked, a failure falls back to a replay, and the policy parks only
what pays."""
from __future__ import annotations

import asyncio
import math

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from cloud_verifier.backends.base import StateLost
from cloud_verifier.backends.kvpark import NoPlaceYet
from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from cloud_verifier.backends.synthetic import SyntheticBackend
from cloud_verifier.cli import backend_from_args, build_parser
from edge_client import EdgeClient
from edge_client.drafters import SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from helpers import edge_options, running_server, stub_for
from llama_runtime import GGUFModel, SharedKV, kv_bytes_per_token
from spec_core.kvpark import ParkCandidate, ParkCost, choose_victim, idle_share, next_use, parked_capacity
from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import SamplingSettings

PROMPTS = ["hello world, the list", "def return the list of a", "the the the", "a list of hello"]


def _rounds(model, k: int, n_rounds: int = 10):
    """Rounds of sequence k: drafts of 0-5 random tokens, a random accepted prefix, a new token."""
    rng = np.random.default_rng(100 + k)
    seq = model.tokenize(PROMPTS[k % len(PROMPTS)])
    for _ in range(n_rounds):
        drafts = [int(t) for t in rng.integers(3, model.n_vocab, size=int(rng.integers(0, 6)))]
        yield seq + drafts, len(drafts) + 1
        seq = seq + drafts[:int(rng.integers(0, len(drafts) + 1))] + [int(rng.integers(3, model.n_vocab))]


def _rows_alone(model, k: int, n_rounds: int = 10) -> np.ndarray:
    ctx = model.new_context(512, invariant=True)
    rows = np.concatenate([ctx.logits(toks, rows) for toks, rows in _rounds(model, k, n_rounds)])
    ctx.close()
    return rows


def _run(kv: SharedKV, seq: int, tokens, rows) -> np.ndarray:
    items = kv.prepare(seq, tokens, rows)
    out = []
    for i in range(0, len(items), kv.n_ubatch):
        out += kv.decode(items[i:i + kv.n_ubatch])
    return np.stack(out)


# --- the runtime: park, restore, same rows -----------------------------------------------------

def test_restored_cells_give_the_rows_of_cells_never_parked(tiny_models):
    """Sequence 0 is parked after every round while the other sequences go on (rollbacks,
    releases, compactions) and a newcomer takes its place for a while; it is restored at another
    place in the cache: every row bit-identical to a private context's that was never parked."""
    model = GGUFModel(str(tiny_models["target"]), n_threads=1)
    kv = SharedKV(model, 3, 100, slack=33, n_ids=4)
    seq, others = kv.acquire(), [kv.acquire(), kv.acquire()]
    assert kv.acquire() is None           # 4 ids, but 3 places
    got, refused = [], 0
    rounds_b = [list(_rounds(model, k, 10)) for k in (1, 2)]
    for r, (tokens, rows) in enumerate(_rounds(model, 0, 10)):
        got.append(_run(kv, seq, tokens, rows))
        parked = kv.park(seq)
        assert parked.tokens == tokens and parked.nbytes > 0 and kv.held[seq] == [] and kv.free_places == 1
        with pytest.raises(RuntimeError, match="parked"):
            kv.prepare(seq, tokens, 1)
        for j, other in enumerate(others):   # the others fill and free cells in between
            _run(kv, other, *rounds_b[j][r])
        if r % 3 == 1:                       # a newcomer takes the place for a while
            newcomer = kv.acquire()
            _run(kv, newcomer, *rounds_b[1][r])
            assert not kv.restore(seq, parked)
            refused += 1
            kv.release(newcomer)
        kv.maintain()                        # between passes, as the batcher does
        assert kv.restore(seq, parked) and kv.held[seq] == tokens
    assert kv.compactions >= 1 and refused >= 3, (kv.compactions, refused)
    np.testing.assert_array_equal(_rows_alone(model, 0), np.concatenate(got))
    kv.close()


def test_a_restore_llama_cpp_refuses_leaves_the_cache_consistent(tiny_models):
    """Corrupt bytes: RuntimeError, the sequence has its place and holds nothing, and the others'
    rows are unchanged."""
    model = GGUFModel(str(tiny_models["target"]), n_threads=1)
    kv = SharedKV(model, 2, 256)
    a, b = kv.acquire(), kv.acquire()
    tokens_a, tokens_b = model.tokenize(PROMPTS[0]), model.tokenize(PROMPTS[1])
    want_a = _run(kv, a, tokens_a, 2)
    before = _run(kv, b, tokens_b, 2)
    parked = kv.park(a)
    bad = parked._replace(data=parked.data[: parked.nbytes // 2].copy())
    with pytest.raises(RuntimeError):
        kv.restore(a, bad)
    assert kv.held[a] == [] and kv.free_places == 0 and a not in kv.parked
    kv.release(b)
    b = kv.acquire()
    np.testing.assert_array_equal(before, _run(kv, b, tokens_b, 2))
    np.testing.assert_array_equal(want_a, _run(kv, a, tokens_a, 2))   # evaluated again from its tokens
    kv.close()


def test_a_restore_that_must_wait_for_a_tree_in_flight_keeps_the_cells_parked(tiny_models):
    """Parking x trees: the parked cells fit only after a compaction, and another session's tree is
    in flight (a compaction now would drop its node cells). The restore says "not now" (False: the
    batcher prepares the round again after the pass, NoPlaceYet) and the sequence stays parked with
    its cells; once the tree has finished it is restored, and its next rows are bit for bit a
    private context's. (Before: RuntimeError, taken for refused bytes: the parked cells were
    dropped and the round failed on a sequence still marked parked.)"""
    model = GGUFModel(str(tiny_models["target"]), n_threads=1)
    kv = SharedKV(model, 2, 100, slack=33, n_ids=3, tree_ids=4)
    a, b = kv.acquire(), kv.acquire()
    rounds_a = list(_rounds(model, 0, 2))
    got = [_run(kv, a, *rounds_a[0])]
    parked = kv.park(a)
    rng = np.random.default_rng(3)
    for _ in range(10):   # b's rollbacks retire cells until a's cells need a compaction to fit
        if kv.used_cells + len(parked.tokens) + kv.n_ubatch + 1 > kv.n_cells:
            break
        _run(kv, b, [1] + [int(t) for t in rng.integers(3, model.n_vocab, 20)], 1)
    assert kv.used_cells + len(parked.tokens) + kv.n_ubatch + 1 > kv.n_cells
    job = kv.tree_job(b, kv.held[b], [5, 6, 7], [-1, 0, -1])
    kv.decode(job.prepare())                      # b's tree is in flight
    assert kv.restore(a, parked) is False
    assert a in kv.parked and kv.held[a] == []
    job.finish()
    kv.maintain()
    assert kv.restore(a, parked) and kv.held[a] == parked.tokens
    got.append(_run(kv, a, *rounds_a[1]))
    np.testing.assert_array_equal(_rows_alone(model, 0, 2), np.concatenate(got))
    kv.close()


# --- the policy ---------------------------------------------------------------------------------

COST = ParkCost(park_s_per_byte=1e-9, restore_s_per_byte=1e-9, fixed_s=1e-3)   # 1 MB: 3 ms


def test_parking_pays_only_for_a_session_expected_away_longer_than_the_move():
    now = 10.0
    # No forecast yet (no full idle gap seen): the ski-rental rule, idle at least as long as the move.
    young = ParkCandidate(1, idle_since=now - 0.002, nbytes=1_000_000, mean_gap_s=None)   # idle 2 ms < 3 ms
    old = ParkCandidate(2, idle_since=now - 0.004, nbytes=1_000_000, mean_gap_s=None)     # idle 4 ms > 3 ms
    assert choose_victim([young], now, COST, bytes_free=10**9) is None
    assert choose_victim([young, old], now, COST, bytes_free=10**9) == 2
    assert choose_victim([old], now, COST, bytes_free=999_999) is None   # does not fit the host bytes left
    # A forecast: due back in 298 ms, worth moving at once; due back in 2 ms, not.
    leaving = ParkCandidate(3, idle_since=now - 0.002, nbytes=1_000_000, mean_gap_s=0.3)
    returning = ParkCandidate(4, idle_since=now - 0.298, nbytes=1_000_000, mean_gap_s=0.3)
    assert choose_victim([leaving], now, COST, 10**9) == 3
    assert choose_victim([returning], now, COST, 10**9) is None
    assert choose_victim([leaving], now, COST, 10**9, order="lru") is None   # lru: the ski-rental rule only


def test_the_session_expected_back_last_is_parked_first():
    """Rounds that recur every round trip: least-recently-used parks the session about to come back;
    next-use parks the one that just left. Sessions never seen back, or long overdue, go first."""
    now = 10.0
    back_soon = ParkCandidate(1, idle_since=now - 0.25, nbytes=1000, mean_gap_s=0.3)   # back in 50 ms
    back_late = ParkCandidate(2, idle_since=now - 0.05, nbytes=1000, mean_gap_s=0.3)   # back in 250 ms
    assert choose_victim([back_soon, back_late], now, COST, 10**9) == 2
    assert choose_victim([back_soon, back_late], now, COST, 10**9, order="lru") == 1
    overdue = ParkCandidate(3, idle_since=now - 0.7, nbytes=1000, mean_gap_s=0.3)      # 2.3 gaps late
    unseen = ParkCandidate(4, idle_since=now - 0.01, nbytes=1000, mean_gap_s=None)
    assert next_use(overdue, now) == math.inf and next_use(unseen, now) == math.inf
    assert next_use(back_late, now) == pytest.approx(now + 0.25)
    assert choose_victim([back_soon, back_late, unseen, overdue], now, COST, 10**9) == 3   # LRU among the never
    with pytest.raises(ValueError):
        choose_victim([back_soon], now, COST, 10**9, order="mru")


def test_cost_estimates_follow_measurements_and_capacity_counts_full_contexts():
    cost = ParkCost()
    for _ in range(40):
        cost = cost.observed(1_000_000, park_s=0.002, restore_s=0.0005)
    assert cost.park_s_per_byte == pytest.approx(2e-9, rel=1e-3)
    assert cost.restore_s_per_byte == pytest.approx(5e-10, rel=1e-3)
    assert cost.observed(0, park_s=1.0) == cost
    assert parked_capacity(1 << 30, 23_056, 512) == 90
    assert parked_capacity(0, 23_056, 512) == 0
    assert idle_share(1.0, 3.0) == 0.75 and idle_share(0.0, 0.0) is None


# --- the verifier --------------------------------------------------------------------------------

def parking_backend(tiny_models, places: int, **kw) -> LlamaCppBackend:
    return LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1, batching=True,
                           kv_tokens=places * 512, kv_park=True, **kw)


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels or None) or 0.0


def test_two_sessions_take_turns_in_one_place(tiny_models):
    """One place, two sessions whose rounds alternate: each round parks the other session and
    restores this one; every row bit-identical to a private context's."""
    backend = parking_backend(tiny_models, places=1)
    model = backend.model
    assert backend.caps.max_states == min(190, 1 + parked_capacity(1 << 30, kv_bytes_per_token(model), 512))
    backend.book.cost = ParkCost(0.0, 0.0, 0.0)   # any idle time pays for a move
    parks0, restores0 = _sample("hybridspec_kv_parks_total"), _sample("hybridspec_kv_restores_total")
    states = [backend.new_state()]
    rounds = [list(_rounds(model, k)) for k in range(2)]
    got = [[], []]
    for r in range(len(rounds[0])):
        for k in range(2):
            if len(states) == k:
                states.append(backend.new_state())   # the place is taken: session 0 is parked
            got[k].append(backend.target_logits(states[k], *rounds[k][r])[0])
    for s in states:
        backend.release(s)
    assert backend.book.parked_bytes == 0
    alone = [_rows_alone(model, k) for k in range(2)]
    backend.close()
    assert _sample("hybridspec_kv_parks_total") - parks0 == 2 * len(rounds[0]) - 1
    assert _sample("hybridspec_kv_restores_total") - restores0 == 2 * len(rounds[0]) - 2
    for k in range(2):
        np.testing.assert_array_equal(alone[k], np.concatenate(got[k]))


def test_without_parking_a_full_cache_refuses_and_idle_time_is_still_measured(tiny_models):
    from cloud_verifier.backends.base import NoFreeState
    backend = LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1, batching=True, kv_tokens=512)
    assert backend.caps.max_states == 1
    idle0 = _sample("hybridspec_kv_session_seconds_total", state="idle")
    state = backend.new_state()
    tokens, rows = next(_rounds(backend.model, 0))
    backend.target_logits(state, tokens, rows)
    backend.target_logits(state, tokens, rows)
    with pytest.raises(NoFreeState):
        backend.new_state()
    backend.release(state)
    backend.close()
    assert _sample("hybridspec_kv_session_seconds_total", state="idle") > idle0


async def _generate(port, drafter, prompt, seed=None, n=24, **client_kw):
    temperature = 0.0 if seed is None else 0.9
    async with EdgeClient(edge_options(f"127.0.0.1:{port}", gamma=4, **client_kw), drafter, drafter.model) as c:
        gen = c.generate(prompt, SamplingSettings(temperature=temperature, max_new_tokens=n, ignore_eos=True,
                                                  seed=seed))
        await gen.text()
    return gen.stats


def _park_after_every_round(backend) -> list[int]:
    """Make the backend park each session as its round (chain or tree) ends; returns a list that
    counts them."""
    parked = []
    verify_round = backend.verify_round

    def verify_then_park(state, *args, **kw):
        out = verify_round(state, *args, **kw)
        # (False: the policy had parked it already, to make room for another session)
        parked.append(int(backend.book.park(state) or state.parked is not None))
        return out
    backend.verify_round = verify_then_park
    return parked


async def test_greedy_text_with_parking_on_every_round_equals_the_text_without(tiny_models, drafters):
    """4 concurrent greedy sessions (and 4 seeded sampling ones) on 2 places, every session parked
    as each of its rounds ends and restored when the next arrives: the same tokens as on the
    batched verifier without parking, with room for all."""
    plain = LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1, batching=True, kv_tokens=8 * 512)
    async with running_server(plain) as server:
        greedy = [(await _generate(server.port, d, p)).token_ids for d, p in zip(drafters, PROMPTS)]
        seeded = [(await _generate(server.port, d, p, seed=k)).token_ids
                  for k, (d, p) in enumerate(zip(drafters, PROMPTS))]
    plain.close()
    backend = parking_backend(tiny_models, places=2)
    parked = _park_after_every_round(backend)
    restores0 = _sample("hybridspec_kv_restores_total")
    async with running_server(backend) as server:
        runs = await asyncio.gather(*[_generate(server.port, d, p) for d, p in zip(drafters, PROMPTS)])
        runs_seeded = await asyncio.gather(*[_generate(server.port, d, p, seed=k)
                                             for k, (d, p) in enumerate(zip(drafters, PROMPTS))])
    backend.close()
    rounds = sum(s.rounds for s in runs + runs_seeded)
    assert sum(parked) == rounds     # every round ended with its session parked ...
    assert _sample("hybridspec_kv_restores_total") - restores0 == rounds - len(runs + runs_seeded)  # ... and back
    assert [s.token_ids for s in runs] == greedy
    assert [s.token_ids for s in runs_seeded] == seeded
    assert len({tuple(t) for t in greedy}) == len(PROMPTS)
    for state in ("busy", "idle", "parked"):
        assert _sample("hybridspec_kv_session_seconds_total", state=state) > 0, state
    assert _sample("hybridspec_kv_idle_gap_seconds_count") > 0


async def test_a_failed_restore_replays_on_the_server_and_no_place_replays_from_the_edge(tiny_models, drafters):
    """Nothing lost: a restore llama.cpp refuses evaluates the committed tokens again (same text);
    a parked round that finds no place in time gets NOT_FOUND and its edge replays (same text)."""
    plain = LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1, batching=True, kv_tokens=8 * 512)
    async with running_server(plain) as server:
        want = [(await _generate(server.port, d, p)).token_ids for d, p in zip(drafters[:2], PROMPTS)]
    plain.close()

    backend = parking_backend(tiny_models, places=2)
    _park_after_every_round(backend)
    restore = backend.kv.restore
    calls = [0]

    def flaky_restore(seq, parked):
        calls[0] += 1
        if calls[0] % 2:
            backend.kv.parked.discard(seq)   # as llama.cpp leaves it: the place taken, nothing held
            raise RuntimeError("injected: llama.cpp refused the bytes")
        return restore(seq, parked)
    backend.kv.restore = flaky_restore
    failures0 = _sample("hybridspec_kv_park_failures_total", stage="restore")
    async with running_server(backend) as server:
        runs = await asyncio.gather(*[_generate(server.port, d, p) for d, p in zip(drafters[:2], PROMPTS)])
    backend.close()
    assert _sample("hybridspec_kv_park_failures_total", stage="restore") - failures0 >= 2
    assert [s.token_ids for s in runs] == want

    backend = parking_backend(tiny_models, places=2)
    _park_after_every_round(backend)
    bring_back, lost = backend.book.bring_back, [0]

    def lost_twice(seq):
        if seq in backend.kv.parked and lost[0] < 2:
            lost[0] += 1
            raise StateLost("injected: no place in time")
        return bring_back(seq)
    backend.book.bring_back = lost_twice
    async with running_server(backend) as server:
        runs = await asyncio.gather(*[_generate(server.port, d, p, max_replays=10) for d, p in
                                      zip(drafters[:2], PROMPTS)])
        assert len(server.engine.sessions) == 2   # the sessions that lost their cells were dropped
    assert backend.book.parked_bytes == 0 and backend.kv.live_cells == 0
    backend.close()
    assert lost[0] == 2 and sum(s.replays for s in runs) == 2
    assert [s.token_ids for s in runs] == want


def test_a_round_that_finds_no_place_in_time_is_lost_not_wrong(tiny_models):
    """SeqBook.run: a parked round the batcher cannot place (NoPlaceYet) is retried until
    restore_wait_s, then StateLost (the engine answers NOT_FOUND: the edge replays)."""
    backend = parking_backend(tiny_models, places=1)
    state = backend.new_state()
    backend.book.restore_wait_s = 0.05
    tries = [0]

    def never():
        tries[0] += 1
        raise NoPlaceYet("injected")
    with backend.book.round(state):
        with pytest.raises(StateLost):
            backend.book.run(state, never)
    backend.release(state)
    backend.close()
    assert tries[0] >= 2


def test_bad_parking_options_are_refused(tiny_models):
    with pytest.raises(ValueError, match="batching"):
        LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, batching=False, kv_park=True)
    with pytest.raises(ValueError, match="kv-park-bytes"):
        parking_backend(tiny_models, places=1, kv_park_bytes=0)
    with pytest.raises(ValueError, match="kv-park-order"):
        parking_backend(tiny_models, places=1, kv_park_order="mru")
    args = build_parser().parse_args(["serve", "--backend", "vllm", "--model", "x", "--kv-park", "on"])
    with pytest.raises(SystemExit, match="vLLM manages its own KV cache"):
        backend_from_args(args)
    args = build_parser().parse_args(["serve", "--backend", "synthetic", "--batching", "off", "--kv-park", "on"])
    with pytest.raises(SystemExit, match="batching on"):
        backend_from_args(args)
    with pytest.raises(ValueError, match="kv-park-bytes"):
        SyntheticBackend(batching=True, kv_park=True, kv_park_bytes=0)
    args = build_parser().parse_args(["serve", "--model", str(tiny_models["target"]), "--batching", "off",
                                      "--kv-park", "on"])
    with pytest.raises(SystemExit, match="batching on"):
        backend_from_args(args)


async def test_a_parked_session_is_closed_cleanly(tiny_models):
    """Releasing a parked session frees its bytes; the server's Close reaches it."""
    backend = parking_backend(tiny_models, places=1)
    a = backend.new_state()
    backend.target_logits(a, *next(_rounds(backend.model, 0)))
    assert backend.book.park(a) and backend.book.parked_bytes > 0 and backend.kv.free_places == 1
    assert backend.book.parked_sessions == 1
    backend.release(a)
    assert backend.book.parked_bytes == 0 and backend.book.parked_sessions == 0
    with pytest.raises(RuntimeError, match="released"):
        backend.target_logits(a, *next(_rounds(backend.model, 0)))
    backend.close()


def test_netsim_load_reads_the_kv_metrics():
    """netsim load's summary of the verifier's hybridspec_kv_* samples (as its scrape parses them)."""
    from netsim.load import _kv_lines, kv_between_rounds
    key = 'hybridspec_kv_session_seconds_total{{state="{}"}}'
    before = {key.format("busy"): 1.0, key.format("idle"): 1.0, key.format("parked"): 0.0}
    after = {key.format("busy"): 3.0, key.format("idle"): 5.0, key.format("parked"): 4.0,
             "hybridspec_kv_parks_total": 10.0, "hybridspec_kv_restores_total": 8.0,
             "hybridspec_kv_park_seconds_total": 0.02, "hybridspec_kv_restore_seconds_total": 0.008,
             "hybridspec_kv_park_bytes_total": 2e7, 'hybridspec_kv_park_failures_total{stage="restore"}': 1.0}
    kv = kv_between_rounds(before, after, rounds=20)
    assert kv["idle_share"] == pytest.approx(8 / 10) and kv["parked_share"] == pytest.approx(4 / 10)
    assert kv["park_ms"] == pytest.approx(2.0) and kv["restore_ms"] == pytest.approx(1.0)
    assert kv["park_bytes"] == pytest.approx(2e6) and kv["move_ms_per_round"] == pytest.approx(1.4)
    assert kv["failures"] == 1.0
    assert "80% idle" in _kv_lines([{"edges": 4, "mode": "hybrid", "kv": kv}])[0]
    assert kv_between_rounds({}, {"hybridspec_verify_rounds_total": 3.0}, 3) is None   # a verifier without them


# --- the synthetic target parks too (the fleet and load tests' verifier) ----------------------------

def test_the_synthetic_target_parks_and_restores_with_its_rows_unchanged():
    """One place, two sessions whose rounds alternate: each round parks the other session and
    restores this one (counted by the metrics), and every row is the synthetic target's own."""
    backend = SyntheticBackend(vocab=16, n_ctx=64, batching=True, kv_tokens=64, kv_park=True)
    assert backend.caps.max_states == 1 + parked_capacity(1 << 30, 4, 64)
    backend.book.cost = ParkCost(0.0, 0.0, 0.0)   # any idle time pays for a move
    parks0, restores0 = _sample("hybridspec_kv_parks_total"), _sample("hybridspec_kv_restores_total")
    states = [backend.new_state()]
    seqs = [[0, 3, 4], [0, 5, 6, 7]]
    for r in range(5):
        for k in range(2):
            if len(states) == k:
                states.append(backend.new_state())   # the place is taken: session 0 is parked
            seqs[k] = seqs[k] + [(r + k) % 16, (3 * r) % 16]
            rows = backend.target_logits(states[k], seqs[k], 3)[0]
            want = np.stack([backend.lm.logits(seqs[k][:len(seqs[k]) - 2 + i]) for i in range(3)])
            np.testing.assert_array_equal(rows, want)
    for st in states:
        backend.release(st)
    backend.batcher.acquire(lambda: None)   # releases apply between passes
    assert backend.book.parked_bytes == 0 and backend.kv.held == {} and not backend.kv.parked
    backend.close()
    assert _sample("hybridspec_kv_parks_total") - parks0 == 9
    assert _sample("hybridspec_kv_restores_total") - restores0 == 8


async def test_greedy_text_with_synthetic_parking_equals_the_target_s():
    """`serve --backend synthetic --kv-park on` with 2 places: 4 concurrent greedy sessions, each
    parked as its rounds end and restored when the next arrives, give the target's own text."""
    from test_faults import VOCAB, synthetic_greedy
    args = build_parser().parse_args(["serve", "--backend", "synthetic", "--kv-park", "on", "--n-ctx", "256",
                                      "--kv-tokens", "512", "--synthetic-vocab", str(VOCAB)])
    backend = backend_from_args(args)
    parked = _park_after_every_round(backend)
    settings = SamplingSettings(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    async with running_server(backend) as server:
        async def one(k):
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3),
                                  SyntheticDrafter(VOCAB, noise=0.3), SyntheticTokenizer(VOCAB)) as c:
                gen = c.generate(f"{k + 2} {k + 5}", settings)
                await gen.text()
                return gen.stats
        runs = await asyncio.gather(*[one(k) for k in range(4)])
    backend.close()
    assert sum(parked) == sum(s.rounds for s in runs)
    for k, stats in enumerate(runs):
        assert stats.token_ids == synthetic_greedy([0, k + 2, k + 5], 24)


def _open(prompt, max_new_tokens=8):
    return pb.VerifyRequest(round=1, committed_length=len(prompt), open=pb.OpenSession(
        prompt_token_ids=prompt, sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)))


@pytest.mark.parametrize("rule", ["frees room", "control: any idle session"])
async def test_the_engine_never_evicts_a_parked_session_that_frees_no_place(rule):
    """One place. A opens and goes idle; B opens (A is parked) and is then mid-round (its session
    locked, its KV busy). C opens: no place, nothing to park, so the engine looks for an idle
    session to evict. The only one is A, parked: evicting it frees no place. The rule keeps A
    (C is refused at once, RESOURCE_EXHAUSTED); control, the old rule (any idle session): A is
    evicted for nothing (its edge must replay) and C is refused all the same, after a second wait."""
    backend = SyntheticBackend(vocab=16, n_ctx=64, batching=True, kv_tokens=64, kv_park=True)
    backend.book.cost = ParkCost(0.0, 0.0, 0.0)
    backend.book.restore_wait_s = 0.2
    if rule.startswith("control"):
        backend.release_frees_room = lambda state: True
    tries = []
    new_state = backend.new_state
    backend.new_state = lambda: tries.append(1) or new_state()
    async with running_server(backend, max_sessions=8) as server:
        async with stub_for(server) as stub:
            a = await stub.Verify(_open([0, 3, 3]), timeout=10)
            b = await stub.Verify(_open([0, 4, 4]), timeout=10)
            assert backend.book.parked_sessions == 1
            session_b = server.engine.sessions.get(b.session_id)
            async with session_b.lock:                       # B mid-round: not evictable ...
                with backend.book.round(session_b.state):    # ... and its KV busy: not parkable
                    tries.clear()
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Verify(_open([0, 5]), timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            kept = {s.id for s in server.engine.sessions.sessions()}
            if rule == "frees room":
                assert kept == {a.session_id, b.session_id} and len(tries) == 1
                assert backend.book.parked_sessions == 1
            else:
                assert kept == {b.session_id} and len(tries) == 2
    backend.close()


@pytest.mark.parametrize("rule", ["frees room", "control: any idle session"])
async def test_the_engine_evicts_the_session_in_a_place_when_parking_is_full(rule):
    """One place; host bytes for one parked session. A opens and goes idle; B opens and A is
    parked; C opens: B cannot be parked (no bytes left), so the engine evicts an idle session.
    The rule skips A (parked: its eviction frees no place) and evicts B, whose place C takes.
    Control, the old rule: the least recently used, A, is evicted; its bytes then let B be parked,
    so C opens too, but A's edge lost its session for no place."""
    backend = SyntheticBackend(vocab=16, n_ctx=16, batching=True, kv_tokens=16, kv_park=True,
                               kv_park_bytes=4 * 16)
    backend.book.cost = ParkCost(0.0, 0.0, 0.0)
    backend.book.restore_wait_s = 0.2
    if rule.startswith("control"):
        backend.release_frees_room = lambda state: True
    async with running_server(backend, max_sessions=8) as server:
        async with stub_for(server) as stub:
            a = await stub.Verify(_open([0] + [3] * 11), timeout=10)
            b = await stub.Verify(_open([0] + [4] * 11), timeout=10)
            assert backend.book.parked_sessions == 1
            c = await stub.Verify(_open([0, 5]), timeout=10)
            assert c.committed_length == 3
            kept = {s.id for s in server.engine.sessions.sessions()}
            if rule == "frees room":
                assert kept == {a.session_id, c.session_id}   # B was evicted, A is still parked
            else:
                assert kept == {b.session_id, c.session_id}
    backend.close()
