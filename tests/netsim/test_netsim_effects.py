"""Departure-time arithmetic of each effect, without sockets: exact where the model is exact."""
from __future__ import annotations

import random
import statistics

import pytest

from netsim import Link, LinkContext, LinkReset, connection_rng, get_profile
from netsim.effects import (Bandwidth, Chunk, Delay, GilbertElliottLoss, Handover, Jitter, Loss, Outage,
                            Trace)
from netsim.effects.loss import MSS_BYTES

EXACT = dict(abs=1e-12)


class ScriptedRandom(random.Random):
    """random() returns the scripted values in order: 0.1 means 'lost' against a 0.5 loss rate."""

    def __init__(self, values: list[float]) -> None:
        super().__init__(0)
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def ctx(rng: random.Random | None = None, **kwargs) -> LinkContext:
    return LinkContext(rng=rng or random.Random(1), **kwargs)


def departures(link: Link, chunks: list[tuple[int, float]], context: LinkContext | None = None) -> list[float]:
    state = link.open(context or ctx())
    return [state.departure_s(size, arrival) for size, arrival in chunks]


# --- delay and composition ---------------------------------------------------------------

def test_delay_adds_its_delay():
    assert departures(Link((Delay(100),)), [(10, 1.0), (10, 2.5)]) == [pytest.approx(1.1, **EXACT),
                                                                       pytest.approx(2.6, **EXACT)]


def test_two_delays_in_series_add_up():
    # Each chunk carries its arrival time from one effect to the next, so delays compose.
    link = Link((Delay(100), Delay(100)))
    assert departures(link, [(10, 0.0), (10, 0.05)]) == [pytest.approx(0.2, **EXACT),
                                                         pytest.approx(0.25, **EXACT)]


# --- bandwidth ---------------------------------------------------------------------------

def test_bandwidth_serialises_chunks_back_to_back():
    link = Link((Bandwidth(1000),))   # 1 Mbit/s: 1250 bytes take 10 ms
    assert departures(link, [(1250, 0.0), (1250, 0.0), (1250, 0.005)]) == [
        pytest.approx(0.010, **EXACT), pytest.approx(0.020, **EXACT), pytest.approx(0.030, **EXACT)]


def test_bandwidth_has_no_burst_allowance_after_idling():
    # A token bucket would have banked credit during the idle second; a link has none.
    link = Link((Bandwidth(1000),))
    assert departures(link, [(1250, 0.0), (1250, 1.0)])[1] == pytest.approx(1.010, **EXACT)


def test_small_message_waits_behind_a_bulk_one():
    link = Link((Bandwidth(1000),))
    bulk, small = departures(link, [(125_000, 0.0), (10, 0.001)])
    assert bulk == pytest.approx(1.0, **EXACT)
    assert small == pytest.approx(1.0 + 10 * 8 / 1e6, **EXACT)


# --- jitter ------------------------------------------------------------------------------

@pytest.mark.parametrize("distribution", ["uniform", "normal"])
def test_jitter_draws_range_and_spread(distribution):
    rng = random.Random(1)
    draws_ms = [Jitter(10, distribution).extra_ms(rng) for _ in range(20_000)]
    assert min(draws_ms) >= 0.0 and max(draws_ms) <= 20.0
    # Normal: sd jitter/2 = 5 ms, clipped at 2 sd, which leaves 0.959·5 ms; uniform: 20/sqrt(12) ms.
    expected_sd = 0.959 * 5.0 if distribution == "normal" else 20 / 12 ** 0.5
    assert statistics.fmean(draws_ms) == pytest.approx(10.0, abs=0.15)
    assert statistics.pstdev(draws_ms) == pytest.approx(expected_sd, rel=0.05)


@pytest.mark.parametrize("distribution", ["uniform", "normal"])
def test_jitter_range_and_mean(distribution):
    link = Link((Jitter(10, distribution),))
    # 20 000 chunks at random times (so at a uniformly random phase of the 80 ms draw interval).
    rng = random.Random(7)
    arrivals = sorted(rng.uniform(0.0, 20_000.0) for _ in range(20_000))
    extras_ms = [(d - a) * 1000 for d, a in zip(departures(link, [(100, a) for a in arrivals]), arrivals)]
    assert min(extras_ms) >= 0.0 and max(extras_ms) <= 20.0 + 1e-6
    # The mean of 20 000 values with sd <= 5.8 ms: standard error 0.04 ms, so +-0.15 ms is ~4 se.
    assert statistics.fmean(extras_ms) == pytest.approx(10.0, abs=0.15)
    # Linear interpolation between two independent draws at a uniform phase u has variance
    # ((1-u)^2 + u^2)·sd^2, which averages to 2/3·sd^2.
    draw_sd = 0.959 * 5.0 if distribution == "normal" else 20 / 12 ** 0.5
    assert statistics.pstdev(extras_ms) == pytest.approx(draw_sd * (2 / 3) ** 0.5, rel=0.05)


def message_delays_ms(link: Link, per_message: int, messages: int = 4000, seed: int = 3) -> list[float]:
    """Extra delay (ms) of each message, sent every ~150 ms as `per_message` chunks 50 us apart.

    A message is delivered when its last chunk is: what an RPC's caller sees.
    """
    rng = random.Random(seed)
    state = link.open(ctx(random.Random(seed + 1)))
    delays_ms, t_s = [], 0.0
    for _ in range(messages):
        t_s += rng.uniform(0.1, 0.2)
        last_s = max(state.departure_s(100, t_s + i * 50e-6) for i in range(per_message))
        delays_ms.append((last_s - t_s) * 1000)
    return delays_ms


def test_jitter_mean_holds_for_messages_of_several_chunks():
    # gRPC writes a message as two or three chunks (HEADERS, DATA, ...). Per-chunk independent
    # draws held in order give the message the largest of its draws, so its mean rises; the
    # delay curve gives every chunk of a message nearly the same delay. 4000 messages, sd
    # about 4.8 ms (normal draws, 2/3 of the variance): standard error 0.08 ms; tolerance 0.4 ms.
    link = Link((Jitter(15, "normal"),))
    for per_message in (1, 3):
        delays_ms = message_delays_ms(link, per_message)
        assert statistics.fmean(delays_ms) == pytest.approx(15.0 + 0.05 * (per_message - 1), abs=0.4)

    # Negative control: the previous model (independent draw per chunk, held behind the chunk
    # in front) is biased by several milliseconds for the same traffic.
    class PerChunkJitter(Jitter):
        def new_state(self, ctx):
            return ctx.rng

        def departure_s(self, chunk, rng):
            return chunk.arrival_s + self.extra_ms(rng) / 1000.0

    old_mean_ms = statistics.fmean(message_delays_ms(Link((PerChunkJitter(15, "normal"),)), 3))
    assert old_mean_ms > 15.0 + 3.0, old_mean_ms


def test_jitter_never_reorders():
    link = Link((Delay(50), Jitter(20)))
    arrivals = [i * 0.001 for i in range(2000)]   # 1 ms apart, far inside the 40 ms spread
    out = departures(link, [(100, a) for a in arrivals])
    assert all(b >= a for a, b in zip(out, out[1:]))
    assert all(d >= a + 0.050 for d, a in zip(out, arrivals))
    # ... and without needing the Link's hold: the effect's own departures are in order.
    jitter, walk = Jitter(20), Jitter(20).new_state(ctx())
    alone = [jitter.departure_s(Chunk(100, a), walk) for a in arrivals]
    assert all(b >= a for a, b in zip(alone, alone[1:]))
    # Independent draws per chunk would have reordered many chunks.
    rng = random.Random(1)
    raw = [a + 0.050 + Jitter(20).extra_ms(rng) / 1000 for a in arrivals]
    assert sum(b < a for a, b in zip(raw, raw[1:])) > 100


def test_jitter_interval_must_keep_the_stream_in_order():
    with pytest.raises(ValueError, match="reorder"):
        Jitter(20, interval_ms=10)


# --- loss as a retransmission stall ------------------------------------------------------

def stall_s(values: list[float], size_bytes: int = 100, rtt_ms: float = 100.0) -> float:
    link = Link((Loss(0.5, rtt_ms=rtt_ms),))
    return link.open(ctx(ScriptedRandom(values))).departure_s(size_bytes, 0.0)


def test_no_loss_no_stall():
    assert stall_s([0.9]) == 0.0


def test_lone_lost_segment_waits_rtt_plus_rto_min():
    # min(2·RTT + 200 ms probe, RTT + 200 ms RTO) = 0.3 s at RTT 100 ms.
    assert stall_s([0.1, 0.9]) == pytest.approx(0.3, **EXACT)


def test_lost_retransmissions_back_off_doubling():
    assert stall_s([0.1, 0.1, 0.9]) == pytest.approx(0.3 + 0.3, **EXACT)
    assert stall_s([0.1, 0.1, 0.1, 0.9]) == pytest.approx(0.3 + 0.3 + 0.6, **EXACT)
    assert stall_s([0.1, 0.1, 0.1, 0.1, 0.9]) == pytest.approx(0.3 + 0.3 + 0.6 + 1.2, **EXACT)


def test_tail_loss_in_a_multi_segment_chunk_is_probed_at_two_rtt():
    # Three segments, the last lost: a tail-loss probe at 2·RTT + 2 ms.
    assert stall_s([0.9, 0.9, 0.1, 0.9], size_bytes=3 * MSS_BYTES) == pytest.approx(0.202, **EXACT)


def test_early_loss_with_three_segments_behind_is_fast_retransmitted():
    assert stall_s([0.1, 0.9, 0.9, 0.9, 0.9], size_bytes=4 * MSS_BYTES) == pytest.approx(0.1, **EXACT)


def test_stall_blocks_what_follows_and_uses_the_path_rtt():
    stalls: list[float] = []
    link = Link((Loss(0.5),))
    state = link.open(ctx(ScriptedRandom([0.1, 0.9, 0.9]), rtt_s=0.05, record_stall=stalls.append))
    first = state.departure_s(100, 0.0)
    second = state.departure_s(100, 0.01)   # not lost itself, but behind the stalled chunk
    assert first == pytest.approx(0.25, **EXACT)
    assert second == first
    assert stalls == [pytest.approx(0.25, **EXACT)]


def test_tcp_gives_up_after_fifteen_retransmissions():
    with pytest.raises(LinkReset):
        Link((Loss(1.0, rtt_ms=10),)).open(ctx()).departure_s(100, 0.0)


def test_iid_loss_rate_per_segment():
    state = Loss(0.02).new_state(ctx(random.Random(5)))
    losses = sum(state.lost() for _ in range(200_000))
    assert losses / 200_000 == pytest.approx(0.02, rel=0.05)


def test_gilbert_elliott_mean_rate_and_burst_length():
    settings = GilbertElliottLoss(p_good_to_bad=0.01, p_bad_to_good=0.25)   # all lost in bad, none in good
    state = settings.new_state(ctx(random.Random(9)))
    draws = [state.lost() for _ in range(400_000)]
    assert sum(draws) / len(draws) == pytest.approx(settings.mean_loss_rate(), rel=0.08)
    bursts, run = [], 0
    for lost in draws:
        if lost:
            run += 1
        elif run:
            bursts.append(run)
            run = 0
    assert statistics.fmean(bursts) == pytest.approx(1 / 0.25, rel=0.08)   # mean burst = 1/r segments


# --- outages ----------------------------------------------------------------------------

def test_outage_stall_holds_until_the_window_ends():
    stalls: list[float] = []
    link = Link((Outage(windows_s=((1.0, 0.5),)),))
    out = departures(link, [(10, 10.5), (10, 11.2), (10, 11.6)], ctx(epoch_s=10.0, record_stall=stalls.append))
    assert out == [pytest.approx(10.5, **EXACT), pytest.approx(11.5, **EXACT), pytest.approx(11.6, **EXACT)]
    assert stalls == [pytest.approx(0.3, **EXACT)]


def test_outage_reset_mode():
    state = Link((Outage(windows_s=((1.0, 0.5),), mode="reset"),)).open(ctx())
    assert state.departure_s(10, 0.5) == 0.5
    with pytest.raises(LinkReset):
        state.departure_s(10, 1.2)
    assert state.reset_at_s(0.0) == 1.0
    assert state.reset_at_s(1.2) == 1.2
    assert state.reset_at_s(1.6) is None


def test_outage_reset_only_after_reset_after_s():
    state = Link((Outage(windows_s=((1.0, 0.5), (3.0, 0.1)), mode="reset", reset_after_s=0.2),)).open(ctx())
    assert state.departure_s(10, 1.1) == pytest.approx(1.5, **EXACT)   # before the reset point: held
    with pytest.raises(LinkReset):
        state.departure_s(10, 1.3)
    assert state.reset_at_s(0.0) == pytest.approx(1.2, **EXACT)
    assert state.departure_s(10, 3.05) == pytest.approx(3.1, **EXACT)   # too short to reset: a stall
    assert state.reset_at_s(1.6) is None


def test_on_off_outages_are_shared_and_have_the_right_duty_cycle():
    settings = Outage(mean_up_s=30.0, mean_down_s=2.0)
    up = settings.new_state(ctx(random.Random(1), seed=4))
    down = settings.new_state(ctx(random.Random(2), seed=4))   # other direction: other rng, same run seed
    other_run = settings.new_state(ctx(random.Random(1), seed=5))
    assert list(up.schedule.windows_from(0.0, 1000.0)) == list(down.schedule.windows_from(0.0, 1000.0))
    assert list(up.schedule.windows_from(0.0, 1000.0)) != list(other_run.schedule.windows_from(0.0, 1000.0))
    windows = list(up.schedule.windows_from(0.0, 200_000.0))
    down_s = sum(end - start for start, end in windows)
    assert down_s / windows[-1][1] == pytest.approx(2.0 / 32.0, rel=0.1)


# --- trace replay ------------------------------------------------------------------------

@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "small.trace"
    path.write_text("1\n1\n3\n5\n")   # two packets at 1 ms, one at 3 ms, one at 5 ms; repeats every 5 ms
    return str(path)


def test_trace_whole_packets(small_trace):
    link = Link((Trace(small_trace),))
    out_ms = [t * 1000 for t in departures(link, [(1500, 0.0)] * 3 + [(3000, 0.0)])]
    # The 3000-byte chunk takes the 5 ms opportunity and the first one of the next cycle (6 ms).
    assert out_ms == pytest.approx([1.0, 1.0, 3.0, 6.0], **EXACT)


def test_trace_counts_bytes_and_wastes_idle_opportunities(small_trace):
    link = Link((Trace(small_trace),))
    out_ms = [t * 1000 for t in departures(link, [
        (100, 0.0),        # opportunity at 1 ms, 1400 bytes left in it
        (1400, 0.0005),    # fits in what is left: still 1 ms
        (1, 0.0005),       # the second opportunity at 1 ms
        (10, 0.0075),      # 3, 5 and 6 ms passed unused; next is 5 + 3 = 8 ms
        (10, 1.0002),      # 200 cycles later: 1000 + 1 ms
    ])]
    assert out_ms == pytest.approx([1.0, 1.0, 1.0, 8.0, 1001.0], **EXACT)


def test_trace_counts_from_the_run_start(small_trace):
    link = Link((Trace(small_trace),))
    assert departures(link, [(10, 100.0)], ctx(epoch_s=100.0)) == [pytest.approx(100.001, **EXACT)]


def test_bundled_trace_loads_and_paces_a_bulk_transfer():
    trace = Trace("synthetic-cellular.down")
    state = Link((trace,)).open(ctx())
    last = [state.departure_s(1500, 0.0) for _ in range(3000)][-1]
    from netsim.effects.trace import load_trace
    assert last == pytest.approx(load_trace(trace.trace)[2999] / 1000, **EXACT)   # one packet per line
    assert 1000 < trace.mean_rate_kbit_s() < 20_000


# --- handover ----------------------------------------------------------------------------

def test_handover_step_is_shared_and_burst_stalls():
    handover = Handover(period_s=15.0, burst_ms=100.0, burst_loss=1.0, delay_step_ms=10.0, rtt_ms=100.0)
    a = Link((handover,)).open(ctx(random.Random(1), seed=3))
    b = Link((handover,)).open(ctx(random.Random(2), seed=3))
    step_a = a.departure_s(10, 5.0) - 5.0
    assert 0.0 <= step_a <= 0.010
    assert b.departure_s(10, 6.0) - 6.0 == pytest.approx(step_a, **EXACT)   # same interval, same step
    # At the boundary every segment is lost; the retransmission 0.3 s later is past the 100 ms burst.
    at_boundary = a.departure_s(10, 15.0)
    next_step = a.departure_s(10, 16.0) - 16.0
    assert at_boundary == pytest.approx(15.0 + next_step + 0.3, **EXACT)


# --- determinism -------------------------------------------------------------------------

def test_seeded_links_repeat_and_seeds_differ():
    profile = get_profile("wifi-congested")

    def run(seed: int) -> list[float]:
        context = ctx(connection_rng(seed, 0, "up"), rtt_s=profile.rtt_ms() / 1000, seed=seed)
        chunks = [(random.Random(0).randint(1, 9000), i * 0.002) for i in range(3000)]
        return departures(profile.uplink, chunks, context)

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_chunk_is_what_effects_see():
    assert Delay(5).departure_s(Chunk(10, 1.0), None) == pytest.approx(1.005, **EXACT)
