"""Live rounds first and honest admission, by counting passes and recording order (never timing):

- the prefill budget rule (cloud_verifier.backends.prefill_budget) on literal cases;
- a batcher whose pass cost is fixed: every pass planned while a session is live holds at most the
  rule's chunk of prefill tokens (a fixed chunk, the negative control, holds more);
- prefills in order: replays first, then new sessions in arrival order;
- the first-token prediction on a fake clock (cloud_verifier.first_token);
- a verifier predicted too slow answers RESOURCE_EXHAUSTED with a retry hint before the session's
  first pass (the target ran no pass for it), and an edge given two replicas moves to the other one
  and generates exactly what that replica alone gives.
"""
from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from cloud_verifier.admission import Refused, ServerPolicy
from cloud_verifier.backends.batcher import Batcher
from cloud_verifier.backends.prefill_budget import (PrefillBudget, cap_prefills, chunk_tokens, idle_tokens, order,
                                                    vllm_chunk_args)
from cloud_verifier.backends.synthetic import SyntheticBackend
from cloud_verifier.backends.vllm_prefill import PrefillMeter
from cloud_verifier.engine import Limits
from cloud_verifier.first_token import HOLD_FACTOR, HOLD_GRACE_S, FirstTokens, Hold
from cloud_verifier.server import VerifierServer
from edge_client import EdgeClient
from edge_client.drafters import SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from helpers import HeldPasses, edge_options, stub_for
from spec_core.batchplan import PassItem
from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import SamplingSettings
from spec_core.wire import ELSEWHERE_KEY, HELD_KEY, QUEUED_KEY, REPLICAS_KEY, RETRY_AFTER_KEY

VOCAB = 64
PER_TOKEN_S = 0.001   # the fixed cost line of the batcher tests: 1 ms a token, no base


# --- the rule ------------------------------------------------------------------------------------

def test_chunk_is_a_share_of_the_pace_in_tokens():
    assert chunk_tokens(0.0, 0.001, 10, 0.05) == 12            # 0.25 x 50 ms at 1 ms a token
    assert chunk_tokens(0.0, 0.001, 400, 0.05) == 100          # the live pass (400 ms) is the pace
    assert chunk_tokens(0.0, 0.001, 10, 0.2) == 50             # a looser pace lets more in
    assert chunk_tokens(0.002, 0.0002, 5, 0.05, pass_tokens=32) == 27   # what the pass has left
    assert chunk_tokens(0.0, 1.0, 5, 0.05) == 1                # a prefill always moves
    with pytest.raises(ValueError):
        chunk_tokens(0.0, 0.0, 5, 0.05)


def test_a_pass_without_rounds_runs_until_the_next_round_is_due():
    assert idle_tokens(0.01, 0.005, 0.06, 3, 32) == 10         # (60 - 10) ms at 5 ms a token
    assert idle_tokens(0.01, 0.005, 0.0, 3, 32) == 3           # a round is due: a ride's worth
    assert idle_tokens(0.01, 0.005, 9.0, 3, 32) == 32          # nobody due for long: a whole pass


def test_prefills_take_the_budget_replays_first_then_by_arrival():
    assert order([(False, 1.0), (True, 3.0), (False, 0.5)]) == [1, 2, 0]
    assert cap_prefills([5, 27, 0], [5, 300, 300], [False, True, True], [2, 1], 12) == [5, 0, 12]
    assert cap_prefills([5, 27, 0], [5, 4, 300], [False, True, True], [1, 2], 12) == [5, 4, 8]


def test_budget_is_unbounded_with_nobody_live_and_paced_by_the_tightest_slo_or_round_without_prefills():
    b = PrefillBudget()
    assert b.chunk((0.0, PER_TOKEN_S), 0, now=0.0, pass_tokens=512, fallback=128) is None
    b.done(1, now=0.0)
    assert b.chunk((0.0, PER_TOKEN_S), 5, now=1.0, pass_tokens=512, fallback=128) == 12   # the default pace
    b.arrived(1, now=0.195)
    b.done(1, now=0.3)                                       # a think time of 195 ms: + 5 ms of pass, 200 ms
    assert b.think[1] == pytest.approx(0.195)
    assert b.chunk((0.0, PER_TOKEN_S), 5, now=0.3, pass_tokens=512, fallback=128) == 50
    b.pace[1] = 0.08                                         # an SLO stated: its slack is the prefill's
    assert b.chunk((0.0, PER_TOKEN_S), 5, now=0.3, pass_tokens=512, fallback=128) == 20
    assert b.chunk((0.0, 0.0), 5, now=0.3, pass_tokens=512, fallback=128) == 128   # cost not measured yet
    assert b.chunk((0.0, PER_TOKEN_S), 0, now=0.3 + b.live_window_s + 1, pass_tokens=512, fallback=128) is None


def test_a_prefill_gets_the_idle_time_until_the_next_round_is_due():
    """Session 1 finished at 0.3 s and comes back after 100 ms (its think time): a pass without
    rounds planned at 0.31 s may run until 0.39 s (90 % of the think time: a round is expected a
    little early), 75 tokens at 1 ms; at 0.39 s, or with its round waiting, it holds the ride's 50
    (a quarter of its 200 ms SLO)."""
    b = PrefillBudget()
    b.pace[1] = 0.2
    b.done(1, now=0.2)
    b.arrived(1, now=0.2 + 0.1)
    b.done(1, now=0.3)
    cost = (0.005, PER_TOKEN_S)
    assert b.chunk(cost, 0, now=0.31, pass_tokens=512, fallback=128) == 75
    assert b.chunk(cost, 0, now=0.39, pass_tokens=512, fallback=128) == 50
    b.arrived(1, now=0.35)
    assert b.chunk(cost, 0, now=0.35, pass_tokens=512, fallback=128) == 50
    assert b.chunk(cost, 0, now=0.35, pass_tokens=512, fallback=128, busy={1}) is None   # its own prefill


def test_vllm_gets_chunked_prefill_on_a_gpu_only():
    assert vllm_chunk_args({}, cpu=False, max_model_len=4096) == {"enable_chunked_prefill": True,
                                                                  "long_prefill_token_threshold": 256}
    assert vllm_chunk_args({}, cpu=False, max_model_len=128)["long_prefill_token_threshold"] == 128
    assert vllm_chunk_args({"long_prefill_token_threshold": 64}, cpu=False, max_model_len=4096) == \
        {"enable_chunked_prefill": True}
    assert vllm_chunk_args({}, cpu=True, max_model_len=4096) == {}
    assert vllm_chunk_args({"enable_chunked_prefill": False}, cpu=False, max_model_len=4096) == {}


# --- the batcher, counted ------------------------------------------------------------------------

class FixedCost:
    """A pass cost line that does not depend on the machine: PER_TOKEN_S a token."""

    def line(self):
        return 0.0, PER_TOKEN_S

    def observe(self, tokens, seconds):
        pass


class CountingPacker:
    """A model-free packer (rows are zeros) that records every pass's items."""

    def __init__(self, n_ubatch=64):
        self.n_ubatch = n_ubatch
        self.passes: list[list[PassItem]] = []

    def prepare(self, seq, tokens, rows):
        return [PassItem(seq, pos, tok, pos >= len(tokens) - rows) for pos, tok in enumerate(tokens)]

    def decode(self, items):
        self.passes.append(list(items))
        return [np.zeros(4, dtype=np.float32) for it in items if it.want_logits]

    def release(self, seq):
        pass


def _live_session_beside_a_prompt(batcher: Batcher, prompt: int = 600) -> None:
    """Session 1 has a round answered (it is live), then sends 5-token rounds back to back while
    session 2 prefills `prompt` tokens; while the prompt is in, every pass waits for session 1's
    next round, so that each carries one whatever the threads' luck."""
    batcher.note_open(1, replay=False, tpot_s=0.05)   # its pace: 50 ms, whatever the machine's speed
    batcher.submit(1, list(range(5)), 5)
    HeldPasses(batcher, lambda i: 2 if any(r.seq == 2 for r in list(batcher._active) + list(batcher._queue)) else 0)
    done = threading.Event()

    def prefill():
        batcher.submit(2, list(range(prompt)), 1)
        done.set()
    thread = threading.Thread(target=prefill)
    thread.start()
    while not done.is_set():
        batcher.submit(1, list(range(5)), 5)
    thread.join()


def test_a_prefill_chunk_beside_live_rounds_is_bounded_by_the_rule():
    """Every pass planned while session 1 is live holds at most the rule's chunk of session 2's
    prompt (12 tokens: 0.25 x its 50 ms pace at 1 ms a token), counted in the passes the packer ran;
    the prompt still gets in (all 600 tokens, over at least 600 / 12 passes)."""
    packer = CountingPacker()
    batcher = Batcher(packer)
    batcher.cost, batcher.prefill_log = FixedCost(), []
    try:
        _live_session_beside_a_prompt(batcher)
    finally:
        batcher.close()
    bound = chunk_tokens(0.0, PER_TOKEN_S, 5, 0.05)
    assert bound == 12
    assert all(p.chunk == bound and p.prefill_tokens <= p.chunk for p in batcher.prefill_log if p.chunk is not None)
    shared = [p for p in packer.passes if any(it.seq == 1 for it in p) and any(it.seq == 2 for it in p)]
    assert len(shared) >= 600 // bound - 1   # the prompt went in beside live rounds (all but its first pass)
    assert max(sum(it.seq == 2 for it in p) for p in packer.passes) <= bound
    assert sum(it.seq == 2 for p in packer.passes for it in p) == 600
    assert sum(1 for p in packer.passes if any(it.seq == 2 for it in p)) >= 600 // bound


def test_negative_control_a_fixed_chunk_fills_passes_beside_live_rounds():
    """The same workload with a fixed --prefill-chunk (the rule off): the prompt takes what the
    rounds leave of a pass, far more than the rule's 12 tokens, in passes that carry a live round."""
    packer = CountingPacker()
    batcher = Batcher(packer, prefill_chunk=16)
    batcher.cost = FixedCost()
    try:
        _live_session_beside_a_prompt(batcher)
    finally:
        batcher.close()
    assert batcher.budget is None
    beside = [sum(it.seq == 2 for it in p) for p in packer.passes if any(it.seq == 1 for it in p)]
    assert max(beside) > 12


def test_a_prefill_takes_whole_passes_while_the_live_session_is_away():
    """Session 1 is live but away (its think time 10 s: its next round is not due for a while):
    session 2's 600-token prompt goes in whole passes of 64, each planned with the rule (session 1
    live) — the idle time between rounds is the prefill's. Control: session 1's think time not
    known, so its round may come at any time: the ride's 12 tokens a pass."""
    for away in (True, False):
        packer = CountingPacker()
        batcher = Batcher(packer)
        batcher.cost, batcher.prefill_log = FixedCost(), []
        try:
            batcher.note_open(1, replay=False, tpot_s=0.05)
            batcher.submit(1, list(range(5)), 5)
            if away:
                batcher.budget.think[1] = 10.0
            batcher.submit(2, list(range(600)), 1)
        finally:
            batcher.close()
        sizes = [sum(it.seq == 2 for it in p) for p in packer.passes if any(it.seq == 2 for it in p)]
        assert sum(sizes) == 600
        assert all(p.chunk is not None for p in batcher.prefill_log if p.prefill_tokens)   # session 1 live
        assert max(sizes) == (64 if away else 12)


# --- the serial verifier (--batching off), counted -------------------------------------------------

def _serial_prefill_turns(backend: SyntheticBackend, live: bool, prompt: int = 600, away: bool = False) -> list:
    """Session 1 answers a 5-token round (live, unless released; `away`: its think time 10 s), then
    session 2's `prompt`-token prompt goes in; returns the turns its prefill took, as planned
    (Turns.prefill_log). Liveness never lapses here (a window of 1e9 s), whatever the machine's speed."""
    turns = backend.turns
    turns.cost, turns.prefill_log = FixedCost(), []
    if turns.budget is not None:
        turns.budget.live_window_s = 1e9
    first, second = backend.new_state(), backend.new_state()
    backend.target_logits(first, [2, 3, 4, 5, 6], 5)
    if away:
        turns.budget.think[id(first)] = 10.0
    if not live:
        backend.release(first)
    forwarded = backend.forward_tokens()
    backend.target_logits(second, [2 + i % 60 for i in range(prompt)], 1)
    assert backend.forward_tokens() - forwarded == prompt   # all of it went in, once
    return turns.prefill_log


def test_the_serial_verifier_bounds_a_prefill_turn_beside_a_live_session_by_the_rule():
    """--batching off: each turn of session 2's 600-token prompt holds the rule's 12 tokens (0.25 x
    the default 50 ms pace at 1 ms a token, the live round's own pass being 5 ms; session 1's think
    time is not known, so no turn counts on idle time): at least 600 / 12 turns, which session 1's
    next round waits for one of at most."""
    backend = SyntheticBackend(vocab=VOCAB)
    planned = _serial_prefill_turns(backend, live=True)
    bound = chunk_tokens(0.0, PER_TOKEN_S, 5, backend.turns.budget.default_pace_s)
    assert bound == 12
    assert all(turn.chunk == bound and turn.tokens == bound for turn in planned)
    assert len(planned) == -(-600 // bound) - 1   # the last chunk goes with the round's own turn


def test_the_serial_verifier_gives_a_prefill_whole_passes_while_the_live_session_is_away():
    """Session 1 live but away (think time 10 s): session 2's prompt takes a whole pass a turn (512
    tokens; the rest goes with its round's own turn), each planned with the rule."""
    planned = _serial_prefill_turns(SyntheticBackend(vocab=VOCAB), live=True, away=True)
    assert [(turn.tokens, turn.chunk) for turn in planned] == [(512, 512)]


def test_negative_controls_the_serial_verifier_with_a_fixed_chunk_or_nobody_live():
    """The same prompt with --prefill-chunk 128 (the rule off), and with session 1 gone before it
    (nobody live): turns of 128 tokens, ten times the rule's chunk."""
    fixed = _serial_prefill_turns(SyntheticBackend(vocab=VOCAB, prefill_chunk=128), live=True)
    alone = _serial_prefill_turns(SyntheticBackend(vocab=VOCAB), live=False)
    for planned in (fixed, alone):
        assert [turn.tokens for turn in planned] == [128] * 4 and all(turn.chunk is None for turn in planned)


def test_the_serial_verifier_prices_a_new_prompt_for_admission():
    """Its prefill rate: the rule's chunk in each live round's time (two sessions live: no idle time
    counted); None until a turn is measured (admission then admits)."""
    backend = SyntheticBackend(vocab=VOCAB)
    assert backend.prefill_rate() is None
    _serial_prefill_turns(backend, live=True)   # two sessions live, 5-token rounds counted
    live = backend.turns.budget.live(0.0)
    assert len(live) == 2
    assert backend.prefill_rate() == pytest.approx(12 / (0.05 + 12 * PER_TOKEN_S))
    for state in live:   # control: nobody live, the default 128 tokens a turn and no round between
        backend.turns.forget(state)
    assert backend.prefill_rate() == pytest.approx(1 / PER_TOKEN_S)


@pytest.mark.parametrize("live", [True, False])
def test_prefills_finish_replays_first_then_in_arrival_order(live):
    """New sessions A (seq 3), B (seq 4) arrive in that order, then a replay R (seq 5); all three are
    in the batcher before the pass that starts them. The passes that complete them (their first
    tokens), as the packer recorded them: R, A, B,
    with a live session beside them (the rule's chunk a pass) and without (whole passes)."""
    packer = CountingPacker()
    batcher = Batcher(packer)
    batcher.cost = FixedCost()
    finished: list[int] = []
    threads = []
    try:
        # The pass after session 1's first waits until all three prompts are in the batcher.
        held = HeldPasses(batcher, lambda i: 1 if i == 0 else 3 if i == 1 else 0)
        batcher.submit(1, list(range(5)), 5)   # session 1 is live from here on ...
        if not live:
            batcher.release(1)                 # ... or gone before the prompts' first pass
        batcher.note_open(5, replay=True, tpot_s=None)
        for seq in (3, 4, 5):
            t = threading.Thread(target=lambda s=seq: (batcher.submit(s, list(range(100)), 1), finished.append(s)))
            t.start()
            threads.append(t)
            while held.held() + len(finished) < len(threads):   # queued before the next is sent: arrival order known
                threading.Event().wait(0.001)
        for t in threads:
            t.join(timeout=30)
    finally:
        batcher.close()
    assert held.timed_out == 0 and sorted(finished) == [3, 4, 5]
    first_pass_of = {seq: min(i for i, p in enumerate(packer.passes) if any(it.seq == seq for it in p))
                     for seq in (3, 4, 5)}
    last_pass_of = {seq: max(i for i, p in enumerate(packer.passes) if any(it.seq == seq for it in p))
                    for seq in (3, 4, 5)}
    # The pass that completes each prompt (its first token): R, then A, then B.
    assert last_pass_of[5] < last_pass_of[3] < last_pass_of[4]
    if live:   # one prompt at a time: the next starts where the previous ends
        assert last_pass_of[5] <= first_pass_of[3] and last_pass_of[3] <= first_pass_of[4]


# --- the prediction ------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_first_token_prediction_counts_the_queue_ahead_and_drains_it():
    clock = Clock()
    gate = FirstTokens(lambda: 100.0, default_ttft_s=10.0, clock=clock)   # 100 prefill tokens/s
    a = gate.admit(500, replay=False, ttft_s=None, key=b"a")                 # 5 s: admitted
    assert gate.history[-1].predicted_s == pytest.approx(5.0) and not gate.history[-1].queued
    with pytest.raises(Refused) as refused:                                  # 500 + 600 tokens: 11 s, on a fleet
        gate.admit(600, replay=False, ttft_s=None, key=b"b", elsewhere=True)
    assert refused.value.elsewhere and refused.value.held and refused.value.retry_after_ms == 1000
    assert "another replica" in refused.value.message
    gate.admit(600, replay=True, ttft_s=None, elsewhere=True)                # a replay is never refused
    clock.t = 4.0                                                            # 400 tokens prefilled since
    # b's held place (600 tokens, until 1 s x 1.5 + 5 s) counts ahead of a later arrival, not of b itself
    assert gate.predict_s(100) == pytest.approx((1100 - 400 + 600 + 100) / 100)
    assert gate.predict_s(600, key=b"b") == pytest.approx((1100 - 400 + 600) / 100)
    assert gate.admit(100, replay=False, ttft_s=5.0).queued is True          # its own target: 14 s > 5 s, queued
    gate.done(a.ticket)
    assert gate.refused == 1 and gate.queued == 1


def test_with_no_other_replica_a_session_past_its_target_is_queued_not_refused():
    """The embedded default (one address): past the target, admitted and queued (its edge is told the
    prediction); the same open from an edge that lists two replicas is refused (negative control)."""
    clock = Clock()
    gate = FirstTokens(lambda: 100.0, default_ttft_s=2.0, clock=clock)
    gate.admit(1000, replay=False, ttft_s=None)                              # 10 s of work ahead
    single = gate.admit(100, replay=False, ttft_s=None, key=b"s")
    assert single.queued and single.predicted_s == pytest.approx(11.0) and gate.refused == 0
    with pytest.raises(Refused):
        gate.admit(100, replay=False, ttft_s=None, key=b"f", elsewhere=True)


def test_a_prompt_that_alone_takes_longer_than_its_target_is_queued_even_on_a_fleet():
    """No replica like this one would give it its first token in time: refusing it only delays it."""
    gate = FirstTokens(lambda: 100.0, default_ttft_s=2.0, clock=Clock())
    lone = gate.admit(1400, replay=False, ttft_s=None, key=b"l", elsewhere=True)   # 14 s on an idle verifier
    assert lone.queued and gate.refused == 0


@pytest.mark.parametrize("seed", range(5))
def test_the_retry_hint_never_exceeds_the_predicted_wait(seed):
    rng = np.random.default_rng(seed)
    clock = Clock()
    gate = FirstTokens(lambda: float(rng.uniform(20, 400)), default_ttft_s=1.0, clock=clock)
    refusals = 0
    for i in range(200):
        clock.t += float(rng.exponential(0.5))
        tokens = int(rng.integers(1, 300))
        try:
            gate.admit(tokens, replay=False, ttft_s=float(rng.choice([0.0, 0.5, 3.0])), key=bytes([i]),
                       elsewhere=True)
        except Refused as r:
            refusals += 1
            h = gate.refusals[-1]
            assert r.retry_after_ms / 1e3 <= h.predicted_s + 1e-3 and h.hint_s <= h.predicted_s
    assert refusals > 10   # the check ran on refusals, not on an empty set


def test_a_session_refused_earlier_goes_ahead_of_later_arrivals():
    """A is refused on a fleet and its place held; C arrives later with a prompt that would fit its
    target without A's place, and is refused because A's place counts ahead of it; A comes back
    after its hint and is admitted whatever the prediction then (refused once, never twice). The
    control: a keyless A holds no place, and C is admitted ahead of it."""
    for keyed in (True, False):
        clock = Clock()
        gate = FirstTokens(lambda: 100.0, default_ttft_s=5.0, clock=clock)
        gate.admit(450, replay=False, ttft_s=None)                             # 4.5 s of work ahead
        key_a = b"a" * 16 if keyed else b""
        with pytest.raises(Refused) as first:                                  # 4.5 + 1 s > 5 s
            gate.admit(100, replay=False, ttft_s=None, key=key_a, elsewhere=True)
        clock.t = 0.2
        if keyed:
            with pytest.raises(Refused):                                       # 4.3 + 1 + 0.5 s > 5 s
                gate.admit(50, replay=False, ttft_s=None, key=b"c" * 16, elsewhere=True)
            clock.t = first.value.retry_after_ms / 1e3
            back = gate.admit(100, replay=False, ttft_s=None, key=key_a, elsewhere=True)
            assert not back.queued or back.predicted_s > 5.0
            assert gate.history[-1].held_since == 0.0 and key_a not in gate.holds
        else:
            assert not gate.admit(50, replay=False, ttft_s=None, key=b"c" * 16, elsewhere=True).queued
            assert not gate.holds


def test_a_held_place_lapses_when_its_session_does_not_come_back():
    clock = Clock()
    gate = FirstTokens(lambda: 100.0, default_ttft_s=1.0, clock=clock)
    gate.admit(300, replay=False, ttft_s=None)
    with pytest.raises(Refused) as r:
        gate.admit(50, replay=False, ttft_s=None, key=b"k" * 16, elsewhere=True)
    hint_s = r.value.retry_after_ms / 1e3
    assert gate.held_tokens() == 50
    clock.t = hint_s * HOLD_FACTOR + HOLD_GRACE_S + 0.01
    gate.predict_s(1)
    assert gate.held_tokens() == 0


def test_first_token_prediction_learns_what_the_prefill_does_not_explain():
    clock = Clock()
    gate = FirstTokens(lambda: 100.0, default_ttft_s=10.0, clock=clock)
    t = gate.admit(100, replay=False, ttft_s=None)     # 1 s of prefill predicted ...
    clock.t = 3.0
    gate.done(t.ticket)                                # ... it took 3 s: 2 s more, a fifth of it learnt
    assert gate.overhead_s == pytest.approx(0.4)
    assert gate.predict_s(100) == pytest.approx(1.4)


def test_unknown_costs_admit():
    gate = FirstTokens(lambda: None, default_ttft_s=0.001)
    gate.admit(10_000, replay=False, ttft_s=None)
    assert gate.refused == 0


# --- vLLM's prefill rate, from its own requests' timestamps ---------------------------------------

class Out:
    """What PrefillMeter reads of a vLLM RequestOutput: engine timestamps and cached tokens."""

    def __init__(self, scheduled: float, first_token: float, cached: int = 0):
        self.metrics = type("Stats", (), {"scheduled_ts": scheduled, "first_token_ts": first_token})()
        self.num_cached_tokens = cached


def test_vllm_prefill_rate_is_tokens_over_the_union_of_the_prefills_intervals():
    meter = PrefillMeter()
    assert meter.rate() is None
    meter.observe_output(Out(10.0, 11.0), 1000)                 # 1000 tokens in 1 s
    assert meter.rate() == pytest.approx(1000.0)
    meter.observe_output(Out(10.5, 11.5, cached=200), 1000)     # 800 more, overlapping by 0.5 s
    assert meter.rate() == pytest.approx(1800 / 1.5)           # the engine's throughput, not each one's
    meter.observe_output(Out(20.0, 20.01), 8)                   # a round's chunk: a step, not a rate
    meter.observe_output(Out(0.0, 0.0), 500)                    # no timestamps (stats off)
    meter.observe_output(object(), 500)
    assert meter.rate() == pytest.approx(1800 / 1.5)
    meter.observe_output(Out(30.0, 57.0), 100)                  # a 27 s stall: counts as 4 x the median's
    median = sorted([1 / 1000, 1 / 800, 27 / 100])[1]           # seconds a token
    assert meter.rate() == pytest.approx(1900 / (1.5 + 4 * median * 100))


# --- the verifier and the edge -------------------------------------------------------------------

def _server(rate: float | None, admit_ttft_s: float = 1.0, ahead: int = 0, admission: str = "auto",
            **backend) -> VerifierServer:
    """A batching synthetic verifier whose prefill rate reads `rate` tokens/s (None: its own), with
    `ahead` prompt tokens of a refused session's held place counted ahead of every new session (work
    queued ahead, which no pass drains while the test runs)."""
    backend = SyntheticBackend(vocab=VOCAB, batching=True, **backend)
    if rate is not None:
        backend.prefill_rate = lambda: rate
    server = VerifierServer(backend, "127.0.0.1", 0, Limits(), grace_s=0.5,
                            policy=ServerPolicy(admit_ttft_s=admit_ttft_s, admission=admission))
    if ahead:
        server.servicer.first_tokens.holds[b"h" * 16] = Hold(ahead, 0.0, 1.0, 1.0, float("inf"))
    return server


def _open(prompt: int, key: bytes, resume: int = 0, ttft_ms: float = 0.0) -> pb.VerifyRequest:
    o = pb.OpenSession(prompt_token_ids=[0] + [5] * (prompt - 1), resume_token_ids=[6] * resume, open_key=key,
                       sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=8, top_p=1.0))
    if ttft_ms:
        o.slo.CopyFrom(pb.SessionSlo(ttft_ms=ttft_ms))
    return pb.VerifyRequest(round=1, committed_length=prompt + resume, draft_token_ids=[7], open=o)


FLEET = ((REPLICAS_KEY, "2"),)   # what an edge given two replicas sends with its open


async def test_one_replica_queues_a_late_session_and_says_how_long_at_once():
    """500 tokens ahead at 100 tokens/s and a target of 1 s: a new session's first token is 5.5 s
    away. From an edge that knows no other replica it is queued: answered at once with "5500 ms"
    (QUEUED_KEY, and the same retry hint; no try-elsewhere) while its round goes on, and the same
    open asked again gets the round's reply. Nothing is refused."""
    server = await _server(rate=100.0, ahead=500).start()
    try:
        async with stub_for(server) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(_open(50, b"q" * 16), timeout=10)
            meta = dict(e.value.trailing_metadata() or ())
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queued" in e.value.details()
            assert int(meta[QUEUED_KEY]) == int(meta[RETRY_AFTER_KEY]) == pytest.approx(5500, abs=100)
            assert ELSEWHERE_KEY not in meta and HELD_KEY not in meta
            reply = await stub.Verify(_open(50, b"q" * 16), timeout=10)   # asked again: the round's reply
            assert reply.committed_length > 50
            small = await stub.Verify(_open(10, b"s" * 16, ttft_ms=60_000), timeout=10)   # its own target: served
            assert small.committed_length > 10
        gate = server.servicer.first_tokens
        assert gate.refused == 0 and gate.queued == 1 and len(gate.history) == 2   # the ask again: not admitted again
        assert len(server.engine.sessions) == 2 and server.servicer.inflight.inflight == 0
    finally:
        await server.stop()


@pytest.mark.parametrize("fleet", ["edge lists two replicas", "operator flag"])
async def test_a_fleet_refuses_before_the_first_pass_with_a_hint_within_the_wait_and_keeps_the_place(fleet):
    """The same open where another replica may serve it: RESOURCE_EXHAUSTED before any pass, with a
    hint below the predicted wait (5.5 s - 1 s), try-elsewhere and place-held; the same open back
    (its open_key) is admitted (queued, then served). Replays and sessions with a target of their own
    are served."""
    server = await _server(rate=100.0, ahead=500, admission="refuse" if fleet == "operator flag" else "auto").start()
    metadata = FLEET if fleet == "edge lists two replicas" else None
    batcher = server.engine.backend.batcher
    try:
        async with stub_for(server) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(_open(50, b"r" * 16), timeout=10, metadata=metadata)
            err = e.value
            meta = dict(err.trailing_metadata() or ())
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert 4400 <= int(meta[RETRY_AFTER_KEY]) <= 4600 and meta[ELSEWHERE_KEY] == "1" and meta[HELD_KEY] == "1"
            assert "another replica" in err.details() and "retry after" in err.details()
            assert batcher.passes == 0 and len(server.engine.sessions) == 0   # no pass, no session
            # Back with its place held: admitted (queued: the held place of the test never drains).
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(_open(50, b"r" * 16), timeout=10, metadata=metadata)
            assert QUEUED_KEY in dict(e.value.trailing_metadata()) and ELSEWHERE_KEY not in dict(e.value.trailing_metadata())
            back = await stub.Verify(_open(50, b"r" * 16), timeout=10, metadata=metadata)
            assert back.committed_length > 50
            await stub.Verify(_open(500, b"p" * 16, resume=2), timeout=10, metadata=metadata)     # a replay
            await stub.Verify(_open(50, b"t" * 16, ttft_ms=60_000), timeout=10, metadata=metadata)   # own target
        assert server.servicer.first_tokens.refused == 1
    finally:
        await server.stop()


async def test_a_text_prompt_is_counted_with_the_tokenizer():
    """80 bytes of text that the target's tokenizer makes 81 tokens (one per character, and BOS):
    at 10 tokens/s that is 8.1 s, past a 5 s target, so the open is queued; counted at 4 bytes a
    token (20 tokens, 2 s) it would not have been."""
    from xvocab_pair import TARGET, longest_match_tokenizer
    server = await _server(rate=10.0, admit_ttft_s=5.0, vocabulary=TARGET,
                           tokenize=longest_match_tokenizer(TARGET)).start()
    try:
        text = "ab" * 40
        ids = server.engine.backend.prompt_ids(text, None)
        assert len(ids) == 81
        async with stub_for(server) as stub:
            o = pb.OpenSession(prompt_text=text, open_key=b"x" * 16,
                               sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=2, top_p=1.0))
            req = pb.VerifyRequest(round=1, committed_length=0, draft_token_ids=[2], open=o)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(req, timeout=10)
            assert int(dict(e.value.trailing_metadata())[QUEUED_KEY]) == pytest.approx(8100, abs=100)
            await stub.Verify(req, timeout=10)
        assert server.servicer.first_tokens.history[-1].tokens == 81
    finally:
        await server.stop()


async def test_an_edge_with_one_replica_is_queued_shows_it_and_loses_nothing():
    """The edge (one address) is queued with work ahead: it hears the prediction (on_queued, stats),
    is never refused, and generates exactly what the same verifier gives with nothing ahead."""
    outputs = {}
    for ahead in (0, 500):
        server = await _server(rate=100.0, ahead=ahead).start()
        heard: list[float] = []
        try:
            client = EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3, deadline_s=10),
                                SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB))
            async with client:
                client.verifier.on_queued = heard.append
                gen = client.generate([0, 5, 6, 7], SamplingSettings(temperature=0.8, seed=3, max_new_tokens=20,
                                                                      ignore_eos=True))
                await asyncio.wait_for(gen.text(), 20)
            outputs[ahead] = list(gen.stats.token_ids)
            assert gen.stats.backoffs == 0 and server.servicer.first_tokens.refused == 0
            assert (heard == [gen.stats.queued_s] and gen.stats.queued_s == pytest.approx(5.04, abs=0.1)) if ahead \
                else (heard == [] and gen.stats.queued_s == 0.0)
        finally:
            await server.stop()
    assert outputs[500] == outputs[0] and len(outputs[0]) == 20


async def test_an_edge_refused_for_its_first_token_moves_to_the_other_replica_and_loses_nothing():
    """Replica A has 10,000 tokens queued ahead (100 s), replica B is free. An edge given "A,B" is
    refused by A before any pass, moves to B, and generates exactly what B alone gives (greedy and
    seeded sampling alike)."""
    a, b = await _server(rate=100.0, ahead=10_000).start(), await _server(rate=None).start()
    try:
        outputs = {}
        for label, servers in (("alone", f"127.0.0.1:{b.port}"), ("moved", f"127.0.0.1:{a.port},127.0.0.1:{b.port}")):
            client = EdgeClient(edge_options(servers, gamma=3, deadline_s=10), SyntheticDrafter(VOCAB, noise=1.0),
                                SyntheticTokenizer(VOCAB))
            async with client:
                for temperature, seed in ((0.0, None), (0.8, 11)):
                    gen = client.generate([0, 5, 6, 7], SamplingSettings(temperature=temperature, seed=seed,
                                                                          max_new_tokens=30, ignore_eos=True))
                    await asyncio.wait_for(gen.text(), 20)
                    outputs[label, temperature] = list(gen.stats.token_ids)
        assert outputs["moved", 0.0] == outputs["alone", 0.0] and len(outputs["alone", 0.0]) == 30
        assert outputs["moved", 0.8] == outputs["alone", 0.8] and len(outputs["alone", 0.8]) == 30
        assert a.servicer.first_tokens.refused >= 1
        assert a.engine.backend.batcher.passes == 0 and len(a.engine.sessions) == 0
    finally:
        await a.stop()
        await b.stop()


async def test_a_session_every_replica_refuses_is_refused_twice_at_most_and_comes_back_at_its_hint():
    """Both replicas have work ahead (a first token 1.6 s away, target 1 s): the edge is refused by
    A, moves to B, is refused there, waits B's hint (0.6 s, place held: at most 5 % more) and is
    served from the place a replica held for it (the move after B's refusal goes back to A). Two
    refusals in a row, one wait."""
    a, b = await _server(rate=100.0, ahead=150).start(), await _server(rate=100.0, ahead=150).start()
    try:
        client = EdgeClient(edge_options(f"127.0.0.1:{a.port},127.0.0.1:{b.port}", gamma=3, deadline_s=10),
                            SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB))
        async with client:
            gen = client.generate([0, 5, 6, 7], SamplingSettings(temperature=0.0, max_new_tokens=8, ignore_eos=True))
            await asyncio.wait_for(gen.text(), 20)
        assert a.servicer.first_tokens.refused + b.servicer.first_tokens.refused == 2
        hint_s = b.servicer.first_tokens.refusals[-1].hint_s
        assert gen.stats.backoffs == 1 and hint_s <= gen.stats.backoff_s <= 1.05 * hint_s + 1e-3
        served = [p for s in (a, b) for p in s.servicer.first_tokens.history]
        assert len(served) == 1 and served[0].held_since is not None   # from the place one of them held
    finally:
        await a.stop()
        await b.stop()


async def test_a_queued_open_may_last_past_the_deadline_without_a_retry():
    """The edge's deadline is 1 s; the open is queued (500 tokens of places held ahead, predicted
    about 5 s) and its own prefill takes 2 s (4 ms a token): told how long at once, the edge waits
    for it instead of timing out and retrying."""
    server = await _server(rate=100.0, ahead=500, step_ms=0.0, per_token_ms=4.0).start()
    try:
        client = EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=2, deadline_s=1.0),
                            SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB))
        async with client:
            gen = client.generate([0] + [5] * 499, SamplingSettings(temperature=0.0, max_new_tokens=3,
                                                                    ignore_eos=True))
            await asyncio.wait_for(gen.text(), 60)
        assert gen.stats.queued_s > 5.0 and gen.stats.retries == 0 and gen.stats.ttft_s > 1.0
    finally:
        await server.stop()
