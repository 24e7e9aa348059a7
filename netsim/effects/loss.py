"""Loss, modelled as the retransmission stall that TCP turns it into.

A proxy must not drop bytes from a TCP stream (that would corrupt gRPC framing), and a real
path's sender would retransmit them anyway: a lost segment reaches the receiver late, and
everything behind it in the same direction waits (head-of-line blocking; the Link's
first-in-first-out hold supplies that part).

A chunk is cut into MSS-sized segments and each one is drawn lost or not, i.i.d. (`Loss`) or
from a Gilbert–Elliott chain (`GilbertElliottLoss`, netem's `gemodel`). The first recovery
wait follows Linux (net/ipv4/tcp_output.c `tcp_schedule_loss_probe`, include/net/tcp.h):

- fast retransmit (RACK), about one RTT, when >= 3 segments follow the lost one (dupacks);
- otherwise a tail-loss probe at 2·RTT, plus TCP_RTO_MIN (200 ms, the delayed-ACK allowance)
  when the chunk is a lone segment or TCP_TIMEOUT_MIN (2 ms) when it is not, capped at the RTO;
- RTO = RTT + 200 ms (Linux floors the variance term at TCP_RTO_MIN).

So a lone lost segment, our usual case (one small gRPC message), waits RTT + 200 ms. If a
retransmission is lost as well, the RTO fires again, doubling each time (RFC 6298 §5.5) up to
120 s, and after 15 retransmissions (Linux `tcp_retries2`) the connection is reset.
Not modelled: lost ACKs (later cumulative ACKs cover them), the congestion window cut, and
the RTT growth from queueing (the timers use the path's base RTT).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, ClassVar

from .base import Chunk, Effect, LinkContext, LinkReset

MSS_BYTES = 1448        # TCP payload of a 1500-byte packet with IPv4 + TCP timestamps
DUPACK_THRESHOLD = 3    # RFC 8985 §1.1 DupThresh
RTO_MIN_S = 0.200       # Linux TCP_RTO_MIN (HZ/5)
TIMEOUT_MIN_S = 0.002   # Linux TCP_TIMEOUT_MIN (2 jiffies at HZ=1000)
RTO_MAX_S = 120.0       # Linux TCP_RTO_MAX
RETRIES_MAX = 15        # Linux net.ipv4.tcp_retries2 default


def recovery_stall_s(first_lost: int, segments: int, rtt_s: float,
                     retransmission_lost: Callable[[float], bool]) -> float:
    """How late a chunk arrives when its segment `first_lost` (0-based, of `segments`) is lost.

    `retransmission_lost(elapsed_s)` says whether the retransmission sent `elapsed_s` after
    the original is lost too. Raises LinkReset once TCP would give up.
    """
    rto_s = rtt_s + RTO_MIN_S
    if segments - first_lost - 1 >= DUPACK_THRESHOLD:
        stall_s = rtt_s
    else:
        probe_s = 2.0 * rtt_s + (RTO_MIN_S if segments == 1 else TIMEOUT_MIN_S)
        stall_s = min(probe_s, rto_s)
    backoff_s = rto_s
    retries = 0
    while retransmission_lost(stall_s):
        retries += 1
        if retries > RETRIES_MAX:
            raise LinkReset(f"retransmission lost {retries} times: TCP gives up")
        stall_s += backoff_s
        backoff_s = min(2.0 * backoff_s, RTO_MAX_S)
    return stall_s


def stalled_departure_s(chunk: Chunk, segment_lost: Callable[[], bool], rtt_s: float,
                        retransmission_lost: Callable[[float], bool],
                        record_stall: Callable[[float], None]) -> float:
    """The chunk's departure once each of its segments has been drawn lost or not."""
    segments = max(1, math.ceil(chunk.size_bytes / MSS_BYTES))
    first_lost = None
    for index in range(segments):
        # Draw every segment, lost or not, so a loss chain advances once per segment sent.
        if segment_lost() and first_lost is None:
            first_lost = index
    if first_lost is None:
        return chunk.arrival_s
    stall_s = recovery_stall_s(first_lost, segments, rtt_s, retransmission_lost)
    record_stall(stall_s)
    return chunk.arrival_s + stall_s


def mean_recovery_stall_ms(loss_rate: float, size_bytes: int, rtt_ms: float) -> float:
    """Expected stall (ms) of a lone message of `size_bytes` on a link losing `loss_rate` of its segments.

    Sums the first recovery wait over which segment is the first lost; a lost retransmission
    (a term in loss_rate squared) is left out.
    """
    segments = max(1, math.ceil(size_bytes / MSS_BYTES))
    never = lambda _elapsed_s: False   # noqa: E731
    return 1000.0 * sum((1.0 - loss_rate) ** k * loss_rate * recovery_stall_s(k, segments, rtt_ms / 1000.0, never)
                        for k in range(segments))


def _check_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value}")


class _IidState:
    def __init__(self, loss_rate: float, ctx: LinkContext, rtt_s: float) -> None:
        self.loss_rate = loss_rate
        self.rng = ctx.rng
        self.rtt_s = rtt_s
        self.record_stall = ctx.record_stall

    def lost(self) -> bool:
        return self.rng.random() < self.loss_rate


@dataclass(frozen=True)
class Loss(Effect):
    """I.i.d. per-segment loss, as netem `loss random`."""

    kind: ClassVar[str] = "loss"

    loss_rate: float               # probability that a segment is lost (0..1)
    rtt_ms: float | None = None    # RTT the sender's timers assume (ms); None = the path's (LinkContext.rtt_s)

    def __post_init__(self) -> None:
        _check_probability("loss_rate", self.loss_rate)

    def new_state(self, ctx: LinkContext) -> _IidState:
        rtt_s = ctx.rtt_s if self.rtt_ms is None else self.rtt_ms / 1000.0
        return _IidState(self.loss_rate, ctx, rtt_s)

    def departure_s(self, chunk: Chunk, state: _IidState) -> float:
        return stalled_departure_s(chunk, state.lost, state.rtt_s, lambda _elapsed_s: state.lost(),
                                   state.record_stall)

    def mean_loss_rate(self) -> float:
        return self.loss_rate

    def mean_stall_ms(self, size_bytes: int, rtt_ms: float) -> float:
        return mean_recovery_stall_ms(self.loss_rate, size_bytes, rtt_ms if self.rtt_ms is None else self.rtt_ms)


class _GilbertElliottState:
    def __init__(self, settings: GilbertElliottLoss, ctx: LinkContext, rtt_s: float) -> None:
        self.settings = settings
        self.rng: random.Random = ctx.rng
        self.rtt_s = rtt_s
        self.record_stall = ctx.record_stall
        self.bad = False    # every connection starts in the good state

    def lost(self) -> bool:
        s = self.settings
        lost = self.rng.random() < (s.loss_in_bad if self.bad else s.loss_in_good)
        if self.bad:
            self.bad = self.rng.random() >= s.p_bad_to_good
        else:
            self.bad = self.rng.random() < s.p_good_to_bad
        return lost


@dataclass(frozen=True)
class GilbertElliottLoss(Effect):
    """Bursty loss from a two-state chain, stepped once per segment (netem `gemodel p r 1-h 1-k`).

    Retransmissions are drawn from the same chain, so a retransmission sent during a burst is
    likely lost as well (the chain counts segments, not seconds: an approximation).
    """

    kind: ClassVar[str] = "ge-loss"

    p_good_to_bad: float           # per-segment probability of entering the bad state (netem p)
    p_bad_to_good: float           # per-segment probability of leaving it (netem r); mean burst = 1/r segments
    loss_in_bad: float = 1.0       # loss probability in the bad state (netem 1-h)
    loss_in_good: float = 0.0      # loss probability in the good state (netem 1-k)
    rtt_ms: float | None = None    # RTT the sender's timers assume (ms); None = the path's (LinkContext.rtt_s)

    def __post_init__(self) -> None:
        for name in ("p_good_to_bad", "p_bad_to_good", "loss_in_bad", "loss_in_good"):
            _check_probability(name, getattr(self, name))
        if self.p_good_to_bad + self.p_bad_to_good == 0:
            raise ValueError("p_good_to_bad and p_bad_to_good cannot both be 0")

    def new_state(self, ctx: LinkContext) -> _GilbertElliottState:
        rtt_s = ctx.rtt_s if self.rtt_ms is None else self.rtt_ms / 1000.0
        return _GilbertElliottState(self, ctx, rtt_s)

    def departure_s(self, chunk: Chunk, state: _GilbertElliottState) -> float:
        return stalled_departure_s(chunk, state.lost, state.rtt_s, lambda _elapsed_s: state.lost(),
                                   state.record_stall)

    def mean_loss_rate(self) -> float:
        # Stationary share of the bad state is p / (p + r).
        bad_share = self.p_good_to_bad / (self.p_good_to_bad + self.p_bad_to_good)
        return bad_share * self.loss_in_bad + (1.0 - bad_share) * self.loss_in_good

    def mean_stall_ms(self, size_bytes: int, rtt_ms: float) -> float:
        # Counted as i.i.d. loss at the chain's mean rate: bursts make it a little lower for one message.
        return mean_recovery_stall_ms(self.mean_loss_rate(), size_bytes, rtt_ms if self.rtt_ms is None else self.rtt_ms)
