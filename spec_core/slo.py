"""The latency target (SLO): when work is due under it, and whether a request or a run met it.

Glossary:
  *TPOT*     time per output token: over a window, (time of the last commit − time of the first) /
             (tokens committed between them);
  *TTFT*     time to first token: from a request's arrival to its first commit;
  *due*      when a round (or a stream's next token) should be answered to keep its session on the
             SLO's schedule: the verifier orders its passes by it (least slack first), and so does the
             fleet simulator when it models that schedule;
  *verdict*  whether a request met the SLO, judged on what a measuring window saw of it: its TPOT
             inside the window, and its TTFT if it arrived inside it; a request the window saw too
             little of (neither) is not judged. The load test (netsim.load) and the fleet simulator
             (netsim.fleet) judge with the same function, so their goodput and capacity agree;
  *run verdict*  a run (many requests) meets the SLO when its p95 TPOT was measured and is within
             it, and its p95 TTFT too where measured.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Slo:
    """A latency target, seconds (0: none on that count)."""
    tpot_s: float = 0.0
    ttft_s: float = 0.0

    def due(self, arrival: float, first_token_at: tuple[float, int] | None, committed: int) -> float | None:
        """When work arriving at `arrival` is due: before the first token, arrival + TTFT; after
        it, the next token's place on the TPOT schedule from the first one, but never later than
        one TPOT after arrival (a session ahead of schedule banks no more than that).
        first_token_at: (time, tokens committed) at the first commit; committed: tokens now."""
        if first_token_at is None:
            return arrival + self.ttft_s if self.ttft_s else None
        if not self.tpot_s:
            return None
        t_first, at_first = first_token_at
        return min(t_first + self.tpot_s * (committed - at_first + 1), arrival + self.tpot_s)


def window_tpot(token_times: Sequence[tuple[float, int]], t_from: float, t_to: float) -> float | None:
    """TPOT over the commits inside [t_from, t_to]; token_times: (time, tokens committed so far),
    in time order. None with fewer than two commits inside, or no tokens between them."""
    inside = [(t, n) for t, n in token_times if t_from <= t <= t_to]
    if len(inside) < 2:
        return None
    (t_first, n_first), (t_last, n_last) = inside[0], inside[-1]
    return (t_last - t_first) / (n_last - n_first) if n_last > n_first else None


def meets_slo(tpot_s: float | None, ttft_s: float | None, slo_tpot_s: float,
              slo_ttft_s: float | None = None) -> bool | None:
    """A request's verdict: its TPOT within slo_tpot_s and its TTFT within slo_ttft_s, each judged
    only where measured (None: not measured; slo_ttft_s None: no TTFT target). None: neither measured."""
    if tpot_s is None and ttft_s is None:
        return None
    return ((tpot_s is None or tpot_s <= slo_tpot_s)
            and (ttft_s is None or slo_ttft_s is None or ttft_s <= slo_ttft_s))


def run_meets_slo(tpot_p95_s: float | None, ttft_p95_s: float | None, slo_tpot_s: float,
                  slo_ttft_s: float | None = None) -> bool:
    """A run's verdict: its p95 TPOT measured and within slo_tpot_s, its p95 TTFT within slo_ttft_s
    where measured (a run in which no request arrived inside the window has none)."""
    return tpot_p95_s is not None and meets_slo(tpot_p95_s, ttft_p95_s, slo_tpot_s, slo_ttft_s) is True
